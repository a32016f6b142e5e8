#!/usr/bin/env bash
# The wheel as a user gets it: build it, install it with the [server] extra into a fresh virtual
# environment (noesis itself from the wheel only; no clone on its path), then run `noesis chat` on
# the bundled model and `noesis serve` with one request. Needs .venv (make setup) for the build.
# uv installs: its cache links torch and the other wheels into each fresh venv, so a run after the
# first takes seconds for the install, not a 750 MB unpack. The cache is uv's own ($UV_CACHE_DIR,
# else ~/.cache/uv), outside the clone, so that a clean clone's CI run on the same machine reuses
# it. torch is the build .venv runs, from $PIP_FIND_LINKS where set (a local wheel), else
# PyTorch's CPU index for a +cpu build.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=$(mktemp -d)
# The server (and its engine and body workers) ends before its venv goes.
trap 'if [ -n "${SERVER:-}" ]; then kill "$SERVER" 2>/dev/null; wait "$SERVER" || true; fi
      rm -rf "$WORK"' EXIT
start=$(date +%s)

test -x .venv/bin/uv || .venv/bin/python -m pip install -q "uv>=0.5,<1"
export UV_CACHE_DIR=${UV_CACHE_DIR:-${XDG_CACHE_HOME:-${HOME:-$ROOT}/.cache}/uv} UV_LINK_MODE=hardlink
.venv/bin/python -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/dist" .
WHEEL=$(ls "$WORK"/dist/noesis-*.whl)
.venv/bin/uv venv -q --python "$(.venv/bin/python -c 'import sys; print(sys.executable)')" "$WORK/venv"
PY=$WORK/venv/bin/python
TORCH=$(.venv/bin/python -c "import torch; print(torch.__version__)")
if [ -n "${PIP_FIND_LINKS:-}" ]; then SOURCE=(--find-links "$PIP_FIND_LINKS");
elif [[ $TORCH == *+cpu ]]; then SOURCE=(--extra-index-url https://download.pytorch.org/whl/cpu);
else SOURCE=(); fi
.venv/bin/uv pip install -q --python "$PY" "${SOURCE[@]}" "torch==$TORCH" "$WHEEL[server]"
echo "wheel_check: built and installed in $(( $(date +%s) - start )) s"

cd "$WORK"  # away from the clone: only the installed wheel can be imported
"$PY" -c "import noesis, sys; assert 'site-packages' in noesis.__file__, noesis.__file__"
export HF_HUB_OFFLINE=1 NO_COLOR=1
"$WORK/venv/bin/noesis" chat --device cpu --temperature 0 "What is 17 times 23?" \
    | tee "$WORK/chat.txt"
grep -q "391" "$WORK/chat.txt" || { echo "wheel_check: chat did not answer 391" >&2; exit 1; }

PORT=$("$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
"$WORK/venv/bin/noesis" serve --device cpu --port "$PORT" --log-level warning &
SERVER=$!
for _ in $(seq 120); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 "$SERVER" 2>/dev/null || { echo "wheel_check: the server exited" >&2; exit 1; }
    sleep 0.5
done
curl -sf "http://127.0.0.1:$PORT/v1/completions" -H 'content-type: application/json' \
    -d '{"model": "noesis-tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0}' \
    | tee "$WORK/completion.json"
echo
grep -q '"choices"' "$WORK/completion.json"
cd "$ROOT"
echo "wheel_check: ok in $(( $(date +%s) - start )) s ($(du -h "$WHEEL" | cut -f1) wheel)"
