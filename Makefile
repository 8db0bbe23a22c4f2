# durable_agents: the two commands of the README, and a few more.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PG_URL ?= postgres://root@127.0.0.1:5432/durable_agents

.PHONY: run test test-postgres test-sqlite lint venv clean

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $@

venv: $(VENV)/.installed

## make run: the demo on SQLite with the offline model (no API key needed)
run: venv
	rm -f demo.sqlite3
	$(PY) manage.py migrate --verbosity 0
	$(PY) manage.py demo

## make test: the whole suite on PostgreSQL, then the SQLite-relevant tests on SQLite
test: venv
	./scripts/ensure-postgres.sh
	DATABASE_URL=$(PG_URL) $(PY) -m pytest -q
	DATABASE_URL=sqlite:///$(CURDIR)/test-suite.sqlite3 $(PY) -m pytest -q -m "not postgres"

test-postgres: venv
	./scripts/ensure-postgres.sh
	DATABASE_URL=$(PG_URL) $(PY) -m pytest -q

test-sqlite: venv
	DATABASE_URL=sqlite:///$(CURDIR)/test-suite.sqlite3 $(PY) -m pytest -q -m "not postgres"

lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) demo.sqlite3 test-*.sqlite3
