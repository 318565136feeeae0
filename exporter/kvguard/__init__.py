"""kvguard: allocator memory exporter and KV-cache OOM guard for LLM serving."""

__version__ = "0.1.0"
