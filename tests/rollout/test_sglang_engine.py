"""The SGLang engine against a contract double (tests/rollout/sglang_double.py, a subprocess on loopback backed by
the tiny Qwen3): tokens, log-probs, versions across pause / weight update / resume, abort, timeouts.

These prove our side of the contract (what the engine sends, how it reads SGLang's documented replies and what it
does around them), not SGLang's: a real SGLang server is exercised only by bench/gpu_check.py on a GPU machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import torch

from services.rollout.engines.sequence import Sampling, Status

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
PROMPTS = [[72, 101, 108, 108, 111], [87, 104, 97, 116, 32, 105, 115]]
LAYER = "model.layers.0.mlp.down_proj.weight"
QKV = "model.layers.1.self_attn.k_proj.weight"   # SGLang holds it inside the fused qkv_proj
LOADER = "services.rollout.engines.sglang_worker.meshrl_weights"


@contextlib.contextmanager
def double(model: str, token_delay: float = 0.0, ignore_eos: bool = False, custom_loader: bool = False):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "tests.rollout.sglang_double", "--model", model, "--port",
                             str(port), "--token-delay", str(token_delay)] + ["--ignore-eos"] * ignore_eos
                            + ["--custom-weight-loader", LOADER] * custom_loader, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(OSError):
                urllib.request.urlopen(url + "/health", timeout=2).close()  # noqa: S310 - loopback
                break
            assert proc.poll() is None, "the double exited while starting"
            assert time.monotonic() < deadline, "the double did not answer /health in 120 s"
            time.sleep(0.2)
        yield url
    finally:
        proc.kill()
        proc.wait(30)


def state(url: str) -> dict:
    with urllib.request.urlopen(url + "/double/state", timeout=5) as r:  # noqa: S310 - loopback
        return json.loads(r.read())


def engine_for(url: str, model: str, **config):
    from services.rollout.engines.sglang_engine import SGLangConfig

    config.setdefault("weight_sync", "none")
    return SGLangConfig(url=url, **config).build(model_path=model, max_batch=8, max_context=256)


def expected_logprobs(model_dir: str, seq, temperature: float, weights_by_version: dict) -> list[float]:
    """Each output token's log-prob under softmax(logits / T) of a fresh forward of the weights of its version."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    out = []
    with torch.no_grad():
        for i, (token, version) in enumerate(zip(seq.output_ids, seq.versions, strict=True)):
            model.load_state_dict({**base, **weights_by_version.get(version, {})}, strict=False)
            logits = model(input_ids=torch.tensor([seq.prompt_ids + seq.output_ids[:i]])).logits[0, -1]
            out.append(float(torch.log_softmax(logits / (temperature or 1.0), -1)[token]))
    return out


@pytest.fixture(scope="module")
def shared_double(tiny_qwen3):
    with double(str(tiny_qwen3), token_delay=0.02, ignore_eos=True) as url:
        yield url


# configuration ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("field", "value"), [("weight_sync", "rsync"), ("group_backend", "mpi"), ("url", "ftp://x"),
                                              ("request_timeout", 0), ("port", 70000), ("tp_size", 0)])
def test_a_bad_config_names_the_field(field, value):
    from services.rollout.engines.sglang_engine import SGLangConfig

    with pytest.raises(ValueError, match=f"engine.sglang.{field}"):
        SGLangConfig(**{field: value})


def test_lora_adapters_go_to_engines_that_merge_them(tiny_qwen3):
    """engine.lora: the embedded engine and worker-sync engines merge adapters; a staged engine is refused naming
    the field. With two TP workers every worker takes every adapter whole and learns where its slices of the fused
    parameters come from."""
    from services.common.errors import FieldError
    from services.rollout.config import RolloutEngineConfig
    from services.rollout.engines.lora_merge import AdapterConfig
    from services.rollout.engines.worker_pulls import adapter_layout, worker_shards
    from services.weight_exchange.client.layouts.inference import InferenceParallel, inference_shards
    from services.weight_exchange.client.layouts.model import model_spec

    lora = AdapterConfig(r=4, alpha=8.0, target_modules=["q_proj", "down_proj"])
    with pytest.raises(FieldError, match="engine.lora: .*sglang.weight_sync worker"):
        RolloutEngineConfig(kind="sglang", model_path=str(tiny_qwen3), lora=lora)
    from services.rollout.engines.sglang_engine import SGLangConfig

    RolloutEngineConfig(kind="sglang", model_path=str(tiny_qwen3), lora=lora, sglang=SGLangConfig(weight_sync="worker"))

    spec = model_spec(str(tiny_qwen3), "float32")
    workers = [{"rank": r, "tp": 2, "tp_rank": r,
                "params": [[s.local_name, list(s.local_shape), "float32", False]
                           for s in {x.local_name: x for x in inference_shards(
                               spec, InferenceParallel(engine="sglang", tp=2, tp_rank=r))}.values()]}
               for r in range(2)]
    full, _ = worker_shards(workers, str(tiny_qwen3), "float32", "sglang")
    shards, shapes, plans = adapter_layout(workers, full, 4, lora.target_modules)
    assert shapes["model.layers.0.self_attn.q_proj.lora_A.weight"] == [4, 128]
    assert shapes["model.layers.0.mlp.down_proj.lora_B.weight"] == [128, 4]
    assert len(shards) == 2 * len(shapes) and {s.local_name.split("/")[0] for s in shards} == {"w0", "w1"}
    qkv = plans["1"]["model.layers.0.self_attn.qkv_proj.weight"]   # q, k and v rows of rank 1, from the checkpoint
    assert sorted(entry[0].rsplit(".", 2)[-2] for entry in qkv) == ["k_proj", "q_proj", "v_proj"]
    down = plans["1"]["model.layers.0.mlp.down_proj.weight"]      # row-parallel: rank 1 holds the second half of inputs
    assert down == [["model.layers.0.mlp.down_proj.weight", [0, 192], [128, 192], [0, 0], [128, 192]]]
    with pytest.raises(FieldError, match="engine.lora.target_modules"):
        adapter_layout(workers, full, 4, ["c_attn"])


def test_the_engine_kind_builds_an_sglang_engine(tiny_qwen3):
    from services.rollout.config import RolloutEngineConfig
    from services.rollout.engines.base import Engine
    from services.rollout.engines.sglang_engine import SGLangConfig

    engine = RolloutEngineConfig(kind="sglang", model_path=str(tiny_qwen3), max_context=256,
                                 sglang=SGLangConfig(url="http://127.0.0.1:1")).build()
    assert isinstance(engine, Engine) and engine.kind == "sglang" and engine.vocab_size == 264
    with pytest.raises(ValueError, match="engine.kind"):
        RolloutEngineConfig(kind="sglang-rs")
    with pytest.raises(ValueError, match="engine.dtype"):
        SGLangConfig().build(model_path=str(tiny_qwen3), max_batch=1, max_context=64, dtype="float8")
    with pytest.raises(ValueError, match="engine.model_path"):
        SGLangConfig().build(model_path=str(ROOT), max_batch=1, max_context=64)


def test_a_reply_off_the_schema_is_refused():
    from services.rollout.engines.sglang_engine import _Malformed, parse_generate_reply

    good = {"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "length", "length": 2},
                                                "output_token_logprobs": [[-0.5, 5, None], [-1.5, 6, None]]}}
    assert parse_generate_reply(good) == ([5, 6], [-0.5, -1.5], "length")
    for bad in ({"text": "x"}, {"meta_info": {"finish_reason": None}},
                {"meta_info": {"output_token_logprobs": [[-0.5]]}},
                {**good, "output_ids": [5, 7]}):
        with pytest.raises(_Malformed):
            parse_generate_reply(bad)


# generation over HTTP ---------------------------------------------------------------------------------------------

def test_tokens_and_logprobs_match_a_fresh_forward(shared_double, tiny_qwen3):
    engine = engine_for(shared_double, str(tiny_qwen3))
    engine.start()

    async def run():
        sampled = await engine.generate(PROMPTS[0], Sampling(temperature=0.7, top_k=0, max_new_tokens=10), n=2)
        greedy = await engine.generate(PROMPTS[1], Sampling(temperature=0.0, max_new_tokens=6))
        return sampled, greedy

    try:
        sampled, greedy = asyncio.run(run())
    finally:
        engine.stop()
    assert engine.model_info["model_path"] == str(tiny_qwen3) and engine.server_info["tp_size"] == 1
    for seq, temperature in [(sampled[0], 0.7), (sampled[1], 0.7), (greedy[0], 0.0)]:
        assert seq.finish_reason in ("stop", "length") and seq.output_ids and seq.versions == [0] * len(seq.output_ids)
        assert seq.logprobs == pytest.approx(expected_logprobs(str(tiny_qwen3), seq, temperature, {}), abs=1e-4)


def test_abort_fires_the_callback_once_and_tells_the_server(shared_double, tiny_qwen3):
    engine = engine_for(shared_double, str(tiny_qwen3))
    finished = []

    async def run():
        seq = engine.submit(PROMPTS[0], Sampling(max_new_tokens=200), finished.append)
        await asyncio.sleep(0.3)
        engine.abort(seq)
        engine.abort(seq)
        await asyncio.sleep(0.5)
        return seq

    try:
        seq = asyncio.run(run())
    finally:
        engine.stop()
    assert finished == [seq] and seq.finish_reason == "abort" and seq.status is Status.FINISHED
    s = state(shared_double)
    assert any(r.startswith(f"meshrl-{seq.seq_id}-") for r in s["aborted_rids"]) and s["running"] == 0


# interruption and weight updates ----------------------------------------------------------------------------------

def test_versions_per_token_across_pause_update_resume(tiny_qwen3, tmp_path):
    with double(str(tiny_qwen3), token_delay=0.03, ignore_eos=True) as url:
        engine = engine_for(url, str(tiny_qwen3), weight_sync="disk", weights_dir=str(tmp_path / "w"))
        engine.start()
        new = {}

        async def run():
            loop = asyncio.get_running_loop()
            futures = [loop.create_future() for _ in PROMPTS]
            seqs = [engine.submit(p, Sampling(temperature=1.0, max_new_tokens=40),
                                  lambda s, f=f: f.set_result(s)) for p, f in zip(PROMPTS, futures, strict=True)]
            await asyncio.sleep(0.5)
            await engine.pause_async()
            held = [(list(s.output_ids), list(s.versions)) for s in seqs]
            assert state(url)["paused"] and engine.paused
            await asyncio.sleep(0.2)   # paused: nothing moves
            assert [(s.output_ids, s.versions) for s in seqs] == held
            params = engine.named_parameters()
            params[LAYER].add_(0.05 * torch.randn_like(params[LAYER]))
            new[LAYER] = params[LAYER].clone()
            await engine.resume_async(1)
            await asyncio.wait_for(asyncio.gather(*futures), 120)
            return seqs, held

        try:
            seqs, held = asyncio.run(run())
        finally:
            engine.stop()
        assert state(url)["weight_version"] == "1" and engine.version == 1 and engine.stats.weight_updates == 1
    assert (tmp_path / "w" / "v1" / "model.safetensors").is_file()
    for seq, (ids_before, _) in zip(seqs, held, strict=True):
        k = len(ids_before)
        assert seq.output_ids[:k] == ids_before and seq.versions == [0] * k + [1] * (len(seq.output_ids) - k)
        assert seq.logprobs == pytest.approx(expected_logprobs(str(tiny_qwen3), seq, 1.0, {1: new}), abs=1e-4)
    assert any(0 in s.versions and 1 in s.versions for s in seqs), "no sequence was cut by the pause"


def test_distributed_update_broadcasts_into_the_server(tiny_qwen3):
    with double(str(tiny_qwen3)) as url:
        engine = engine_for(url, str(tiny_qwen3), weight_sync="distributed", group_backend="gloo",
                            control_timeout=60)
        engine.start()
        new = {}

        async def run():
            await engine.pause_async()
            params = engine.named_parameters()
            params[LAYER].mul_(-1.0)
            new[LAYER] = params[LAYER].clone()
            await engine.resume_async(3)
            return (await engine.generate(PROMPTS[1], Sampling(temperature=0.0, max_new_tokens=6)))[0]

        try:
            seq = asyncio.run(run())
        finally:
            engine.stop()
        assert state(url)["updates"] == 1 and state(url)["weight_version"] == "3"
    assert seq.versions == [3] * len(seq.output_ids)
    assert seq.logprobs == pytest.approx(expected_logprobs(str(tiny_qwen3), seq, 0.0, {3: new}), abs=1e-4)


def test_each_tp_worker_pulls_its_own_shard_in_place(tiny_qwen3, tmp_path):
    """weight_sync worker: no stage in this process; the server's worker (the double calls meshrl's custom loader
    as SGLang's model runner does, on weights held under SGLang's names and fused shapes) reports what it holds,
    pulls exactly its bytes from the trainer's sender, commits them in place with a cache flush, and generates with
    the new weights. A pull whose sender is gone is abandoned: the old weights stay whole."""
    from transformers import AutoModelForCausalLM

    from services.weight_exchange.bench.local import engine_receiver, local_exchange

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3), dtype=torch.float32).eval()
    params = dict(hf.named_parameters())
    original = {n: params[n].detach().clone() for n in (LAYER, QKV)}
    with double(str(tiny_qwen3), custom_loader=True) as url:
        engine = engine_for(url, str(tiny_qwen3), weight_sync="worker", results_dir=str(tmp_path / "results"),
                            control_timeout=60)
        engine.start()
        held = {name: shape for name, shape, *_ in engine.workers[0]["params"]}
        assert held["model.layers.1.self_attn.qkv_proj.weight"] == [256, 128] and QKV not in held
        assert held["model.embed_tokens.weight"] == [320, 128]   # the vocabulary padded to 64 rows
        assert engine.stage is None
        with pytest.raises(RuntimeError, match="weight_sync is worker"):
            engine.named_parameters()

        def change(p) -> None:
            p[LAYER].mul_(-1.0)
            p[QKV].mul_(2.0)

        async def run():
            async with local_exchange(params, engine_receiver(engine)) as wx:
                reply = await wx.update(1, change, transport="tcp")
                model_bytes = sum(t.numel() * t.element_size() for n, t in params.items() if n != "lm_head.weight")
                assert reply.bytes_moved == model_bytes == sum(s.num_bytes for s in engine.receiver_shards)
                seq = (await engine.generate(PROMPTS[1], Sampling(temperature=0.0, max_new_tokens=6)))[0]
                await asyncio.to_thread(wx.sender.server.stop)   # the sender's data plane is gone
                with pytest.raises(Exception, match="trainer-0"):
                    await wx.update(2, lambda p: p[LAYER].mul_(-1.0), transport="tcp")
            after = (await engine.generate(PROMPTS[1], Sampling(temperature=0.0, max_new_tokens=6)))[0]
            return reply, seq, after

        try:
            reply, seq, after = asyncio.run(run())
        finally:
            engine.stop()
        assert state(url)["cache_flushes"] == 1 and engine.last_update["in_place"] >= 2
    changed = {LAYER: -original[LAYER], QKV: 2.0 * original[QKV]}
    assert seq.versions == [1] * len(seq.output_ids) and after.versions == [1] * len(after.output_ids)
    assert seq.logprobs == pytest.approx(expected_logprobs(str(tiny_qwen3), seq, 0.0, {1: changed}), abs=1e-4)
    assert after.output_ids == seq.output_ids, "the abandoned update left the weights of version 1 whole"
    assert not list((tmp_path / "results").iterdir()), "every result read and removed"


def test_lora_adapters_alone_travel_and_the_worker_merges_them(tiny_qwen3, tmp_path):
    """trainer lora.sync adapter into SGLang's worker: the update moves the adapters' bytes only; the worker rebuilds
    every parameter they touch (fused qkv_proj / gate_up_proj included) from the checkpoint's base plus
    (B @ A) * alpha / r and generates what peft's merged model gives."""
    import copy

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from services.rollout.engines.lora_merge import AdapterConfig
    from services.trainer.lora import adapter_tensors
    from services.weight_exchange.bench.local import engine_receiver, local_exchange

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3), dtype=torch.float32).eval()
    peft_model = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    adapters = adapter_tensors(peft_model)
    with torch.no_grad():
        for name, t in adapters.items():
            if ".lora_B." in name:
                t.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    merged = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    changed = {n: merged[n] for n in merged if any(f".{t}." in n for t in targets)}
    with double(str(tiny_qwen3), custom_loader=True) as url:
        engine = engine_for(url, str(tiny_qwen3), weight_sync="worker", results_dir=str(tmp_path), control_timeout=60)
        engine.take_adapters(AdapterConfig(r=4, alpha=8.0, target_modules=targets))
        engine.start()
        assert {s.local_name for s in engine.receiver_shards} == set(adapters)

        async def run():
            async with local_exchange(adapters, engine_receiver(engine)) as wx:
                reply = await wx.update(1, transport="tcp")
            seq = (await engine.generate(PROMPTS[1], Sampling(temperature=0.0, max_new_tokens=6)))[0]
            return reply, seq

        try:
            reply, seq = asyncio.run(run())
        finally:
            engine.stop()
    assert reply.bytes_moved == sum(t.numel() * 4 for t in adapters.values())
    assert engine.last_update["in_place"] == 2 * 4   # per layer: qkv_proj, o_proj, gate_up_proj, down_proj
    assert seq.logprobs == pytest.approx(expected_logprobs(str(tiny_qwen3), seq, 0.0, {1: changed}), abs=1e-4)


def test_a_server_without_the_loader_is_named(tiny_qwen3, tmp_path):
    with double(str(tiny_qwen3)) as url:
        engine = engine_for(url, str(tiny_qwen3), weight_sync="worker", results_dir=str(tmp_path))
        with pytest.raises(RuntimeError, match="Unknown load_format"):
            engine.start()
        engine.stop()


# a server that does not answer --------------------------------------------------------------------------------------

@pytest.fixture
def silent_server():
    """Accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held, stop = [], threading.Event()

    def accept():
        listener.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join(5)
    for conn in held:
        conn.close()
    listener.close()


def test_a_server_that_does_not_answer_fails_within_the_timeouts(silent_server, tiny_qwen3):
    engine = engine_for(silent_server, str(tiny_qwen3), startup_timeout=1.5, request_timeout=1.0,
                        control_timeout=1.0)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="engine.sglang.startup_timeout"):
        engine.start()
    assert time.monotonic() - started < 10

    async def run():
        started = time.monotonic()
        seqs = await asyncio.wait_for(engine.generate(PROMPTS[0], Sampling(max_new_tokens=4)), 10)
        assert seqs[0].finish_reason == "abort" and time.monotonic() - started < 5   # redelivered, not dead-lettered
        with pytest.raises(Exception) as info:
            await asyncio.wait_for(engine.pause_async(), 10)
        assert not isinstance(info.value, TimeoutError) or "wait_for" not in str(info.value)
        assert not engine.paused

    try:
        asyncio.run(run())
    finally:
        engine.stop()
