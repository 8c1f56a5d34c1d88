#!/bin/sh
# Container entrypoint: the server on 0.0.0.0:$PAGEDSERVE_PORT; any arguments are extra
# `pagedserve serve` flags (e.g. --model /models/x.gguf --max-num-seqs 32).
set -e
exec pagedserve serve --host "${PAGEDSERVE_HOST:-0.0.0.0}" --port "${PAGEDSERVE_PORT:-8000}" "$@"
