#!/usr/bin/env bash
# Shell helpers of the benchmark scripts (sourced by run_cpu.sh and peers.sh).

# port: a free TCP port on 127.0.0.1.
port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# start_server LOG CMD...: start CMD (a server on $PORT) with its output in LOG, wait until /health answers,
# and set SERVER_PID; exit 1 with the log's tail if it dies first.
start_server() {
    local log=$1; shift
    "$@" > "$log" 2>&1 &
    SERVER_PID=$!
    for _ in $(seq 1 300); do
        curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && return 0
        kill -0 "$SERVER_PID" 2> /dev/null || { tail -20 "$log"; exit 1; }
        sleep 1
    done
}

# stop_server: SIGINT the server start_server started, and wait for it.
stop_server() { kill -INT "$SERVER_PID"; wait "$SERVER_PID" || true; }
