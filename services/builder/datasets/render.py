"""Prompt rendering: through the model's chat template, or raw text.

Chat: [system prompt] + few-shot turns (user: example prompt, assistant: its answer) + the task's user turn
(or the task's own messages, which keep their own system message if they have one), rendered by
``tokenizer.apply_chat_template(..., add_generation_prompt=True)``.
Raw: the texts concatenated as they are (system prompt, then each example's prompt and answer, then the
task's prompt); put separators in the texts themselves.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

from services.builder.datasets.task import Task
from services.common.errors import FieldError


def chat_messages(task: Task, *, system_prompt: str = "",
                  few_shot: Sequence[Mapping[str, str]] = ()) -> list[dict[str, Any]]:
    own = list(task.messages) if task.messages is not None else [{"role": "user", "content": task.prompt}]
    head: list[dict[str, Any]] = []
    if own[0]["role"] == "system":
        head, own = own[:1], own[1:]
    elif system_prompt:
        head = [{"role": "system", "content": system_prompt}]
    for ex in few_shot:
        head += [{"role": "user", "content": ex["prompt"]}, {"role": "assistant", "content": ex["answer"]}]
    return head + own


def raw_text(task: Task, *, system_prompt: str = "", few_shot: Sequence[Mapping[str, str]] = ()) -> str:
    if task.messages is not None:
        raise FieldError("dataset.render", f"'raw' cannot render task {task.task_id} (it has messages); use 'chat'")
    return system_prompt + "".join(ex["prompt"] + ex["answer"] for ex in few_shot) + task.prompt


class PromptEncoder:
    """Task -> prompt token ids, with the tokenizer of the model being trained."""

    def __init__(self, tokenizer, *, chat: bool, system_prompt: str = "",
                 few_shot: Sequence[Mapping[str, str]] = (), processor=None) -> None:
        if chat and not getattr(tokenizer, "chat_template", None):
            raise FieldError("dataset.render", "'chat' but the model's tokenizer has no chat template; "
                             "set render: raw")
        self.tokenizer = tokenizer
        self.chat = chat
        self.system_prompt = system_prompt
        self.few_shot = list(few_shot)
        self.processor = processor  # a vision-language model's: expands each image placeholder to its tokens

    def text(self, task: Task) -> str:
        if not self.chat:
            return raw_text(task, system_prompt=self.system_prompt, few_shot=self.few_shot)
        messages = chat_messages(task, system_prompt=self.system_prompt, few_shot=self.few_shot)
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def __call__(self, task: Task) -> list[int]:
        # what apply_chat_template(tokenize=True) does: the rendered text, without adding special tokens again
        if not task.images:
            return self.tokenizer.encode(self.text(task), add_special_tokens=False)
        if self.processor is None:
            raise FieldError("dataset", f"task {task.task_id} has images but the model takes none (it is not a "
                             "vision-language model)")
        from PIL import Image

        images = [Image.open(io.BytesIO(blob)).convert("RGB") for blob in task.images]
        try:
            out = self.processor(text=[self.text(task)], images=images, add_special_tokens=False)
        except ValueError as exc:  # placeholders and images disagree
            raise FieldError("dataset", f"task {task.task_id}: {exc}") from exc
        return list(out["input_ids"][0])
