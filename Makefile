# meshrl: asynchronous RL post-training as five services over NATS JetStream and gRPC.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PYTHON  := $(BIN)/python
SEED    ?= 0
NAME    ?= seed$(SEED)
ALGO    ?= grpo
NATS    ?= single
STAMP   := $(VENV)/.installed

.PHONY: setup run run-agent chaos up down status test test-fast test-deploy proto lint bench-weights bench-gateway fuzz clean

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip
	$(PYTHON) -m pip install --quiet torch==2.13.0
	$(PYTHON) -m pip install --quiet -r requirements.txt
	touch $(STAMP)

run: setup
	$(PYTHON) -m launcher run --name $(NAME) --seed $(SEED) --algo $(ALGO) --nats $(NATS)

chaos: setup
	$(PYTHON) -m launcher chaos --seed $(SEED) --name chaos-$(NAME) --nats $(NATS) $(if $(KILLS),--kills $(KILLS)) $(if $(SERVICES),--services $(SERVICES))

run-agent: setup
	$(PYTHON) -m launcher run --config configs/agent.yaml --name agent-$(NAME) --seed $(SEED)

up: setup
	$(PYTHON) -m launcher up --seed $(SEED) --algo $(ALGO) --nats $(NATS)

down:
	$(PYTHON) -m launcher down

status: setup
	$(PYTHON) -m launcher status

test: setup
	$(PYTHON) -m pytest -q -ra

test-fast: setup
	$(PYTHON) -m pytest -q -ra -m "not slow and not e2e"

# builds the image and runs the Compose stack for real (root; installs docker.io, debootstrap, Compose if missing)
test-deploy: setup
	$(PYTHON) scripts/deploy_test.py

proto: setup
	$(PYTHON) scripts/gen_proto.py

lint: setup
	$(BIN)/ruff check .

bench-weights: setup
	$(PYTHON) -m bench.weights

bench-gateway: setup
	$(PYTHON) -m bench.gateway

# property-based fuzzing of every edge (gateway HTTP, each consumed bus subject): one JSON line per target
FUZZ_CASES ?= 10000
fuzz: setup
	$(PYTHON) -m bench.fuzz --cases $(FUZZ_CASES)

clean:
	rm -rf runs artifacts .stack
