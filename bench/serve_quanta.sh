# Sourced by the client benchmarks (bench/clients/run.sh, bench/lm_eval/run.sh): start
# `quanta serve` on free loopback ports with the OpenAI gateway, stop it when the script exits,
# and return once both Triton and the gateway are ready.
#
#   start_quanta_serve QUANTA PYTHON OUT MODEL [serve options...]
#
# Sets SERVER (its pid), OPENAI_PORT and METRICS_PORT; the server's output is OUT/serve.log.

free_port() {
    "$SERVE_PYTHON" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"
}

stop_server() {
    if kill -0 "$SERVER" 2>/dev/null; then
        kill -INT "$SERVER"
        wait "$SERVER" || true
    fi
}

start_quanta_serve() {
    local quanta="$1" out="$3" model="$4"
    SERVE_PYTHON="$2"
    shift 4
    OPENAI_PORT="$(free_port)"
    METRICS_PORT="$(free_port)"
    : >"$out/serve.log"
    "$quanta" serve "$model" "$@" \
        --http-port "$(free_port)" --grpc-port "$(free_port)" --metrics-port "$METRICS_PORT" \
        --openai-port "$OPENAI_PORT" --state-dir "$out/quanta-state" \
        --log-file "$out/tritonserver.log" >"$out/serve.log" 2>&1 &
    SERVER=$!
    trap stop_server EXIT
    # "ready" is printed once Triton and the gateway both answer
    until grep -q "^ready" "$out/serve.log"; do
        if ! kill -0 "$SERVER" 2>/dev/null; then
            cat "$out/serve.log"
            echo "quanta serve exited before it was ready" >&2
            exit 1
        fi
        sleep 1
    done
}
