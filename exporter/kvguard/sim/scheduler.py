"""vLLM V1's scheduler, simplified, as both serving models use it (``scenario.ServingScenario``'s
fixed request list and ``traffic.LiveServing``'s open stream).

One token budget per step (``max_num_batched_tokens``): running sequences first, each one decode
token or its next prefill chunk; then waiting ones first come first served while the budget, the
KV blocks and ``max_num_seqs`` allow. When a running sequence needs blocks that are not free, the
most recently admitted one is preempted (recompute: its blocks return, it goes back to the front
of the queue with nothing computed), as vLLM's ``Scheduler.schedule()`` does under FCFS
(vllm/v1/core/sched/scheduler.py:271 in vLLM 0.11.0, ``preempted_req = self.running.pop()``).
"""

from __future__ import annotations

from collections import deque
from typing import Iterable


class Sequence:
    """One request's progress: prompt tokens prefilled, output tokens produced, KV blocks held."""

    __slots__ = ("prompt_tokens", "output_tokens", "computed", "generated", "blocks", "request")

    def __init__(self, prompt_tokens: int, output_tokens: int, request: object = None) -> None:
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.request = request  # the caller's own record of the request, if any
        self.computed = 0
        self.generated = 0
        self.blocks = 0

    @property
    def in_prefill(self) -> bool:
        return self.computed < self.prompt_tokens

    @property
    def context(self) -> int:
        return self.computed + self.generated


class Scheduler:
    """The waiting queue, the running batch and the free KV blocks of one rank."""

    def __init__(
        self,
        block_size: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        waiting: Iterable[Sequence] = (),
        *,
        reject_unfittable: bool = False,
    ) -> None:
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        # With nothing running, a waiting request that needs more blocks than are free can never
        # run: reject it (as vLLM does) and go on with the queue, instead of waiting forever.
        self.reject_unfittable = reject_unfittable
        self.waiting: deque[Sequence] = deque(waiting)
        self.running: list[Sequence] = []
        self.free_blocks = 0
        self.preemptions = 0
        self.rejected = 0

    def preempt(self) -> None:
        victim = self.running.pop()
        self.free_blocks += victim.blocks
        victim.blocks = victim.computed = victim.generated = 0
        self.waiting.appendleft(victim)
        self.preemptions += 1

    def schedule(self) -> list[tuple[Sequence, int]]:
        """This step's (sequence, new tokens), with their KV blocks taken."""
        budget = self.max_num_batched_tokens
        block_size = self.block_size
        scheduled: list[tuple[Sequence, int]] = []
        running = self.running
        index = 0
        # Sequence.in_prefill inlined, and the blocks a step needs: cdiv(context + new tokens, block_size)
        # minus the blocks held. This runs for every sequence at every step.
        while index < len(running) and budget > 0:
            seq = running[index]
            computed = seq.computed
            tokens = min(seq.prompt_tokens - computed, budget) if computed < seq.prompt_tokens else 1
            need = -(-(computed + seq.generated + tokens) // block_size) - seq.blocks
            while need > self.free_blocks and running[-1] is not seq:
                self.preempt()
            if need > self.free_blocks:
                self.preempt()  # the sequence itself
                break
            self.free_blocks -= need
            seq.blocks += need
            scheduled.append((seq, tokens))
            budget -= tokens
            index += 1
        waiting = self.waiting
        while waiting and budget > 0 and len(running) < self.max_num_seqs:
            seq = waiting[0]
            computed = seq.computed
            tokens = min(seq.prompt_tokens - computed, budget)
            need = -(-(computed + seq.generated + tokens) // block_size) - seq.blocks
            if need > self.free_blocks:
                if self.reject_unfittable and not running:
                    waiting.popleft()
                    self.rejected += 1
                    continue
                break
            waiting.popleft()
            self.free_blocks -= need
            seq.blocks += need
            running.append(seq)
            scheduled.append((seq, tokens))
            budget -= tokens
        return scheduled

    def advance(self, scheduled: list[tuple[Sequence, int]]) -> list[Sequence]:
        """Count the step's tokens; the sequences that finished leave the batch with their blocks
        returned, and are returned."""
        for seq, tokens in scheduled:
            if seq.computed < seq.prompt_tokens:  # in prefill
                seq.computed += tokens
                if seq.computed >= seq.prompt_tokens:
                    seq.generated += 1  # the last prefill chunk samples the first token
            else:
                seq.generated += 1
        finished: list[Sequence] = []
        still_running: list[Sequence] = []
        for seq in self.running:
            if seq.computed >= seq.prompt_tokens and seq.generated >= seq.output_tokens:
                self.free_blocks += seq.blocks
                seq.blocks = 0
                finished.append(seq)
            else:
                still_running.append(seq)
        self.running = still_running
        return finished
