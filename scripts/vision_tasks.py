"""The vision-language warm start's curriculum (scripts/bootstrap_model.py --vision): the shape-counting pictures
of services/builder/datasets/shapes.py through the tiny LLaVA's processor, SFT on the count and the end of text,
scored by greedy generation on the held-out pictures as the reward service grades them (the last number)."""

from __future__ import annotations

import io

import torch
from PIL import Image

from services.builder.datasets import shapes
from services.builder.datasets.task import Task


def images_of(tasks: list[Task]) -> list[Image.Image]:
    return [Image.open(io.BytesIO(b)).convert("RGB") for t in tasks for b in t.images]


def sft_inputs(processor, tasks: list[Task]) -> dict[str, torch.Tensor]:
    """Prompt + answer + EOS per task (every prompt has the same length here: no padding), labels on the answer
    and EOS only."""
    tok = processor.tokenizer
    prompts = processor(text=[t.prompt for t in tasks], images=images_of(tasks), return_tensors="pt")
    answers = [tok.encode(t.answer, add_special_tokens=False) + [tok.eos_token_id] for t in tasks]
    width = max(len(a) for a in answers)
    assert all(len(a) == width for a in answers), "answers of one length (a digit) keep the batch unpadded"
    ids = torch.cat([prompts["input_ids"], torch.tensor(answers)], dim=1)
    labels = ids.clone()
    labels[:, :prompts["input_ids"].shape[1]] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
            "pixel_values": prompts["pixel_values"]}


@torch.no_grad()
def greedy_accuracy(model, processor, tasks: list[Task], is_correct, batch: int = 200) -> float:
    tok = processor.tokenizer
    correct = 0
    for s in range(0, len(tasks), batch):
        chunk = tasks[s:s + batch]
        enc = processor(text=[t.prompt for t in chunk], images=images_of(chunk), return_tensors="pt")
        out = model.generate(**enc, max_new_tokens=3, do_sample=False, pad_token_id=tok.eos_token_id)
        texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        correct += sum(is_correct(text, t.answer) for text, t in zip(texts, chunk, strict=True))
    return correct / max(len(tasks), 1)


def splits(seed: int, train_num: int, eval_num: int, size: int) -> tuple[list[Task], list[Task]]:
    return shapes.generate_split("train", train_num, seed, size), shapes.generate_split("eval", eval_num, 0, size)
