"""Fake vLLM package for kvguard's plugin tests (see tests/support/fake_vllm/README.md)."""
