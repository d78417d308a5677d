"""The typed grading envelope: what a dataset builds reaches verifiers unchanged; a bad value fails where it is built."""

import pytest

from services.builder.datasets import Task
from services.builder.tasks import grading_of
from services.common import grading
from services.common.contracts import data_pb2

TASK = {"answer": "42", "question": "6*7?", "verifier": "regex", "extract": "tag",
        "verifier_options": {"pattern": r"(\d+)", "casefold": True},
        "shaping": [{"name": "length", "max_chars": 10, "weight": 0.5}, {"name": "format"}],
        "rg_entry": {"question": "q", "answer": "a", "metadata": {"n": 3}}, "row": {"difficulty": 2},
        "tests": "assert f(1) == 2", "entry_point": "f", "eval_round": 4}


def test_a_task_crosses_the_wire_and_reads_back_as_the_same_map():
    sent = grading.to_proto(TASK)
    back = grading.to_task(data_pb2.Grading.FromString(sent.SerializeToString()))
    assert back == TASK
    assert sent.verifier == "regex" and sent.eval_round == 4 and [t.name for t in sent.shaping] == ["length", "format"]
    assert grading.eval_round(sent) == 4 and grading.eval_round(data_pb2.Grading()) == -1


def test_a_verifiers_own_keys_travel_in_extra_and_never_shadow_the_typed_ones():
    sent = grading.to_proto({"answer": "1", "tests": "assert True"})
    assert sent.extra and sent.answer == "1"
    forged = data_pb2.Grading(answer="1", extra=grading.to_proto({"x": {"answer": "2"}}).extra)
    assert grading.to_task(forged)["answer"] == "1"


@pytest.mark.parametrize("task, field", [
    ({"answer": 42}, "grading.answer: must be a string"),
    ({"verifier_options": "fast"}, "grading.verifier_options: must be a map"),
    ({"shaping": {"name": "format"}}, "grading.shaping: must be a list"),
    ({"shaping": [{"weight": 1}]}, r"grading.shaping\[0\]: must be a map with a string name"),
    ({"eval_round": "1"}, "grading.eval_round: must be an integer"),
    ({"row": {"when": object()}}, "grading.row: cannot be serialised"),
])
def test_a_bad_value_is_refused_where_the_message_is_built_naming_the_key(task, field):
    with pytest.raises(ValueError, match=field):
        grading.to_proto(task)


@pytest.mark.parametrize("part", ["verifier_options", "rg_entry", "row", "extra"])
def test_a_part_that_is_not_a_msgpack_map_is_refused_naming_it(part):
    with pytest.raises(ValueError, match=f"grading.{part}: "):
        grading.to_task(data_pb2.Grading(**{part: b"\xc1"}))
    with pytest.raises(ValueError, match=f"grading.{part}: must be a msgpack map"):
        grading.to_task(data_pb2.Grading(**{part: b"\x91\x01"}))


def test_the_builder_sends_the_tasks_answer_question_and_metadata():
    task = Task(task_id="t", prompt="What is 6*7?", answer="42", metadata={"verifier": "math", "extract": "last_number"})
    sent = grading_of(task, eval_round=2)
    assert grading.to_task(sent) == {"answer": "42", "question": task.question, "verifier": "math",
                                     "extract": "last_number", "eval_round": 2}
    assert not grading_of(task).HasField("eval_round")
