"""A simulated accelerator: a capacity, a fixed non-allocator share, and what the allocator maps.

The device knows nothing about blocks; it only grants or refuses physical bytes, as
``cudaMalloc`` / ``aclrtMalloc`` / a VMM physical map would. ``mem_get_info`` answers
the way ``torch.cuda.mem_get_info`` does: device-wide ``(free, total)``.
"""

from __future__ import annotations

# Held outside the allocator from the start, per allocator: CUDA context (+ cuBLAS workspace) on
# NVIDIA; the ACL runtime context and HCCL buffers on Ascend. The simulator's device starts with it,
# and the budget-time verdict assumes it where a rank's counters are not known.
DEFAULT_NON_ALLOCATOR_BYTES = {"torch": 512 << 20, "torch_npu": 1 << 30, "mindspore": 1 << 30}


class Device:
    """Physical memory of one rank's device.

    ``non_allocator_bytes`` is what is held outside any framework allocator from the
    start (runtime context, communication buffers, workspaces): it counts as used in
    ``mem_get_info`` and is never freed. ``grow_non_allocator`` models such memory
    appearing later (for example a runtime workspace created on the first forward).
    """

    __slots__ = ("capacity_bytes", "non_allocator_bytes", "allocator_bytes", "peak_used_bytes")

    def __init__(self, capacity_bytes: int, non_allocator_bytes: int = 0) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"device capacity must be positive, got {capacity_bytes}")
        if not 0 <= non_allocator_bytes < capacity_bytes:
            raise ValueError(f"non-allocator share {non_allocator_bytes} must be in [0, capacity)")
        self.capacity_bytes = int(capacity_bytes)
        self.non_allocator_bytes = int(non_allocator_bytes)
        self.allocator_bytes = 0
        self.peak_used_bytes = self.non_allocator_bytes

    @property
    def used_bytes(self) -> int:
        return self.non_allocator_bytes + self.allocator_bytes

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.non_allocator_bytes - self.allocator_bytes

    def mem_get_info(self) -> tuple[int, int]:
        """``(free_bytes, total_bytes)``, as ``torch.cuda.mem_get_info`` returns them."""
        return self.free_bytes, self.capacity_bytes

    def malloc(self, size: int) -> bool:
        """Take ``size`` physical bytes; False (nothing taken) when they are not free."""
        if size > self.capacity_bytes - self.non_allocator_bytes - self.allocator_bytes:
            return False
        self.allocator_bytes += size
        used = self.non_allocator_bytes + self.allocator_bytes
        if used > self.peak_used_bytes:
            self.peak_used_bytes = used
        return True

    def free(self, size: int) -> None:
        self.allocator_bytes -= size

    def grow_non_allocator(self, size: int) -> bool:
        if size > self.free_bytes:
            return False
        self.non_allocator_bytes += size
        self.peak_used_bytes = max(self.peak_used_bytes, self.used_bytes)
        return True
