#!/usr/bin/env bash
# The CPU numbers of docs/benchmarks.md, in one go (about 25 minutes on 2 cores; run on a quiet machine).
#
#   bash benchmarks/run_cpu.sh            # everything: served sweeps, HF baselines, offline, decode-step profile
#   OUT=/tmp/results bash benchmarks/run_cpu.sh
#   PARTS="hf offline" bash benchmarks/run_cpu.sh   # some of: served hf plot offline profile chunked
#   DTYPES=float32 bash benchmarks/run_cpu.sh       # a CPU without native bf16 (AVX2 only): bfloat16 is emulated there
#
# Every server is started here on a free port and stopped before the next one, so runs never overlap.
# JSON goes to $OUT (default benchmarks/results/), the plot to $OUT/serving.png.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-benchmarks/results}
SWEEP=${SWEEP:-1,2,4,8,16,32}
PARTS=" ${PARTS:-served hf plot offline profile} "
DTYPES=${DTYPES:-float32 bfloat16}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1
[[ -n ${OMP_WAIT_POLICY:-}${GOMP_SPINCOUNT:-} ]] || export GOMP_SPINCOUNT=4000  # pagedserve serve's default (engine/platform/openmp.py), for every server here

# shellcheck source=benchmarks/lib.sh
source benchmarks/lib.sh

# serve LABEL JSON LOAD CMD...: start CMD (a server on $PORT), wait for /health, run serving.py with the
# LOAD options on it, stop it.
serve() {
    local label=$1 json=$2 load=$3; shift 3
    start_server "$OUT/$json.log" "$@"
    # shellcheck disable=SC2086  # LOAD is a list of options
    "$PY" benchmarks/serving.py --base-url "http://127.0.0.1:$PORT" --label "$label" $load --strict \
        --output-json "$OUT/$json.json"
    stop_server
}
sweep() { echo "--sweep $1 --rounds 2 --num-prompts-min 4"; }

part() { [[ $PARTS == *" $1 "* ]]; }

if part served; then
    for dtype in $DTYPES; do
        PORT=$(port); serve "pagedserve ($dtype)" "ours_$dtype" "$(sweep "$SWEEP")" \
            "$PY" -m server.cli serve --port "$PORT" --disable-log-stats --dtype "$dtype"
    done
fi
if part hf; then  # what a user would write without pagedserve: HF generate behind the same API
    for dtype in $DTYPES; do
        PORT=$(port); serve "HF generate, one at a time ($dtype)" "hf_$dtype" "$(sweep 1,4)" \
            "$PY" benchmarks/hf_server.py --port "$PORT" --dtype "$dtype"
    done
fi
if part plot; then
    runs=()
    for dtype in $DTYPES; do runs+=("$OUT/ours_$dtype.json"); done
    for dtype in $DTYPES; do runs+=("$OUT/hf_$dtype.json"); done
    "$PY" benchmarks/plot.py "${runs[@]}" -o "$OUT/serving.png"
fi

# Offline: LLM.generate against HF's sequential and static padded batches, both dtypes for HF.
if part offline; then
    "$PY" benchmarks/throughput.py --num-prompts 128 --dtype float32 --hf-batch-sizes 32,64,128 \
        --hf-dtypes "${DTYPES// /,}" --hf-sequential-prompts 1 --quiet --output-json "$OUT/throughput_float32.json"
    if [[ " $DTYPES " == *" bfloat16 "* ]]; then
        "$PY" benchmarks/throughput.py --num-prompts 128 --dtype bfloat16 --skip-hf --quiet \
            --output-json "$OUT/throughput_bfloat16.json"
    fi
fi

# Chunked prefill against the default scheduler under Poisson arrivals of mixed lengths, two rounds, alternating
# (in the last of DTYPES: bfloat16 by default).
if part chunked; then
    POISSON="--num-prompts 96 --request-rate 3 --input-len-range 0.5 --output-len-range 0.5"
    for round in 1 2; do
        PORT=$(port); serve "default" "poisson_default_$round" "$POISSON" \
            "$PY" -m server.cli serve --port "$PORT" --disable-log-stats --dtype "${DTYPES##* }"
        PORT=$(port); serve "chunked prefill" "poisson_chunked_$round" "$POISSON" \
            "$PY" -m server.cli serve --port "$PORT" --disable-log-stats --dtype "${DTYPES##* }" --enable-chunked-prefill
    done
fi

# Where a decode step and a prefill go.
part profile && for dtype in $DTYPES; do
    "$PY" benchmarks/profile_step.py --dtype "$dtype" --steps 32 --output-json "$OUT/profile_decode_$dtype.json"
    "$PY" benchmarks/profile_step.py --dtype "$dtype" --prefill --output-json "$OUT/profile_prefill_$dtype.json"
done
echo "results in $OUT"
