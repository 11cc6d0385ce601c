# Sourced by the pipeline scripts: serve a retriever index on a free 127.0.0.1 port for the rest
# of the calling script, and wait until it answers.
#   source scripts/serve_retriever.sh INDEX_DIR LOG_FILE      -> sets RETRIEVER_URL
# The server is stopped when the calling script exits (or by `stop_retriever`).

serve_retriever() {
  local index=$1 log=$2 port
  port=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  python -m etagent.retriever.server index_dir="$index" serve.port="$port" > "$log" 2>&1 &
  RETRIEVER_PID=$!
  trap stop_retriever EXIT
  RETRIEVER_URL="http://127.0.0.1:$port"
  python - "$RETRIEVER_URL" "$log" <<'PY'
import sys, time, httpx
for _ in range(240):
    try:
        if httpx.get(f"{sys.argv[1]}/health", timeout=1).json()["status"] == "ok":
            break
    except (httpx.HTTPError, ValueError):
        time.sleep(0.5)
else:
    sys.exit(f"the retriever did not start; see {sys.argv[2]}")
PY
}

stop_retriever() {
  if [ -n "${RETRIEVER_PID:-}" ]; then
    kill "$RETRIEVER_PID" 2>/dev/null || true
    wait "$RETRIEVER_PID" 2>/dev/null || true
    RETRIEVER_PID=
  fi
}

serve_retriever "$@"
