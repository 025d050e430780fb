# Two commands on a fresh machine with Python 3.11 and a C compiler:
#   make demo   -- set everything up and run the demo job end to end
#   make test   -- set everything up and run the test suite (the quick tier, < 6 min on 2 cores)
# make test-slow runs the rest (several nodes, failover, autoscaling, the training
# examples under torchrun, Lightning and Accelerate); CI (.ci/run) runs both.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.overlord-installed
# CPU machines take the CPU wheel; set TORCH_SPEC= to keep an existing (CUDA) torch.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test test-slow lint install clean bench bench-peers

$(STAMP): pyproject.toml setup.py native/ring.c native/ring.h native/ringhandle.h native/ringhandle.c native/ringmodule.c native/balance.c native/balance_assign.c native/plan_check.c native/balance.h native/balance_sort.h native/balancemodule.c
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade "pip>=23" setuptools wheel
	if [ -n "$(TORCH_SPEC)" ]; then $(BIN)/python -m pip install -q "$(TORCH_SPEC)"; fi
	$(BIN)/python -m pip install -q -e '.[torch,test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/overlord demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not slow" tests

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m slow tests

LINT_STAMP := $(VENV)/.overlord-lint-installed
$(LINT_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e '.[lint]'
	touch $(LINT_STAMP)

# ruff (lint and format), the import-linter layers contract, mypy: zero findings
lint: $(LINT_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python bench/ring.py --json
	$(BIN)/python bench/balance.py --json
	$(BIN)/python bench/memory.py --sources 300 --ranks 8 --workers 4 --json

# bench/peers.py runs in a venv of its own: the peers' pins (numpy<2.2, transformers<5 and
# so huggingface-hub<1.0) conflict with the test extra's datasets (pyproject.toml, "peers").
# The torch pin keeps pip from choosing a newer torch (and its CUDA wheels) for torchvision.
PEERS_VENV := .venv-peers
PEERS_STAMP := $(PEERS_VENV)/.overlord-peers-installed
$(PEERS_STAMP): pyproject.toml setup.py native/ring.c native/ring.h native/ringhandle.h native/ringhandle.c native/ringmodule.c
	test -x $(PEERS_VENV)/bin/python || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install -q --upgrade "pip>=23" setuptools wheel
	$(PEERS_VENV)/bin/python -m pip install -q -e '.[peers]' $(or $(TORCH_SPEC),torch)
	touch $(PEERS_STAMP)

# Overlord, colocated DataLoader, MosaicML Streaming, LitData: one corpus, 8 ranks x 4 workers
bench-peers: $(PEERS_STAMP)
	$(PEERS_VENV)/bin/python bench/peers.py --json

clean:
	rm -rf $(VENV) $(PEERS_VENV) build *.egg-info demo-data
