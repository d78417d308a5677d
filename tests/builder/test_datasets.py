import math_verify
import pytest

from services.builder.datasets import Task, demonstration, extract_answer, generate_split


def _verify(reference: str, completion: str) -> bool:
    extracted = extract_answer(completion)
    if extracted is None:
        return False
    return bool(math_verify.verify(math_verify.parse(reference), math_verify.parse(extracted)))


def test_splits_are_disjoint_and_deterministic():
    train = generate_split("train", 2000, seed=0)
    evals = generate_split("eval", 200, seed=0)
    assert len(train) == 2000 and len(evals) == 200
    assert {t.prompt for t in train}.isdisjoint({t.prompt for t in evals})
    assert len({t.task_id for t in train}) == 2000
    assert generate_split("train", 2000, seed=0) == train
    assert generate_split("eval", 200, seed=0) == evals
    assert generate_split("eval", 200, seed=1) != evals
    # a different seed still never crosses splits
    assert {t.prompt for t in generate_split("train", 2000, seed=1)}.isdisjoint({t.prompt for t in evals})


def test_bad_split_names_the_argument():
    with pytest.raises(ValueError, match="split"):
        generate_split("test", 10, seed=0)


def test_demonstrations_verify_and_wrong_answers_are_rejected():
    for t in generate_split("eval", 50, seed=0):
        assert isinstance(t, Task)
        assert _verify(t.answer, demonstration(t))
        assert not _verify(t.answer, str(int(t.answer) + 1))
        assert not _verify(t.answer, "no number here")


def test_extract_answer_takes_the_last_integer():
    assert extract_answer("47") == "47"
    assert extract_answer("12+35=47") == "47"
    assert extract_answer("the answer is 108.") == "108"
    assert extract_answer("") is None
