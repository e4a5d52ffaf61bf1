#!/usr/bin/env bash
# Make sure a Redis server answers at REDIS_URL; start a local one if we can.
set -euo pipefail
URL="${REDIS_URL:-redis://127.0.0.1:6379/0}"
HOSTPORT="${URL#redis://}"; HOSTPORT="${HOSTPORT%%/*}"; HOSTPORT="${HOSTPORT##*@}"
HOST="${HOSTPORT%%:*}"; PORT="${HOSTPORT##*:}"; [ "$PORT" = "$HOST" ] && PORT=6379

ping() { python3 - "$HOST" "$PORT" <<'PY'
import socket, sys
try:
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1)
    s.sendall(b"PING\r\n"); ok = s.recv(16).startswith(b"+PONG")
except OSError:
    ok = False
sys.exit(0 if ok else 1)
PY
}

if ping; then echo "redis: reachable at $HOST:$PORT"; exit 0; fi
if ! command -v redis-server >/dev/null 2>&1; then
  echo "redis: nothing answers at $HOST:$PORT and redis-server is not installed." >&2
  echo "       Install it (Debian/Ubuntu: sudo apt-get install -y redis-server; macOS: brew install redis)" >&2
  echo "       or point REDIS_URL at a running server." >&2
  exit 1
fi
case "$HOST" in 127.0.0.1|localhost) ;; *) echo "redis: $HOST is not local; start it there." >&2; exit 1;; esac
mkdir -p var
echo "redis: starting a local redis-server on port $PORT (no persistence)"
redis-server --daemonize yes --bind 127.0.0.1 --port "$PORT" --save "" --appendonly no \
  --dir "$(pwd)/var" --logfile "$(pwd)/var/redis.log"
for _ in $(seq 50); do ping && { echo "redis: up"; exit 0; }; sleep 0.1; done
echo "redis: failed to start; see var/redis.log" >&2; exit 1
