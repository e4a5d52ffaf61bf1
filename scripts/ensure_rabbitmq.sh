#!/usr/bin/env bash
# Make sure a RabbitMQ server answers for the broker tests (tests/rabbitmq.py): the local
# one at FAIRQUEUE_TEST_AMQP_URL (default 127.0.0.1:5672). Start it if it is installed;
# with --install (CI), install the Debian/Ubuntu package first when it is missing.
set -euo pipefail
URL="${FAIRQUEUE_TEST_AMQP_URL:-amqp://guest:guest@127.0.0.1:5672}"
HOSTPORT="${URL#*://}"; HOSTPORT="${HOSTPORT##*@}"; HOSTPORT="${HOSTPORT%%/*}"
HOST="${HOSTPORT%%:*}"; PORT="${HOSTPORT##*:}"; [ "$PORT" = "$HOST" ] && PORT=5672
STARTUP_TIMEOUT_S=90  # a cold RabbitMQ (Erlang VM, Mnesia) takes several seconds to listen

# An AMQP 0-9-1 server answers the protocol header with a frame (type 1, connection.start).
ping() { python3 - "$HOST" "$PORT" <<'PY'
import socket, sys
try:
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2)
    s.sendall(b"AMQP\x00\x00\x09\x01"); ok = s.recv(1) == b"\x01"
except OSError:
    ok = False
sys.exit(0 if ok else 1)
PY
}

if ping; then echo "rabbitmq: reachable at $HOST:$PORT"; exit 0; fi
case "$HOST" in 127.0.0.1|localhost) ;; *) echo "rabbitmq: $HOST is not local; start it there." >&2; exit 1;; esac
if ! command -v rabbitmq-server >/dev/null 2>&1; then
  if [ "${1:-}" = "--install" ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "rabbitmq: installing rabbitmq-server"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends rabbitmq-server >/dev/null
  else
    echo "rabbitmq: nothing answers at $HOST:$PORT and rabbitmq-server is not installed." >&2
    echo "          The broker tests need it (Debian/Ubuntu: sudo apt-get install -y rabbitmq-server;" >&2
    echo "          macOS: brew install rabbitmq), or point FAIRQUEUE_TEST_AMQP_URL at a running server." >&2
    exit 1
  fi
fi
if ping; then echo "rabbitmq: up (started by its package)"; exit 0; fi
echo "rabbitmq: starting the local rabbitmq-server"
# Whichever service manager this machine has; the server's own daemon mode last.
if [ -d /run/systemd/system ] && systemctl start rabbitmq-server 2>/dev/null; then :
elif command -v service >/dev/null 2>&1 && service rabbitmq-server start >/dev/null 2>&1; then :
elif [ -x /etc/init.d/rabbitmq-server ] && /etc/init.d/rabbitmq-server start >/dev/null 2>&1; then :
else rabbitmq-server -detached || true
fi
for _ in $(seq "$STARTUP_TIMEOUT_S"); do ping && { echo "rabbitmq: up"; exit 0; }; sleep 1; done
echo "rabbitmq: failed to start within ${STARTUP_TIMEOUT_S}s (see /var/log/rabbitmq/)" >&2; exit 1
