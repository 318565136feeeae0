"""Replays an allocator op stream through torch_npu's real NPUCachingAllocator on the fake device.

    PYTHONPATH=<oracle>/site LD_LIBRARY_PATH=<oracle>/fake FAKE_NPU_TOTAL=<bytes> \
        [PYTORCH_NPU_ALLOC_CONF=...] .venv/bin/python tests/upstream/oracles/torch_npu/worker.py \
        OPS.jsonl [OPS.jsonl ...]

OPS.jsonl is kvguard's op stream (``kvguard.allocators.ops``): ``{"op": "malloc", "size": N}``,
``{"op": "free", "index": K}`` (K: the line of the malloc whose block is freed; a malloc that
ran out of memory, or returned null for 0 bytes, frees nothing), ``{"op": "empty_cache"}``.
Writes one JSON line per op, read from the real allocator after the op: stream (which file),
index, reserved_bytes, allocated_bytes, peak_allocated_bytes (``torch.npu.memory_stats()``),
num_ooms, num_alloc_retries, oom and address (a malloc's block; None for other ops and on out of
memory; 0 for the null torch_npu returns for 0 bytes),
device_used_bytes (what the fake device has handed out: mallocs and physical pages).

Several files replay one after another in the one process (torch_npu's import takes seconds):
between them every block is freed, the cache emptied, the statistics reset and the fake device
restarted on its first addresses, so each stream starts as in a fresh process. The allocator
config and the device's size (read once, at initialisation) are the same for all of them. Where
a stream leaves an address range reserved (an expandable segment that ran out of memory before
mapping a page outlives empty_cache), the worker stops with exit status 3: give that stream a
process of its own.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time

import torch
import torch_npu  # noqa: F401  (registers torch.npu)


def settle(live: dict[int, int], timeout: float = 10.0) -> None:
    """Wait until the allocator holds no block as in use but the live ones: every free the task queue
    still carries has reached the allocator (its snapshot: a freed block is inactive again)."""
    deadline = time.monotonic() + timeout
    wanted = set(live.values())
    while True:
        torch.npu.synchronize()
        in_use = {
            block["address"]
            for segment in torch.npu.memory_snapshot()
            for block in segment["blocks"]
            if block["state"] != "inactive"
        }
        if in_use <= wanted:
            return
        if time.monotonic() > deadline:
            print(f"settle: blocks still in use after {timeout} s: {sorted(in_use - wanted)}", file=sys.stderr)
            return
        time.sleep(0.001)


def _cached_whole() -> list[int]:
    """Segments the allocator holds whole and idle (every block inactive, not an expandable one): what a settled
    empty_cache returns to the device."""
    return [
        segment["address"]
        for segment in torch.npu.memory_snapshot()
        if not segment.get("is_expandable") and all(block["state"] == "inactive" for block in segment["blocks"])
    ]


def released(live: dict[int, int], timeout: float = 10.0) -> None:
    """After an empty_cache: wait until it has returned every whole idle segment, emptying the cache again where a
    free's bookkeeping on the task queue's thread landed after the call (seen under CI load: settle() saw the block
    inactive, empty_cache kept the 2.2 GB segment, and the next read of the statistics had the free). The op stream
    means an empty_cache after every earlier free has landed; a segment still kept after ``timeout`` is recorded
    as kept (and the comparison with the model shows it)."""
    deadline = time.monotonic() + timeout
    while _cached_whole():
        if time.monotonic() > deadline:
            print(f"released: whole idle segments still cached after {timeout} s", file=sys.stderr)
            return
        time.sleep(0.001)
        settle(live)
        torch.npu.empty_cache()


def replay(path: str, stream_number: int, fake: ctypes.CDLL) -> None:
    with open(path) as stream:
        ops = [json.loads(line) for line in stream if line.strip()]
    live: dict[int, int] = {}
    out = sys.stdout
    for index, op in enumerate(ops):
        record: dict = {"stream": stream_number, "index": index, "op": op["op"], "oom": False, "address": None}
        if op["op"] == "malloc":
            try:
                address = torch.npu.caching_allocator_alloc(int(op["size"]))
            except torch.OutOfMemoryError:
                record.update(oom=True, address=None)
            else:
                record.update(oom=False, address=address)
                if address:
                    live[index] = address
        elif op["op"] == "free":
            address = live.pop(int(op["index"]), None)
            if address is not None:
                torch.npu.caching_allocator_delete(address)
                settle(live)
        elif op["op"] == "empty_cache":
            # With TASK_QUEUE_ENABLE=1 (the default, pinned by the tests) a free's bookkeeping runs on the task
            # queue's thread; an empty_cache that overtakes it keeps the block (2.2 GB kept after a free, seen
            # under CI-like load even after torch.npu.synchronize()). settle() waits for the settled state the
            # model describes, and released() empties the cache again where the free still landed after the call.
            # With TASK_QUEUE_ENABLE=0 this stream's empty_cache keeps the block always, synchronized or not:
            # another real behaviour, not modelled.
            settle(live)
            torch.npu.empty_cache()
            released(live)
        else:
            raise SystemExit(f"line {index + 1}: unknown op {op['op']!r}")
        stats = torch.npu.memory_stats()
        record.update(
            reserved_bytes=stats.get("reserved_bytes.all.current", 0),
            allocated_bytes=stats.get("allocated_bytes.all.current", 0),
            peak_allocated_bytes=stats.get("allocated_bytes.all.peak", 0),
            num_ooms=stats.get("num_ooms", 0),
            num_alloc_retries=stats.get("num_alloc_retries", 0),
            device_used_bytes=fake.fake_npu_used_bytes(),
        )
        out.write(json.dumps(record) + "\n")
    out.flush()
    for address in live.values():
        torch.npu.caching_allocator_delete(address)


def restart(fake: ctypes.CDLL) -> None:
    """Back to a fresh allocator: nothing cached, statistics zero, the device's first addresses."""
    torch.npu.empty_cache()
    torch.npu.reset_peak_memory_stats()
    torch.npu.reset_accumulated_memory_stats()
    if torch.npu.memory_reserved() or fake.fake_npu_restart():
        print("cannot restart: the previous stream left device memory or an address range reserved", file=sys.stderr)
        raise SystemExit(3)


def main(paths: list[str]) -> None:
    fake = ctypes.CDLL("libascendcl.so")
    fake.fake_npu_used_bytes.restype = ctypes.c_uint64
    torch.npu.set_device(0)
    for number, path in enumerate(paths):
        if number:
            restart(fake)
        replay(path, number, fake)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(f"usage: {sys.argv[0]} OPS.jsonl [OPS.jsonl ...]")
    main(sys.argv[1:])
