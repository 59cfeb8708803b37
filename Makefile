# consumer-proxy: every target installs what it needs (idempotently) into .venv.
#   make demo   - a local Kafka, example service instances, the proxy and sample traffic
#   make test   - ruff, mypy --strict (package, tests, benches), stale-stub (Python, Go) and
#                 stale-chart-schema checks and the whole pytest suite (real Kafka; builds and
#                 runs the Go example)
#   make test-fast - the same checks and the suite without the tests marked slow (the Helm
#                 chart tests, the Spark standalone cluster), for a quicker local run
#   make bench  - the benchmarks in bench/ (not part of the test suite)
#   make simulate - the long soak of the deterministic simulation: the real shell on a
#                 virtual-time loop (1M steps, some 4 minutes; SIM_STEPS=100000 for a short one)

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: install test test-fast lint typecheck browser demo bench simulate protos kafka-start kafka-stop clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# setuptools says "Editable installation ... folders with the same name may take
	@# precedence" on every editable build: an InformationOnly notice, not a deprecation
	@# (pypa/packaging-problems#558); it is silenced so that real warnings stand out.
	PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install -q -e ".[dev,pipeline]"
	@rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

lint: install
	$(VENV)/bin/ruff check consumer_proxy tests bench scripts examples
	$(VENV)/bin/ruff format --check consumer_proxy tests bench scripts examples

typecheck: install
	$(VENV)/bin/mypy

# The console's browser tests drive Debian's Chromium (Playwright's own browser download does
# not work on a closed network); installed once, as root, like the CI machine runs it.
browser:
	@test -x /usr/bin/chromium || { apt-get update -q && apt-get install -y -q chromium; }

test: lint typecheck browser
	$(PY) scripts/gen_protos.py --check
	$(PY) scripts/gen_values_schema.py --check
	$(PY) scripts/gen_go.py --check
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: PYTEST_ARGS += -m "not slow"
test-fast: test

demo: install
	$(PY) scripts/demo.py $(DEMO_ARGS)

bench: install
	$(PY) -m bench.run_all

# The long soak of the deterministic simulation: GroupRunner and the real core on a virtual-time
# loop, 1M steps by default in one process per CPU (about 2,200 steps a second each: some 4
# minutes on these shared 2-core machines; SIM_STEPS=100000 for a short one). A failure prints its
# seed, replayed with: .venv/bin/python -m tests.sim --seed N
simulate: install
	$(PY) -m tests.sim --steps 2000 --total-steps $(or $(SIM_STEPS),1000000)

protos: install
	$(PY) scripts/gen_protos.py
	$(PY) scripts/gen_go.py

kafka-start:
	scripts/kafka start

kafka-stop:
	scripts/kafka stop

clean:
	rm -rf $(VENV) .kafka .demo build *.egg-info
