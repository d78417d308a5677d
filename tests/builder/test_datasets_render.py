"""Prompt rendering (chat template or raw) and the prompt work a dataset task becomes."""

from __future__ import annotations

import json

import pytest
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from services.builder.config import BuilderConfig
from services.builder.datasets import DatasetConfig, Task, generate_split
from services.builder.datasets.render import chat_messages
from services.builder.server import Builder
from services.builder.tasks import make_work
from services.common import grading
from services.common.contracts import data_pb2
from services.trainer.models.tiny_qwen3 import CHAT_TEMPLATE, build_tokenizer

SYSTEM = "You are a careful solver."
FEW_SHOT = [{"prompt": "What is 1+1?", "answer": "2"}, {"prompt": "What is 2+3?", "answer": "5"}]


def bpe_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A small BPE tokenizer with merges (unlike the character-level tiny one), trained here, offline."""
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    corpus = ["What is the sum of 12 and 30? The answer is 42.", "You are a careful solver.", "system user assistant"]
    tok.train_from_iterator(corpus * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=[
        "[UNK]", "<|endoftext|>", "<|im_start|>", "<|im_end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                                additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


TOKENIZERS = {"tiny": build_tokenizer, "bpe": bpe_tokenizer}


def reference_ids(tok, messages) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if isinstance(out, dict | transformers.BatchEncoding) else out)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_chat_rendering_equals_apply_chat_template(name, tmp_path):
    tok = TOKENIZERS[name]()
    rows = [{"prompt": "What is the sum of 12 and 30?", "answer": "42"},
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                          {"role": "user", "content": "What is 7+8?"}], "answer": "15"},
            {"messages": [{"role": "system", "content": "Own system."}, {"role": "user", "content": "1+2?"}],
             "answer": "3"}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for system, few_shot in (("", []), (SYSTEM, FEW_SHOT)):
        config = DatasetConfig.from_mapping({"train": str(path), "eval": str(path), "system_prompt": system,
                                             "few_shot": few_shot})
        encode = config.encoder(tok)
        prompt, chat, own_system = config.build(seed=0, train_size=0, eval_size=0).train
        expected = ([{"role": "system", "content": system}] if system else []) + [
            m for ex in few_shot for m in ({"role": "user", "content": ex["prompt"]},
                                           {"role": "assistant", "content": ex["answer"]})]
        assert encode(prompt) == reference_ids(tok, [*expected, {"role": "user", "content": prompt.prompt}])
        assert encode(chat) == reference_ids(tok, [*expected, *rows[1]["messages"]])
        assert encode(own_system) == reference_ids(tok, [rows[2]["messages"][0], *expected[1 if system else 0:],
                                                         rows[2]["messages"][1]])


def test_the_arithmetic_default_stays_raw():
    tok = build_tokenizer()
    config = BuilderConfig()
    assert not config.dataset.chat
    task = generate_split("train", 1, seed=0)[0]
    assert config.dataset.encoder(tok)(task) == tok.encode(task.prompt, add_special_tokens=False)


def test_raw_rendering_concatenates_system_few_shot_and_prompt():
    tok = build_tokenizer()
    config = DatasetConfig.from_mapping({"render": "raw", "system_prompt": "Add.\n",
                                         "few_shot": [{"prompt": "1+1=", "answer": "2\n"}]})
    task = Task(task_id="t", prompt="3+4=", answer="7")
    assert config.encoder(tok).text(task) == "Add.\n1+1=2\n3+4="


def test_raw_cannot_render_messages_and_chat_needs_a_template(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}], "answer": "y"}) + "\n")
    with pytest.raises(ValueError, match="render: 'raw' cannot render task"):
        DatasetConfig.from_mapping({"train": str(path), "eval": str(path), "render": "raw"}).build(
            seed=0, train_size=0, eval_size=0)
    tok = build_tokenizer()
    tok.chat_template = None
    with pytest.raises(ValueError, match="dataset.render: 'chat' but the model's tokenizer has no chat template"):
        DatasetConfig.from_mapping({"render": "chat"}).encoder(tok)
    with pytest.raises(ValueError, match="render: must be one of"):
        DatasetConfig.from_mapping({"render": "markdown"})


def test_chat_messages_put_few_shot_after_the_system_prompt():
    task = Task(task_id="t", prompt="q", answer="a")
    assert [m["role"] for m in chat_messages(task, system_prompt="s", few_shot=FEW_SHOT[:1])] == [
        "system", "user", "assistant", "user"]


def test_prompt_work_carries_the_grading_contract(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"q": "Name it", "a": "x", "check": "exact", "metadata": {"id": 7}}) + "\n"
                    + json.dumps({"q": "Count", "a": 3}) + "\n")
    config = DatasetConfig.from_mapping({"train": str(path), "eval": str(path), "prompt_field": "q",
                                         "answer_field": "a", "verifier_field": "check", "verifier": "regex",
                                         "verifier_options": {"pattern": r"answer: (\w+)"},
                                         "shaping": [{"name": "format", "weight": 0.2}]})
    tok = build_tokenizer()
    encode = config.encoder(tok)
    own, default = config.build(seed=0, train_size=0, eval_size=0).eval
    work = make_work(own, work_id="eval-0-0", group_id="eval-0-0", group_size=1, encode=encode,
                     sampling=data_pb2.SamplingParams(), version=0, split="eval", issued_at=0.0,
                     eval_round=0)
    assert list(work.prompt_ids) == encode(own)
    assert work.grading.verifier == "exact" and work.grading.eval_round == 0
    assert grading.to_task(work.grading) == {
        "answer": "x", "question": "Name it", "verifier": "exact", "verifier_options": {"pattern": r"answer: (\w+)"},
        "shaping": [{"name": "format", "weight": 0.2}], "row": {"id": 7}, "eval_round": 0}
    meta = grading.to_task(make_work(default, work_id="g-0", group_id="g-0", group_size=2, encode=encode,
                                     sampling=data_pb2.SamplingParams(), version=0, split="train",
                                     issued_at=0.0).grading)
    assert meta["answer"] == "3" and meta["verifier"] == "regex" and "row" not in meta


def test_the_builder_issues_from_the_configured_dataset_and_counts_filtered_rows(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"question": "x" * n, "answer": "1"}) + "\n" for n in (1, 2, 50, 3, 60)))
    config = BuilderConfig(dataset=DatasetConfig.from_mapping({
        "train": str(path), "eval": str(path), "prompt_field": "question", "render": "raw",
        "max_prompt_tokens": 10}))
    builder = Builder(config, None, lambda task: list(range(len(task.prompt))), [0])
    assert builder.prompts_filtered == {"train": 2, "eval": 2}
    assert sorted(len(t.prompt) for t in builder.eval_tasks) == [1, 2, 3]
    assert {len(next(builder.train).prompt) for _ in range(30)} == {1, 2, 3}
