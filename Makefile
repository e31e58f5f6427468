# trimtab: `make demo` runs the main job, `make test` runs the tests. Both create .venv if missing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# the container image: the tag deploy/base/trimtab.yaml runs (tests/test_image.py checks they agree)
VERSION := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' pyproject.toml)
IMAGE   ?= ghcr.io/trimtab/trimtab:$(VERSION)

.PHONY: venv test test-fast demo lint bench image clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	@touch $(STAMP)

# trimtab, envoy and python live in .venv/bin; `make venv` and `make demo` say so on their last line
HINT   := trimtab and envoy are in $(VENV)/bin: run  . $(VENV)/bin/activate  to use them in this shell

venv: $(STAMP)
	@echo "$(HINT)"

test: $(STAMP)  ## every test, the slow ones (real Envoy, Prometheus, backends) included
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: $(STAMP)  ## unit tests only
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

demo: $(STAMP)
	@$(PY) -m trimtab_dev.demo.simulated; status=$$?; \
	 echo "$(HINT)"; \
	 exit $$status

lint: $(STAMP)
	$(VENV)/bin/ruff check xds_server weight_calculator trimtab_dev tests benchmarks
	$(VENV)/bin/mypy xds_server weight_calculator trimtab_dev

bench: $(STAMP)
	$(PY) benchmarks/push_latency.py

image:  ## the Dockerfile with podman, buildah or docker (CONTAINER_ENGINE=... to choose)
	scripts/build-image.sh "$(IMAGE)"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
