"""The vLLM budget: the formula, its inverse, and the model's config."""
