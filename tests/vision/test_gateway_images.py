"""An agent shows the policy pictures through the gateway, unchanged: the official openai SDK's ``image_url`` parts
(data URLs) and the anthropic SDK's base64 ``image`` blocks reach the embedded engine as pixels; the exported
trajectory names its images by digest, stored at the export, and its sampled tokens' log-probs are the trainer's
for those pictures (a second turn with another picture included). A text-only policy and a URL to fetch are refused
with 400s naming the field.

The image store here is an in-memory stand-in with ImageStore's `put`; the store itself runs against a real
nats-server in test_image_store.py."""

from __future__ import annotations

import base64

import pytest
import torch
from anthropic import Anthropic
from openai import BadRequestError, OpenAI
from transformers import AutoTokenizer

from services.common.hf_models import Pixels, load_lm
from services.common.images import ref_of
from services.rollout.engines.torch_engine import EngineConfig
from services.rollout.gateway.images import Vision
from services.trainer.batching import pack
from services.trainer.forward import frozen_logp
from tests.gateway.harness import GatewayServer


class MemoryImages:
    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}

    async def put(self, blob: bytes):
        ref = ref_of(blob)
        self.blobs[ref.sha256] = blob
        return ref


def data_url(blob: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(blob).decode()


@pytest.fixture
def vlm_gateway(vlm_dir):
    engine = EngineConfig(model_path=vlm_dir, max_batch=8).build()
    tokenizer = AutoTokenizer.from_pretrained(vlm_dir)
    token = tokenizer.convert_tokens_to_ids("<image>")
    store = MemoryImages()
    vision = Vision(token_text="<image>", token_id=token, per_image=engine.image_slots[1], pixels=Pixels(vlm_dir),
                    store=store)
    server = GatewayServer(engine, tokenizer, vision=vision, default_max_tokens=4).start()
    server.store = store
    yield server
    server.stop()


def end(gw, session) -> list:
    assert gw.session_post(session["api_key"], "/rl/set_reward", {"reward": 1.0}).status_code == 200
    assert gw.session_post(session["api_key"], "/rl/end_session").status_code == 200
    return [t for t in gw.published if t.work_id == session["session_id"]]


def test_openai_and_anthropic_images_reach_the_policy_and_the_trainer(vlm_gateway, vlm_dir, pictures):
    gw = vlm_gateway
    s = gw.start_session(task_id="count-1")
    client = OpenAI(base_url=gw.url + "/v1", api_key=s["api_key"], max_retries=0)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(pictures[0])}},
                                             {"type": "text", "text": "How many shapes?"}]}]
    reply = client.chat.completions.create(model="m", messages=messages, max_tokens=3).choices[0].message
    messages += [reply.model_dump(exclude_none=True),
                 {"role": "user", "content": [{"type": "text", "text": "And here?"},
                                              {"type": "image_url", "image_url": {"url": data_url(pictures[1])}}]}]
    client.chat.completions.create(model="m", messages=messages, max_tokens=3)
    (traj,) = end(gw, s)
    refs = [ref_of(pictures[0]), ref_of(pictures[1])]
    assert list(traj.images) == refs and set(gw.store.blobs) == {r.sha256 for r in refs}
    token, per_image = gw.engine.image_slots
    assert list(traj.prompt_ids).count(token) == per_image  # the first turn's picture ...
    assert list(traj.completion_ids).count(token) >= per_image  # ... and the second, inside the later turn
    model = load_lm(vlm_dir, torch.float32)
    pixels = dict(zip((r.sha256 for r in refs), Pixels(vlm_dir)(pictures[:2]), strict=True))
    batch = pack([traj], pad_token_id=256, pixels=pixels)
    cells = batch.loss_mask.bool()
    torch.testing.assert_close(frozen_logp(model, batch, 1.0)[cells], batch.behav_logp[cells], atol=2e-4, rtol=0)

    s = gw.start_session(task_id="count-2")
    Anthropic(base_url=gw.url, api_key=s["api_key"], max_retries=0).messages.create(
        model="m", max_tokens=3, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(pictures[2]).decode()}},
            {"type": "text", "text": "How many shapes?"}]}])
    (traj,) = end(gw, s)
    assert list(traj.images) == [ref_of(pictures[2])]


def test_urls_to_fetch_and_reserved_characters_are_refused_naming_the_field(vlm_gateway):
    s = vlm_gateway.start_session(task_id="count-3")
    client = OpenAI(base_url=vlm_gateway.url + "/v1", api_key=s["api_key"], max_retries=0)
    with pytest.raises(BadRequestError, match=r"messages\[0\]\.content\[0\]\.image_url\.url: images are never fetched"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}])
    with pytest.raises(BadRequestError, match=r"messages\[0\]\.content: holds U\+E000"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a \ue000 b"}])


def test_a_text_policy_refuses_images(tiny_qwen3, pictures):
    engine = EngineConfig(model_path=str(tiny_qwen3), max_batch=4).build()
    gw = GatewayServer(engine, AutoTokenizer.from_pretrained(tiny_qwen3)).start()
    try:
        s = gw.start_session(task_id="count-4")
        client = OpenAI(base_url=gw.url + "/v1", api_key=s["api_key"], max_retries=0)
        with pytest.raises(BadRequestError, match="messages: holds images, and the policy is text-only"):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url(pictures[0])}}]}])
    finally:
        gw.stop()
