"""The sidecar: reads the spool, sources and vLLM; serves /metrics and /guard."""
