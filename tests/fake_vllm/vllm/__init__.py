"""Fake vLLM package for kvguard's plugin tests (see tests/fake_vllm/README.md)."""
