"""Allocator models (PyTorch's caching allocator, torch_npu's, MindSpore's pool) and their exact replay.

Pure logic: nothing here reads files or talks to devices, except ``traces`` and ``snapshot``
(readers of recorded traces)."""
