"""Rendering canonical messages with the model's own chat template, and what the template says about turns.

At start-up the template is probed once: where an assistant turn ends (its end marker, e.g. `<|im_end|>`),
and whether it renders tools itself. Templates without tool support get the Qwen / Hermes tool prompt
written into the system message, tool calls as `<tool_call>` text and tool results as user turns.
"""

from __future__ import annotations

import json
from typing import Any

from services.common.errors import FieldError
from services.rollout.gateway.errors import bad_request
from services.rollout.gateway.images import IMAGE_MARK, Vision, expand
from services.rollout.gateway.messages import Message, Tool
from services.rollout.gateway.toolcalls import CLOSE, OPEN

_END_OF_TURN_NAMES = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>")
_SENTINEL = "MESHRL-SENTINEL-7f3a"

HERMES_TOOL_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>"
)


class ChatFormat:
    def __init__(self, tokenizer: Any, extra_stop_tokens: list[str] | tuple[str, ...] = ()) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise FieldError("tokenizer", "has no chat_template; the gateway renders messages with the model's template")
        self.tokenizer = tokenizer
        self.template_tools = "tools" in str(tokenizer.chat_template)
        vocab = tokenizer.get_vocab()
        stops = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        for name in (*_END_OF_TURN_NAMES, *extra_stop_tokens):
            if name in vocab:
                stops.add(vocab[name])
        self.stop_token_ids = frozenset(stops)
        self._backend = None
        self.vision: Vision | None = None  # set for a vision-language policy (gateway/images.py)
        self.end_marker, self.end_marker_ids = self._probe_end_marker()
        self._backend = _direct_backend(tokenizer, self._probe_texts())

    # rendering ---------------------------------------------------------------------------------------
    def render(self, messages: list[Message], tools: list[Tool], *, add_generation_prompt: bool = True,
               template_kwargs: dict | None = None) -> str:
        conversation, tool_dicts = self._template_input(messages, tools)
        try:
            text = self.tokenizer.apply_chat_template(conversation, tools=tool_dicts, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **(template_kwargs or {}))
        except Exception as exc:  # jinja raises what the template author chose (TemplateError, TypeError, ...)
            raise bad_request("messages", f"the model's chat template rejected the conversation: {exc}") from exc
        text = text if isinstance(text, str) else str(text)
        return text.replace(IMAGE_MARK, self.vision.token_text) if self.vision is not None else text

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        if self._backend is not None:
            ids = self._backend.encode(text, add_special_tokens=False).ids
        else:
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        return ids if self.vision is None else expand(ids, self.vision.token_id, self.vision.per_image)

    def decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _template_input(self, messages: list[Message], tools: list[Tool]) -> tuple[list[dict], list[dict] | None]:
        if self.template_tools or (not tools and not any(m.tool_calls or m.role == "tool" for m in messages)):
            return [_template_message(m) for m in messages], [t.openai_dict() for t in tools] or None
        return _hermes_fallback(messages, tools), None

    # probing -------------------------------------------------------------------------------------------
    def _probe_texts(self) -> list[str]:
        specials = "".join(self.token_text(t) for t in sorted(self.stop_token_ids))
        return [f"{specials}user\n2 + 2 = ? \u00e9\u4e16 \U0001f600{self.end_marker}\nassistant\n", f" Four.\n\n  \t{specials}x"]

    def _probe_end_marker(self) -> tuple[str, list[int]]:
        user = Message(role="user", content="ping")
        text = self.render([user, Message(role="assistant", content=_SENTINEL)], [], add_generation_prompt=False)
        if _SENTINEL not in text:
            raise FieldError("tokenizer.chat_template", "does not render assistant message content")
        close = text[text.rindex(_SENTINEL) + len(_SENTINEL):]
        for token_id in sorted(self.stop_token_ids):
            marker = self.token_text(token_id)
            if marker and close.startswith(marker):
                return marker, [token_id]
        marker = close.rstrip() or close
        if not marker:
            raise FieldError("tokenizer.chat_template", "cannot find where an assistant turn ends")
        return marker, self.encode(marker)


def _template_message(m: Message) -> dict:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments_value()}} for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


def _hermes_fallback(messages: list[Message], tools: list[Tool]) -> list[dict]:
    """For templates that know nothing of tools: tools in the system prompt, calls and results as text."""
    out: list[dict] = []
    if tools:
        prompt = HERMES_TOOL_PROMPT.format(tools="".join("\n" + json.dumps(t.openai_dict()) for t in tools))
        if messages and messages[0].role == "system":
            prompt = messages[0].content + "\n\n" + prompt
            messages = messages[1:]
        out.append({"role": "system", "content": prompt})
    for m in messages:
        if m.role == "assistant" and m.tool_calls:
            calls = "".join(f"\n{OPEN}\n" + json.dumps({"name": c.name, "arguments": c.arguments_value()}) + f"\n{CLOSE}"
                            for c in m.tool_calls)
            out.append({"role": "assistant", "content": (m.content + calls).strip("\n")})
        elif m.role == "tool":
            block = f"<tool_response>\n{m.content}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool": True})
        else:
            out.append({"role": m.role, "content": m.content})
    for m in out:
        m.pop("_tool", None)
    return out


def _direct_backend(tokenizer: Any, probes: list[str]) -> Any:
    """The Rust `tokenizers.Tokenizer` behind a fast Hugging Face tokenizer, when calling it directly gives the
    same ids and text as the wrapper (no truncation, padding, special-token splitting or clean-up, checked on
    probes): it skips the wrapper's per-call Python work, which is most of what a short prompt costs."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not all(hasattr(backend, a) for a in ("encode", "decode", "truncation", "padding")):
        return None
    if backend.truncation or backend.padding or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    if getattr(backend, "encode_special_tokens", False) != bool(getattr(tokenizer, "split_special_tokens", False)):
        return None
    for text in probes:
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        if backend.encode(text, add_special_tokens=False).ids != ids or \
                backend.decode(ids, skip_special_tokens=True) != tokenizer.decode(ids, skip_special_tokens=True):
            return None
    return backend
