"""What a step that raises costs: the StepError it becomes, the block invariants checked after it, the stages.

LLMEngine.step ends the requests of a step that raised (their blocks freed) and raises StepError naming them;
the waiting and swapped requests are untouched. AsyncLLMEngine then checks the invariants below and resets the
engine (new scheduler, block manager and KV cache) when they fail or the fault recurs.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Optional

from engine.sequence import RequestOutput

# The stages of one step, in order. A fault_injector(stage, request_ids) set on the LLMEngine is called at the
# start of each (tests) with the requests a fault there ends: the step's batch for cache_ops to sampler, one
# request for output_processor and detokenizer; for schedule every queued request, though none is ended.
STAGES = ("schedule", "cache_ops", "prepare_inputs", "forward", "sampler", "output_processor", "detokenizer")
# Not a step's stage: the injector is also called with ADMISSION and the one request id as add_request takes it
# (a fault there fails only that request: AsyncLLMEngine answers it with a 500 and serves on).
ADMISSION = "admission"
FaultInjector = Callable[[str, list[str]], None]


class StepError(RuntimeError):
    """A step raised in `stage`: `request_ids` were ended and their blocks freed; `outputs` are the step's
    results for the requests it did finish (a per-request stage fails only its request)."""

    def __init__(self, stage: str, cause: BaseException, request_ids: list[str],
                 outputs: Optional[list[RequestOutput]] = None) -> None:
        super().__init__(f"{stage}: {type(cause).__name__}: {cause}")
        self.stage, self.cause, self.request_ids = stage, cause, request_ids
        self.outputs = outputs or []

    def client_message(self) -> str:
        """The sentence a client of a failed request reads (the 500 body or the stream's error event)."""
        return (f"The engine failed while running this request ({self.stage}): "
                f"{type(self.cause).__name__}: {self.cause}")


def block_problems(scheduler) -> list[str]:
    """Broken block-manager invariants, empty when all hold: every table belongs to an unfinished sequence in
    a queue, every block's ref count equals the tables holding it, and the free count matches."""
    bm = scheduler.block_manager
    live = {seq.seq_id for queue in (scheduler.waiting, scheduler.running, scheduler.swapped)
            for group in queue for seq in group.seqs if not seq.is_finished()}
    problems = []
    for name, tables, allocator in (("device", bm.block_tables, bm.gpu), ("cpu", bm.cpu_block_tables, bm.cpu)):
        orphans = sorted(set(tables) - live)
        if orphans:
            problems.append(f"{name} block tables of sequences no queue holds: {orphans[:5]}")
        held: Counter = Counter()
        for seq_id, table in tables.items():
            held.update(table[bm.num_released(seq_id):])
        wrong = [b for b in range(allocator.num_blocks) if allocator.ref_counts[b] != held[b]]
        if wrong:
            b = wrong[0]
            problems.append(f"{name} block {b} has ref count {allocator.ref_counts[b]}, held by {held[b]} "
                            f"table entries ({len(wrong)} such blocks)")
        unreferenced = sum(1 for count in allocator.ref_counts if count == 0)
        if unreferenced != allocator.num_free():
            problems.append(f"{name}: {allocator.num_free()} blocks free, {unreferenced} with no reference")
    return problems
