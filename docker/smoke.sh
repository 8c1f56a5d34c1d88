#!/usr/bin/env bash
# Real container check: build the CPU image, run it, wait for /health, get one completion.
#
# Works with no container registry: a Docker engine is started here if none answers
# (Debian's docker.io, data and exec roots under $SMOKE_DIR), the base image is made with
# debootstrap, and torch comes from the CPU wheel pip finds on this host (.whl/).
# The host's CA bundle (for a TLS-intercepting proxy) reaches pip only as a build secret.
#
# Env: SMOKE_DIR (scratch, default /tmp/pagedserve-smoke), BASE_IMAGE (default: a local
# debootstrap'd bookworm, localbase:bookworm), SMOKE_PORT (18080), SMOKE_SERVE_ARGS (extra
# server flags, passed through the entrypoint; default "--kv-cache-space 1 --swap-space 1"),
# KEEP_DOCKERD=1 (leave a dockerd this script started running), IMAGE.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
SMOKE_DIR=${SMOKE_DIR:-/tmp/pagedserve-smoke}
IMAGE=${IMAGE:-pagedserve:cpu}
BASE_IMAGE=${BASE_IMAGE:-localbase:bookworm}
PORT=${SMOKE_PORT:-18080}
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
NAME=pagedserve-smoke-$$
mkdir -p "$SMOKE_DIR"
TIMINGS="$SMOKE_DIR/timings.txt"
: > "$TIMINGS"

log() { echo ">> [smoke] $*"; }
now() { date +%s; }
timing() { echo "$1: $2 s" | tee -a "$TIMINGS"; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
apt_install() {
    log "apt-get install $*"
    as_root apt-get update -qq
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "$@" >/dev/null
}

# ------------------------------------------------------------------ the engine
# The Docker 20.10 client from docker.io talks to the daemon's own BuildKit; a newer client
# without the buildx plugin refuses BuildKit builds, and RUN --mount needs BuildKit.
pick_client() {
    if docker buildx version >/dev/null 2>&1; then DOCKER=(docker); else DOCKER=(/usr/bin/docker); fi
}
STARTED_DOCKERD=""
pick_client
if ! "${DOCKER[@]}" info >/dev/null 2>&1; then
    if [ ! -x /usr/sbin/dockerd ] || [ ! -x /usr/bin/docker ]; then apt_install docker.io; fi
    pick_client
    export DOCKER_HOST="unix://$SMOKE_DIR/docker.sock"
    if ! "${DOCKER[@]}" info >/dev/null 2>&1; then
        log "starting dockerd (roots under $SMOKE_DIR)"
        as_root dockerd --data-root "$SMOKE_DIR/docker-data" --exec-root "$SMOKE_DIR/docker-exec" \
            -H "$DOCKER_HOST" --pidfile "$SMOKE_DIR/docker.pid" >"$SMOKE_DIR/dockerd.log" 2>&1 &
        STARTED_DOCKERD=1
        for _ in $(seq 60); do "${DOCKER[@]}" info >/dev/null 2>&1 && break; sleep 1; done
        "${DOCKER[@]}" info >/dev/null || { tail -20 "$SMOKE_DIR/dockerd.log"; exit 1; }
    fi
fi
export DOCKER_BUILDKIT=1

cleanup() {
    "${DOCKER[@]}" rm -f "$NAME" >/dev/null 2>&1 || true
    "${DOCKER[@]}" volume rm -f "$NAME-cache" >/dev/null 2>&1 || true
    if [ -n "$STARTED_DOCKERD" ] && [ "${KEEP_DOCKERD:-0}" != 1 ]; then
        log "stopping the dockerd this script started"
        as_root kill "$(cat "$SMOKE_DIR/docker.pid")" 2>/dev/null || true
    fi
}
trap cleanup EXIT

# ------------------------------------------------------------------ the base image
if ! "${DOCKER[@]}" image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    if [ "$BASE_IMAGE" != localbase:bookworm ]; then
        log "base image $BASE_IMAGE not present"; exit 1
    fi
    t=$(now)
    command -v debootstrap >/dev/null || apt_install debootstrap
    rootfs="$SMOKE_DIR/rootfs-bookworm"
    if [ ! -x "$rootfs/usr/bin/apt-get" ]; then
        log "debootstrap --variant=minbase bookworm $rootfs"
        as_root rm -rf "$rootfs"
        as_root debootstrap --variant=minbase bookworm "$rootfs" >"$SMOKE_DIR/debootstrap.log" 2>&1 \
            || { tail -20 "$SMOKE_DIR/debootstrap.log"; exit 1; }
    fi
    log "importing $rootfs as $BASE_IMAGE"
    as_root tar -C "$rootfs" -c . | "${DOCKER[@]}" import - "$BASE_IMAGE" >/dev/null
    timing "base image (debootstrap + import)" $(( $(now) - t ))
fi

# ------------------------------------------------------------------ torch wheel + build
# .whl/ is gitignored and the only non-source path in the build context (.dockerignore).
t=$(now)
mkdir -p "$REPO/.whl"
if ! compgen -G "$REPO/.whl/torch-*.whl" >/dev/null; then
    log "pip download torch==2.13.0 (the host's CPU wheel)"
    python3 -m pip download --no-deps "torch==${TORCH_VERSION:-2.13.0}" -d "$REPO/.whl" -q
fi
case "$(ls "$REPO"/.whl/torch-*.whl)" in
    *+cpu*) ;;
    *) log "the torch wheel in .whl/ is not a CPU build: $(ls "$REPO"/.whl/torch-*.whl)"; exit 1;;
esac
secret=()
[ -f "$CA_BUNDLE" ] && secret=(--secret "id=pipcert,src=$CA_BUNDLE")
log "building $IMAGE from docker/Dockerfile.cpu on $BASE_IMAGE"
if ! "${DOCKER[@]}" build --network host --progress plain -f "$REPO/docker/Dockerfile.cpu" \
        --build-arg "BASE_IMAGE=$BASE_IMAGE" "${secret[@]}" -t "$IMAGE" "$REPO" >"$SMOKE_DIR/build.log" 2>&1; then
    tail -40 "$SMOKE_DIR/build.log"; log "build FAILED (full log: $SMOKE_DIR/build.log)"; exit 1
fi
grep -E '^#[0-9]+ (\[|DONE [0-9.]+s$)' "$SMOKE_DIR/build.log" | grep -B1 DONE | grep '\[' || true
timing "docker build (CPU image)" $(( $(now) - t ))
"${DOCKER[@]}" image ls "$IMAGE" --format 'image size: {{.Size}}' | tee -a "$TIMINGS"

# ------------------------------------------------------------------ run + request
# Host networking: the test talks to 127.0.0.1 only; the port is the entrypoint's env.
t=$(now)
log "docker run $IMAGE on 127.0.0.1:$PORT"
# shellcheck disable=SC2086
# --init: the server is not PID 1, so a signal that kills it (a segfault) ends the container, and
# --restart on-failure starts it again: how a deployment recovers from a native crash (docs/reliability.md).
"${DOCKER[@]}" run -d --name "$NAME" --network host -e "PAGEDSERVE_PORT=$PORT" --init --restart on-failure:3 \
    -v "$NAME-cache:/home/app/.cache/pagedserve" \
    --ulimit nofile=1024:20000 --ulimit nproc=4096:4096 \
    "$IMAGE" ${SMOKE_SERVE_ARGS:---kv-cache-space 1 --swap-space 1} >/dev/null
healthy=""
for _ in $(seq 600); do
    if curl -fsS "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; then healthy=1; break; fi
    [ "$("${DOCKER[@]}" inspect -f '{{.State.Running}}' "$NAME")" = true ] || break
    sleep 1
done
if [ -z "$healthy" ]; then
    "${DOCKER[@]}" logs --tail 60 "$NAME" 2>&1
    log "the server never answered /health"; exit 1
fi
timing "container start to /health 200" $(( $(now) - t ))
# What the container serves (the default on a CPU: the package's Q4_1 file as its blocks).
log "$("${DOCKER[@]}" logs "$NAME" 2>&1 | grep -m1 'model_executor.loader: loaded' | sed 's/.*loader: //')"

t0=$(date +%s.%N)
model=$(curl -fsS "http://127.0.0.1:$PORT/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
code=$(curl -sS -o "$SMOKE_DIR/completion.json" -w '%{http_code}' "http://127.0.0.1:$PORT/v1/completions" \
    -H 'Content-Type: application/json' \
    -d "{\"model\": \"$model\", \"prompt\": \"The capital of France is\", \"max_tokens\": 16, \"temperature\": 0}")
t1=$(date +%s.%N)
echo "completion request: $(python3 -c "print(round($t1 - $t0, 2))") s" | tee -a "$TIMINGS"
log "HTTP $code: $(cat "$SMOKE_DIR/completion.json")"
[ "$code" = 200 ] || { "${DOCKER[@]}" logs --tail 40 "$NAME" 2>&1; log "completion FAILED"; exit 1; }
python3 - "$SMOKE_DIR/completion.json" <<'EOF'
import json, sys
body = json.load(open(sys.argv[1]))
text = body["choices"][0]["text"]
assert body["object"] == "text_completion" and text.strip(), body
print(f">> [smoke] completion text: {text!r}")
EOF

# The image's own HEALTHCHECK must agree (interval 15 s).
status=""
for _ in $(seq 45); do
    status=$("${DOCKER[@]}" inspect -f '{{.State.Health.Status}}' "$NAME")
    [ "$status" = starting ] || break
    sleep 2
done
log "docker HEALTHCHECK status: $status"
[ "$status" = healthy ] || { log "HEALTHCHECK not healthy"; exit 1; }
"${DOCKER[@]}" exec "$NAME" id -u | sed 's/^/container uid: /' | tee -a "$TIMINGS"

# ------------------------------------------------------------------ a native crash
# SIGSEGV to the server, as a faulting kernel would raise: the process dies, the container exits 139, the
# restart policy starts a new one, and the same volume serves again.
t=$(now)
log "SIGSEGV to the server process"
"${DOCKER[@]}" exec "$NAME" python -c 'import os, signal
me = os.getpid()
for p in filter(str.isdigit, os.listdir("/proc")):
    cmd = open(f"/proc/{p}/cmdline", "rb").read().split(b"\0")
    if int(p) != me and any(c.endswith(b"pagedserve") for c in cmd) and b"serve" in cmd:
        os.kill(int(p), signal.SIGSEGV); print("killed", p, b" ".join(cmd).decode())'
restarted=""
for _ in $(seq 300); do
    count=$("${DOCKER[@]}" inspect -f '{{.RestartCount}}' "$NAME" 2>/dev/null || echo 0)
    if [ "$count" -ge 1 ] && curl -fsS "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; then restarted=1; break; fi
    sleep 1
done
[ -n "$restarted" ] || { "${DOCKER[@]}" logs --tail 40 "$NAME" 2>&1; log "no restart after the crash"; exit 1; }
timing "segfault to /health 200 again (restart policy)" $(( $(now) - t ))
code=$(curl -sS -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/v1/completions" \
    -H 'Content-Type: application/json' -d "{\"model\": \"$model\", \"prompt\": \"Hi\", \"max_tokens\": 4}")
log "after the restart: HTTP $code, restarts $("${DOCKER[@]}" inspect -f '{{.RestartCount}}' "$NAME")"
[ "$code" = 200 ] || { log "completion after the restart FAILED"; exit 1; }
log "PASSED; timings in $TIMINGS"
