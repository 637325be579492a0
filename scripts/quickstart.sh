#!/usr/bin/env bash
# `make run`: the tiny model (generated once, offline), the Transformers
# fallback server on it, and the proxy in front — all on localhost.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL_DIR="${BROWNOUT_TINY_MODEL_DIR:-$HOME/.cache/brownout/tiny-model-v1}"
FALLBACK_PORT="${BROWNOUT_FALLBACK_PORT:-8001}"
PORT="${BROWNOUT_PORT:-8080}"
export BROWNOUT_PORT="$PORT"
export BROWNOUT_FALLBACK_URL="${BROWNOUT_FALLBACK_URL:-http://127.0.0.1:$FALLBACK_PORT}"

if [ ! -f "$MODEL_DIR/config.json" ]; then
    echo "== generating the tiny model in $MODEL_DIR (offline, a few seconds)"
    brownout make-tiny-model "$MODEL_DIR"
fi

echo "== starting the fallback server on :$FALLBACK_PORT"
brownout fallback-server --model "$MODEL_DIR" --served-model-name tiny --port "$FALLBACK_PORT" \
    --max-concurrency 2 &
FALLBACK_PID=$!
trap 'kill $FALLBACK_PID 2>/dev/null; wait $FALLBACK_PID 2>/dev/null' EXIT INT TERM

for _ in $(seq 1 120); do
    if curl -fsS "http://127.0.0.1:$FALLBACK_PORT/health" >/dev/null 2>&1; then break; fi
    if ! kill -0 "$FALLBACK_PID" 2>/dev/null; then echo "fallback server failed to start" >&2; exit 1; fi
    sleep 0.5
done

cat <<MSG

== Brownout is starting on http://127.0.0.1:$PORT — try:

curl -N http://127.0.0.1:$PORT/v1/chat/completions -H 'Content-Type: application/json' \\
  -d '{"model":"tiny","stream":true,"max_tokens":32,"messages":[{"role":"user","content":"Hello!"}]}'

   status: curl http://127.0.0.1:$PORT/brownout/status     (Ctrl-C stops everything)

MSG
brownout serve --config policies/quickstart.yaml
