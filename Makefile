# sparkforge: `make help` lists the targets.
PYTHON ?= python3
VARIANT ?= ng17e
IMAGES ?= images
ARGS ?=
BUILD := $(PYTHON) build.py --images $(IMAGES)

.DEFAULT_GOAL := help
.PHONY: help setup install image render show list check-mods test lint base-local registry registry-stop bench-rebuild bench-distribute

help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-16s %s\n", $$1, $$2}'

install: ## install sparkforge and its test tools into the current Python
	$(PYTHON) -m pip install -q -e '.[test]'

setup: install ## everything the tests need: packages, a Docker engine with buildx, the local base
	@$(PYTHON) -m pip install -q torch==2.13.0 2>/dev/null \
	  || echo "setup: torch 2.13.0 (CPU) is not installable here; the GLOO test of serve-torchrun will skip"
	bash scripts/docker-up.sh
	bash scripts/base-local.sh

image: ## build, smoke-test and tag VARIANT (make image VARIANT=ng17e ARGS='--base ...')
	$(BUILD) build $(VARIANT) $(ARGS)

render: ## write the Dockerfile and build context of VARIANT to build/VARIANT
	$(BUILD) render $(VARIANT) $(ARGS)

show: ## print the resolved plan of VARIANT
	$(BUILD) show $(VARIANT) $(ARGS)

list: ## list the variants
	$(BUILD) list

check-mods: ## prove every mod of every variant applies to its real source
	$(BUILD) check-mods --all $(ARGS)

test: setup ## set up what is missing, then run the whole test suite
	$(PYTHON) -m pytest -q tests $(ARGS)

lint: ## hadolint every rendered variant, and byte-compile the package
	@set -e; for v in $$($(BUILD) list --names); do \
	  $(BUILD) render $$v -o build/lint/$$v >/dev/null; \
	  hadolint build/lint/$$v/Dockerfile; echo "hadolint: $$v clean"; \
	done
	$(PYTHON) -m compileall -q sparkforge build.py

base-local: ## make the local Debian base image used by the tests (cached)
	bash scripts/base-local.sh

registry: ## start a local registry on 127.0.0.1:5000 (stop it with make registry-stop)
	bash scripts/registry.sh start

registry-stop: ## stop the local registry
	bash scripts/registry.sh stop

bench-rebuild: ## time a cold build, a rebuild after one mod changed, and the cached-build overhead
	$(PYTHON) bench/rebuild.py

bench-distribute: ## bytes and time to put the test image on 3 real nodes: save|load vs registry, cold and after a mod change
	$(PYTHON) bench/distribute.py
