"""The spool: the snapshot record the probe writes and the sidecar reads."""
