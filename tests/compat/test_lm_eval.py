"""EleutherAI's lm-eval against the server, on tiny local tasks (a jsonl and a task yaml written here, no download).

local-completions scores loglikelihoods through echo + logprobs: they must equal HF transformers' on the same
weights. local-chat-completions generates: its answers must equal the server's own greedy chat answers.

lm-eval runs in a process of its own through its Python entry point, simple_evaluate (what the `lm_eval` command
calls), with a TaskManager that indexes only the local task: the command indexes every built-in task first
(~14 000 yaml files, 8-14 s a run on 2 cores) and takes no flag against it. The model classes and their requests to
the server are the same.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import torch
import yaml
from compat_helpers import MODEL, client_env, venv_bin

MC_DOCS = [{"question": "The capital of France is", "choices": ["Paris", "Berlin"], "answer": 0},
           {"question": "Two plus two equals", "choices": ["four", "five apples"], "answer": 0}]
GEN_DOCS = [{"question": "What is the capital of France?", "answer": "Paris"},
            {"question": "Name a color.", "answer": "blue"}]
GEN_TOKENS = 8


def _task(folder: Path, name: str, docs: list[dict], **fields) -> None:
    """A task yaml over a local jsonl: lm-eval's `json` dataset builder reads it without a download."""
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    task = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test", "doc_to_text": "{{question}}", "doc_to_target": "{{answer}}", **fields}
    (folder / f"{name}.yaml").write_text(yaml.safe_dump(task))


# argv: model, model_args, task, the folder of its yaml, "chat" to apply the chat template, the samples' json path.
LM_EVAL = """
import json, sys
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
model, model_args, task, folder, chat, out = sys.argv[1:7]
results = simple_evaluate(model=model, model_args=model_args, tasks=[task], batch_size=1, log_samples=True,
                          apply_chat_template=chat == "chat",
                          task_manager=TaskManager(include_path=folder, include_defaults=False))
open(out, "w").write(json.dumps(results["samples"][task], default=str))
"""


def _lm_eval(tmp_path: Path, model: str, model_args: str, task: str, chat: bool = False) -> list[dict]:
    """lm-eval's samples of task: each with its doc_id, arguments (one tuple a request) and resps."""
    venv_bin("lm_eval")  # skips where the dev extra's lm-eval is not installed
    out = tmp_path / "samples.json"
    run = subprocess.run([sys.executable, "-c", LM_EVAL, model, model_args, task, str(tmp_path),
                          "chat" if chat else "", str(out)],
                         cwd=tmp_path, env=client_env(), capture_output=True, text=True, timeout=150)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(out.read_text())


@torch.no_grad()
def _hf_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """lm-eval's encoding of a (context, continuation) pair, scored by HF: sum of the continuation's logprobs."""
    context_ids = tokenizer.encode(context, add_special_tokens=False)
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    logprobs = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), dim=-1)
    return sum(logprobs[i - 1, whole[i]].item() for i in range(len(context_ids), len(whole)))


def test_local_completions_loglikelihoods_equal_hf(compat_server, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _task(tmp_path, "pagedserve_mc", MC_DOCS, output_type="multiple_choice", doc_to_choice="{{choices}}",
          metric_list=[{"metric": "acc"}])
    args = (f"model={MODEL},base_url={compat_server.base_url}/v1/completions,tokenizer={compat_server.model_dir},"
            "tokenizer_backend=huggingface,num_concurrent=2,max_retries=1")
    samples = _lm_eval(tmp_path, "local-completions", args, "pagedserve_mc")
    hf = AutoModelForCausalLM.from_pretrained(str(compat_server.model_dir), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(compat_server.model_dir))
    scored = 0
    for sample in sorted(samples, key=lambda s: s["doc_id"]):
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            ours = float(resp[0][0])
            assert ours == pytest.approx(_hf_loglikelihood(hf, tokenizer, context, continuation), abs=1e-3)
            scored += 1
    assert scored == sum(len(d["choices"]) for d in MC_DOCS)


def test_local_chat_completions_generate_the_server_answers(compat_server, tmp_path):
    _task(tmp_path, "pagedserve_gen", GEN_DOCS, output_type="generate_until", metric_list=[{"metric": "exact_match"}],
          generation_kwargs={"until": ["\n\n"], "max_gen_toks": GEN_TOKENS, "do_sample": False, "temperature": 0.0})
    args = f"model={MODEL},base_url={compat_server.base_url}/v1/chat/completions,num_concurrent=2,max_retries=1"
    samples = _lm_eval(tmp_path, "local-chat-completions", args, "pagedserve_gen", chat=True)
    client = openai.OpenAI(base_url=compat_server.base_url + "/v1", api_key="unused")
    for sample in samples:
        question = GEN_DOCS[sample["doc_id"]]["question"]
        want = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                              max_tokens=GEN_TOKENS, temperature=0, stop=["\n\n"])
        assert sample["resps"][0][0] == want.choices[0].message.content
    assert sorted(s["doc_id"] for s in samples) == [0, 1]
