# Developer entry points. Everything runs from the project's own virtualenv, .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install deps test test-fast test-ts ts-client lint up faults-long bench fuzz proto-landed

# The programs the tests run beside the virtualenv (b3sum, jq, promtool, nftables,
# iproute2, systemd-analyze, PostgreSQL's server, Debian's etcd 3.4): installed on
# Debian as root, without leaving a service running; elsewhere one line per missing
# program says what needs it and how to get it. Quick when everything is there.
deps:
	$(PYTHON) scripts/install_deps.py

# The virtualenv re-installs only when pyproject.toml changed since the last install.
install: deps $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -e '.[dev]'
	touch $@

# The whole suite: the TypeScript client's own tests (node's test runner), then every
# Python test, the conformance suite (tests/conformance) with both clients among them.
test: install test-ts
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The TypeScript client (clients/typescript): its packages from the lockfile (npm ci,
# again only when the lockfile changed), then built to dist/ (its conformance driver).
TS := clients/typescript
ts-client: $(TS)/node_modules/.package-lock.json
	npm --prefix $(TS) run --silent build

$(TS)/node_modules/.package-lock.json: $(TS)/package-lock.json
	npm ci --prefix $(TS) --no-audit --no-fund --loglevel=error

# Its own tests, on node's test runner (those needing a registry run in
# tests/conformance, against the suite's stack), and its stubs checked against the contract.
test-ts: ts-client
	npm --prefix $(TS) run --silent check-generated
	npm --prefix $(TS) run --silent test:only

# The fast tier, to run before each commit (under 3 minutes on two cores): the unit
# tests and the in-process tests against one shared etcd (tests/unit, tests/integration);
# the registry's behavioural tests (both_stores) on the in-memory store only, and the
# tests that wait for real time left to their twins on the test's clock (real_time).
# `make test` runs them too, with the system tier, the fault run and the fuzzing.
test-fast: install
	$(BIN)/python -m pytest -q tests/unit tests/integration --registry-store=memory \
		-m "not real_time" $(PYTEST_ARGS)

# (Defined before the rules that name them: make expands prerequisites as it reads.)
# The wire contract's checks: buf's CLI, from its npm package, pinned, in .tools/.
# `buf breaking` compares the contract with the last landed one (a buf image kept in
# the repository); after a deliberate, released change, `make proto-landed` renews it.
BUF_VERSION := 1.75.0
BUF := .tools/node_modules/.bin/buf
LANDED := kernel/proto/landed.binpb

lint: install $(BUF)
	$(BIN)/ruff check .
	$(BIN)/python scripts/typecheck.py
	$(BIN)/lint-imports
	$(BUF) lint
	$(BUF) breaking --against $(LANDED)

$(BUF):
	npm install --prefix .tools --no-save --no-audit --no-fund --loglevel=error \
		@bufbuild/buf@$(BUF_VERSION)

proto-landed: $(BUF)
	$(BUF) build -o $(LANDED)

up: install
	$(BIN)/baton up --demo

# Benchmarks (minutes; not part of the tests): writes docs/benchmarks.md and its plots.
bench: install
	$(BIN)/python -m bench

# A long fault run (docs/faults.md): a 3-member etcd cluster (deploy/local/etcd-cluster.sh),
# two registries, a watcher and agents under nemeses, then the checker. For example
#   make faults-long SEED=42 DURATION=3600 FAULTS_ARGS="--ttl 2 --out /tmp/run42"
SEED ?= $(shell date +%s)
DURATION ?= 1800
faults-long: install
	$(BIN)/python -m tests.faults --seed $(SEED) --duration $(DURATION) $(FAULTS_ARGS)

# The long fuzzing run (docs/faults.md, "Fuzzing"): FUZZ_EXAMPLES fresh inputs for each
# target (manifest validation, every RPC against a real registry, the watcher's reading
# of hostile staging trees); the test suite runs a few hundred fixed ones. For example
#   make fuzz FUZZ_EXAMPLES=100000
FUZZ_EXAMPLES ?= 100000
fuzz: install
	BATON_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/python -m pytest -q --timeout 0 \
		--hypothesis-show-statistics tests/fuzz
