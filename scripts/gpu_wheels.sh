#!/usr/bin/env bash
# Downloads, on a machine with network, the wheels an offline GPU machine lacks to run pagedserve and
# scripts/gpu_check.sh: the project's pure-Python dependencies that a CUDA torch image does not ship,
# and xformers. For CPython 3.12 on manylinux x86_64. Carry the folder over, then:
#
#   bash scripts/gpu_wheels.sh wheels/                                   # here, with network
#   WHEELS=wheels/ PYTHON=/opt/torch/.venv/bin/python3 bash scripts/gpu_check.sh   # there, offline
#
# (or install them there with: $PYTHON -m pip install --no-index --no-deps wheels/*.whl).
# Each is downloaded with --no-deps: this list is the closure of what the image misses (torch,
# transformers, tokenizers, safetensors, numpy, accelerate, pytest, ninja and friends are already there),
# so nothing the image holds is shadowed by a second version.
# Variables: PYTHON (the pip to run, default python3), PACKAGES (replaces the list below),
# XFORMERS ("xformers==X": pick the release built against the GPU machine's torch; "" skips it).
set -euo pipefail

dest="${1:-wheels}"
python="${PYTHON:-python3}"
packages="${PACKAGES:-gguf fastapi starlette pydantic pydantic-core annotated-types typing-inspection uvicorn \
sse-starlette}"
xformers="${XFORMERS-xformers}"
platforms=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
           manylinux1_x86_64)
platform_args=()
for p in "${platforms[@]}"; do platform_args+=(--platform "$p"); done

mkdir -p "$dest"
for spec in $packages $xformers; do
  # --only-binary with a target python: pip picks cp312 / py3-none-any wheels, whichever the package has.
  "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none "${platform_args[@]}" -d "$dest" "$spec"
done
echo "gpu_wheels: $(find "$dest" -name '*.whl' | wc -l) wheels in $dest:"
ls -1 "$dest"
