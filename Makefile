# One command each, from a fresh clone: `make test` (set up + tests), `make run` (set up + main job).
# Set-up makes .venv, installs the CPU build of torch 2.13.0 when the venv has no torch, then the
# project with its dev and recipe extras. GPU users: `make setup VENV_FLAGS=--system-site-packages`
# reuses the CUDA torch of the surrounding environment instead.
PYTHON ?= python3
VENV ?= .venv
VENV_FLAGS ?=
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
RUN_ARGS ?=

.PHONY: setup test test-fast run lint format bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[dev,recipes]"
	touch $(STAMP)

setup: $(STAMP)

test: setup
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

# The main job: 2-process pretraining of the tiny LLaMA on the embedded corpus (gloo and the
# rendezvous on 127.0.0.1; wandb offline). Outputs in runs/demo; Ctrl-C saves a checkpoint and the
# same command resumes. Overrides: `make run RUN_ARGS="--fsdp fsdp2 --run-dir runs/demo-fsdp2"`.
run: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m recipes.llama.launch --nnodes 1 --nproc-per-node 2 \
		--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:0 --local-addr 127.0.0.1 \
		-m recipes.llama.train --run-dir runs/demo --wandb-mode offline $(RUN_ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: setup
	$(BIN)/python benchmarks/planner_table.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis *.egg-info
