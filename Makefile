# Tally: `make run` starts web + worker + beat; `make test` runs the whole suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# PostgreSQL for the integration run of the suite (the first run uses SQLite).
TEST_POSTGRES_URL ?= postgres://postgres@127.0.0.1:5432/postgres
PYTEST_ARGS ?=
# Port of the web process under `make run` (honcho would otherwise give it 5000).
PORT ?= 8000

export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: install install-test run test test-sqlite test-postgres lint migrate flush clean

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

migrate: install
	$(BIN)/python scripts/ensure_redis.py
	$(BIN)/python manage.py migrate --noinput

run: migrate
	$(BIN)/honcho start -f Procfile --port $(PORT)

test: test-sqlite test-postgres

test-sqlite: install-test
	$(BIN)/python scripts/ensure_redis.py
	$(BIN)/pytest $(PYTEST_ARGS)

test-postgres: install-test
	$(BIN)/python scripts/ensure_redis.py
	DATABASE_URL=$(TEST_POSTGRES_URL) $(BIN)/pytest $(PYTEST_ARGS)

lint: install-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

flush: install
	$(BIN)/python manage.py notification_update_counter

clean:
	rm -rf $(VENV) var .pytest_cache .ruff_cache .hypothesis
