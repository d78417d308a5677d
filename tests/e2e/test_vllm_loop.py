"""The five services with the rollout on vLLM (configs/e2e-vllm.yaml, shortened): SmolLM2-135M-Instruct in float32,
a few GRPO steps; every trainer version reaches the vLLM server in place (weight exchange -> the engine's stage ->
the worker extension), and afterwards vLLM's greedy tokens are those of the final checkpoint."""

from __future__ import annotations

import json

import grpc
import pytest
import torch
import yaml

from launcher.stack import ROOT, random_ports, run
from services.common.contracts import common_pb2, data_pb2, rollout_pb2, rollout_pb2_grpc

MODEL = ROOT / "artifacts" / "models" / "smollm2-135m-instruct"
PROMPT = "<|im_start|>user\nCalculate 6 + 2.<|im_end|>\n<|im_start|>assistant\n"
STEPS = 3

pytestmark = [
    pytest.mark.e2e, pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(2400),
    pytest.mark.skipif(not (ROOT / ".venv-vllm" / "bin" / "python").exists(),
                       reason=".venv-vllm is absent (build it: bash scripts/vllm_venv.sh)"),
    pytest.mark.skipif(not (MODEL / "model.safetensors").exists(),
                       reason="artifacts/models/smollm2-135m-instruct is absent (scripts/convert_smollm2.py)"),
]


def probe(stack, prompt_ids: list[int], found: dict) -> None:
    operator = (("authorization", f"Bearer {stack.operator_token}"),)
    sampling = data_pb2.SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=6)
    with grpc.insecure_channel(stack.address("rollout")) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        reply = stub.Generate(rollout_pb2.GenerateRequest(prompt_ids=prompt_ids, sampling=sampling, n=1), timeout=300,
                              metadata=operator)
        found["status"] = stub.Status(common_pb2.StatusRequest(), timeout=30, metadata=operator)
    found["tokens"] = list(reply.completions[0].token_ids)
    found["versions"] = list(reply.completions[0].versions)
    found["logprobs"] = list(reply.completions[0].logprobs)


def test_vllm_rollout_trains_and_receives_every_version(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(MODEL))
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    plan = yaml.safe_load((ROOT / "configs" / "e2e-vllm.yaml").read_text())
    builder = plan["services"]["builder"]
    builder.update(batch_size=2, group_size=4, total_steps=STEPS, eval_size=4, eval_every=0, train_size=64)
    builder["sampling"]["max_new_tokens"] = builder["eval_max_new_tokens"] = 8
    plan["services"]["trainer"]["algo_overrides"] = {}   # no dynamic sampling: the steps run whatever the rewards
    plan["services"]["rollout"]["engine"]["vllm"]["extra_args"] = ["--enforce-eager"]  # serves in ~30 s, not minutes
    config = tmp_path / "e2e-vllm.yaml"
    config.write_text(yaml.safe_dump(plan))
    found: dict = {}
    summary = run(str(config), name="vllm", seed=0, ports=random_ports(), runs_root=tmp_path, progress=False,
                  before_stop=lambda stack, _: probe(stack, prompt_ids, found))
    assert summary["completed"], summary
    assert summary["steps"] == STEPS and summary["trajectories_trained"] == STEPS * 2 * 4
    assert found["status"].engine == "vllm"
    assert found["status"].weight_updates >= 1
    assert set(found["versions"]) == {STEPS}, "vLLM generates with the final policy"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "vllm" / "final", dtype=torch.float32)
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=6, do_sample=False,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    expected = out[0, len(prompt_ids):].tolist()
    assert found["tokens"] == expected[:len(found["tokens"])], (found["tokens"], expected)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + found["tokens"]])).logits[0]
    lp = torch.log_softmax(logits.float(), -1)
    ref = [lp[len(prompt_ids) - 1 + i, t].item() for i, t in enumerate(found["tokens"])]
    assert max(abs(a - b) for a, b in zip(ref, found["logprobs"], strict=True)) < 1e-3
    assert summary["exit_codes"]["rollout"] == 0, "the rollout stopped its vLLM server and exited cleanly"
    synced = [json.loads(line) for line in (tmp_path / "vllm" / "logs" / "weight_exchange.log").read_text().splitlines()
              if '"synced"' in line]
    assert synced and not synced[0]["delta"], "the first update into the new receiver is full"
    assert any(s["delta"] for s in synced), "later updates are deltas (weight_exchange.delta in the config)"
