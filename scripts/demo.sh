#!/usr/bin/env bash
# Run the whole demo: seed, the production web server (gunicorn + uvicorn workers, as in
# README's Running in production), workers and demo load. Ctrl-C stops all.
set -euo pipefail
PORT="${1:-8000}"
PY=.venv/bin/python
export FAIRQUEUE_DEMO=1 DEBUG="${DEBUG:-1}"
mkdir -p var
$PY manage.py seed_demo | tee var/demo-credentials.txt
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM
# Restart a worker that dies, as its Kubernetes deployment would (demo.hungry kills a lean one).
supervise() {
  local child=""
  trap '[ -n "$child" ] && kill "$child" 2>/dev/null; exit 0' TERM INT
  while true; do "$@" & child=$!; wait "$child" || true; sleep 1; done
}
if $PY manage.py help worker >/dev/null 2>&1; then
  # Lean normal workers: past 300 MB a worker is killed (FAIRQUEUE_DEMO_WORKER_MEMORY_MB stands
  # in for a container's memory limit), and a job that kills one moves to the quarantine lane.
  FAIRQUEUE_DEMO_WORKER_MEMORY_MB=300 supervise $PY manage.py worker --concurrency 8 --hostname demo1@%h \
    > var/worker1.log 2>&1 & pids+=($!)
  FAIRQUEUE_DEMO_WORKER_MEMORY_MB=300 supervise $PY manage.py worker --concurrency 8 --hostname demo2@%h \
    > var/worker2.log 2>&1 & pids+=($!)
  # The quarantine lane's worker: no memory limit, few slots (README, "The quarantine lane").
  $PY manage.py worker --quarantine --concurrency 2 --hostname quarantine1@%h \
    > var/worker-quarantine.log 2>&1 & pids+=($!)
fi
if $PY manage.py help demo_load >/dev/null 2>&1; then
  $PY manage.py demo_load --base-url "http://127.0.0.1:$PORT" > var/demo-load.log 2>&1 & pids+=($!)
fi
# Static files are collected by `make demo` (make collectstatic); with DEBUG the server
# also finds them in the apps' folders.
WEB_BIND="127.0.0.1:$PORT" $PY -m gunicorn fairqueue.asgi:application --config gunicorn.conf.py \
  > var/web.log 2>&1 & pids+=($!)
$PY - "$PORT" <<'PY'  # wait (at most 30 s) until a worker process answers
import sys, time, urllib.request
for _ in range(300):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/api/v1/openapi.json", timeout=1)
        break
    except OSError:
        time.sleep(0.1)
PY
cat <<MSG

  FairQueue demo is running (logs in var/; web: gunicorn, ${WEB_CONCURRENCY:-2 per core} processes).
    Admin:      http://127.0.0.1:$PORT/admin/
    Dashboard:  http://127.0.0.1:$PORT/dashboard/
    API:        http://127.0.0.1:$PORT/api/v1/docs
    Metrics:    http://127.0.0.1:$PORT/metrics
  Quarantine:  http://127.0.0.1:$PORT/admin/jobs/job/?quarantined=yes (demo.hungry jobs kill a lean
               worker every couple of minutes and finish on the quarantine worker)
  Login and demo API keys: var/demo-credentials.txt (printed above).
  Ctrl-C stops everything.
MSG
wait "${pids[-1]}"
