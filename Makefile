# FairQueue: `make demo` runs the whole system; `make test` runs the suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export REDIS_URL ?= redis://127.0.0.1:6379/0
export FAIRQUEUE_TEST_REDIS_URL ?= redis://127.0.0.1:6379/15
# These targets are the local demo/dev workflow; production sets SECRET_KEY and FAIRQUEUE_DEMO=0.
export FAIRQUEUE_DEMO ?= 1
DEMO_PORT ?= 8000

.PHONY: demo test test-distributed lint typecheck venv redis rabbitmq test-tools migrate clean bench-engine bench-noisy chaos chaos-cluster

venv: $(VENV)/.installed
$(VENV)/.installed: requirements.txt requirements-dev.txt
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -r requirements-dev.txt
	touch $@

redis:
	@scripts/ensure_redis.sh

# Chromium (browser tests) and promtool (metrics lint): installed with apt-get where that is
# possible, otherwise the script says how.
test-tools:
	@scripts/ensure_test_tools.sh

# The broker tests (tests/test_brokers.py) run the jobs end to end on RabbitMQ too.
rabbitmq:
	@scripts/ensure_rabbitmq.sh

# A local checkout run through `make demo` is a demo environment: manage.py commands
# (bench, chaos, shell) then work without a SECRET_KEY. Never created in production.
.env:
	printf 'FAIRQUEUE_DEMO=1\nDEBUG=1\n' > .env

migrate: venv .env
	$(PY) manage.py migrate --noinput

# Static files (admin, dashboard, API docs) into var/static, where the web server serves them.
collectstatic: venv .env
	$(PY) manage.py collectstatic --noinput -v 0

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The engine is held to mypy --strict; the Django side is checked with django-stubs.
typecheck: venv
	$(VENV)/bin/mypy fairqueue/engine
	$(VENV)/bin/mypy --config-file mypy-django.ini fairqueue tenants dashboard webhooks examples

# The suite runs as TEST_SHARDS `manage.py test` processes side by side, each with its own
# Redis server, test database and logs (scripts/test_shards.py); TEST_SHARDS=1 runs it as
# one. `python manage.py test` runs it in one process too. Tests tagged "serial" (accuracy
# figures of a real workload) run after the shards, alone on the machine.
TESTS ?= tests
TEST_SHARDS ?= 3
test: venv redis rabbitmq test-tools lint typecheck
	$(PY) scripts/test_shards.py --shards $(TEST_SHARDS) $(TESTS) -- --noinput --exclude-tag distributed --exclude-tag serial
	$(PY) manage.py test --noinput --tag serial --exclude-tag distributed $(TESTS)

# The tests that start a Redis Cluster of their own (3 primaries + 3 replicas on free local
# ports; FAIRQUEUE_TEST_CLUSTER_PORTS / FAIRQUEUE_CHAOS_CLUSTER_PORTS fix them), with the
# cluster chaos run, and several hosts in network namespaces (root and iproute2): a few
# minutes, so apart from `make test`; .ci/run runs both.
test-distributed: venv redis
	$(PY) manage.py test --noinput --tag distributed $(TESTS)

demo: venv redis .env migrate collectstatic
	@scripts/demo.sh $(DEMO_PORT)

bench-engine: venv redis .env
	$(PY) manage.py bench engine --json var/bench-engine.json

bench-noisy: venv redis .env migrate
	$(PY) manage.py bench noisy --json var/bench-noisy.json --plot var/bench-noisy.png

chaos: venv redis .env migrate
	$(PY) manage.py chaos --json var/chaos.json

chaos-cluster: venv redis .env migrate
	$(PY) manage.py chaos --cluster --json var/chaos-cluster.json

clean:
	rm -rf $(VENV) var test_db.sqlite3*
