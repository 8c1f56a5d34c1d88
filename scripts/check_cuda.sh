#!/usr/bin/env bash
# Compile-checks pagedserve's CUDA code without a GPU (CI runs this):
#   1. every csrc/cuda/*.cu with nvcc, for sm_90 and sm_80;
#   2. the torch side of the CUDA build (cuda/torch_bindings.cpp and the
#      PAGEDSERVE_CUDA branch of bindings.cpp) with g++ -fsyntax-only against
#      the installed torch headers, when torch is importable.
# Fails on any error. NVCC (default: nvcc on PATH, else /usr/local/bin/nvcc),
# PYTHON (default: .venv/bin/python) and CUDA_ARCHS ("90 80") can be overridden.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
csrc="$root/csrc"
nvcc="${NVCC:-$(command -v nvcc || echo /usr/local/bin/nvcc)}"
python="${PYTHON:-$root/.venv/bin/python}"
archs="${CUDA_ARCHS:-90 80}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

[ -x "$nvcc" ] || { echo "check_cuda: nvcc not found (set NVCC=...)" >&2; exit 1; }
echo "check_cuda: $("$nvcc" --version | tail -1)"

pids=()
names=()
run() {  # run NAME CMD... in the background, log to $out/NAME.log
  local name="$1"; shift
  ( "$@" >"$out/$name.log" 2>&1 ) &
  pids+=("$!"); names+=("$name")
}

for cu in "$csrc"/cuda/*.cu; do
  for arch in $archs; do
    base="$(basename "$cu" .cu)"
    run "nvcc-$base-sm_$arch" "$nvcc" -std=c++17 -O3 -arch="sm_$arch" -I"$csrc" -Werror all-warnings \
      -c "$cu" -o "$out/$base.sm_$arch.o"
  done
done

if torch_inc="$("$python" -c 'import torch.utils.cpp_extension as c; print(" ".join(c.include_paths()))' 2>/dev/null)"; then
  py_inc="$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
  cuda_inc="$(dirname "$(dirname "$(readlink -f "$nvcc")")")/include"
  # A CPU torch wheel lacks this generated CUDA header; a stub suffices for syntax.
  mkdir -p "$out/stub/c10/cuda/impl"
  printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$out/stub/c10/cuda/impl/cuda_cmake_macros.h"
  incs=(-I"$csrc" -I"$py_inc" -I"$cuda_inc" -I/usr/local/cuda/include -I"$out/stub")
  for d in $torch_inc; do incs+=(-I"$d"); done
  for src in cuda/torch_bindings.cpp bindings.cpp; do
    run "g++-$(basename "$src" .cpp)" g++ -std=c++20 -fsyntax-only -DPAGEDSERVE_CUDA -DTORCH_EXTENSION_NAME=check \
      -w "${incs[@]}" "$csrc/$src"
  done
else
  echo "check_cuda: torch not importable with $python; skipping the torch binding check"
fi

failed=0
for i in "${!pids[@]}"; do
  if wait "${pids[$i]}"; then
    echo "ok    ${names[$i]}"
  else
    echo "FAIL  ${names[$i]}"; sed 's/^/    /' "$out/${names[$i]}.log"; failed=1
  fi
done
exit "$failed"
