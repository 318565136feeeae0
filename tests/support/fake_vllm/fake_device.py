"""A device with a caching allocator, in place of torch.cuda, for the fake vLLM.

Memory is reserved in fixed segments (like MindSpore's 2 GB increase size): the reserved
peak of a profile run can exceed its allocated peak by up to a segment.
"""

GIB = 1 << 30


class FakeDevice:
    def __init__(self, total=64 * GIB, non_torch=1 * GIB, segment=2 * GIB):
        self.total = total
        self.non_torch = non_torch
        self.segment = segment
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.tensors = {}
        self._next = 0

    def malloc(self, size):
        self.allocated += size
        while self.allocated > self.reserved:
            if self.total - self.reserved - self.non_torch < self.segment:
                self.allocated -= size
                raise MemoryError(f"CUDA out of memory. Tried to allocate {size} bytes")
            self.reserved += self.segment
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self._next += 1
        self.tensors[self._next] = size
        return self._next

    def free(self, handle):
        self.allocated -= self.tensors.pop(handle)

    def empty_cache(self):
        # Only whole free segments go back (a split segment cannot be released).
        needed = -(-self.allocated // self.segment) * self.segment
        self.reserved = max(needed, 0)

    def reset_peak_memory_stats(self, device=None):
        self.peak_allocated = self.allocated
        self.peak_reserved = self.reserved

    def memory_stats(self, device=None):
        return {
            "allocated_bytes.all.current": self.allocated,
            "allocated_bytes.all.peak": self.peak_allocated,
            "reserved_bytes.all.current": self.reserved,
            "reserved_bytes.all.peak": self.peak_reserved,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }

    def memory_reserved(self, device=None):
        return self.reserved

    def mem_get_info(self, device=None):
        return self.total - self.reserved - self.non_torch, self.total


DEVICE = FakeDevice()
