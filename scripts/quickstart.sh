#!/usr/bin/env bash
# `make run`: the tiny model (generated once, offline), the Transformers
# fallback server on it, and the proxy in front — all on localhost. Prints the
# curl lines to try once the proxy answers, with an admin token made for this
# run (passed to policies/quickstart.yaml as ${BROWNOUT_ADMIN_TOKEN}).
set -euo pipefail
cd "$(dirname "$0")/.."

# Versioned like the tests' cache, so a new tiny-model format is generated anew.
TINY_VERSION="$(python3 -c 'from proxy.tinymodel import TINY_MODEL_VERSION as v; print(v)')"
MODEL_DIR="${BROWNOUT_TINY_MODEL_DIR:-$HOME/.cache/brownout/tiny-model-v$TINY_VERSION}"
FALLBACK_PORT="${BROWNOUT_FALLBACK_PORT:-8001}"
PORT="${BROWNOUT_PORT:-8080}"
URL="http://127.0.0.1:$PORT"
export BROWNOUT_PORT="$PORT"
export BROWNOUT_FALLBACK_URL="${BROWNOUT_FALLBACK_URL:-http://127.0.0.1:$FALLBACK_PORT}"
# A fresh random token per run (unless one is given): admin endpoints answer only with it.
export BROWNOUT_ADMIN_TOKEN="${BROWNOUT_ADMIN_TOKEN:-$(python3 -c 'import secrets; print(secrets.token_hex(16))')}"
TOKEN="$BROWNOUT_ADMIN_TOKEN"
BROWNOUT="$(command -v brownout)"
BROWNOUT="${BROWNOUT#"$PWD/"}"

# Plain variables, no negative indexes or empty arrays under `set -u`: the
# bash 3.2 of macOS runs this too.
FALLBACK_PID=""
PROXY_PID=""
cleanup() {
    for pid in $FALLBACK_PID $PROXY_PID; do kill "$pid" 2>/dev/null || true; done
    for pid in $FALLBACK_PID $PROXY_PID; do wait "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# wait_for URL PID WHAT: poll URL until it answers, or fail if PID died.
wait_for() {
    for _ in $(seq 1 240); do
        if curl -fsS "$1" >/dev/null 2>&1; then return 0; fi
        if ! kill -0 "$2" 2>/dev/null; then echo "$3 failed to start" >&2; exit 1; fi
        sleep 0.5
    done
    echo "$3 did not answer $1 within 120 s" >&2
    exit 1
}

if ! python3 -c 'import sys; from proxy.tinymodel import is_tiny_model as ok; sys.exit(not ok(sys.argv[1]))' \
    "$MODEL_DIR"; then
    echo "== generating the tiny model in $MODEL_DIR (offline, a few seconds)"
    HF_HUB_DISABLE_PROGRESS_BARS=1 brownout make-tiny-model "$MODEL_DIR"
fi

echo "== starting the fallback server on :$FALLBACK_PORT"
brownout fallback-server --model "$MODEL_DIR" --served-model-name tiny --port "$FALLBACK_PORT" \
    --max-concurrency 2 &
FALLBACK_PID=$!
wait_for "http://127.0.0.1:$FALLBACK_PORT/health" "$FALLBACK_PID" "the fallback server"

echo "== starting the proxy on :$PORT (policies/quickstart.yaml)"
brownout serve --config policies/quickstart.yaml &
PROXY_PID=$!
wait_for "$URL/healthz" "$PROXY_PID" "the proxy"

cat <<MSG

== Brownout is ready on $URL — in another terminal, try:

curl -N $URL/v1/chat/completions -H 'Content-Type: application/json' \\
  -d '{"model":"tiny","stream":true,"max_tokens":32,"messages":[{"role":"user","content":"Hello!"}]}'

Status page: $URL/brownout/   (admin token for this run: $TOKEN)

curl $URL/brownout/status
curl -X POST $URL/brownout/tier -H 'Authorization: Bearer $TOKEN' -d '{"tier": "maintenance"}'
curl -X POST $URL/brownout/tier -H 'Authorization: Bearer $TOKEN' -d '{"tier": null}'
curl -X POST $URL/brownout/reload -H 'Authorization: Bearer $TOKEN'
$BROWNOUT reload --url $URL --token $TOKEN

Ctrl-C stops everything.

MSG
wait "$PROXY_PID"
