"""The offline batch API: LLM(model=...).generate(prompts, params) and .chat(messages, params), as vLLM's."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Optional, Sequence as Seq, Union

from tqdm.auto import tqdm

from engine.chat import template_message
from engine.config import EngineConfig
from engine.generation_config import generation_defaults
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.sequence import RequestOutput


Prompt = Union[str, dict[str, Any]]  # a string, or vLLM's TextPrompt {"prompt"} / TokensPrompt {"prompt_token_ids"}
Message = dict[str, Any]  # {"role": ..., "content": str or [{"type": "text", "text": ...}, ...]}

_PROMPT_KEYS = {"prompt", "prompt_token_ids"}


def _prompt_inputs(prompts, prompt_token_ids) -> tuple[list[Optional[str]], list[Optional[list[int]]]]:
    """Each prompt's (text, token ids), either None where not given; TypeError / ValueError naming what is wrong."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    if prompts is None and prompt_token_ids is None:
        raise ValueError("either prompts or prompt_token_ids must be given")
    if prompts is None:
        return [None] * len(prompt_token_ids), [list(ids) for ids in prompt_token_ids]
    texts: list[Optional[str]] = []
    token_ids: list[Optional[list[int]]] = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            text, ids = p, None
        elif isinstance(p, dict):
            unknown = sorted(set(p) - _PROMPT_KEYS)
            if unknown:
                raise ValueError(f"prompt {i}: {', '.join(unknown)} not supported (a dict prompt holds "
                                 "'prompt' and/or 'prompt_token_ids'; this engine serves text-only models)")
            if "prompt" not in p and "prompt_token_ids" not in p:
                raise ValueError(f"prompt {i}: a dict prompt needs 'prompt' or 'prompt_token_ids'")
            text, ids = p.get("prompt"), p.get("prompt_token_ids")
        else:
            raise TypeError(f"prompt {i}: expected a string or a dict, got {type(p).__name__}")
        texts.append(text)
        token_ids.append(list(ids) if ids is not None else None)
    if prompt_token_ids is not None:
        if len(prompt_token_ids) != len(texts):
            raise ValueError("prompts and prompt_token_ids must have the same length")
        token_ids = [list(ids) for ids in prompt_token_ids]
    return texts, token_ids


class LLM:
    """Generate for a batch of prompts with continuous batching, in this process.

    With tensor_parallel_size N > 1 the other ranks run in N - 1 spawned processes: a script that builds one
    must guard its entry point with `if __name__ == "__main__":` (spawn re-imports the main module)."""

    def __init__(self, model: Optional[str] = None, **engine_kwargs) -> None:
        config = EngineConfig(model=model, **engine_kwargs)
        # (before the weights load: a generation_config.json value no request could run with fails at once)
        self._default_sampling = generation_defaults(config.model, config.generation_config,
                                                     config.override_generation_config)
        self.engine = LLMEngine(config)
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: SamplingParams with the model folder's generation_config.json defaults (generation_config="auto"),
        what generate() and chat() use when given none."""
        return SamplingParams(**self._default_sampling)

    def shutdown(self) -> None:
        """End the other tensor-parallel ranks' processes (nothing to do on one rank); generate fails after it."""
        self.engine.shutdown()

    def generate(
        self,
        prompts: Union[None, Prompt, Seq[Prompt]] = None,
        sampling_params: Union[None, SamplingParams, Seq[SamplingParams]] = None,
        prompt_token_ids: Optional[Seq[Seq[int]]] = None,
        use_tqdm: bool = True,
        priority: Union[None, int, Seq[int]] = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the prompts' order.

        A prompt is a string or, as vLLM's, a dict: {"prompt": text} (TextPrompt) or {"prompt_token_ids": ids}
        (TokensPrompt, its "prompt" optional). `priority` (one for all, or one per prompt, as vLLM's) matters with
        scheduling_policy="priority": a lower value is scheduled first and may preempt running requests of a higher
        value."""
        texts, token_ids = _prompt_inputs(prompts, prompt_token_ids)
        num = len(texts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
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
                    prompt=texts[i],
                    prompt_token_ids=token_ids[i],
                    params=final[id(params_list[i])],
                    priority=priorities[i],
                )
        except BaseException:  # a bad prompt i: the batch is refused whole, prompts 0..i-1 leave the queue (vLLM's)
            self.engine.abort_request(list(order))
            raise
        return self._run(order, use_tqdm)

    def chat(
        self,
        messages: Union[Seq[Message], Seq[Seq[Message]]],
        sampling_params: Union[None, SamplingParams, Seq[SamplingParams]] = None,
        use_tqdm: bool = True,
        chat_template: Optional[str] = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Optional[list[dict[str, Any]]] = None,
        chat_template_kwargs: Optional[dict[str, Any]] = None,
        priority: Union[None, int, Seq[int]] = None,
    ) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of {"role", "content"} messages) or a list of them, each rendered
        by chat_template (else the tokenizer's) and generated as generate() would; content may be a string or a list
        of {"type": "text", "text": ...} parts."""
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        one = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if one else list(messages)
        if not conversations or not all(conversations):
            raise ValueError("chat needs at least one message in each conversation")
        tokenizer = self.engine.tokenizer
        template = chat_template or getattr(tokenizer, "chat_template", None)
        prompts: list[Prompt] = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                [template_message(m, template) for m in conversation], tokenize=False, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                tools=tools, **(chat_template_kwargs or {}))
            # The template wrote the special tokens it wants (as the server's chat endpoint: add_special_tokens off).
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer(text, add_special_tokens=False)["input_ids"]})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, priority=priority)

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
