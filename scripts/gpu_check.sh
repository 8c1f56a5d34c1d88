#!/usr/bin/env bash
# One command that proves the CUDA path on an offline GPU machine and writes a markdown report
# (ready to paste into docs/benchmarks.md). Installs nothing from the network.
#
#   PYTHON=/opt/torch/.venv/bin/python3 bash scripts/gpu_check.sh
#
# In order: build the kernels (device=cuda must get the compiled CUDA backend), tests/kernels on CUDA,
# the engine-level CUDA tests (tests/e2e/test_cuda_engine.py, tests/model, and
# tests/e2e/test_tensor_parallel.py: NCCL with a world of one), greedy parity of the
# default model with HF on the GPU, benchmarks/kernels.py (paged decode vs SDPA over a contiguous cache,
# batch 1..256 x context 128..4096), benchmarks/throughput.py on a 1B-class random-weight Llama vs HF
# generate. About 6 to 8 minutes on an H100. Exit status 1 if any step failed; the report says which.
#
# Needs on the machine:
#   - PYTHON: a python with CUDA torch (and transformers, tokenizers, safetensors, numpy, pytest);
#   - nvcc of torch's CUDA major version on PATH (or CUDA_HOME);
#   - the default model converted: $PAGEDSERVE_CACHE/models/SmolLM2-135M-Instruct (else
#     ~/.cache/pagedserve/...): copy that folder from a machine where `make model` ran;
#   - what else the python lacks, as wheels in WHEELS=dir (made beforehand by scripts/gpu_wheels.sh);
#     they are installed with --no-index into a scratch folder put on PYTHONPATH, never into PYTHON.
# Variables: REPORT (default benchmarks/results/gpu_check.md), WORK (scratch, default a temp dir),
# GPU_CHECK_CPU=1 runs every step with tiny sizes on the CPU: it checks this script's plumbing on a
# machine without a GPU, and proves nothing about CUDA.
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root" || exit 2
python="${PYTHON:-python3}"
report="${REPORT:-$root/benchmarks/results/gpu_check.md}"
work="${WORK:-$(mktemp -d)}"
cpu_mode="${GPU_CHECK_CPU:-0}"
mkdir -p "$work" "$(dirname "$report")"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1

die() { echo "gpu_check: $*" >&2; exit 2; }

# ---- preflight: everything must be here already
command -v "$python" >/dev/null 2>&1 || [ -x "$python" ] || die "PYTHON=$python not found"
if [ -n "${WHEELS:-}" ]; then
  [ -d "$WHEELS" ] || die "WHEELS=$WHEELS is not a folder"
  "$python" -m pip install -q --no-index --no-deps --no-compile --target "$work/site" "$WHEELS"/*.whl \
    || die "installing the wheels of $WHEELS failed"
  export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
fi
missing="$("$python" - <<'EOF'
import importlib.util
need = ["torch", "transformers", "tokenizers", "safetensors", "numpy", "jinja2", "tqdm", "yaml", "psutil",
        "prometheus_client", "ninja", "pytest", "pytest_timeout", "accelerate"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
EOF
)" || die "$python does not run"
[ -z "$missing" ] || die "$python lacks: $missing (make wheels with scripts/gpu_wheels.sh elsewhere, pass WHEELS=dir)"
if [ "$cpu_mode" != 1 ]; then
  "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() and torch.version.cuda else 1)' \
    || die "$python's torch sees no CUDA GPU (or is a CPU build)"
  command -v nvcc >/dev/null 2>&1 || [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ] \
    || die "nvcc not found: put it on PATH or set CUDA_HOME"
fi
model_dir="${PAGEDSERVE_CACHE:-$HOME/.cache/pagedserve}/models/SmolLM2-135M-Instruct"
[ -f "$model_dir/config.json" ] && [ -f "$model_dir/tokenizer.json" ] \
  || die "the default model is not at $model_dir: copy the folder made by \`make model\` there (or set PAGEDSERVE_CACHE)"

device="cuda"; [ "$cpu_mode" = 1 ] && device="cpu"
about="$("$python" - "$device" <<'EOF'
import platform, sys, torch
if sys.argv[1] == "cuda":
    p = torch.cuda.get_device_properties(0)
    print(f"{p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs; torch {torch.__version__} "
          f"(CUDA {torch.version.cuda})")
else:
    print(f"CPU {platform.processor() or platform.machine()} (GPU_CHECK_CPU=1: plumbing check only); "
          f"torch {torch.__version__}")
EOF
)"
nvcc_version="$( (command -v nvcc >/dev/null && nvcc --version | tail -1) || echo "nvcc not on PATH")"
echo "gpu_check: $about; $nvcc_version; scratch in $work"

# ---- the steps
names=(); statuses=(); seconds=()
step() {  # step NAME CMD...: runs it, logs to $work/NAME.log, records pass/fail and time
  local name="$1"; shift
  echo ">> $name"
  local start=$SECONDS
  if "$@" 2>&1 | tee "$work/$name.log"; then statuses+=("pass"); else statuses+=("FAIL"); fi
  names+=("$name"); seconds+=($((SECONDS - start)))
  echo "<< $name: ${statuses[-1]} ($((SECONDS - start)) s)"
}
# shellcheck disable=SC2329  # invoked through step
pytest() { "$python" -m pytest -q -p no:cacheprovider "$@"; }

step build "$python" -c "
import logging, sys
logging.basicConfig(level=logging.INFO)
from engine import ops
backend = ops.require_backend('$device')
print('ops backend:', backend.value)"

if [ "$cpu_mode" = 1 ]; then
  step kernel-tests pytest tests/kernels/test_backend.py tests/kernels/test_attention.py -k "backend or refuse or edge"
  step engine-cuda-tests pytest tests/e2e/test_cuda_engine.py tests/e2e/test_tensor_parallel.py tests/model/test_cache_engine.py
  step default-model-parity pytest tests/e2e/test_parity.py -k tiny_llama
  step kernel-bench "$python" benchmarks/kernels.py --device cpu --batches 1 --contexts 128 --min-time 0.01 \
    --out "$work/kernels.json"
else
  step kernel-tests pytest tests/kernels
  step engine-cuda-tests pytest tests/e2e/test_cuda_engine.py tests/e2e/test_tensor_parallel.py tests/model
  step default-model-parity pytest tests/e2e/test_parity.py -k default_model
  step kernel-bench "$python" benchmarks/kernels.py --device cuda --full --out "$work/kernels.json"
fi

# A 1B-class Llama (hidden 2048, 16 layers, 32/8 heads of 64, MLP 8192; the default tokenizer's 49k vocabulary),
# random bfloat16 weights saved once, so pagedserve and HF load the same model.
# shellcheck disable=SC2329  # invoked through step
make_model() {
  "$python" - "$work/llama-1b" "$model_dir" "$device" "$cpu_mode" <<'EOF'
import shutil, sys
from pathlib import Path
import torch
from transformers import LlamaConfig, LlamaForCausalLM

folder, tokenizer_from, device, cpu_mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
size = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4) if cpu_mode else \
    dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32)
config = LlamaConfig(vocab_size=49152, num_key_value_heads=size["num_attention_heads"] // 4, head_dim=64,
                     max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                     tie_word_embeddings=False, **size)
torch.manual_seed(0)
with torch.device(device):
    model = LlamaForCausalLM(config).to(torch.bfloat16)
model.save_pretrained(folder)
for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(tokenizer_from / name, folder / name)
params = f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f}B"
(folder / "parameters.txt").write_text(params)
print(f"{params} parameters in {folder}")
EOF
}
step dummy-1b-model make_model
if [ "$cpu_mode" = 1 ]; then
  sizes=(--num-prompts 2 --input-len 8 --output-len 4 --hf-sequential-prompts 1 --hf-batch-sizes 2)
else
  sizes=(--num-prompts 256 --input-len 128 --output-len 128 --hf-sequential-prompts 2 --hf-batch-sizes "64,256")
fi
step throughput "$python" benchmarks/throughput.py --model "$work/llama-1b" --dtype bfloat16 --hf-dtypes bfloat16 \
  "${sizes[@]}" --output-json "$work/throughput.json"

# ---- the report
{
  echo "## GPU check: $about"
  echo
  echo "$nvcc_version. \`scripts/gpu_check.sh\` at commit $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')."
  echo
  echo "| step | result | seconds |"
  echo "| --- | --- | --- |"
  for i in "${!names[@]}"; do
    summary="$(grep -E '^[0-9]+ (passed|failed)|passed|failed|error' "$work/${names[$i]}.log" | tail -1)"
    echo "| ${names[$i]} | ${statuses[$i]}${summary:+: $summary} | ${seconds[$i]} |"
  done
  echo
  "$python" - "$work/kernels.json" "$work/throughput.json" "$work/llama-1b/parameters.txt" <<'EOF'
import json, sys
from pathlib import Path

kernels, throughput, params = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
if kernels.exists():
    data = json.loads(kernels.read_text())
    m = data["meta"]
    print(f"### Paged decode attention vs SDPA over a contiguous cache ({m['device']}, backend {m['backend']}, "
          f"{m['dtype']}, {m['num_heads']}/{m['num_kv_heads']} heads x {m['head_size']}, block {m['block_size']})\n")
    print("| batch | context | paged ms | SDPA ms | paged/SDPA | KV GB/s |\n| --- | --- | --- | --- | --- | --- |")
    for r in data["results"]:
        if r["op"] == "paged":
            print(f"| {r['batch']} | {r['context']} | {r['ms']:.4f} | {r['sdpa_ms']:.4f} | {r['ratio']:.2f} "
                  f"| {r['gb_s']:.0f} |")
    print()
if throughput.exists():
    data = json.loads(throughput.read_text())
    c = data["config"]
    size = params.read_text() if params.exists() else "?"
    print(f"### Throughput: random-weight Llama of {size} parameters, {c['num_prompts']} prompts x ({c['input_len']} in, "
          f"{c['output_len']} out), bfloat16\n")
    print("| run | output tokens/s | pagedserve is |\n| --- | --- | --- |")
    for r in data["results"]:
        ratio = f"{r['pagedserve_ratio']:.2f}x" if "pagedserve_ratio" in r else ""
        print(f"| {r['name']} | {r['output_tokens_per_s']:.0f} | {ratio} |")
EOF
} > "$report"
echo "gpu_check: report in $report"
for s in "${statuses[@]}"; do [ "$s" = pass ] || exit 1; done
exit 0
