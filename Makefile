# durable_agents: the two commands of the README, and a few more.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PG_URL ?= postgres://root@127.0.0.1:5432/durable_agents

.PHONY: run admin live docs test test-fast test-slow test-long test-postgres test-sqlite test-django6 venv-django6 check-wheel dist lint venv demo-venv constraints clean

PIP := $(PY) -m pip install -qq --disable-pip-version-check -c constraints.txt

# The development set: the app with all its extras (editable), the demo's own needs, the tools.
# Each marker is written only once everything the demo imports imports (scripts/check-imports.py),
# so an install that left something out is repaired by the next make, not remembered as done.
$(VENV)/.installed: requirements.txt requirements-demo.txt pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) -r requirements.txt
	$(PY) scripts/check-imports.py
	touch $@ $(VENV)/.demo-installed

venv: $(VENV)/.installed

# The demo's own marker: the app as pyproject.toml declares it (installed editable: its
# dependency list is the one list) and what only the demo project needs, nothing for the tests.
$(VENV)/.demo-installed: requirements-demo.txt pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) -r requirements-demo.txt
	$(PY) scripts/check-imports.py
	touch $@

demo-venv: $(VENV)/.demo-installed

## make constraints: pin again the versions of everything the development set installs (after
## changing requirements*.txt or pyproject.toml), in a fresh venv, into constraints.txt
constraints:
	rm -rf .venv-constraints
	$(PYTHON) -m venv .venv-constraints
	.venv-constraints/bin/python -m pip install --quiet --disable-pip-version-check -r requirements.txt
	{ sed -n '/^#/p' constraints.txt; .venv-constraints/bin/python -m pip freeze --exclude-editable \
	  | grep -v '^django-durable-agents' | sort -f; } > constraints.txt.new
	mv constraints.txt.new constraints.txt
	rm -rf .venv-constraints

## make run: the demo on SQLite with the offline model (no API key needed)
run: demo-venv
	rm -f demo.sqlite3
	$(PY) manage.py migrate --verbosity 0
	$(PY) manage.py demo

# `make admin` on a fresh checkout: the demo's database comes from `make run` first.
demo.sqlite3: | demo-venv
	$(MAKE) --no-print-directory run

## make admin: the admin on the demo's database, with a demo superuser (admin / admin, for the
## local demo only), a pending intent, a dead run and a waiting run to act on
admin: demo-venv demo.sqlite3
	$(PY) manage.py migrate --verbosity 0
	$(PY) manage.py demo_admin
	$(PY) manage.py runserver 127.0.0.1:8000

## make live: the demo's live page under uvicorn, http://127.0.0.1:8000/demo/live/, with a worker
## beside it (Ctrl-C stops both): start a run and watch it work
live: demo-venv demo.sqlite3
	$(PY) manage.py migrate --verbosity 0
	$(PY) manage.py runagents & worker=$$!; trap 'kill $$worker' EXIT INT TERM; \
	  $(PY) -m uvicorn project.asgi:application --host 127.0.0.1 --port 8000

# The tiers of the suite, by marker (tests/conftest.py marks each test by its folder):
# fast = unit and integration tests; slow = worker subprocesses, signals, PgBouncer, failover
# clusters, the browser. Each pass is spread over XDIST processes (pytest-xdist, a test
# database per process): most of a test's time is spent waiting on workers and the fake API.
# The slow tier uses XDIST_SLOW: its tests start worker subprocesses of their own, so four at
# once on two cores mostly wait on each other (measured on two cores: the tier took a fifth
# longer with 2 than with 4, its slowest tests about half as long), and a busy machine
# stretches each test further, which CI allows 60 s.
XDIST ?= 4
XDIST_SLOW ?= 2
FAST := not (acceptance or slow or browser or failover)
SLOW := acceptance or slow or browser or failover
ON_PG := DATABASE_URL=$(PG_URL)
ON_SQLITE := DATABASE_URL=sqlite:///$(CURDIR)/test-suite.sqlite3
# Where each pass appends how long its tests took (scripts/slowest-tests.py reads it).
TIMES := $(CURDIR)/test-times.txt
PYTEST_ON := DA_TEST_TIMES=$(TIMES) $(PY) -m pytest -q -n
PYTEST := $(PYTEST_ON) $(XDIST)

## make test: the fast tiers on PostgreSQL, then on SQLite (the unit tests, which touch no
## database, once), then the slow tier on both; the first pass that fails stops it, so a
## failure of the fast tiers shows first. Then the 10 slowest tests.
test: venv
	./scripts/ensure-postgres.sh
	rm -f $(TIMES)
	$(MAKE) --no-print-directory test-fast test-slow
	$(PY) scripts/slowest-tests.py $(TIMES) --top 10

test-fast: venv
	./scripts/ensure-postgres.sh
	$(ON_PG) $(PYTEST) -m "$(FAST)"
	$(ON_SQLITE) $(PYTEST) -m "not postgres and not unit and ($(FAST))"

test-slow: venv
	./scripts/ensure-postgres.sh
	$(ON_PG) $(PYTEST_ON) $(XDIST_SLOW) -m "$(SLOW)"
	$(ON_SQLITE) $(PYTEST_ON) $(XDIST_SLOW) -m "not postgres and ($(SLOW))"

test-postgres: venv
	./scripts/ensure-postgres.sh
	$(ON_PG) $(PYTEST)

test-sqlite: venv
	$(ON_SQLITE) $(PYTEST) -m "not postgres"

## make test-long: the property-based fuzz suite with its long profile (500 examples on
## PostgreSQL, 150 on SQLite; make test runs 60 and 40). Not part of make test or CI.
test-long: venv
	./scripts/ensure-postgres.sh
	$(ON_PG) DA_FUZZ=long $(PY) -m pytest -q tests/integration/test_fuzz.py
	$(ON_SQLITE) DA_FUZZ=long $(PY) -m pytest -q tests/integration/test_fuzz.py

## make test-django6: the PostgreSQL suite on Django 6.x (needs Python 3.12+)
PY6 ?= $(shell ./scripts/find-python.sh 3.13 || ./scripts/find-python.sh 3.12)
VENV6 := .venv-django6
$(VENV6)/.installed: requirements.txt requirements-demo.txt pyproject.toml constraints.txt
	@test -n "$(PY6)" || (echo "no python3.12 or python3.13 here" >&2; exit 1)
	$(PY6) -m venv $(VENV6)
	grep -iv '^django==' constraints.txt > $(VENV6)/constraints.txt
	$(VENV6)/bin/python -m pip install --quiet --disable-pip-version-check \
	  -c $(VENV6)/constraints.txt -r requirements.txt "Django>=6,<7"
	touch $@

# What differs between Django versions: the admin, migrations, async views (the live
# stream), system checks, the plugin, and the ORM statements of the store.
DJANGO6_TESTS := tests/unit/test_checks.py tests/integration/test_admin*.py \
  tests/integration/test_demo_admin.py tests/integration/test_live*.py \
  tests/integration/test_migration_cost.py tests/integration/test_not_migrated.py \
  tests/integration/test_plugin.py tests/integration/test_store_contract.py
venv-django6: $(VENV6)/.installed

test-django6: $(VENV6)/.installed
	./scripts/ensure-postgres.sh
	DATABASE_URL=$(PG_URL)_dj6 $(VENV6)/bin/python -m pytest -q -n 2 $(DJANGO6_TESTS) \
	  -m "not browser and not slow"

## make check-wheel: build the wheel and use it from a fresh venv and a minimal project
check-wheel: venv
	./scripts/check-wheel.sh

## make dist: build the wheel and the sdist into dist/ and print their paths (for
## `pip install dist/django_durable_agents-*.whl` elsewhere, until the package is on PyPI)
dist: demo-venv
	rm -rf dist
	$(PY) -m pip install --quiet "build>=1.0"
	$(PY) -m build --outdir dist . >/dev/null
	@ls -1 $(CURDIR)/dist/*

## make lint: ruff, then mypy (its configuration and the files it checks are in mypy.ini), then
## lint-imports (the layers: the contracts of [tool.importlinter] in pyproject.toml)
lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(VENV)/bin/lint-imports

## make docs: the documentation site (mkdocs.yml: the pages of docs/, the API reference from the
## docstrings) built into site/; a warning (a broken link or anchor, a page left out of the
## nav, a docstring that does not render) fails it
docs: venv
	$(PY) -m mkdocs build --strict

clean:
	rm -rf $(VENV) $(VENV6) demo.sqlite3 test-*.sqlite3 test-times.txt site

## make bench: the benchmarks (bench/), writes docs/benchmarks.md and docs/img/bench_*.png
.PHONY: bench
bench: venv
	./scripts/ensure-postgres.sh
	$(PY) -m pip install --quiet -r bench/requirements.txt
	$(PY) -m bench.run_all $(BENCH_ARGS)
