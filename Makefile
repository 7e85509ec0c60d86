# sparkforge: `make help` lists the targets.
PYTHON ?= python3
VARIANT ?= ng17e
ARGS ?=
BUILD := $(PYTHON) build.py

.DEFAULT_GOAL := help
.PHONY: help install image render show list check-mods test lint base-local registry registry-stop bench-rebuild

help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-16s %s\n", $$1, $$2}'

install: ## install sparkforge and its test tools into the current Python
	$(PYTHON) -m pip install -q -e '.[test]'

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

test: ## run the whole test suite (needs Docker for the image tests: scripts/docker-up.sh)
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
