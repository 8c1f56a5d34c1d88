"""The offline batch API: LLM(model=...).generate(prompts, params)."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Optional, Sequence as Seq, Union

from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.sequence import RequestOutput


class LLM:
    """Generate for a batch of prompts with continuous batching, in this process.

    With tensor_parallel_size N > 1 the other ranks run in N - 1 spawned processes: a script that builds one
    must guard its entry point with `if __name__ == "__main__":` (spawn re-imports the main module)."""

    def __init__(self, model: Optional[str] = None, **engine_kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_kwargs))
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """End the other tensor-parallel ranks' processes (nothing to do on one rank); generate fails after it."""
        self.engine.shutdown()

    def generate(
        self,
        prompts: Union[None, str, Seq[str]] = None,
        sampling_params: Union[None, SamplingParams, Seq[SamplingParams]] = None,
        prompt_token_ids: Optional[Seq[Seq[int]]] = None,
        use_tqdm: bool = True,
        priority: Union[None, int, Seq[int]] = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the prompts' order.

        `priority` (one for all, or one per prompt, as vLLM's) matters with scheduling_policy="priority":
        a lower value is scheduled first and may preempt running requests of a higher value."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if prompts is None and prompt_token_ids is None:
            raise ValueError("either prompts or prompt_token_ids must be given")
        num = len(prompts) if prompts is not None else len(prompt_token_ids)
        if prompts is not None and prompt_token_ids is not None and len(prompt_token_ids) != num:
            raise ValueError("prompts and prompt_token_ids must have the same length")
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (
            [sampling_params] * num if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        if len(params_list) != num:
            raise ValueError("sampling_params must be one SamplingParams or one per prompt")
        priorities = [priority or 0] * num if priority is None or isinstance(priority, int) else list(priority)
        if len(priorities) != num:
            raise ValueError("priority must be one int or one per prompt")

        # Only the finished outputs are read: none is built a step for the others (the caller's params unchanged).
        final = {id(p): p if p.final_only else dataclasses.replace(p, final_only=True) for p in params_list}
        order: dict[str, int] = {}
        try:
            for i in range(num):
                request_id = str(next(self._request_counter))
                order[request_id] = i
                self.engine.add_request(
                    request_id,
                    prompt=prompts[i] if prompts is not None else None,
                    prompt_token_ids=list(prompt_token_ids[i]) if prompt_token_ids is not None else None,
                    params=final[id(params_list[i])],
                    priority=priorities[i],
                )
        except BaseException:  # a bad prompt i: the batch is refused whole, prompts 0..i-1 leave the queue (vLLM's)
            self.engine.abort_request(list(order))
            raise
        return self._run(order, use_tqdm)

    def _run(self, order: dict[str, int], use_tqdm: bool) -> list[RequestOutput]:
        results: list[Optional[RequestOutput]] = [None] * len(order)
        bar = tqdm(total=len(order), desc="Processed prompts", unit="req", disable=not use_tqdm)
        generated = 0
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished and output.request_id in order:
                        results[order[output.request_id]] = output
                        generated += sum(len(c.token_ids) for c in output.outputs)
                        bar.update(1)
                        elapsed = bar.format_dict["elapsed"] or 1e-9
                        bar.set_postfix_str(f"{generated / elapsed:.1f} toks/s output")
        finally:
            bar.close()
        return results  # type: ignore[return-value]
