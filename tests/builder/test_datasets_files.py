"""Dataset sources read from files: JSONL, Parquet, save_to_disk directories; field mapping, splits, errors."""

from __future__ import annotations

import json

import pytest

from services.builder.config import BuilderConfig
from services.builder.datasets import DatasetConfig
from services.common.config import ConfigError, load_config


def write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def qa_rows(n: int, start: int = 0) -> list[dict]:
    return [{"question": f"What is {i}+{i}?", "answer": 2 * i} for i in range(start, start + n)]


def build(**fields):
    return DatasetConfig.from_mapping(fields).build(seed=0, train_size=10, eval_size=5)


def test_the_readme_config_reads_two_jsonl_files(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", qa_rows(6))
    evals = write_jsonl(tmp_path / "eval.jsonl", qa_rows(3, start=100))
    config = DatasetConfig.from_mapping({"train": train, "eval": evals, "prompt_field": "question",
                                         "answer_field": "answer", "verifier": "math"})
    assert config.kind == "jsonl" and config.chat
    data = config.build(seed=0, train_size=0, eval_size=0)
    assert [t.prompt for t in data.train] == [r["question"] for r in qa_rows(6)]
    assert [t.answer for t in data.eval] == ["200", "202", "204"]
    assert data.train[0].metadata == {"verifier": "math"}
    ids = [t.task_id for t in data.train + data.eval]
    assert len(set(ids)) == len(ids)


def test_rows_carry_their_own_verifier_messages_and_metadata(tmp_path):
    rows = [{"prompt": "Say hi", "answer": "hi", "verifier": "exact", "metadata": {"level": 2, "tags": ["a"]}},
            {"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}],
             "answer": "4"}]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    data = build(train=path, eval=path, verifier="regex", verifier_options={"pattern": r"(\w+)"},
                 shaping=[{"name": "format", "weight": 0.1}], extract="tag")
    first, second = data.train
    assert first.metadata == {"verifier": "exact", "verifier_options": {"pattern": r"(\w+)"},
                              "shaping": [{"name": "format", "weight": 0.1}], "extract": "tag",
                              "row": {"level": 2, "tags": ["a"]}}
    assert second.messages[-1] == {"role": "user", "content": "2+2?"} and second.metadata["verifier"] == "regex"


def test_field_names_are_mappable(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"q": "x?", "a": "y", "check": "exact", "info": {"k": 1}}])
    data = build(train=path, eval=path, prompt_field="q", answer_field="a", verifier_field="check",
                 metadata_field="info")
    assert (data.train[0].prompt, data.train[0].answer) == ("x?", "y")
    assert data.train[0].metadata == {"verifier": "exact", "row": {"k": 1}}


def test_a_bad_json_line_names_the_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [qa_rows(1)[0], '{"question": "oops", ', qa_rows(1)[0]])
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not valid JSON"):
        build(train=path, eval=path, prompt_field="question")


@pytest.mark.parametrize(("row", "match"), [
    ({"question": "q"}, r"x\.jsonl:3: missing field 'answer'"),
    ({"answer": "a"}, r"x\.jsonl:3: missing field 'question' \(or 'messages'\)"),
    ({"question": 5, "answer": "a"}, r"x\.jsonl:3: field 'question' must be a string"),
    ({"question": "q", "answer": ["a"]}, r"x\.jsonl:3: field 'answer' must be a string or a number"),
    ({"messages": [{"role": "bot", "content": "x"}], "answer": "a"}, r"x\.jsonl:3: field messages\[0\]"),
    ({"question": "q", "answer": "a", "verifier": 3}, r"x\.jsonl:3: field 'verifier'"),
    ([1, 2], r"x\.jsonl:3: a row must be a JSON object"),
])
def test_a_bad_row_names_file_line_and_field(tmp_path, row, match):
    path = write_jsonl(tmp_path / "x.jsonl", [*qa_rows(1), "", row])  # the blank line still counts
    with pytest.raises(ValueError, match=match):
        build(train=path, eval=path, prompt_field="question")


def test_unknown_source_and_unknown_key_stop_start_up(tmp_path):
    with pytest.raises(ValueError, match="source: unknown 'csv'"):
        DatasetConfig.from_mapping({"source": "csv", "train": "t.csv"})
    with pytest.raises(ValueError, match="dataset.promt_field: unknown key"):
        DatasetConfig.from_mapping({"train": "t.jsonl", "eval": "e.jsonl", "promt_field": "q"})
    with pytest.raises(ValueError, match="cannot tell the source"):
        DatasetConfig.from_mapping({"train": "t.csv", "eval": "e.csv"})
    cfg = tmp_path / "builder.yaml"
    cfg.write_text("dataset:\n  train: t.jsonl\n  eval: e.jsonl\n  bogus: 1\n")
    with pytest.raises(ConfigError, match="builder.dataset.bogus: unknown key"):
        load_config(BuilderConfig, "builder", path=cfg, env={})
    with pytest.raises(ValueError, match="no such file"):
        build(train=str(tmp_path / "missing.jsonl"), eval=str(tmp_path / "missing.jsonl"))


def test_an_eval_split_is_required_and_exclusive(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", qa_rows(4))
    with pytest.raises(ValueError, match="eval: required"):
        build(train=path, prompt_field="question")
    with pytest.raises(ValueError, match="eval_fraction: set with eval"):
        DatasetConfig.from_mapping({"train": path, "eval": path, "eval_fraction": 0.5})


def test_the_builder_config_takes_a_dataset_mapping(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", qa_rows(4))
    cfg = tmp_path / "builder.yaml"
    cfg.write_text("dataset:\n  train: t.jsonl\n  eval_fraction: 0.25\n  prompt_field: question\n")
    config = load_config(BuilderConfig, "builder", path=cfg, env={"MESHRL_BUILDER__DATASET__TRAIN": path})
    assert config.dataset.train == path and config.dataset.eval_fraction == 0.25
    assert BuilderConfig().dataset.kind == "arithmetic"
    rel = DatasetConfig.from_mapping({"train": "t.jsonl", "eval": "t.jsonl"}, base_dir=tmp_path)
    assert rel.train == path


def test_held_out_fraction_is_deterministic_and_disjoint(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", qa_rows(40))
    first = build(train=path, eval_fraction=0.25, prompt_field="question")
    again = build(train=path, eval_fraction=0.25, prompt_field="question")
    other = build(train=path, eval_fraction=0.25, prompt_field="question", split_seed=1)
    assert (len(first.train), len(first.eval)) == (30, 10)
    assert first == again and first.eval != other.eval
    assert {t.task_id for t in first.train}.isdisjoint({t.task_id for t in first.eval})
    with pytest.raises(ValueError, match="eval_fraction"):
        build(train=write_jsonl(tmp_path / "one.jsonl", qa_rows(1)), eval_fraction=0.5, prompt_field="question")


def test_eval_limit_caps_the_eval_rows(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", qa_rows(8))
    assert len(build(train=path, eval=path, prompt_field="question", eval_limit=3).eval) == 3


def test_the_length_filter_counts_what_it_drops(tmp_path):
    rows = [{"question": "x" * n, "answer": "1"} for n in (1, 5, 10, 20)]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    data = build(train=path, eval=path, prompt_field="question")
    kept = data.filtered(lambda t: len(t.prompt), 10)
    assert [len(t.prompt) for t in kept.train] == [1, 5, 10] and kept.dropped == {"train": 1, "eval": 1}
    assert data.filtered(lambda t: 1 / 0, 0).dropped == {"train": 0, "eval": 0}  # 0: nothing counted
    with pytest.raises(ValueError, match="max_prompt_tokens: every train prompt is longer than 10"):
        data.filtered(lambda t: 100, 10)


def test_parquet_round_trip(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"question": "q1", "answer": "a1", "metadata": {"k": 1}}, {"question": "q2", "answer": "a2",
                                                                        "metadata": {"k": 2}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    data = build(train=str(tmp_path / "train.parquet"), eval=str(tmp_path / "train.parquet"), prompt_field="question")
    assert [(t.prompt, t.answer, t.metadata["row"]) for t in data.train] == [("q1", "a1", {"k": 1}),
                                                                              ("q2", "a2", {"k": 2})]
    pq.write_table(pa.Table.from_pylist([{"question": "q"}]), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"bad\.parquet:row 1: missing field 'answer'"):
        build(train=str(tmp_path / "bad.parquet"), eval=str(tmp_path / "bad.parquet"), prompt_field="question")
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match="junk.parquet: not a readable Parquet file"):
        build(train=str(tmp_path / "junk.parquet"), eval=str(tmp_path / "junk.parquet"))


def test_save_to_disk_round_trip(tmp_path):
    import datasets

    single = tmp_path / "single"
    datasets.Dataset.from_list(qa_rows(3)).save_to_disk(str(single))
    data = build(train=str(single), eval=str(single), prompt_field="question")
    assert [t.answer for t in data.train] == ["0", "2", "4"]
    split = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(qa_rows(4)),
                          "test": datasets.Dataset.from_list(qa_rows(2, start=50))}).save_to_disk(str(split))
    data = build(train=str(split), prompt_field="question")  # the eval split comes from the same directory
    assert (len(data.train), [t.answer for t in data.eval]) == (4, ["100", "102"])
    with pytest.raises(ValueError, match="has no split 'validation'"):
        build(train=str(split), eval=str(split), eval_split="validation", prompt_field="question")
