"""Beam search equals HF transformers' generate(num_beams=...) top sequences, with its length penalty and early stopping."""
from __future__ import annotations

import pytest
import torch

from engine.sampling_params import SamplingParams

BEAM_TOKENS = 12


@torch.no_grad()
def hf_beams(model, prompt, width, length_penalty, early_stopping, eos):
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=BEAM_TOKENS, do_sample=False, num_beams=width,
        num_return_sequences=width, length_penalty=length_penalty, early_stopping=early_stopping,
        eos_token_id=eos, pad_token_id=eos if eos is not None else 0,
    )
    beams = []
    for row in out[:, len(prompt):].tolist():
        # Shorter hypotheses are padded after their EOS: keep up to and including it.
        beams.append(row[: row.index(eos) + 1] if eos is not None and eos in row else row)
    return beams


@pytest.mark.parametrize("which,width,length_penalty,early_stopping", [
    ("tiny", 2, 1.0, False),
    ("tiny", 3, 0.5, True),
    ("smol", 3, 1.0, False),
])
def test_beam_search_matches_hf(make_llm, hf_tiny, hf_smol, prompt_ids, which, width, length_penalty, early_stopping):
    hf_model = hf_tiny if which == "tiny" else hf_smol
    eos = None if which == "tiny" else hf_model.generation_config.eos_token_id
    prompts = [prompt_ids[1], prompt_ids[3], prompt_ids[-1]]
    params = SamplingParams(n=width, best_of=width, use_beam_search=True, temperature=0.0, max_tokens=BEAM_TOKENS,
                            length_penalty=length_penalty, early_stopping=early_stopping, ignore_eos=eos is None)
    outputs = make_llm(which).generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        ours = [c.token_ids for c in out.outputs]
        assert ours == hf_beams(hf_model, prompt, width, length_penalty, early_stopping, eos), f"{len(prompt)} tokens"
