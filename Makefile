# kitchen — `make help` lists the targets.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -ec
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt 2>/dev/null | cksum | cut -d' ' -f1)
# The CPU wheel of torch lies on these machines' disk; an unpinned torch would pull a CUDA build.
TORCH_CPU ?= torch==2.13.0
PYTEST_ARGS ?=
# `make test` runs the suite on this many pytest-xdist workers, one torch thread each (tests/conftest.py)
TEST_WORKERS ?= 2

.DEFAULT_GOAL := help
.PHONY: help install demo test test-slow test-gpu gpu-check gpu-wheels test-verl test-browser bench ipynb nbval lint format check-notebooks schema clean

help: ## list the targets, one line each
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-16s %s\n", $$1, $$2}'

$(STAMP):
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "kitchen needs Python >= 3.11, found " + sys.version.split()[0])'
	$(PYTHON) -m venv $(VENV)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
	  echo "CUDA found: installing torch from the default index"; $(PY) -m pip install -q 'torch>=2.4'; \
	else \
	  echo "no CUDA: installing the CPU build $(TORCH_CPU)"; $(PY) -m pip install -q $(TORCH_CPU) 2>&1 | { grep -v '^WARNING: Location' || true; }; \
	fi
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,qlora]' 2>&1 | { grep -v '^WARNING: Location' || true; }
	@rm -f $(VENV)/.installed-*; touch $@

install: $(STAMP) ## create .venv and install the kit with its dev and qlora extras

demo: $(STAMP) ## set up, then run the main job end to end
	$(VENV)/bin/kitchen demo

test: $(STAMP) lint check-notebooks ## set up, then lint, check notebooks, run the whole test suite (2 workers), then the verl tests
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-verl

test-slow: $(STAMP) ## run the slow tests too (long training; not in CI)
	$(PY) -m pytest -m 'slow or not slow' $(PYTEST_ARGS)

# The verl tests run in their own environment (verl 0.9 needs transformers<5.11), built once and
# reused until the package list or pyproject.toml changes (a stamp file, like the main venv's).
VERL_VENV ?= build/venv-verl
VERL_PKGS := verl==0.9.1 cachetools TransferQueue>=0.1.10 pyzmq msgspec fastapi uvicorn trl==1.16.0 polars==2.1.0 altair==6.3.0 marimo==0.25.2 vl-convert-python==1.9.0.post1 pytest==9.2.0 hypothesis
VERL_STAMP := $(VERL_VENV)/.installed-$(shell echo '$(TORCH_CPU) $(VERL_PKGS)' | cat - pyproject.toml | cksum | cut -d' ' -f1)

$(VERL_STAMP):
	$(PYTHON) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/pip install -q $(TORCH_CPU) 2>&1 | { grep -v '^WARNING: Location' || true; }
	$(VERL_VENV)/bin/pip install -q $(foreach p,$(VERL_PKGS),'$(p)') 2>&1 | { grep -v '^WARNING: Location' || true; }
	$(VERL_VENV)/bin/pip install -q --no-deps -e .
	@rm -f $(VERL_VENV)/.installed-*; touch $@

test-verl: $(VERL_STAMP) ## verl integration tests in their own venv (built once: ~2 min, 2.4 GB; part of make test)
	$(VERL_VENV)/bin/python -m pytest tests/test_integrations_verl.py $(PYTEST_ARGS)

# The real-browser test drives Debian's Chromium through selenium (a browser a test tool downloads
# itself does not start on these machines). Set up once per venv, then skipped: the apt packages
# when chromium or chromedriver is missing (as root, or through sudo), selenium into the venv.
SELENIUM ?= selenium==4.51.0
BROWSER_STAMP := $(VENV)/.browser-$(shell echo '$(SELENIUM)' | cksum | cut -d' ' -f1)

$(BROWSER_STAMP): $(STAMP)
	@if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then \
	  sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); mkdir -p build; \
	  echo "installing Debian's chromium and chromium-driver (apt-get; log: build/apt-browser.log)"; \
	  { $$sudo apt-get update -q && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -q \
	    chromium chromium-driver; } >build/apt-browser.log 2>&1 \
	  || echo "apt-get failed (build/apt-browser.log): the browser test will skip, saying so"; \
	fi
	$(PY) -m pip install -q '$(SELENIUM)' 2>&1 | { grep -v '^WARNING: Location' || true; }
	@rm -f $(VENV)/.browser-*
	@if command -v chromedriver >/dev/null 2>&1; then touch $@; fi

test-browser: $(BROWSER_STAMP) ## serve every notebook (marimo run), check it in headless Chromium; screenshots to build/screens/
	KITCHEN_BROWSER=1 $(PY) -m pytest tests/test_browser.py $(PYTEST_ARGS)

bench: $(STAMP) ## run the speed and memory benchmarks that need no GPU (prints ratios)
	$(PY) benchmarks/bench_buffer.py
	$(PY) benchmarks/bench_lab.py
	OMP_NUM_THREADS=1 $(PY) benchmarks/bench_trl.py --threads 1
	$(PY) benchmarks/bench_grm.py

test-gpu: $(STAMP) ## run the CUDA tests (on a GPU machine)
	$(PY) -m pytest -m cuda $(PYTEST_ARGS)

# No $(STAMP): the GPU machine runs its own python3 and has no registry to install from.
gpu-check: ## every GPU check in one go, ~8 min: CUDA tests, bench_gpu.py, the GPU recipe (README "On one GPU")
	bash benchmarks/gpu_check.sh $(GPU_CHECK_ARGS)

gpu-wheels: $(STAMP) ## download what the GPU machine lacks (bitsandbytes, pydantic) into build/wheels/ (~10 MB)
	bash benchmarks/gpu_check.sh --wheels

lint: $(STAMP) ## ruff lint and format check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP) ## ruff fix and format in place
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

check-notebooks: $(STAMP) ## marimo check on every notebook (warnings fail too)
	$(VENV)/bin/marimo check --strict notebooks/*.py

schema: $(STAMP) ## regenerate the JSON schemas in data/schema/ (editor completion for YAML)
	$(VENV)/bin/kitchen constitution schema > data/schema/constitution.schema.json
	$(VENV)/bin/kitchen constitution schema --kind profile > data/schema/profile.schema.json
	$(VENV)/bin/kitchen schema recipe > data/schema/recipe.schema.json
	$(VENV)/bin/kitchen schema sft-recipe > data/schema/sft_recipe.schema.json

ipynb: $(STAMP) ## export every notebook to build/ipynb/*.ipynb, ready for Jupyter and Colab
	$(PY) -m kitchen.notebook export build/ipynb

nbval: $(STAMP) ## run every exported notebook in a Jupyter kernel (pytest --nbval-lax; also part of make test)
	$(PY) -m pytest tests/test_ipynb.py $(PYTEST_ARGS)

clean: ## remove the virtual environment, caches and run outputs of the tests
	rm -rf $(VENV) $(VERL_VENV) .pytest_cache .ruff_cache build *.egg-info
