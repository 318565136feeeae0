"""The guard: the verdict from a rank's counters and profile, live and at the budget."""
