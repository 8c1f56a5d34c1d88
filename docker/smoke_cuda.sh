#!/usr/bin/env bash
# Build-only check of the CUDA image (docker/Dockerfile) on a machine with no GPU and no container registry.
#
# The nvidia/cuda devel base is replaced by one made here: a debootstrap'd bookworm (docker/smoke.sh makes it)
# with CUDA's compiler from PyPI (nvidia-cuda-nvcc and the runtime, CCCL, CRT and NVVM wheels of the same CUDA
# 13.0), laid out as /usr/local/cuda. torch comes from PyPI (torch 2.11's Linux wheels are CUDA 13.0 builds).
# What runs: every step of docker/Dockerfile, the nvcc/torch CUDA check and the CPU and CUDA kernel builds
# included. Nothing runs on a GPU.
#
# Env: SMOKE_DIR (scratch, default /tmp/pagedserve-smoke), IMAGE (pagedserve:cuda-smoke), CUDA_PIP (13.0.*),
# TORCH_SPEC (torch==2.11.0), TORCH_CUDA_ARCH_LIST (9.0: one architecture keeps the build short).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
SMOKE_DIR=${SMOKE_DIR:-/tmp/pagedserve-smoke}
IMAGE=${IMAGE:-pagedserve:cuda-smoke}
CUDA_PIP=${CUDA_PIP:-13.0.*}
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
mkdir -p "$SMOKE_DIR"
log() { echo ">> [smoke-cuda] $*"; }
now() { date +%s; }

# The engine and the bookworm base, as docker/smoke.sh makes them (Debian's docker.io: its 20.10 client talks to
# the daemon's own BuildKit, which RUN --mount needs).
if [ ! -x /usr/sbin/dockerd ] || [ ! -x /usr/bin/docker ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >/dev/null
fi
docker() { /usr/bin/docker "$@"; }
if ! docker info >/dev/null 2>&1; then
    export DOCKER_HOST="unix://$SMOKE_DIR/docker.sock"
    if ! docker info >/dev/null 2>&1; then
        log "starting dockerd (roots under $SMOKE_DIR)"
        /usr/sbin/dockerd --data-root "$SMOKE_DIR/docker-data" --exec-root "$SMOKE_DIR/docker-exec" \
            -H "$DOCKER_HOST" --pidfile "$SMOKE_DIR/docker.pid" >"$SMOKE_DIR/dockerd.log" 2>&1 &
        trap 'kill "$(cat "$SMOKE_DIR/docker.pid")" 2>/dev/null || true' EXIT
        for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    fi
fi
export DOCKER_BUILDKIT=1
if ! docker image inspect localbase:bookworm >/dev/null 2>&1; then
    rootfs="$SMOKE_DIR/rootfs-bookworm"
    if [ ! -x "$rootfs/usr/bin/apt-get" ]; then
        command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
        log "debootstrap --variant=minbase bookworm $rootfs"
        rm -rf "$rootfs"
        debootstrap --variant=minbase bookworm "$rootfs" >"$SMOKE_DIR/debootstrap.log" 2>&1
    fi
    tar -C "$rootfs" -c . | docker import - localbase:bookworm >/dev/null
fi
secret=()
[ -f "$CA_BUNDLE" ] && secret=(--secret "id=pipcert,src=$CA_BUNDLE")

t=$(now)
log "the CUDA $CUDA_PIP devel base from PyPI's wheels (localcuda:bookworm)"
docker build --network host --progress plain "${secret[@]}" -t localcuda:bookworm - >"$SMOKE_DIR/base.log" 2>&1 <<EOF || {
FROM localbase:bookworm
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PATH=/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
RUN --mount=type=secret,id=pipcert \\
    if [ -f /run/secrets/pipcert ]; then export PIP_CERT=/run/secrets/pipcert; fi \\
    && apt-get update && apt-get install -y --no-install-recommends python3-pip ca-certificates \\
    && pip install --break-system-packages --no-deps --target /opt/cuda-pip \\
       "nvidia-cuda-nvcc==$CUDA_PIP" "nvidia-cuda-runtime==$CUDA_PIP" "nvidia-cuda-cccl==$CUDA_PIP" \\
       "nvidia-cuda-crt==$CUDA_PIP" "nvidia-nvvm==$CUDA_PIP" \\
    && ln -s /opt/cuda-pip/nvidia/cu13 /usr/local/cuda && ln -s lib /usr/local/cuda/lib64 \\
    && ln -s libcudart.so.13 /usr/local/cuda/lib/libcudart.so \\
    && /usr/local/cuda/bin/nvcc --version
EOF
    tail -30 "$SMOKE_DIR/base.log"; log "base FAILED ($SMOKE_DIR/base.log)"; exit 1; }
log "base: $(( $(now) - t )) s"

t=$(now)
log "docker/Dockerfile on localcuda:bookworm (torch ${TORCH_SPEC:-torch==2.11.0} from PyPI, arch ${TORCH_CUDA_ARCH_LIST:-9.0})"
if ! docker build --network host --progress plain -f "$REPO/docker/Dockerfile" "${secret[@]}" \
        --build-arg BASE_IMAGE=localcuda:bookworm --build-arg "TORCH_SPEC=${TORCH_SPEC:-torch==2.11.0}" \
        --build-arg TORCH_INDEX_URL= --build-arg "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}" \
        -t "$IMAGE" "$REPO" >"$SMOKE_DIR/build-cuda.log" 2>&1; then
    tail -40 "$SMOKE_DIR/build-cuda.log"; log "build FAILED ($SMOKE_DIR/build-cuda.log)"; exit 1
fi
grep -E '^#[0-9]+ (\[|DONE [0-9.]+s$)' "$SMOKE_DIR/build-cuda.log" | grep -B1 DONE | grep '\[' || true
docker run --rm --entrypoint python "$IMAGE" -c "import torch, engine.model_executor.layers.prefill_kernels as p; \
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'candidates', [k.name for k in p.installed_kernels()])"
log "PASSED: $IMAGE built in $(( $(now) - t )) s; $(docker image ls "$IMAGE" --format '{{.Size}}')"
