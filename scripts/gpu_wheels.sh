#!/usr/bin/env bash
# Downloads, on a machine with network, the wheels an offline GPU machine lacks to run pagedserve and
# scripts/gpu_check.sh, for CPython 3.12 on manylinux x86_64, and puts the default model's tokenizer and config
# (no weights) beside them: ~12 MiB. Carry the folder over, then:
#
#   bash scripts/gpu_wheels.sh wheels/                                   # here, with network
#   WHEELS=wheels/ PYTHON=/opt/torch/.venv/bin/python3 bash scripts/gpu_check.sh   # there, offline
#
# (or install them there with: $PYTHON -m pip install --no-index --no-deps wheels/*.whl).
# What is missing is computed, not listed: scripts/gpu_wheels.py walks the project's dependencies, pinned to the
# versions this checkout's environment resolved, and leaves out what the GPU image holds (its package list is
# there). Each wheel is downloaded with --no-deps, so nothing the image holds is shadowed by a second version.
# `bash scripts/gpu_wheels.sh --list` prints the pinned specs and downloads nothing.
# Variables: PYTHON (the environment whose versions are pinned, and whose pip downloads; default .venv/bin/python,
# else python3), XFORMERS ("xformers==X" adds an xformers built for the GPU machine's torch and CUDA; none by
# default: the engine's prefill attention is torch's own, and a build for another torch cannot run).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-}"
if [ -z "$python" ]; then
  if [ -x "$root/.venv/bin/python" ]; then python="$root/.venv/bin/python"; else python=python3; fi
fi
mapfile -t specs < <("$python" "$root/scripts/gpu_wheels.py")
[ -n "${XFORMERS:-}" ] && specs+=("$XFORMERS")
if [ "${1:-}" = --list ]; then
  printf '%s\n' "${specs[@]}"
  exit 0
fi

dest="${1:-wheels}"
platforms=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
           manylinux1_x86_64)
platform_args=()
for p in "${platforms[@]}"; do platform_args+=(--platform "$p"); done

mkdir -p "$dest"
# --only-binary with a target python: pip picks cp312 / py3-none-any wheels, whichever the package has.
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --abi cp312 --abi abi3 --abi none "${platform_args[@]}" -d "$dest" "${specs[@]}"
# The default model's tokenizer and config.json (never its weights): scripts/gpu_check.sh builds random-weight
# models of its shapes and serves it with --load-format dummy.
model="$(cd "$root" && "$python" -c 'from engine.model_executor.loader import default_model_path; print(default_model_path())')"
mkdir -p "$dest/SmolLM2-135M-Instruct"
cp "$model"/*.json "$model"/*.jinja "$dest/SmolLM2-135M-Instruct/"
echo "gpu_wheels: $(find "$dest" -name '*.whl' | wc -l) wheels and the default model's tokenizer and config in $dest" \
  "($(du -sh "$dest" | cut -f1)):"
ls -1 "$dest" "$dest/SmolLM2-135M-Instruct"
