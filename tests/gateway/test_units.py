"""The pure modules on their own: tool-call parsing, decoding with stop strings, templates, sessions, export."""

from __future__ import annotations

import asyncio
import random

import pytest

from services.rollout.gateway.chat_format import ChatFormat
from services.rollout.gateway.dedupe import ReplayCache
from services.rollout.gateway.errors import ApiError
from services.rollout.gateway.export import export_session, paths
from services.rollout.gateway.messages import Message, Tool, ToolCall
from services.rollout.gateway.openai_parse import parse_chat
from services.rollout.gateway.outputs import ChoiceDecoder
from services.rollout.gateway.session import (
    Interaction,
    InvalidTransition,
    Session,
    SessionState,
    discounted_returns,
    transcript_key,
)
from services.rollout.gateway.tokens import chat_prompt
from services.rollout.gateway.toolcalls import TextEvent, ToolCallEvent, ToolCallParser, Trim
from tests.gateway.policies import tokenizer

TEXT = ('Sure.  \n<tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\nnot json\n'
        '</tool_call> and <tool_ca then {"name": "b"} <tool_call>{"name":"b","arguments":"{\\"y\\": 2}"}')
SMOL_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def run_parser(chunks: list[str]) -> list:
    ids = iter(range(100))
    parser, trim = ToolCallParser(lambda: f"call_{next(ids)}"), Trim()
    events = []
    for chunk in chunks:
        events += trim.apply(parser.feed(chunk))
    events += trim.apply(parser.finish(), final=True)
    merged: list = []
    for e in events:  # adjacent text events are one piece of text
        if merged and isinstance(e, TextEvent) and isinstance(merged[-1], TextEvent):
            merged[-1] = TextEvent(merged[-1].text + e.text)
        else:
            merged.append(e)
    return merged


def test_tool_call_parsing_does_not_depend_on_chunking():
    whole = run_parser([TEXT])
    calls = [e.call for e in whole if isinstance(e, ToolCallEvent)]
    assert [(c.name, c.arguments) for c in calls] == [("calc", '{"x": 1}'), ("b", '{"y": 2}')]
    text = "".join(e.text for e in whole if isinstance(e, TextEvent))
    assert text.startswith("Sure.") and "<tool_call>\nnot json\n</tool_call>" in text and not text.endswith(" ")
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(TEXT)), rng.randint(1, 30)))
        chunks = [TEXT[a:b] for a, b in zip([0, *cuts], [*cuts, len(TEXT)], strict=True)]
        assert run_parser(chunks) == whole


def test_decoder_cuts_at_stop_strings_and_keeps_the_covering_tokens():
    tok = tokenizer()
    ids = tok.encode("hello world, stop here", add_special_tokens=False)
    for step in (1, 3, len(ids)):
        d = ChoiceDecoder(0, lambda x: tok.decode(x, skip_special_tokens=True), stop=["wor", "zzz"], parse_tools=False,
                          prefix_text="", new_call_id=lambda: "c")
        emitted = ""
        for n in range(step, len(ids) + step, step):
            emitted += "".join(e.text for e in d.update(ids[:n], n >= len(ids)))
            if d.finished:
                break
        r = d.result(ids, [0.0] * len(ids), [0] * len(ids), "length", frozenset({256}))
        assert emitted == r.content == "hello " and r.stop_sequence == "wor"
        assert tok.decode(r.output_ids) == "hello wor" and r.finish_reason == "stop" and not r.ended_on_stop_token


def test_chat_format_probes_the_turn_end_and_falls_back_for_templates_without_tools():
    tok = tokenizer()
    fmt = ChatFormat(tok)
    assert fmt.end_marker == "<|im_end|>" and fmt.template_tools
    assert fmt.stop_token_ids == {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    smol = tokenizer()
    smol.chat_template = SMOL_TEMPLATE
    fmt = ChatFormat(smol)
    assert not fmt.template_tools and fmt.end_marker == "<|im_end|>"
    call = ToolCall("c1", "calc", '{"x": 1}')
    msgs = [Message("user", "hi"), Message("assistant", "", (call,)), Message("tool", "2", tool_call_id="c1")]
    text = fmt.render(msgs, [Tool("calc", "adds", {"type": "object"})])
    assert "<tools>" in text and '<tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n2\n</tool_response><|im_end|>" in text


def test_history_reuses_sampled_ids_only_when_the_template_agrees():
    tok = tokenizer()
    fmt = ChatFormat(tok)
    session = _session()
    first = chat_prompt(fmt, [Message("user", "hi")], [], session)
    sampled = tok.encode("Hi  there", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    _add_chat(session, "a", first, [Message("user", "hi")], sampled, Message("assistant", "Hi  there"))
    follow = [Message("user", "hi"), Message("assistant", "Hi  there "), Message("user", "more")]
    second = chat_prompt(fmt, follow, [], session)
    assert second.parent is not None and second.ids[:len(first.ids) + len(sampled)] == first.ids + sampled
    assert fmt.decode(second.ids).endswith("more\nassistant\n")
    other = chat_prompt(fmt, [Message("system", "new"), *follow], [], session)
    assert other.parent is None  # a different history: no parent, fresh tokens


def test_session_transitions_returns_and_branching_export():
    session = _session()
    with pytest.raises(LookupError):
        session.set_reward(1.0)
    _add_tokens(session, "a", None, [9], [1, 2])
    _add_tokens(session, "b", "a", [9, 1, 2, 7], [3])
    _add_tokens(session, "c", "a", [9, 1, 2, 8], [4, 5])
    session.set_reward(1.0)
    assert discounted_returns(session.interactions, 0.5) == [0.25, 0.5, 1.0]
    assert [[i.id for i in p] for p in paths(session)] == [["a", "c"], ["a", "b"]]
    session.transition(SessionState.ENDED, "ended")
    with pytest.raises(InvalidTransition):
        session.transition(SessionState.ENDED)
    primary, branch = export_session(session, mode="session", gamma=1.0)
    assert list(primary.prompt_ids) == [9] and list(primary.completion_ids) == [1, 2, 8, 4, 5]
    assert list(primary.loss_mask) == [1, 1, 0, 1, 1] and list(primary.versions) == [0, 0, -1, 0, 0]
    assert (primary.group_id, primary.group_size, primary.reward) == ("grp", 2, 1.0)
    assert branch.group_size == 1 and branch.reward == 0.0 and list(branch.completion_ids) == [1, 2, 7, 3]
    session.release()
    assert session.interaction_count == 3 and session.interactions == []


def test_per_turn_rewards_travel_as_process_rewards_on_each_turns_last_token():
    session = _session()
    _add_tokens(session, "a", None, [9], [1, 2])
    _add_tokens(session, "b", "a", [9, 1, 2, 7], [3, 4, 5])
    _add_tokens(session, "c", "b", [9, 1, 2, 7, 3, 4, 5, 6], [8])
    session.set_reward(0.5, "a")
    session.set_reward(2.0, "c")  # turn b gets no reward of its own: no step for it
    session.transition(SessionState.ENDED, "ended")
    (traj,) = export_session(session, mode="session", gamma=1.0)
    assert list(traj.completion_ids) == [1, 2, 7, 3, 4, 5, 6, 8]
    assert [(s.end, s.reward) for s in traj.step_rewards] == [(2, 0.5), (8, 2.0)]
    assert all(traj.loss_mask[s.end - 1] == 1 for s in traj.step_rewards)
    assert traj.reward == 2.5  # the outcome reward stays the turns' discounted sum


async def test_replay_cache_forgets_failed_and_expired_attempts():
    cache = ReplayCache(ttl_s=0.05)
    first = cache.register("s", "k")
    assert cache.lookup("s", "k") is first
    cache.fail("s", "k", first)
    assert cache.lookup("s", "k") is None and first.result() is None
    done = cache.register("s", "k2")
    cache.resolve("s", "k2", done, "result")
    await asyncio.sleep(0.06)
    assert cache.lookup("s", "k2") is None
    cache.register("s", "k3")
    assert list(cache._entries) == [("s", "k3")]


def test_parse_chat_names_nested_fields():
    with pytest.raises(ApiError) as err:
        parse_chat({"model": "m", "messages": [{"role": "assistant", "tool_calls": [{"type": "function"}]}]},
                   max_n=4, strict=True)
    assert err.value.param == "messages[0].tool_calls[0].function"


def _session() -> Session:
    return Session(id="s", api_key="k", task_id="t", group_id="grp", group_size=2, group_index=0)


def _add_tokens(session: Session, iid: str, parent: str | None, prompt: list[int], output: list[int]) -> None:
    session.add(Interaction(id=iid, response_id=iid, api="completions", parent_id=parent, prompt_ids=prompt,
                            output_ids=output, logprobs=[0.0] * len(output), versions=[0] * len(output),
                            finish_reason="stop", ended_on_stop_token=False))


def _add_chat(session: Session, iid: str, prompt, messages: list[Message], output: list[int], response: Message) -> None:
    session.add(Interaction(id=iid, response_id=iid, api="chat", parent_id=None, prompt_ids=prompt.ids, output_ids=output,
                            logprobs=[0.0] * len(output), versions=[0] * len(output), finish_reason="stop",
                            ended_on_stop_token=True, render_text=prompt.render_text, messages=tuple(messages),
                            response=response, transcript_key=transcript_key(tuple(messages), response, [])))


def test_a_template_that_rejects_the_conversation_is_a_400_naming_messages():
    tok = tokenizer()
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}"
                         "{% endif %}{{ m['content'] }}<|im_end|>{% endfor %}")
    fmt = ChatFormat(tok)
    with pytest.raises(ApiError) as err:
        fmt.render([Message("system", "x"), Message("user", "y")], [])
    assert err.value.status == 400 and err.value.param == "messages" and "no system role" in err.value.message


def test_there_is_no_public_admin_key_one_is_generated_0600_and_kept(tmp_path, monkeypatch):
    from services.rollout.gateway import GatewayConfig
    from services.rollout.gateway.config import PUBLIC_DEV_KEY, ensure_admin_key

    monkeypatch.delenv("MESHRL_ADMIN_KEY", raising=False)
    monkeypatch.delenv("MESHRL_ADMIN_KEY_FILE", raising=False)
    with pytest.raises(ValueError, match="admin_key"):
        GatewayConfig(admin_key=PUBLIC_DEV_KEY)
    with pytest.raises(ValueError, match="admin_key"):
        GatewayConfig(admin_key="short")
    config = GatewayConfig()
    assert config.admin_key == ""
    path = ensure_admin_key(config, tmp_path)
    assert path == tmp_path / "secrets" / "gateway_admin_key" and path.stat().st_mode & 0o777 == 0o600
    assert len(config.admin_key) >= 40 and path.read_text().strip() == config.admin_key
    again = GatewayConfig()
    assert ensure_admin_key(again, tmp_path) == path and again.admin_key == config.admin_key  # a restart keeps it
    other = GatewayConfig()
    ensure_admin_key(other, tmp_path / "other-run")
    assert other.admin_key != config.admin_key
    given = GatewayConfig(admin_key="an-operator-chosen-key")
    assert ensure_admin_key(given, tmp_path / "third") is None and not (tmp_path / "third").exists()


def test_the_direct_tokenizer_path_gives_the_wrapper_s_ids_and_text_or_is_not_taken():
    tok = tokenizer()
    fmt = ChatFormat(tok)
    assert fmt._backend is not None
    rng = random.Random(0)
    pieces = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", " ", "\n", "é", "世", "😀", "a", "Hello", "  "]
    for _ in range(200):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 12)))
        ids = list(tok.encode(text, add_special_tokens=False))
        assert fmt.encode(text) == ids
        assert fmt.decode(ids) == tok.decode(ids, skip_special_tokens=True)
        cut = rng.randint(0, len(ids))  # a partial UTF-8 character at the end decodes alike too
        assert fmt.decode(ids[:cut]) == tok.decode(ids[:cut], skip_special_tokens=True)
    tok.clean_up_tokenization_spaces = True
    assert ChatFormat(tok)._backend is None, "the wrapper post-processes text: its own path is kept"
