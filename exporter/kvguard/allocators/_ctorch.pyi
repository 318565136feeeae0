# The C engine of torch_alloc.CachingAllocator (_ctorch.c), as torch_native.py uses it.
from typing import Any

Engine: Any
Cells: Any
SHARED_CONSTANTS: tuple[str, ...]
K_MIN_BLOCK_SIZE: int
K_SMALL_SIZE: int
K_SMALL_BUFFER: int
K_MIN_LARGE_ALLOC: int
K_ROUND_LARGE: int
K_EXTRA_LARGE_BUFFER: int
K_ROUNDUP_INTERVALS: int
K_ROUNDUP_START_LOG2: int
UNLIMITED: int
MAX_DEVICE_BYTES: int
N_STAT_ARRAYS: int
N_STAT_POOLS: int
N_STAT_FIELDS: int
C_OVERSIZE_ALLOCATIONS: int
C_OVERSIZE_SEGMENTS: int
N_CELLS: int
