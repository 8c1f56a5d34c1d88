#!/usr/bin/env bash
# One command that proves the CUDA path on an offline GPU machine and writes a markdown report
# (ready to paste into docs/benchmarks.md). Installs nothing from the network; reads no model weights.
#
#   bash scripts/gpu_wheels.sh bundle/                  # where there is network: wheels + tokenizer/config files
#   WHEELS=bundle/ PYTHON=/opt/torch/.venv/bin/python3 bash scripts/gpu_check.sh    # there, from the checkout
#
# What travels: this checkout (~1 MiB as a git archive) and bundle/ (~12 MiB: the wheels the GPU image lacks, and
# the default model's tokenizer and config.json, never its weights). Every model is built there with random
# weights: the default model's shapes (SmolLM2-135M, greedy parity with HF, and `pagedserve serve
# --load-format dummy`), a 1.17B Llama (hidden 2048, 16 layers, 32/8 heads of 64) for the benchmarks.
#
# In order: build the kernels (device=cuda must get the compiled CUDA backend); the CPU kernel and model suites on
# the host CPU (in the background while the GPU tests run); the kernel tests' CUDA cases; the engine-level CUDA tests
# (tests/e2e/test_cuda_engine.py, the NCCL world of one, the prefill-attention fallback); which prefill attention
# the engine's probe picked; greedy parity with HF on the random SmolLM2; the served default-model shapes with
# --load-format dummy; benchmarks/kernels.py (paged decode vs SDPA over a contiguous cache); then on the 1.17B
# random Llama: benchmarks/throughput.py against HF generate, `pagedserve serve` under benchmarks/serving.py at
# concurrency 1, 16, 64 and 256 (128 in, 128 out), and benchmarks/profile_step.py at batch 1 and 256 (bfloat16, then
# --quantization fp8 weights). Meant to take at most 5 minutes on an H100 host (each step's seconds are in the
# report). Exit status 1 if any step failed; the report says which.
#
# Needs on the machine:
#   - PYTHON: a python with CUDA torch (and transformers, tokenizers, safetensors, numpy, pytest);
#   - nvcc of torch's CUDA major version on PATH (or CUDA_HOME);
#   - the tokenizer and config of the default model: WHEELS/SmolLM2-135M-Instruct (gpu_wheels.sh puts them
#     there), else TOKENIZER_DIR, else $PAGEDSERVE_CACHE/models/SmolLM2-135M-Instruct;
#   - what else the python lacks, as wheels in WHEELS=dir (made beforehand by scripts/gpu_wheels.sh);
#     they are installed with --no-index into a scratch folder put on PYTHONPATH, never into PYTHON.
# Variables: REPORT (default benchmarks/results/gpu_check.md), WORK (scratch, default a temp dir), PORT (18765),
# GPU_CHECK_CPU=1 runs every step with tiny sizes on the CPU: it checks this script's plumbing on a machine
# without a GPU, and proves nothing about CUDA. GPU_CHECK_SKIP_CPU_SUITE=1 leaves out the host CPU's test suite
# (CI runs it; on a lent GPU it only costs device time), GPU_CHECK_SKIP_HF=1 the HF generate baseline; SWEEP
# (default 1,16,64,256) the served concurrencies. STEP_TIMEOUT (default 600) bounds each step in seconds.
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root" || exit 2
python="${PYTHON:-python3}"
report="${REPORT:-$root/benchmarks/results/gpu_check.md}"
work="${WORK:-$(mktemp -d)}"
cpu_mode="${GPU_CHECK_CPU:-0}"
port="${PORT:-18765}"
step_timeout="${STEP_TIMEOUT:-600}"
mkdir -p "$work" "$(dirname "$report")"
: > "$work/steps.tsv"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1

die() { echo "gpu_check: $*" >&2; exit 2; }

# ---- preflight: everything must be here already
command -v "$python" >/dev/null 2>&1 || [ -x "$python" ] || die "PYTHON=$python not found"
if [ -n "${WHEELS:-}" ]; then
  [ -d "$WHEELS" ] || die "WHEELS=$WHEELS is not a folder"
  if compgen -G "$WHEELS/*.whl" >/dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --target "$work/site" "$WHEELS"/*.whl \
      || die "installing the wheels of $WHEELS failed"
    export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
missing="$("$python" - <<'EOF'
import importlib.util
need = ["torch", "transformers", "tokenizers", "safetensors", "numpy", "jinja2", "tqdm", "yaml", "psutil",
        "prometheus_client", "ninja", "pytest", "pytest_timeout", "accelerate", "fastapi", "uvicorn",
        "sse_starlette", "pydantic", "gguf", "xgrammar", "httpx"]
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
tokenizer_dir="${TOKENIZER_DIR:-}"
if [ -z "$tokenizer_dir" ] && [ -n "${WHEELS:-}" ] && [ -f "$WHEELS/SmolLM2-135M-Instruct/config.json" ]; then
  tokenizer_dir="$WHEELS/SmolLM2-135M-Instruct"
fi
tokenizer_dir="${tokenizer_dir:-${PAGEDSERVE_CACHE:-$HOME/.cache/pagedserve}/models/SmolLM2-135M-Instruct}"
[ -f "$tokenizer_dir/config.json" ] && [ -f "$tokenizer_dir/tokenizer.json" ] \
  || die "no tokenizer.json and config.json of the default model at $tokenizer_dir (scripts/gpu_wheels.sh bundles them)"
tokenizer_dir="$(cd "$tokenizer_dir" && pwd)"
# The tests' default model folder is these files alone, in a scratch cache (the kernels are built there too).
export PAGEDSERVE_CACHE="$work/cache"
mkdir -p "$PAGEDSERVE_CACHE/models/SmolLM2-135M-Instruct"
for f in "$tokenizer_dir"/*.json "$tokenizer_dir"/*.jinja; do [ -f "$f" ] && cp "$f" "$PAGEDSERVE_CACHE/models/SmolLM2-135M-Instruct/"; done

device="cuda"; [ "$cpu_mode" = 1 ] && device="cpu"
"$python" - "$device" > "$work/about.txt" <<'EOF' || die "$python cannot describe its device"
import platform, sys, torch
if sys.argv[1] == "cuda":
    p = torch.cuda.get_device_properties(0)
    print(f"{p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs, compute capability "
          f"{p.major}.{p.minor}; torch {torch.__version__} "
          f"(CUDA {torch.version.cuda})", end="")
else:
    print(f"CPU {platform.processor() or platform.machine()} (GPU_CHECK_CPU=1: plumbing check only); "
          f"torch {torch.__version__}", end="")
EOF
nvcc_version="$( (command -v nvcc >/dev/null && nvcc --version | tail -1) || echo "nvcc not on PATH")"
cpu_name="$(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2 | xargs) ($(nproc) cores)"
echo "; $nvcc_version; host $cpu_name; commit $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')" \
  >> "$work/about.txt"
echo "gpu_check: $(cat "$work/about.txt"); scratch in $work"

# ---- the steps
statuses=()
record() {  # record NAME STATUS SECONDS LOG: one row of the report
  local summary
  summary="$(grep -E '[0-9]+ (passed|failed)|tokens are HF|HTTP [0-9]+|prefill attention|error' "$4" | tail -1 \
             | tr '\t|' '  ' | cut -c1-200)"
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$summary" >> "$work/steps.tsv"
  statuses+=("$2")
}
step() {  # step NAME CMD...: runs it, logs to $work/NAME.log, records pass/fail and time
  local name="$1"; shift
  echo ">> $name"
  local start=$SECONDS status=pass
  if declare -F "$1" >/dev/null; then  # a function of this script: its long commands carry their own timeout
    "$@" 2>&1 | tee "$work/$name.log" || status=FAIL
  else
    timeout "$step_timeout" "$@" 2>&1 | tee "$work/$name.log" || status=FAIL
  fi
  record "$name" "$status" $((SECONDS - start)) "$work/$name.log"
  echo "<< $name: $status ($((SECONDS - start)) s)"
}
# shellcheck disable=SC2329  # invoked through step
pytest() { timeout "$step_timeout" "$python" -m pytest -q -p no:cacheprovider "$@"; }
helper() { timeout "$step_timeout" "$python" "$root/scripts/gpu_check.py" "$@"; }

step build "$python" -c "
import logging, sys
logging.basicConfig(level=logging.INFO)
from engine import ops
backend = ops.require_backend('$device')
print('ops backend:', backend.value)"

# The CPU kernel and model suites on the host CPU, beside the GPU tests (half the cores); joined before the
# benchmarks. Left out: the model tests that read the default model's weights (not carried) and the slow ones.
cpu_start=$SECONDS
cpu_threads=$(( $(nproc) > 2 ? $(nproc) / 2 : 1 ))
if [ "$cpu_mode" = 1 ]; then
  cpu_tests=(tests/kernels/test_small_gemm.py tests/model/test_cache_engine.py -k "refuses or (cache_engine and not cuda)")
else
  cpu_tests=(tests/kernels tests/model -m "not slow" -k "not cuda and not split_decode and not int8_compiled_step")
fi
cpu_pid=
if [ "${GPU_CHECK_SKIP_CPU_SUITE:-0}" != 1 ]; then
  OMP_NUM_THREADS=$cpu_threads pytest "${cpu_tests[@]}" > "$work/cpu-suite.log" 2>&1 &
  cpu_pid=$!
fi

if [ "$cpu_mode" = 1 ]; then
  step cuda-kernel-tests pytest tests/kernels/test_backend.py tests/kernels/test_attention.py -k "backend or refuse or edge"
  step engine-cuda-tests pytest tests/e2e/test_cuda_engine.py tests/e2e/test_prefill_fallback.py -k "not survive"
else
  step cuda-kernel-tests pytest tests/kernels tests/model/test_fp8.py -k "cuda or backend"
  step engine-cuda-tests pytest tests/e2e/test_cuda_engine.py tests/e2e/test_prefill_fallback.py \
    tests/e2e/test_tensor_parallel.py -k "cuda or nccl or fallback or probe or sdpa"
fi
# shellcheck disable=SC2329  # invoked through step
prefill_kernel() {
  timeout "$step_timeout" "$python" - "$device" <<'EOF'
import logging, sys, torch
logging.basicConfig(level=logging.INFO, format="%(message)s")
from engine.model_executor.layers.prefill_kernels import ProbeShape, candidates_for, installed_kernels, select_prefill_kernel
device = torch.device(sys.argv[1])
candidates = candidates_for(device) or installed_kernels()  # the CPU engine probes none: show the chain anyway
kernel = select_prefill_kernel(candidates, ProbeShape(32, 8, 64, torch.bfloat16, device))
print(f"prefill attention on {device}: {kernel.name} (of {', '.join(k.name for k in candidates)})")
EOF
}
step prefill-kernel prefill_kernel

smol_size=smol; [ "$cpu_mode" = 1 ] && smol_size=tiny
step smollm2-random-model helper model "$work/smollm2" --like "$tokenizer_dir" --size "$smol_size" \
  --device "$device" --dtype float32
step smollm2-parity helper parity "$work/smollm2" --device "$device"

# shellcheck disable=SC2329  # invoked through step
wait_healthy() {  # wait_healthy PID: until the server on $port answers /health (5 minutes), or PID exits
  for _ in $(seq 300); do
    curl -fsS "http://127.0.0.1:$port/health" >/dev/null 2>&1 && return 0
    kill -0 "$1" 2>/dev/null || return 1
    sleep 1
  done
  return 1
}

# shellcheck disable=SC2329  # invoked through step
serve_and_request() {  # serve_and_request MODEL_DIR ARGS...: one completion through `pagedserve serve`
  local model="$1"; shift
  "$python" -m server.cli serve "$model" --device "$device" --host 127.0.0.1 --port "$port" "$@" \
    > "$work/server.log" 2>&1 &
  local pid=$! code=000
  wait_healthy "$pid" || true  # the request or the sweep below reports a server that never came up
  code=$(curl -sS -m 120 -o "$work/completion.json" -w '%{http_code}' "http://127.0.0.1:$port/v1/completions" \
    -H 'Content-Type: application/json' -d '{"prompt": "The capital of France is", "max_tokens": 8}')
  kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
  echo "HTTP $code: $(head -c 300 "$work/completion.json")"
  [ "$code" = 200 ] || { tail -20 "$work/server.log"; return 1; }
}
step smollm2-dummy-serve serve_and_request "$tokenizer_dir" --load-format dummy --max-model-len 256

if [ "$cpu_mode" = 1 ]; then
  step kernel-bench "$python" benchmarks/kernels.py --device cpu --batches 1 --contexts 128 --min-time 0.01 \
    --out "$work/kernels.json"
else
  step kernel-bench "$python" benchmarks/kernels.py --device cuda --full --min-time 0.02 \
    --out "$work/kernels.json"
fi

# Wait for the CPU suite before the timed runs below.
if [ -n "$cpu_pid" ]; then
  cpu_status=pass
  wait "$cpu_pid" || cpu_status=FAIL
  tail -3 "$work/cpu-suite.log"
  record cpu-suite "$cpu_status" $((SECONDS - cpu_start)) "$work/cpu-suite.log"
fi

big_size=1b; [ "$cpu_mode" = 1 ] && big_size=tiny
step llama-1b-random-model helper model "$work/llama-1b" --like "$tokenizer_dir" --size "$big_size" \
  --device "$device" --dtype bfloat16
if [ "$cpu_mode" = 1 ]; then
  sizes=(--num-prompts 2 --input-len 8 --output-len 4 --hf-sequential-prompts 1 --hf-batch-sizes 2)
  sweep=(--sweep "1,2" --input-len 8 --output-len 4 --num-prompts-min 2 --rounds 1 --warmup 1)
  batches=(1 2); steps=4
else
  sizes=(--num-prompts 256 --input-len 128 --output-len 128 --hf-sequential-prompts 0 --hf-batch-sizes 256)
  [ "${GPU_CHECK_SKIP_HF:-0}" = 1 ] && sizes+=(--skip-hf)
  sweep=(--sweep "${SWEEP:-1,16,64,256}" --input-len 128 --output-len 128 --rounds 1 --warmup 2)
  batches=(1 256); steps=32
fi
step throughput "$python" benchmarks/throughput.py --model "$work/llama-1b" --dtype bfloat16 --hf-dtypes bfloat16 \
  "${sizes[@]}" --output-json "$work/throughput.json"

for b in "${batches[@]}"; do
  step "profile-step-batch-$b" "$python" benchmarks/profile_step.py --model "$work/llama-1b" --dtype bfloat16 \
    --batch "$b" --steps "$steps" --output-json "$work/profile-$b.json"
  # The same step op by op (no CUDA graphs): what the graphs win (GPU_CHECK_EAGER=0 leaves it out).
  [ "${GPU_CHECK_EAGER:-1}" = 1 ] && step "profile-step-eager-batch-$b" "$python" benchmarks/profile_step.py --model "$work/llama-1b" \
    --dtype bfloat16 --enforce-eager --batch "$b" --steps "$steps" --output-json "$work/profile-eager-$b.json"
  # fp8 weights (--quantization fp8: torch's scaled matmul): the same step with half the weight bytes.
  step "profile-step-fp8-batch-$b" "$python" benchmarks/profile_step.py --model "$work/llama-1b" --dtype bfloat16 \
    --quantization fp8 --batch "$b" --steps "$steps" --output-json "$work/profile-fp8-$b.json"
done

# shellcheck disable=SC2329  # invoked through step
serve_sweep() {  # serve_sweep NAME SERVER_FLAGS...: the sweep against `pagedserve serve`, to $work/NAME.json
  local name="$1"; shift
  "$python" -m server.cli serve "$work/llama-1b" --device "$device" --dtype bfloat16 --host 127.0.0.1 \
    --port "$port" --max-model-len 512 --max-num-seqs 256 "$@" > "$work/server-$name.log" 2>&1 &
  local pid=$! rc=0
  wait_healthy "$pid" || true  # the request or the sweep below reports a server that never came up
  timeout "$step_timeout" "$python" benchmarks/serving.py --base-url "http://127.0.0.1:$port" "${sweep[@]}" \
    --strict --output-json "$work/$name.json" || rc=1
  kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
  [ "$rc" = 0 ] || tail -20 "$work/server-$name.log"
  return "$rc"
}
step serve-sweep serve_sweep serving
step serve-sweep-core-process serve_sweep serving-core --engine-core-process

# ---- the report
helper report "$work" "$report" || die "the report failed"
echo "gpu_check: report in $report"
for s in "${statuses[@]}"; do [ "$s" = pass ] || exit 1; done
exit 0
