"""Token accounting: the prompt ids of a request, reusing the ids an earlier interaction actually sampled.

When a request's messages extend an earlier interaction (its messages, then the assistant message the
gateway returned), the new prompt is that interaction's prompt ids + its sampled ids + the tokens of
what the template renders after the assistant turn's end marker. The assistant's text is never
re-tokenised, so the ids the policy sampled are the ids it is trained on.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from services.rollout.gateway.chat_format import ChatFormat
from services.rollout.gateway.messages import Message, Tool
from services.rollout.gateway.session import Interaction, Session


@dataclasses.dataclass
class Prompt:
    ids: list[int]                    # what the engine continues (forced tool-call prefix included)
    render_text: str                  # the prompt as text, without the forced prefix
    parent: Interaction | None = None
    reused: int = 0                   # leading ids taken verbatim from the parent's context
    forced_text: str = ""
    images: tuple[bytes, ...] = ()    # the conversation's images, in the order of their placeholders
    engine_images: Any = None         # ... as the engine takes them (digests and pixels)


def chat_prompt(fmt: ChatFormat, messages: list[Message], tools: list[Tool], session: Session | None,
                forced_text: str = "", template_kwargs: dict | None = None) -> Prompt:
    text = fmt.render(messages, tools, add_generation_prompt=True, template_kwargs=template_kwargs)
    parent = session.find_chat_parent(messages, tools) if session else None
    ids = _extend(fmt, parent, text) if parent else None
    if ids is None:
        parent, ids = None, fmt.encode(text)
    reused = len(parent.context) if parent else 0
    return Prompt(ids=ids + fmt.encode(forced_text), render_text=text, parent=parent, reused=reused,
                  forced_text=forced_text, images=tuple(b for m in messages for b in m.images))


def _extend(fmt: ChatFormat, parent: Interaction, text: str) -> list[int] | None:
    """parent.context + end marker (unless sampled) + tokens of what follows the parent's assistant turn."""
    base = parent.render_text
    if base is None or not text.startswith(base):
        return None  # the template re-rendered earlier turns differently: no exact reuse possible
    end = text.find(fmt.end_marker, len(base))
    if end < 0:
        return None
    bridge = text[end + len(fmt.end_marker):]
    marker = [] if parent.ended_on_stop_token else list(fmt.end_marker_ids)
    return parent.context + marker + fmt.encode(bridge)


def completion_prompt(fmt: ChatFormat, prompt: str | list[int], session: Session | None) -> Prompt:
    """/v1/completions: token-id prompts are taken as they are; text prompts reuse a parent's ids as text allows."""
    if isinstance(prompt, list):
        parent = session.find_token_parent(prompt) if session else None
        return Prompt(ids=list(prompt), render_text=fmt.decode(prompt), parent=parent,
                      reused=len(parent.context) if parent else 0)
    parent = session.find_text_parent(prompt) if session else None
    if parent is None:
        return Prompt(ids=fmt.encode(prompt), render_text=prompt)
    rest = prompt[len(parent.render_text) + len(parent.output_text):]
    return Prompt(ids=parent.context + fmt.encode(rest), render_text=prompt, parent=parent, reused=len(parent.context))
