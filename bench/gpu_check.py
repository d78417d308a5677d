"""Device checks for a machine with an accelerator: `python -m bench.gpu_check [--device cuda] [--only NAME]`.

Each check runs in a subprocess of its own under a timeout (a hang or a crash in one never stops the others) and
prints one JSON line {"check", "ok", "seconds", "detail"} ("skipped": true when it does not apply here); a short
table follows. Models are built in-process with random weights: no files, no downloads. Needs torch,
transformers, numpy, msgpack, protobuf and structlog (imported by services.common.logging); megatron-core only
for its own check.

  engine             the embedded engine on the device: a batch, interrupted mid-generation for an in-place
                     weight update through the receiver's path (tcp, from a CPU state dict); per-token versions
  engine_throughput  SmolLM2-135M-sized Llama, random bf16 weights: generated tokens/s
  trainer_step       one decoupled-PPO (grpo) step of services.trainer.step on the device: loss finite, params moved
  trainer_backends   the trainer engine padded, packed and as one fsdp2 rank (nccl on CUDA): the same losses
  weight_exchange    sender on device tensors -> receiver into device tensors over tcp on loopback: bytes equal
  megatron           megatron-core GPTModel (TP=1, PP=1) forward, torch.distributed world size 1
  megatron_backend   the trainer service's megatron backend on one rank of the device (tp=1; on CUDA a
                     SmolLM2-135M-shaped Llama, random weights; on CPU a tiny Qwen3): three grpo steps whose losses
                     equal the torch backend's, then its weights pulled into the embedded engine on the device
                     (planner + tcp), every byte equal, and a generation at the new version
  megatron_train     (CUDA only) the tiny Qwen3 converted HF -> Megatron (services.trainer.megatron), TP=1 PP=1
                     GPTModel: logits and vocab-parallel log-probs match the HF model's, then a few AdamW steps
                     of the decoupled PPO loss on vocab_parallel_logp: loss decreases
  sglang             (CUDA, sglang installed; skipped otherwise) the SGLang engine starts a real SGLang server on the
                     tiny Qwen3 (random weights, saved to a temp dir): generate, then pause, an in-place update
                     (/update_weights_from_disk), resume; per-token versions, and the log-probs of every token
                     against a fresh HF forward of the weights of its version
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
VOCAB = 264  # the tiny Qwen3's padded vocabulary (byte tokenizer + specials)


# helpers -------------------------------------------------------------------------------------------------------
def _tiny(seed: int):
    import torch

    from services.trainer.models.tiny_qwen3 import TinyQwen3Config

    torch.manual_seed(seed)
    return TinyQwen3Config().build(VOCAB)


def _generate(engine, prompts: list[list[int]], sampling, *, timeout: float = 120.0, during=None) -> list:
    """Submit every prompt and wait for all; `during(engine)` runs once the batch is under way."""
    import threading

    left, done = [len(prompts)], threading.Event()
    lock = threading.Lock()

    def finished(_seq) -> None:
        with lock:
            left[0] -= 1
            if not left[0]:
                done.set()

    seqs = [engine.submit(p, sampling, finished) for p in prompts]
    if during is not None:
        during(engine)
    if not done.wait(timeout):
        raise TimeoutError(f"{left[0]} of {len(prompts)} sequences unfinished after {timeout}s")
    return seqs


def _sync(src: dict, dst: dict, *, version: int) -> dict[str, Any]:
    """Pull `src` (a sender's tensors) into `dst` in place: planner + SenderServer + pull_all over tcp."""
    from services.weight_exchange.client.layout import RECEIVER, SENDER, RankLayout
    from services.weight_exchange.client.layouts.hf import dedupe_tied, hf_full_shards
    from services.weight_exchange.client.sink import pull_all
    from services.weight_exchange.client.source import SenderServer
    from services.weight_exchange.planner import plan

    src, dst = dedupe_tied(src), dedupe_tied(dst)
    server = SenderServer("trainer-0", src, transport_names=("tcp",))
    endpoints = server.start()
    try:
        senders = [RankLayout("trainer-0", SENDER, "hf", hf_full_shards(src), endpoints=endpoints)]
        receivers = [RankLayout("rollout-0", RECEIVER, "embedded", hf_full_shards(dst))]
        transfers = plan(senders, receivers).transfers
        result = pull_all("rollout-0", dst, transfers, {"trainer-0": endpoints["tcp"]}, "tcp", 60.0, verify=True,
                          version=version)
    finally:
        server.stop()
    return {"bytes": result.bytes_received, "transfer_seconds": round(result.seconds, 4)}


def _placed(device) -> str:
    """The device a tensor created on `device` reports: `cuda` places it on the current index (`cuda:0`)."""
    import torch

    return str(torch.empty(0, device=device).device)


def _differ(a: dict, b: dict) -> list[str]:
    import torch

    return [n for n in b if not torch.equal(a[n].detach().cpu(), b[n].detach().cpu())]


# checks ----------------------------------------------------------------------------------------------------------
def check_engine(device) -> dict[str, Any]:
    from services.rollout.engines.sequence import Sampling
    from services.rollout.engines.torch_engine import EmbeddedEngine

    model = _tiny(0).to(device)
    new = {k: v.clone() for k, v in _tiny(1).state_dict().items()}  # the next policy, on the host
    engine = EmbeddedEngine(model, eos_token_id=-1, pad_token_id=0, max_batch=16, max_context=256, seed=0)
    engine.start()
    update: dict[str, Any] = {}

    def interrupt(eng, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while eng.stats.tokens_generated < 16 * 8:
            if eng.failure is not None or time.monotonic() > deadline:
                raise TimeoutError(f"engine: {eng.stats.tokens_generated} of {16 * 8} tokens within {timeout:g}s "
                                   f"(engine failure: {eng.failure})")
            time.sleep(0.005)
        eng.pause()
        update.update(_sync(new, eng.named_parameters(), version=1))
        eng.resume(version=1)

    try:
        prompts = [[(7 * i + j) % 250 + 1 for j in range(4 + i % 5)] for i in range(16)]
        seqs = _generate(engine, prompts, Sampling(temperature=1.0, max_new_tokens=48), during=interrupt)
    finally:
        engine.stop()
    versions = [s.versions for s in seqs]
    mixed = sum(0 in v and 1 in v for v in versions)
    ordered = all(v == sorted(v) and len(v) == 48 for v in versions)
    stale = _differ(dict(engine.model.state_dict()), new)
    where = {str(p.device) for p in engine.model.parameters()} | {str(engine.runner._last.device)}
    python = all(type(t) is int for s in seqs for t in s.output_ids) and all(
        type(x) is float for s in seqs for x in s.logprobs)
    ok = mixed > 0 and ordered and not stale and where == {_placed(device)} and python
    return {"ok": ok, "detail": {"sequences": len(seqs), "with_both_versions": mixed, "versions_ordered": ordered,
                                 "params_not_updated": stale[:3], "tensors_on": sorted(where),
                                 "python_values": python, "weight_updates": engine.stats.weight_updates, **update}}


def check_engine_throughput(device) -> dict[str, Any]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from services.rollout.engines.sequence import Sampling
    from services.rollout.engines.torch_engine import EmbeddedEngine

    cuda = device.type != "cpu"
    layers, batch, new = (30, 64, 128) if cuda else (2, 8, 16)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    engine = EmbeddedEngine(model, eos_token_id=-1, pad_token_id=0, max_batch=batch, max_context=512, seed=0)
    engine.start()
    try:
        _generate(engine, [[1, 2, 3, 4]] * 2, Sampling(temperature=1.0, max_new_tokens=4))  # warm-up
        before, start = engine.stats.tokens_generated, time.perf_counter()
        prompts = [[(31 * i + j) % 49000 + 1 for j in range(32)] for i in range(batch)]
        seqs = _generate(engine, prompts, Sampling(temperature=1.0, max_new_tokens=new), timeout=300.0)
        seconds = time.perf_counter() - start
        tokens = engine.stats.tokens_generated - before
    finally:
        engine.stop()
    ok = tokens == batch * new and all(len(s.output_ids) == new for s in seqs)
    return {"ok": ok, "detail": {"layers": layers, "dtype": "bfloat16", "batch": batch, "new_tokens": new,
                                 "tokens": tokens, "tokens_per_second": round(tokens / seconds, 1),
                                 "params_millions": round(sum(p.numel() for p in model.parameters()) / 1e6, 1)}}


def check_trainer_step(device) -> dict[str, Any]:
    import math

    import torch

    from services.common.contracts import data_pb2
    from services.trainer.algorithms import AlgorithmConfig
    from services.trainer.batching import pack
    from services.trainer.forward import frozen_logp
    from services.trainer.optim import OptimConfig
    from services.trainer.step import train_step

    model = _tiny(0).to(device).train()
    g = torch.Generator().manual_seed(0)
    trajs = []
    for i in range(16):
        completion = torch.randint(1, 250, (6 + i % 3,), generator=g).tolist()
        trajs.append(data_pb2.Trajectory(
            trajectory_id=f"t{i}", group_id=f"g{i // 4}", prompt_ids=torch.randint(1, 250, (5,), generator=g).tolist(),
            completion_ids=completion, behavior_logprobs=[0.0] * len(completion), versions=[i % 2] * len(completion),
            loss_mask=[1] * len(completion), reward=float(i % 4 == 0), finish_reason="stop"))
    batch = pack(trajs, 0).to(device)
    batch.behav_logp = (frozen_logp(model, batch, 1.0) - 0.05) * batch.loss_mask  # a slightly older behaviour policy
    config = AlgorithmConfig.from_preset("grpo", max_new_tokens=8, dynamic_sampling=False)
    algo = config.build()
    optim = OptimConfig(lr=1e-3)
    optimizer, schedule = optim.build(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    metrics = train_step(model, optimizer, algo, batch, version=1, optim=optim, temperature=1.0, generator=g,
                         schedule=schedule)
    moved = len(_differ(before, dict(model.named_parameters())))
    loss = metrics.get("loss", float("nan"))
    where = {str(p.device) for p in model.parameters()} | {str(s.device) for st in optimizer.state.values()
                                                           for s in st.values() if torch.is_tensor(s) and s.dim()}
    ok = math.isfinite(loss) and moved > 0 and metrics.get("nonfinite_skipped", 0.0) == 0 and where == {_placed(device)}
    return {"ok": ok, "detail": {"loss": loss, "params_changed": moved, "params": len(before),
                                 "tensors_on": sorted(where), "grad_norm": metrics.get("grad_norm"),
                                 "decoupled_loss": config.use_decoupled_loss}}


def check_weight_exchange(device) -> dict[str, Any]:

    from services.weight_exchange.client.layouts.hf import dedupe_tied

    src = dict(_tiny(0).to(device).state_dict())  # tied embeddings stay tied on both sides
    dst = dict(_tiny(1).to(device).state_dict())
    dst_ptrs = {k: v.data_ptr() for k, v in dst.items()}
    start = time.perf_counter()
    moved = _sync(src, dst, version=0)
    seconds = time.perf_counter() - start
    unequal = _differ(dst, dedupe_tied(src))
    in_place = all(dst[k].data_ptr() == p for k, p in dst_ptrs.items())
    where = {str(v.device) for v in dst.values()}
    ok = not unequal and in_place and where == {_placed(device)} and moved["bytes"] > 0
    return {"ok": ok, "detail": {"tensors": len(src), "unequal": unequal[:3], "in_place": in_place,
                                 "tensors_on": sorted(where), "MB_per_s": round(moved["bytes"] / seconds / 1e6, 1),
                                 **moved}}


def check_megatron(device) -> dict[str, Any]:
    import importlib.util

    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return {"ok": False, "skipped": True, "detail": "megatron-core is not installed"}
    try:
        return _megatron_forward(device)
    except Exception as exc:
        if device.type == "cpu":  # its forward needs CUDA; on a CPU host this check only tells construction ran
            return {"ok": False, "skipped": True, "detail": f"forward on cpu: {type(exc).__name__}: {exc}"[:500]}
        raise


def _megatron_forward(device) -> dict[str, Any]:
    import socket

    import torch
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        from megatron.core import parallel_state as ps
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer import TransformerConfig

        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        if device.type == "cuda":
            from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(0)
        config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                                   use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0)
        model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=128,
                         max_sequence_length=64, position_embedding_type="rope").to(device)
        ids = torch.randint(0, 128, (2, 16), device=device)
        positions = torch.arange(16, device=device).expand(2, 16)
        mask = torch.triu(torch.ones(16, 16, dtype=torch.bool, device=device), 1)[None, None]
        with torch.no_grad():
            logits = model(ids, positions, mask)
        ok = tuple(logits.shape) == (2, 16, 128) and bool(torch.isfinite(logits).all())
        return {"ok": ok, "detail": {"backend": backend, "logits": list(logits.shape), "device": str(logits.device)}}
    finally:
        dist.destroy_process_group()


def _group_batch(groups: int = 4, size: int = 4):
    """Groups of rows sharing a prompt (what prompt sharing packs), rewards mixed inside each group."""
    import torch

    from services.common.contracts import data_pb2
    from services.trainer.batching import pack

    g = torch.Generator().manual_seed(1)
    trajs = []
    for i in range(groups):
        prompt = torch.randint(1, 250, (5 + i,), generator=g).tolist()
        for j in range(size):
            completion = torch.randint(1, 250, (3 + (i + j) % 5,), generator=g).tolist()
            trajs.append(data_pb2.Trajectory(
                trajectory_id=f"t{i}.{j}", group_id=f"g{i}", prompt_ids=prompt, completion_ids=completion,
                behavior_logprobs=[-5.5] * len(completion), versions=[0] * len(completion),
                loss_mask=[1] * len(completion), reward=float(j % 2), finish_reason="stop"))
    return pack(trajs, 0)


def check_trainer_backends(device) -> dict[str, Any]:
    """Three steps of the service's trainer engine three ways on the device: the torch backend padded, the same
    packed (prompts shared, 4-D masks), and fsdp2 on one rank over the device's collective (nccl on CUDA). Same
    model, same batches: the losses must agree."""
    import tempfile

    import torch

    from services.trainer.config import TrainerConfig
    from services.trainer.engine import build_engine
    from services.trainer.models import TinyQwen3Config, build_tokenizer, padded_vocab_size
    from services.trainer.optim import OptimConfig
    from services.trainer.packing import PackingConfig

    variants = {"padded": {}, "packed": {"packing": PackingConfig(enabled=True)}, "fsdp2": {"backend": "fsdp2"}}
    losses: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as model_dir:
        torch.manual_seed(0)
        tok = build_tokenizer()
        TinyQwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, intermediate_size=128).build(padded_vocab_size(tok)).save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
        batch = _group_batch()
        for name, settings in variants.items():
            torch.manual_seed(0)
            engine = build_engine(TrainerConfig(model_path=model_dir, algo="grpo", max_new_tokens=8, wx_address="",
                                                device=str(device), optim=OptimConfig(lr=1e-3), **settings))
            losses[name] = [engine.step(batch, version)["loss"] for version in range(3)]
            if hasattr(engine, "close"):
                engine.close()
    worst = max(abs(a - b) for name in ("packed", "fsdp2") for a, b in zip(losses[name], losses["padded"], strict=True))
    ok = worst <= 1e-5 + 1e-3 * max(abs(v) for v in losses["padded"])
    return {"ok": ok, "detail": {"loss": [round(v, 6) for v in losses["padded"]], "max_loss_difference": worst,
                                 "losses": losses}}


def _smollm2_shaped(model_dir: str, device) -> None:
    """SmolLM2-135M's shape (Llama, 30 layers, GQA 9/3, tied, vocab 49152) with random weights on an accelerator;
    a tiny Qwen3 on the CPU (the suite runs this check there)."""
    import torch
    import transformers

    from services.trainer.models import TinyQwen3Config, build_tokenizer, padded_vocab_size

    torch.manual_seed(0)
    tok = build_tokenizer()
    if device.type == "cpu":
        model = TinyQwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=16, intermediate_size=128).build(padded_vocab_size(tok))
    else:
        config = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                          num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                          max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=100000.0,
                                          tie_word_embeddings=True, torch_dtype="float32")
        model = transformers.AutoModelForCausalLM.from_config(config).float()
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)


def check_megatron_backend(device) -> dict[str, Any]:
    import importlib.util
    import tempfile

    import torch

    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return {"ok": False, "skipped": True, "detail": "megatron-core is not installed"}
    from services.rollout.engines.sequence import Sampling
    from services.rollout.engines.torch_engine import EmbeddedEngine
    from services.trainer.config import TrainerConfig
    from services.trainer.engine import build_engine
    from services.trainer.optim import OptimConfig
    from services.trainer.packing import PackingConfig

    steps, losses = 3, {}
    with tempfile.TemporaryDirectory() as model_dir:
        _smollm2_shaped(model_dir, device)
        batch = _group_batch()
        for backend in ("torch", "megatron"):
            torch.manual_seed(0)
            trainer = build_engine(TrainerConfig(
                model_path=model_dir, algo="grpo", max_new_tokens=8, wx_address="", device=str(device),
                optim=OptimConfig(lr=1e-4), backend=backend, packing=PackingConfig(enabled=False),
                run_dir=model_dir))
            started = time.perf_counter()
            losses[backend] = [trainer.step(batch, version)["loss"] for version in range(steps)]
            seconds = time.perf_counter() - started
            if backend == "megatron":
                trained = {n: t.detach() for n, t in trainer.weights().items()}
                policy = _hf_model(model_dir).to(device)
                engine = EmbeddedEngine(policy, eos_token_id=-1, pad_token_id=0, max_batch=8, max_context=128,
                                        seed=0)
                engine.start()
                try:
                    engine.pause()
                    moved = _sync(trained, engine.named_parameters(), version=steps)
                    engine.resume(version=steps)
                    seqs = _generate(engine, [[5, 6, 7, 8]] * 4, Sampling(temperature=1.0, max_new_tokens=8))
                finally:
                    engine.stop()
                stale = _differ(dict(engine.model.state_dict()), trained)
            trainer.close()
    worst = max(abs(a - b) for a, b in zip(losses["megatron"], losses["torch"], strict=True))
    versions = {v for s in seqs for v in s.versions}
    ok = worst <= 1e-4 + 1e-3 * max(abs(v) for v in losses["torch"]) and not stale and versions == {steps}
    return {"ok": ok, "detail": {"loss": [round(v, 6) for v in losses["megatron"]], "torch_loss": losses["torch"],
                                 "max_loss_difference": worst, "megatron_step_seconds": round(seconds / steps, 3),
                                 "params_not_synced": stale[:3], "generated_versions": sorted(versions), **moved}}


def _hf_model(model_dir: str):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def check_megatron_train(device) -> dict[str, Any]:
    import importlib.util

    if device.type != "cuda":
        return {"ok": False, "skipped": True,
                "detail": f"needs CUDA (megatron-core's forward places tensors with torch.cuda); device is {device}"}
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return {"ok": False, "skipped": True, "detail": "megatron-core is not installed"}
    return _megatron_train(device)


def _megatron_train(device, steps: int = 6) -> dict[str, Any]:
    import math
    import socket

    import torch
    import torch.distributed as dist

    from services.trainer.algorithms import decoupled_ppo_loss, token_logp
    from services.trainer.megatron.convert import canonical_state, hf_to_megatron
    from services.trainer.megatron.loss import vocab_parallel_logp
    from services.trainer.megatron.model import build_gpt_model, current_parallel
    from services.weight_exchange.client.layouts.model import model_spec

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device.index or 0)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        from megatron.core import parallel_state as ps

        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        if cuda:
            from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(0)
        spec = model_spec("tiny-qwen3")
        hf = _tiny(0).to(device).eval()
        assert spec.vocab_size == hf.config.vocab_size == VOCAB, (spec, hf.config.vocab_size)
        rope = getattr(hf.config, "rope_parameters", None) or {}   # transformers 5; 4.x has config.rope_theta
        theta = rope.get("rope_theta", getattr(hf.config, "rope_theta", 10000.0))
        model = build_gpt_model(spec, current_parallel(), rope_theta=theta, norm_eps=hf.config.rms_norm_eps, max_sequence_length=256).to(device)
        model.load_state_dict(hf_to_megatron(canonical_state(hf.state_dict(), spec), spec, current_parallel()),
                              strict=True)
        tp_group = ps.get_tensor_model_parallel_group()
        g = torch.Generator().manual_seed(0)
        batch, length, prompt = 8, 32, 12
        ids = torch.randint(1, 250, (batch, length + 1), generator=g).to(device)
        inputs, targets = ids[:, :-1], ids[:, 1:]
        positions = torch.arange(length, device=device).expand(batch, length)
        causal = torch.triu(torch.ones(length, length, dtype=torch.bool, device=device), 1)[None, None]

        def logp_of(m) -> torch.Tensor:
            return vocab_parallel_logp(m(inputs, positions, causal), targets, tp_group, 1.0, spec.vocab_size)

        model.eval()
        with torch.no_grad():
            logits, want = model(inputs, positions, causal), hf(inputs).logits
            logits_err = (logits[..., :VOCAB] - want).abs().max().item()
            scale = want.abs().max().item()
            logp_err = (logp_of(model) - token_logp(want, targets)).abs().max().item()
            prox = logp_of(model)
        mask = torch.zeros(batch, length, dtype=torch.bool, device=device)
        mask[:, prompt:] = True
        behav = prox - 0.05 * torch.rand(prox.shape, generator=g).to(device)   # a slightly older behaviour policy
        advantages = torch.where(torch.arange(batch, device=device) % 2 == 0, 1.0, -1.0)[:, None].expand(-1, length)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
        losses = []
        for _ in range(steps):
            loss = decoupled_ppo_loss(logp_of(model), prox, behav, advantages, mask)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        with torch.no_grad():
            final = decoupled_ppo_loss(logp_of(model), prox, behav, advantages, mask).item()
        where = {str(p.device) for p in model.parameters()}
        fits = logits_err <= 1e-3 * max(1.0, scale) and logp_err <= 1e-3
        ok = fits and all(map(math.isfinite, losses + [final])) and final < losses[0] and \
            where == {str(torch.device(device.type, torch.cuda.current_device()) if cuda else device)}
        return {"ok": ok, "detail": {"loss": f"{losses[0]:.4f}->{final:.4f}", "losses": [round(x, 5) for x in losses],
                                     "final_loss": final, "logits_max_err": logits_err, "logits_max_abs": scale,
                                     "logp_max_err": logp_err, "tensors_on": sorted(where),
                                     "params": sum(p.numel() for p in model.parameters())}}
    finally:
        dist.destroy_process_group()


def check_sglang(device) -> dict[str, Any]:
    import importlib.util

    if device.type != "cuda":
        return {"ok": False, "skipped": True, "detail": f"SGLang needs CUDA here (device {device})"}
    if importlib.util.find_spec("sglang") is None:
        return {"ok": False, "skipped": True, "detail": "sglang is not installed (pip install sglang)"}
    import asyncio
    import tempfile

    from services.rollout.engines.sequence import Sampling
    from services.rollout.engines.sglang_engine import SGLangConfig

    model = _tiny(0)
    with tempfile.TemporaryDirectory(prefix="meshrl-sglang-check-") as tmp:
        model_dir = pathlib.Path(tmp) / "model"
        model.save_pretrained(model_dir)
        _save_byte_tokenizer(model_dir)
        engine = SGLangConfig(weights_dir=str(pathlib.Path(tmp) / "weights"), startup_timeout=180.0,
                              mem_fraction_static=0.3).build(model_path=str(model_dir), max_batch=8, max_context=256)
        engine.start()
        layer = "model.layers.0.mlp.down_proj.weight"

        async def run():
            loop = asyncio.get_running_loop()
            futures = [loop.create_future() for _ in range(4)]
            prompts = [[72 + i, 101, 108, 108, 111] for i in range(4)]
            seqs = [engine.submit(p, Sampling(temperature=1.0, max_new_tokens=64), lambda s, f=f: f.set_result(s))
                    for p, f in zip(prompts, futures, strict=True)]
            await asyncio.sleep(0.05)
            await engine.pause_async()
            params = engine.named_parameters()
            params[layer].mul_(-1.0)
            await engine.resume_async(1)
            await asyncio.wait_for(asyncio.gather(*futures), 120)
            return seqs

        try:
            seqs = asyncio.run(run())
        finally:
            engine.stop()
        new = {layer: -model.state_dict()[layer].clone()}
        err = _logprob_error(model, seqs, {1: new})
        versions_ok = all(s.versions == sorted(s.versions) and set(s.versions) <= {0, 1} for s in seqs)
        both = sum(0 in s.versions and 1 in s.versions for s in seqs)
        tokens = sum(len(s.output_ids) for s in seqs)
        return {"ok": versions_ok and err < 2e-2,
                "detail": {"with_both_versions": both, "logprob_max_err": err, "tokens": tokens,
                           "server_version": engine.server_info.get("version"),
                           "weight_updates": engine.stats.weight_updates}}


def _save_byte_tokenizer(model_dir: pathlib.Path) -> None:
    """SGLang loads a tokenizer with the model: the tiny model's character-level one."""
    from services.trainer.models.tiny_qwen3 import build_tokenizer

    build_tokenizer().save_pretrained(model_dir)


def _logprob_error(model, seqs, weights_by_version: dict) -> float:
    """The largest |log-prob - fresh forward| over every token, each under the weights of its version (T = 1)."""
    import torch

    base = {k: v.clone() for k, v in model.state_dict().items()}
    worst = 0.0
    model = model.float().eval()
    with torch.no_grad():
        for seq in seqs:
            for i, (token, version) in enumerate(zip(seq.output_ids, seq.versions, strict=True)):
                model.load_state_dict({**base, **weights_by_version.get(version, {})}, strict=False)
                logits = model(input_ids=torch.tensor([seq.prompt_ids + seq.output_ids[:i]])).logits[0, -1]
                worst = max(worst, abs(float(torch.log_softmax(logits.float(), -1)[token]) - seq.logprobs[i]))
    return worst


CHECKS = {"engine": check_engine, "engine_throughput": check_engine_throughput, "trainer_step": check_trainer_step,
          "trainer_backends": check_trainer_backends,
          "weight_exchange": check_weight_exchange, "megatron": check_megatron,
          "megatron_backend": check_megatron_backend, "megatron_train": check_megatron_train,
          "sglang": check_sglang}


# running -----------------------------------------------------------------------------------------------------------
def run_one(name: str, device_name: str) -> dict[str, Any]:
    """One check in this process; never raises."""
    start = time.perf_counter()
    try:
        from services.common.device import resolve_device

        device = resolve_device(device_name)
        out = CHECKS[name](device)
    except Exception as exc:  # noqa: BLE001 - the report carries whatever failed
        out = {"ok": False, "detail": f"{type(exc).__name__}: {exc}"[:2000]}
    return {"check": name, "ok": bool(out["ok"]), "seconds": round(time.perf_counter() - start, 2),
            **({"skipped": True} if out.get("skipped") else {}), "detail": out["detail"]}


def run_isolated(name: str, device_name: str, timeout: float) -> dict[str, Any]:
    """One check in a subprocess under `timeout`; a crash or a hang becomes a failed result."""
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "bench.gpu_check", "--device", device_name, "--only", name]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"check": name, "ok": False, "seconds": round(time.perf_counter() - start, 2),
                "detail": f"timed out after {timeout:.0f}s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"check": name, "ok": False, "seconds": round(time.perf_counter() - start, 2),
            "detail": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}"}


def table(results: list[dict[str, Any]]) -> str:
    rows = [f"{'check':<18} {'result':<8} {'seconds':>8}  key figure"]
    for r in results:
        d = r["detail"] if isinstance(r["detail"], dict) else {}
        key = next((f"{k}={d[k]}" for k in ("tokens_per_second", "loss", "MB_per_s", "with_both_versions", "logits")
                    if k in d), "" if d else str(r["detail"])[:60])
        result = "skipped" if r.get("skipped") else "ok" if r["ok"] else "FAILED"
        rows.append(f"{r['check']:<18} {result:<8} {r['seconds']:>8.2f}  {key}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cpu | cuda | cuda:N | npu (default cuda)")
    ap.add_argument("--only", choices=sorted(CHECKS), action="append", help="run only these checks")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per check (default 240)")
    args = ap.parse_args(argv)
    names = args.only or list(CHECKS)
    if args.only and len(names) == 1:  # the child: one check, in this process
        print(json.dumps(run_one(names[0], args.device)), flush=True)
        return 0
    results = []
    for name in names:
        results.append(run_isolated(name, args.device, args.timeout))
        print(json.dumps(results[-1]), flush=True)
    print(table(results), flush=True)
    return 0 if all(r["ok"] or r.get("skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
