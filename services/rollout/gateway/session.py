"""Sessions and interactions: pure state, transitions as data, no I/O.

A session is one agent episode, identified by its API key. Each generated completion is an interaction;
an interaction whose prompt extends an earlier one's prompt + completion records that earlier one as its
parent, so the session's interactions form a tree whose root-to-leaf paths are token-exact transcripts.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import math
import secrets

from services.common.contracts import data_pb2
from services.common.errors import FieldError
from services.common.ids import new_id, now
from services.rollout.gateway.messages import Message, Tool


class SessionState(enum.StrEnum):
    ACTIVE = "active"
    ENDED = "ended"


VALID_TRANSITIONS: dict[SessionState, frozenset[SessionState]] = {
    SessionState.ACTIVE: frozenset({SessionState.ENDED}),
    SessionState.ENDED: frozenset(),
}


class InvalidTransition(ValueError):
    pass


@dataclasses.dataclass(eq=False, kw_only=True)
class Interaction:
    id: str
    response_id: str
    api: str
    parent_id: str | None
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    ended_on_stop_token: bool
    render_text: str | None = None                 # the prompt as text (chat: rendered template, no forced prefix)
    output_text: str = ""                          # completions: the text returned to the client
    messages: tuple[Message, ...] | None = None    # chat APIs: the request's messages
    response: Message | None = None                # chat APIs: the assistant message returned
    transcript_key: bytes | None = None            # digest of messages + response (+ tools)
    created_at: float = dataclasses.field(default_factory=now)
    finished_at: float = dataclasses.field(default_factory=now)
    reward: float | None = None
    sampling: dict = dataclasses.field(default_factory=dict)
    images: tuple[bytes, ...] = dataclasses.field(default=(), repr=False)  # the prompt's, in placeholder order

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.output_ids


@dataclasses.dataclass(eq=False, kw_only=True)
class Session:
    id: str
    api_key: str
    task_id: str
    group_id: str
    group_size: int
    group_index: int
    metadata: dict = dataclasses.field(default_factory=dict)
    grading: data_pb2.Grading | None = None  # the reward service grades the export (None: the agent's reward)
    state: SessionState = SessionState.ACTIVE
    created_at: float = dataclasses.field(default_factory=now)
    last_active: float = dataclasses.field(default_factory=now)
    ended_at: float | None = None
    end_reason: str = ""
    exported: int = 0
    inflight: int = 0
    released: int | None = None     # after export: how many interactions there were (their tokens are freed)
    exports: list = dataclasses.field(default_factory=list)   # publish futures of the exported trajectories
    ending: object = None           # the end in progress (an asyncio task): concurrent ends share it
    confirmed: object = None        # all `exports` resolved (an asyncio future): the session ends then
    refusal: object = None          # the ApiError that closed the session without an export (too large, ...)
    tokens: int = 0                 # recorded prompt + completion ids (bounded per session and in all)
    interactions: list[Interaction] = dataclasses.field(default_factory=list)
    _by_id: dict[str, Interaction] = dataclasses.field(default_factory=dict)
    _by_transcript: dict[bytes, Interaction] = dataclasses.field(default_factory=dict)

    @property
    def active(self) -> bool:
        return self.state is SessionState.ACTIVE

    @property
    def interaction_count(self) -> int:
        return len(self.interactions) if self.released is None else self.released

    def release(self) -> None:
        """Free the token data of an exported session; its counts stay for idempotent answers."""
        self.released = len(self.interactions)
        self.interactions, self._by_id, self._by_transcript = [], {}, {}

    def transition(self, to: SessionState, reason: str = "") -> None:
        if to not in VALID_TRANSITIONS[self.state]:
            raise InvalidTransition(f"session {self.id} is {self.state.value}; cannot become {to.value}")
        self.state = to
        if to is SessionState.ENDED:
            self.ended_at, self.end_reason = now(), reason

    # interactions ------------------------------------------------------------------------------------
    def add(self, interaction: Interaction) -> None:
        if interaction.id in self._by_id:
            raise ValueError(f"interaction {interaction.id} already recorded")
        self.interactions.append(interaction)
        self.tokens += len(interaction.prompt_ids) + len(interaction.output_ids)
        self._by_id[interaction.id] = interaction
        if interaction.transcript_key is not None:
            self._by_transcript[interaction.transcript_key] = interaction
        self.last_active = now()

    def get(self, interaction_id: str) -> Interaction | None:
        return self._by_id.get(interaction_id)

    def by_response(self, response_id: str) -> list[Interaction]:
        return [i for i in self.interactions if i.response_id == response_id]

    def find_chat_parent(self, messages: list[Message], tools: list[Tool]) -> Interaction | None:
        """The latest interaction whose messages + returned message are the longest prefix of `messages`."""
        found = None
        digest = transcript_hasher(tools)
        for m in messages:
            digest.update(repr(m.key()).encode())
            if m.role == "assistant":
                found = self._by_transcript.get(digest.copy().digest(), found)
        return found

    def find_token_parent(self, prompt_ids: list[int]) -> Interaction | None:
        for inter in reversed(self.interactions):
            ctx = inter.context
            if len(ctx) <= len(prompt_ids) and prompt_ids[:len(ctx)] == ctx:
                return inter
        return None

    def find_text_parent(self, prompt: str) -> Interaction | None:
        for inter in reversed(self.interactions):
            if inter.render_text is not None and inter.messages is None and \
                    prompt.startswith(inter.render_text + inter.output_text):
                return inter
        return None

    # rewards ------------------------------------------------------------------------------------------
    def set_reward(self, reward: float, interaction_id: str | None = None, *,
                   max_abs: float = math.inf) -> list[Interaction]:
        if not math.isfinite(reward):
            raise FieldError("reward", "must be a finite number")
        if abs(reward) > max_abs:  # past float32 it would become inf on the wire, and huge ones swamp a batch
            raise FieldError("reward", f"{reward:g} is outside [-{max_abs:g}, {max_abs:g}] (max_abs_reward)")
        if not self.interactions:
            raise LookupError("the session has no interactions yet")
        if interaction_id is None:
            last = self.interactions[-1]
            targets = self.by_response(last.response_id)
        else:
            one = self.get(interaction_id)
            targets = [one] if one else self.by_response(interaction_id)
            if not targets:
                raise KeyError(f"interaction_id: {interaction_id!r} is not an interaction of this session")
        for inter in targets:
            inter.reward = float(reward)
        self.last_active = now()
        return targets


def transcript_hasher(tools: list[Tool]):
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(sorted((t.name, repr(t.parameters)) for t in tools)).encode())
    return h


def transcript_key(messages: tuple[Message, ...], response: Message, tools: list[Tool]) -> bytes:
    h = transcript_hasher(tools)
    for m in (*messages, response):
        h.update(repr(m.key()).encode())
    return h.digest()


def discounted_returns(interactions: list[Interaction], gamma: float) -> list[float]:
    """Chronological returns: G_t = r_t + gamma * G_{t+1}; unset rewards count 0."""
    out, running = [0.0] * len(interactions), 0.0
    for i in range(len(interactions) - 1, -1, -1):
        running = (interactions[i].reward or 0.0) + gamma * running
        out[i] = running
    return out


class SessionStore:
    """Sessions by id and by API key. A key names its latest session; starting again with it ends the old one."""

    def __init__(self, max_active: int) -> None:
        self.max_active = max_active
        self._by_id: dict[str, Session] = {}
        self._by_key: dict[str, Session] = {}

    @property
    def active(self) -> list[Session]:
        return [s for s in self._by_id.values() if s.active]

    def by_key(self, api_key: str) -> Session | None:
        return self._by_key.get(api_key)

    def by_id(self, session_id: str) -> Session | None:
        return self._by_id.get(session_id)

    def create_group(self, *, task_id: str, group_size: int, api_key: str | None, metadata: dict,
                     grading: data_pb2.Grading | None = None) -> list[Session]:
        """New sessions (the caller ends any session still bound to `api_key` first)."""
        if len(self.active) + group_size > self.max_active:
            raise OverflowError(f"{len(self.active)} sessions are active; the gateway holds at most {self.max_active}")
        group_id = new_id("grp")
        sessions = []
        for index in range(group_size):
            key = api_key if api_key else "sk-meshrl-" + secrets.token_urlsafe(24)
            session = Session(id=new_id("sess"), api_key=key, task_id=task_id, group_id=group_id,
                              group_size=group_size, group_index=index, metadata=dict(metadata), grading=grading)
            self._by_id[session.id] = session
            self._by_key[key] = session
            sessions.append(session)
        return sessions

    def idle(self, older_than: float) -> list[Session]:
        return [s for s in self._by_id.values() if s.active and s.last_active < older_than]

    def prune(self, ended_before: float) -> int:
        """Forget ended sessions (their keys stop working) once they ended before `ended_before`."""
        gone = [s for s in self._by_id.values() if not s.active and s.ended_at is not None and s.ended_at < ended_before]
        for s in gone:
            del self._by_id[s.id]
            if self._by_key.get(s.api_key) is s:
                del self._by_key[s.api_key]
        return len(gone)
