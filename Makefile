# Two commands for a fresh machine: `make demo` and `make test`. Both set up what they need.
#   make test       ruff, then everything, the slow tier (Ray clusters, subprocess jobs, faults, the S3 server) included: what CI runs
#   make test-fast  the inner loop: every test not marked slow (no Ray, no subprocesses, nothing that takes seconds), property tests with a quarter of their examples
#   make lint       ruff over the code, the jobs, the tests and the benchmark
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export RAY_USAGE_STATS_ENABLED := 0
# Compiled modules are cached: the tests start hundreds of Python processes (jobs, Ray
# workers), and each would otherwise compile raycap's modules again.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup test test-fast lint demo bench clean

setup: $(STAMP)

# uv installs the same packages as pip in about a third of the time; pip is the fallback.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet uv && $(VENV)/bin/uv pip install --python $(PY) --quiet --compile-bytecode -e '.[test]' \
		|| $(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# Two test processes (pytest-xdist): one alone leaves a core idle while it waits on Ray
# start-ups and subprocess jobs, two keep both busy. Each has its own simulated cluster,
# and a file stays on one process, so a module's nodes and fixtures are set up once. The fast
# tier has no such fixtures and spreads test by test; its property tests draw a quarter of
# their examples (tests/strategies.py: examples), make test draws them all.
XDIST := -n 2 --dist loadfile

# The S3 tests talk to one moto server (a real S3 API over HTTP on 127.0.0.1) for the whole
# run: tests/s3server.py starts it on a free port, exports its endpoint to pytest and stops
# it when pytest ends, passed or failed. make test-fast needs no server.
test: lint
	$(PY) tests/s3server.py run -- $(PY) -m pytest -q $(XDIST)

test-fast: $(STAMP)
	RAYCAP_TEST_EXAMPLES=quick $(PY) -m pytest -q -m "not slow" -n 2

lint: $(STAMP)
	$(PY) -m ruff check raycap jobs tests bench

demo: $(STAMP)
	$(PY) -m jobs.demo

bench: $(STAMP)
	$(PY) -m bench
	$(PY) -m bench.stream
	$(PY) -m bench.finalize
	$(PY) -m bench.scale

clean:
	rm -rf $(VENV) demo-data out .pytest_cache .hypothesis .ruff_cache
