# pgque developer entry points. Everything runs from the project's .venv,
# (re)installed only when pyproject.toml changes.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.stamp
PYTEST_ARGS ?=

# Prints the first machine bin directory whose PostgreSQL major differs from the
# embedded one, or nothing: the suite runs a second time against it.
OTHER_BINDIR_PY := from pgque.testing.localpg import bindir_major, embedded_bindir, system_bindirs; \
	e = embedded_bindir(); m = bindir_major(e) if e else None; \
	print(next((str(d) for d in system_bindirs() if bindir_major(d) != m), ""))

.PHONY: venv lint twins test test-faults test-long demo screenshots bench bench-curves bench-dimensions bench-held-horizon clean distclean system-deps

venv: $(STAMP)

# An existing venv is reused: re-running venv with another interpreter would break it.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -e '.[cli,embedded,dev]'
	touch $(STAMP)

# The sync modules are generated from their async sources by tools/async_to_sync.py,
# whose TWINS lists them: lint fails, showing the diff, when one is stale.
lint: venv
	$(BIN)/python tools/async_to_sync.py --check
	$(BIN)/ruff check pgque tests bench tools
	$(BIN)/mypy --strict pgque

# Regenerate every sync module from its async source; never edit the generated files.
twins: venv
	$(BIN)/python tools/async_to_sync.py

# Against PGQUE_TEST_DSN when it is set; otherwise on the embedded binaries and,
# when the machine has PostgreSQL of another major, on those too. The two runs
# go side by side (each starts its own cluster): the suite mostly waits on
# workers and timeouts, so this halves the wall time on two cores. The second
# run's output follows the first's. What tests the client side rather than the
# server runs on the first server only, to keep `make test` within 12 minutes on
# two cores: the fault-injection suite (kills, freezes, network cuts of worker
# processes; `make test-faults` runs it on both, long variants included), the
# command line and the demo (their SQL is the Client's, which the rest of the
# suite runs on both), the pytest plugin (it starts servers of its own) and
# the modules that need no server.
# (The worker command's and the services' lifecycle tests, the Worker's behind a
# pooler (by lock, refused; by lease), the failover of a replication pair and
# the ordering property tests run on the second server instead, to balance the
# two; the fault suite's
# scenario by lease runs on the first; `make test-faults` runs the failover on
# both.)
SYSTEM_LOG := .pytest-system.log
SYSTEM_ONLY_ARGS := --ignore=tests/test_faults.py --ignore=tests/test_cli.py \
	--ignore=tests/test_demo.py --ignore=tests/test_testing.py --ignore=tests/test_twins.py \
	--ignore=tests/test_acompat.py --ignore=tests/test_bench_report.py
FIRST_ONLY_ARGS := --ignore=tests/test_cli_worker.py --ignore=tests/test_lifecycle.py \
	--ignore=tests/test_pooler.py --ignore=tests/test_lease_worker.py \
	--ignore=tests/test_failover.py --ignore=tests/test_ordering.py

# The suite starts a few hundred Python processes (the CLI, workers, the demo):
# each would compile pgque from source again where PYTHONDONTWRITEBYTECODE is set.
PYC := $(BIN)/python -m compileall -q pgque tests > /dev/null

test: venv
	@$(PYC)
ifdef PGQUE_TEST_DSN
	$(BIN)/pytest -q $(PYTEST_ARGS)
else
	@other="$$($(BIN)/python -c '$(OTHER_BINDIR_PY)')"; \
	if [ -n "$$other" ]; then \
		echo "== PostgreSQL 18 (embedded) here; the machine's PostgreSQL ($$other) alongside"; \
		PGQUE_TEST_SERVER=system PGQUE_TEST_BINDIR="$$other" \
			$(BIN)/pytest -q -p no:cacheprovider $(SYSTEM_ONLY_ARGS) $(PYTEST_ARGS) \
			> $(SYSTEM_LOG) 2>&1 & \
		system=$$!; \
		PGQUE_TEST_SERVER=embedded $(BIN)/pytest -q $(FIRST_ONLY_ARGS) $(PYTEST_ARGS); \
			embedded_rc=$$?; \
		wait $$system; system_rc=$$?; \
		echo "== on the machine's PostgreSQL: $$other"; \
		cat $(SYSTEM_LOG); \
		[ $$embedded_rc -eq 0 ] && [ $$system_rc -eq 0 ]; \
	else \
		echo "== no machine PostgreSQL of another major than the embedded one: one run only"; \
		PGQUE_TEST_SERVER=embedded $(BIN)/pytest -q $(PYTEST_ARGS); \
	fi
endif

# The fault suite alone, long variants included (30 s freezes and blackholes,
# repeated kills), on the embedded PostgreSQL and then on the machine's of
# another major: `make test` runs only its short variants, on the first.
test-faults: venv
	@$(PYC)
	PGQUE_TEST_SERVER=embedded PGQUE_FAULTS_LONG=1 $(BIN)/pytest -q tests/test_faults.py tests/test_failover.py $(PYTEST_ARGS)
	@other="$$($(BIN)/python -c '$(OTHER_BINDIR_PY)')"; \
	if [ -n "$$other" ]; then \
		echo "== on the machine's PostgreSQL: $$other"; \
		PGQUE_TEST_SERVER=system PGQUE_TEST_BINDIR="$$other" PGQUE_FAULTS_LONG=1 \
			$(BIN)/pytest -q -p no:cacheprovider tests/test_faults.py tests/test_failover.py $(PYTEST_ARGS); \
	fi

# The long variants of tests whose short form `make test` runs (a 30 s idle
# window instead of 6 s, 200,000 events through the rotations instead of
# 40,000), alone.
test-long: venv
	@$(PYC)
	PGQUE_TEST_SERVER=embedded PGQUE_TEST_LONG=1 $(BIN)/pytest -q -m long $(PYTEST_ARGS)

# Optional system packages the suite uses when present: pg_cron for the
# machine's PostgreSQL (its cron tests skip without it), PgBouncer (the pooler
# tests) and nftables (the network-fault tests cut a veth link with it). Best
# effort: needs root and apt; never fails the build. A packaged service that
# starts (pgbouncer on port 6432) is stopped and disabled: the tests start their
# own pgbouncer on a free port.
system-deps:
	@apt_install() { \
		apt-get install -y -qq "$$@" >/dev/null 2>&1 || \
		(apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq "$$@" >/dev/null 2>&1); \
	}; \
	if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
		echo "system-deps: needs root and apt-get; pg_cron, pgbouncer, nftables and gdb tests will skip"; \
		exit 0; \
	fi; \
	for bindir in /usr/lib/postgresql/*/bin; do \
		major=$$(basename $$(dirname $$bindir)); \
		if [ -x "$$bindir/postgres" ] && [ ! -e /usr/lib/postgresql/$$major/lib/pg_cron.so ]; then \
			echo "installing pg_cron for PostgreSQL $$major"; \
			apt_install postgresql-$$major-cron || echo "pg_cron not installed; its tests will skip"; \
		fi; \
		if [ -x "$$bindir/postgres" ] && [ ! -e /usr/share/postgresql/$$major/extension/pgq.control ]; then \
			echo "installing PgQ for PostgreSQL $$major (the bench's peers suite)"; \
			apt_install postgresql-$$major-pgq3 || echo "PgQ not installed; the bench's peers suite will skip"; \
		fi; \
	done; \
	if ! command -v pgbouncer >/dev/null && [ ! -x /usr/sbin/pgbouncer ]; then \
		echo "installing pgbouncer"; \
		if apt_install pgbouncer; then \
			(systemctl disable --now pgbouncer || service pgbouncer stop) >/dev/null 2>&1 || true; \
		else \
			echo "pgbouncer not installed; the pooler tests will skip"; \
		fi; \
	fi; \
	if ! command -v nft >/dev/null && [ ! -x /usr/sbin/nft ]; then \
		echo "installing nftables"; \
		apt_install nftables || echo "nftables not installed; the network-fault tests will skip"; \
	fi; \
	if ! command -v gdb >/dev/null; then \
		echo "installing gdb (tests/late_grant.py stops a backend between two lines of its lock wait)"; \
		apt_install gdb || echo "gdb not installed; the lock-timeout race tests will skip"; \
	fi; \
	if ! command -v chromedriver >/dev/null; then \
		echo "installing chromium and chromedriver (the dashboard's browser tests)"; \
		apt_install chromium chromium-driver || echo "chromium not installed; the dashboard's browser tests will skip"; \
	fi

demo: venv
	$(BIN)/python -m pgque.demo

# The dashboard's main pages, drawn by its browser test into docs/images/ (the
# README shows them); needs chromium and chromedriver (make system-deps).
screenshots: venv
	PGQUE_SCREENSHOTS=docs/images $(BIN)/python -m pytest tests/test_dashboard_browser.py -q

bench: venv
	$(BIN)/python -m bench

# The cost curves against the number of queues (bench/curves.py): creating
# 5,000 queues takes a while, so apart from `make bench`.
bench-curves: venv
	$(BIN)/python -m bench curves

# The per-event costs against slots, groups, keys and backlog (bench/dimensions.py):
# its 10,000,000-event backlog alone takes minutes; apart from `make bench`.
bench-dimensions: venv
	$(BIN)/python -m bench dimensions

# An hour under a held snapshot (bench/held_horizon.py), apart from `make bench`.
bench-held-horizon: venv
	$(BIN)/python -m bench held_horizon

clean:
	rm -rf build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis $(SYSTEM_LOG)
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
