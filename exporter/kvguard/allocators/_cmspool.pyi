# The C engine of mindspore_pool.DynamicMemPool (_cmspool.c), as mindspore_native.py uses it.
from typing import Any

Pool: Any
SHARED_CONSTANTS: tuple[str, ...]
IDLE: int
USED: int
EAGER_FREE: int
SPLIT_MIN_BYTES: int
SIZE_BEYOND: int
STEP_LIMIT: int
