"""A vision-language policy (the tiny LLaVA) through the embedded engine and the trainer's forwards: the engine's
log-probs are the trainer's (padded and packed) for the same pictures, and other pictures change them; prompts with
the same tokens over different pictures are never merged (the engine's shared prefill, its prefix cache, the
trainer's shared prompts); a placeholder token the policy samples stays a token; requests whose placeholders and
images disagree are refused naming the field; gradients reach the vision tower."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.common.contracts import data_pb2
from services.common.hf_models import Pixels, image_embeds, load_lm
from services.common.images import ref_of
from services.rollout.engines.sequence import Images, Sampling
from services.rollout.engines.torch_engine import EngineConfig
from services.trainer.batching import pack
from services.trainer.forward import frozen_logp, policy_logp
from services.trainer.packing import PackingConfig, packed_forwards
from tests.vision.vlm import images_of, prompt_ids

DEADLINE = 300.0


def generate(engine, requests: list[tuple[list[int], Images | None]], n: int, new: int = 6) -> list:
    async def run():
        sampling = Sampling(temperature=1.0, max_new_tokens=new, ignore_eos=True)
        return await asyncio.gather(*(engine.generate(p, sampling, n=n, images=im) for p, im in requests))
    return [seq for group in asyncio.run(asyncio.wait_for(run(), DEADLINE)) for seq in group]


def trajectories(seqs: list, blobs: list[bytes]) -> list[data_pb2.Trajectory]:
    return [data_pb2.Trajectory(
        trajectory_id=f"t{i}", group_id=f"g{i // 2}", prompt_ids=s.prompt_ids, completion_ids=s.output_ids,
        behavior_logprobs=s.logprobs, versions=s.versions, loss_mask=[1] * len(s.output_ids), reward=float(i % 2),
        images=[ref_of(blobs[i // 2])]) for i, s in enumerate(seqs)]


def test_engine_log_probs_are_the_trainers_for_the_same_pictures(vlm_dir, pictures):
    engine = EngineConfig(model_path=vlm_dir, max_batch=16, prefix_cache_mb=64).build()
    engine.start()
    try:
        blobs = pictures[:2]
        ids = prompt_ids(vlm_dir, blobs[0])
        assert ids == prompt_ids(vlm_dir, blobs[1])  # the same tokens: only the pictures tell the prompts apart
        seqs = generate(engine, [(ids, images_of(vlm_dir, [b])) for b in blobs], n=2)
        assert engine.runner.prefilled_contexts == 2  # one shared prefill per picture, not one for both
        assert engine.runner.prefix is not None and len(engine.runner.prefix) == 0  # pictures are never cached
    finally:
        engine.stop()
    model = load_lm(vlm_dir, torch.float32)
    pixels = dict(zip((ref_of(b).sha256 for b in blobs), Pixels(vlm_dir)(blobs), strict=True))
    batch = pack(trajectories(seqs, blobs), pad_token_id=256, pixels=pixels)
    assert batch.image_group.tolist() == [1, 1, 2, 2]
    cells = batch.loss_mask.bool()
    behaviour = batch.behav_logp[cells]
    padded = frozen_logp(model, batch, 1.0)[cells]
    with packed_forwards(PackingConfig(enabled=True)):
        packed = frozen_logp(model, batch, 1.0)[cells]
    torch.testing.assert_close(padded, behaviour, atol=2e-4, rtol=0)
    torch.testing.assert_close(packed, behaviour, atol=2e-4, rtol=0)
    # the pictures swapped between the groups: the same tokens get other log-probs
    swapped = pack(trajectories(seqs, blobs[::-1]), pad_token_id=256, pixels=pixels)
    assert (frozen_logp(model, swapped, 1.0)[cells] - behaviour).abs().max() > 1e-3


def test_a_sampled_placeholder_stays_a_token_and_mismatched_requests_are_refused(vlm_dir, pictures):
    model = load_lm(vlm_dir, torch.float32).eval()
    token = model.config.image_token_id
    ids = prompt_ids(vlm_dir, pictures[0])
    longer = torch.tensor([ids + [token, 65]])
    pixels = Pixels(vlm_dir)(pictures[:1])
    with torch.no_grad():
        embeds = image_embeds(model, longer, pixels, torch.tensor([1]))
        own = model(input_ids=torch.tensor([ids]), pixel_values=pixels).logits
        ours = model(inputs_embeds=embeds).logits
    torch.testing.assert_close(ours[:, :len(ids)], own, atol=1e-5, rtol=0)  # the prompt as the model places it
    torch.testing.assert_close(embeds[0, len(ids)], model.get_input_embeddings().weight[token])  # a plain token
    engine = EngineConfig(model_path=vlm_dir, max_batch=4).build()
    sampling = Sampling(max_new_tokens=2)
    with pytest.raises(ValueError, match="images: 0 image"):
        engine.check(ids, sampling)
    with pytest.raises(ValueError, match="images: 2 image"):
        engine.check(ids, sampling, images=images_of(vlm_dir, pictures[:2]))
    engine.check(ids, sampling, images=images_of(vlm_dir, pictures[:1]))


def test_a_text_engine_refuses_images(tiny_qwen3, vlm_dir, pictures):
    engine = EngineConfig(model_path=str(tiny_qwen3), max_batch=4).build()
    with pytest.raises(ValueError, match="images: this engine's model takes no images"):
        engine.check([65, 66], Sampling(max_new_tokens=2), images=images_of(vlm_dir, pictures[:1]))


def test_gradients_reach_the_vision_tower(vlm_dir, pictures):
    model = load_lm(vlm_dir, torch.float32).train()
    ids = prompt_ids(vlm_dir, pictures[0])
    t = data_pb2.Trajectory(trajectory_id="t0", group_id="g0", prompt_ids=ids, completion_ids=[51, 256],
                            behavior_logprobs=[-1.0, -1.0], versions=[0, 0], loss_mask=[1, 1], reward=1.0,
                            images=[ref_of(pictures[0])])
    pixels = {ref_of(pictures[0]).sha256: Pixels(vlm_dir)(pictures[:1])[0]}
    for packed in (False, True):
        model.zero_grad()
        with packed_forwards(PackingConfig(enabled=packed)):
            policy_logp(model, pack([t], 256, pixels=pixels), 1.0).sum().backward()
        tower = model.model.vision_tower.embeddings.patch_embedding.weight.grad
        assert tower is not None and tower.abs().sum() > 0, f"packed={packed}"
    with pytest.raises(ValueError, match="images: trajectory t0 names an image with no pixels"):
        pack([t], 256, pixels={})
