"""FieldError carries its field to every edge; nested configs name it from the top without parsing text."""

import pickle

import pytest

from services.common.config import ConfigError, build_config
from services.common.errors import FieldError, field_error
from services.rollout.config import RolloutConfig
from services.rollout.engines.base import check_request
from services.rollout.engines.sequence import Sampling


def test_a_field_error_reads_as_field_colon_problem_and_survives_pickling():
    exc = FieldError("grading.answer", "missing")
    assert str(exc) == "grading.answer: missing" and isinstance(exc, ValueError)
    back = pickle.loads(pickle.dumps(exc))
    assert (back.field, back.problem, str(back)) == ("grading.answer", "missing", "grading.answer: missing")


def test_within_names_the_field_from_the_top_once():
    assert FieldError("algo", "unknown").within("services.trainer").field == "services.trainer.algo"
    assert FieldError("engine.dtype", "bad").within("services.rollout.engine").field == "services.rollout.engine.dtype"
    assert FieldError("x", "bad").within("").field == "x"
    assert str(FieldError("", "a run needs a model")) == "a run needs a model"  # a problem of no one field


def test_a_foreign_value_error_is_read_for_a_field_only_when_it_names_one():
    assert field_error(ValueError("n: must be >= 1")).field == "n"
    assert field_error(ValueError("something broke: badly")) is None
    own = FieldError("a", "b")
    assert field_error(own) is own


def test_a_nested_config_check_arrives_as_a_config_error_with_the_full_path():
    with pytest.raises(ConfigError) as info:
        build_config(RolloutConfig, {"engine": {"dtype": "float8"}}, "services.rollout")
    assert info.value.field == "services.rollout.engine.dtype", str(info.value)


def test_the_engines_request_check_raises_field_errors():
    with pytest.raises(FieldError) as info:
        check_request([], Sampling(), 1, max_context=16, vocab_size=10)
    assert (info.value.field, info.value.problem) == ("prompt_ids", "empty")
