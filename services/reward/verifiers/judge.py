"""`llm_judge`: an LLM behind any OpenAI-compatible endpoint grades the response with a rubric and ends its reply
with `SCORE: <n>`; the last such score, clamped to [score_min, score_max], maps linearly to a reward in [0, 1].

Where the endpoint comes from: the reward service's `judge` section (`JudgeConfig`), handed to this module once at
start-up by `configure()` (services/reward/server.py). The registry builds verifiers with no arguments, so a
`JudgeVerifier()` reads the configured endpoint each time it checks or scores (a verifier built before
`configure()` still sees it); tests build `JudgeVerifier(config)` directly. With no judge configured (the default:
`judge.base_url` empty) `check` refuses every task naming `llm_judge` with a ValueError naming `judge.base_url`.

Per task, `grading.verifier_options` may override `rubric`, `model` and `max_tokens`, and set `steps: true`: the
response's non-empty lines are then numbered steps in the prompt, and the judge's `STEP <k>: <n>` lines become
process rewards (`Verdict.steps`, on the same scale) beside the outcome (a step the judge skipped has none). The rubric is a
`str.format` template over `{question}` (`grading.question`, else `grading.prompt`, else `rg_entry.question`),
`{answer}` (`grading.answer`, or "(none given)"), `{response}`, `{score_min}` and `{score_max}`.

Failures never raise: an endpoint that cannot be reached, times out, or answers 429/5xx is retried `max_retries`
times with exponential back-off (`backoff_s * 2**i`, at most `backoff_max_s`; no jitter, so it is predictable);
a refusal that a retry cannot fix (400, 401, 403, 404, ...) is not retried. Either way, and for a reply without a
parsable score, the verdict is `failure_reward` with a detail saying why. The call blocks its thread for at most
about `(max_retries + 1) * timeout_s` plus the back-offs: the scorer runs non-isolated verifiers on a worker
thread (`Scorer.score_async` / `score_text_async`), so the event loop never waits on the judge.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import re
import string
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from services.common.errors import FieldError
from services.reward.verifiers.base import StepVerdict, Verdict, parse_options

if TYPE_CHECKING:
    import openai  # imported when a judge first sends a request: the registry (and every worker) stays light

FIELD = "grading.verifier_options"
NO_KEY = "EMPTY"  # what the SDK is given when the endpoint needs no key (it refuses an empty one)
PLACEHOLDERS = ("question", "answer", "response", "score_min", "score_max")
DEFAULT_RUBRIC = """\
You are grading a response to a question. Judge its correctness first (against the reference answer when one \
is given), then its reasoning and clarity.

Question:
{question}

Reference answer:
{answer}

Response:
{response}

Explain your judgement in a few sentences, then end with a line of the form "SCORE: <n>", where <n> is a number \
from {score_min} (worst) to {score_max} (best)."""

DEFAULT_STEP_RUBRIC = """\
You are grading a worked response to a question step by step. Its steps are numbered [1], [2], ... Judge each \
step's correctness on its own (given the steps before it), then the response as a whole (against the reference \
answer when one is given).

Question:
{question}

Reference answer:
{answer}

Response, one step per line:
{response}

For every step write a line "STEP <k>: <n>", then end with a line "SCORE: <n>" for the whole response; every <n> \
is a number from {score_min} (worst) to {score_max} (best)."""

_SCORE = re.compile(r"score\W{0,4}?[:=]\W{0,4}?(-?\d+(?:\.\d+)?)", re.I)
_STEP_SCORE = re.compile(r"step\W{0,3}?(\d+)\W{0,4}?[:=]\W{0,4}?(-?\d+(?:\.\d+)?)", re.I)


@dataclasses.dataclass(frozen=True, kw_only=True)
class JudgeConfig:
    """The LLM judge's endpoint (verifier `llm_judge`): any OpenAI-compatible server, e.g. a meshrl gateway."""

    base_url: str = ""              # e.g. http://127.0.0.1:8000/v1; "": no judge (tasks naming llm_judge are refused)
    model: str = ""                 # the model name sent with each request (required with base_url)
    # the API key: the name of an environment variable holding it, or a file (0600) holding it; none: "EMPTY"
    api_key_env: str = ""
    api_key_file: str = ""
    api_key: str = dataclasses.field(default="", repr=False)  # inline key (prefer api_key_env or api_key_file)
    timeout_s: float = 30.0         # per request; past it the attempt fails (and is retried)
    max_retries: int = 2            # retries after a failed attempt (unreachable, timeout, 429, 5xx)
    backoff_s: float = 0.5          # wait before retry i: backoff_s * 2**i, at most backoff_max_s
    backoff_max_s: float = 8.0
    max_tokens: int = 512           # of the judge's reply
    temperature: float = 0.0
    rubric: str = ""                # str.format template ({question} {answer} {response} {score_min} {score_max}); "": built-in
    score_min: float = 0.0          # the judge's scale; a score s gives (s - score_min) / (score_max - score_min)
    score_max: float = 10.0
    failure_reward: float = 0.0     # when the judge is unreachable or its reply has no parsable score

    def __post_init__(self) -> None:
        if self.base_url and not re.match(r"https?://[^/\s]+", self.base_url):
            raise FieldError("base_url", f"must start with http:// or https://, got {self.base_url!r}")
        if self.base_url and not self.model:
            raise FieldError("model", "required when base_url is set")
        if sum(bool(s) for s in (self.api_key_env, self.api_key_file, self.api_key)) > 1:
            raise FieldError("api_key_env", "set at most one of api_key_env, api_key_file, api_key")
        if not self.timeout_s > 0:
            raise FieldError("timeout_s", f"must be > 0, got {self.timeout_s}")
        if self.max_retries < 0:
            raise FieldError("max_retries", f"must be >= 0, got {self.max_retries}")
        for name in ("backoff_s", "backoff_max_s", "temperature"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise FieldError(name, f"must be >= 0, got {value}")
        if self.max_tokens < 1:
            raise FieldError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not (math.isfinite(self.score_min) and math.isfinite(self.score_max) and self.score_max > self.score_min):
            raise FieldError("score_max", f"must be > score_min ({self.score_min}), got {self.score_max}")
        if not math.isfinite(self.failure_reward):
            raise FieldError("failure_reward", f"must be finite, got {self.failure_reward}")
        check_rubric(self.rubric, "rubric")

    @property
    def enabled(self) -> bool:
        return bool(self.base_url)

    def key(self, environ: Mapping[str, str] | None = None) -> str:
        """The API key from wherever it is configured; ValueError naming the field when it cannot be read."""
        environ = os.environ if environ is None else environ
        if self.api_key_env:
            value = environ.get(self.api_key_env, "").strip()
            if not value:
                raise FieldError("api_key_env", f"environment variable {self.api_key_env} is not set")
            return value
        if self.api_key_file:
            try:
                value = pathlib.Path(self.api_key_file).read_text(encoding="utf-8").strip()
            except OSError as exc:
                raise FieldError("api_key_file", f"cannot read {self.api_key_file} ({exc.strerror})") from exc
            if not value:
                raise FieldError("api_key_file", f"{self.api_key_file} is empty")
            return value
        return self.api_key or NO_KEY


@dataclasses.dataclass(frozen=True, kw_only=True)
class JudgeOptions:
    """Per-task `verifier_options`: "" / 0 keep the service's setting."""

    rubric: str = ""
    model: str = ""
    max_tokens: int = 0
    # score steps too: each non-empty line of the response a step, numbered for the judge, whose "STEP <k>: <n>"
    # lines become process rewards (Verdict.steps) beside the outcome's "SCORE: <n>"
    steps: bool = False


def check_rubric(template: str, field: str) -> None:
    """ValueError naming `field` for a template with a placeholder the judge does not fill, or none for the response."""
    if not template:
        return
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise FieldError(field, f"not a format template ({exc})") from exc
    for name in names:
        if name not in PLACEHOLDERS:
            raise FieldError(field, f"unknown placeholder {{{name}}} (known: {', '.join(PLACEHOLDERS)}; "
                             "write {{ and }} for braces)")
    if "response" not in names:
        raise FieldError(field, "must contain {response}")


def question_of(task: Mapping[str, Any]) -> str | None:
    for key in ("question", "prompt"):
        value = task.get(key)
        if isinstance(value, str) and value:
            return value
    entry = task.get("rg_entry")
    if isinstance(entry, Mapping) and isinstance(entry.get("question"), str) and entry["question"]:
        return entry["question"]
    return None


def parse_score(reply: str) -> float | None:
    """The number of the last `SCORE: <n>` (any case; `**Score:** 7`, `score = 7/10` too), or None."""
    found = _SCORE.findall(reply or "")
    return float(found[-1]) if found else None


def parse_step_scores(reply: str) -> dict[int, float]:
    """Step number -> the number of its last `STEP <k>: <n>` line (any case)."""
    return {int(k): float(n) for k, n in _STEP_SCORE.findall(reply or "")}


def step_spans(response: str) -> list[tuple[str, int]]:
    """The response's steps, its non-empty lines: (text, the offset where the line's text ends)."""
    out, offset = [], 0
    for line in response.splitlines(keepends=True):
        text = line.rstrip("\r\n")
        if text.strip():
            out.append((text.strip(), offset + len(text)))
        offset += len(line)
    return out


_configured = JudgeConfig()
_lock = threading.Lock()


def configure(config: JudgeConfig) -> None:
    """The endpoint registry-built judges use; the reward service sets its own at start. An enabled config's API
    key is read now, so a missing key file stops start-up (ValueError naming `judge.<field>`)."""
    global _configured
    if config.enabled:
        try:
            config.key()
        except ValueError as exc:
            raise ValueError(f"judge.{exc}") from None
    with _lock:
        _configured = config


def configured() -> JudgeConfig:
    return _configured


class JudgeVerifier:
    name = "llm_judge"
    isolated = False  # network I/O, not CPU: it runs on the scorer's worker thread with its own timeouts

    def __init__(self, config: JudgeConfig | None = None, *, sleep: Callable[[float], None] = time.sleep) -> None:
        self._config = config
        self._sleep = sleep
        self._clients: dict[tuple[str, str, float], openai.OpenAI] = {}
        self._clients_lock = threading.Lock()

    @property
    def config(self) -> JudgeConfig:
        return self._config if self._config is not None else _configured

    @property
    def reward_range(self) -> tuple[float, float]:
        """[0, 1] (the judge's scale, mapped), widened to take in `failure_reward`."""
        failure = self.config.failure_reward
        return min(0.0, failure), max(1.0, failure)

    def _options(self, task: Mapping[str, Any]) -> tuple[JudgeConfig, JudgeOptions]:
        config = self.config
        if not config.enabled:
            raise FieldError("judge.base_url", "no LLM judge is configured for llm_judge "
                             "(set judge.base_url and judge.model in the reward config)")
        options = parse_options(JudgeOptions, task.get("verifier_options"), FIELD)
        check_rubric(options.rubric, f"{FIELD}.rubric")
        if options.max_tokens < 0:
            raise FieldError(f"{FIELD}.max_tokens", f"must be >= 0, got {options.max_tokens}")
        if "question" in self._placeholders(self._rubric(config, options)) and \
                question_of(task) is None:
            raise FieldError("grading.question", "missing (the judge's rubric shows it; or grading.prompt)")
        return config, options

    @staticmethod
    def _placeholders(template: str) -> set[str]:
        return {name for _, name, _, _ in string.Formatter().parse(template) if name}

    def check(self, task: Mapping[str, Any]) -> None:
        self._options(task)

    @staticmethod
    def _rubric(config: JudgeConfig, options: JudgeOptions) -> str:
        """The task's rubric, else (judging steps) the step rubric, else the service's, else the default."""
        return options.rubric or (DEFAULT_STEP_RUBRIC if options.steps else config.rubric or DEFAULT_RUBRIC)

    def prompt(self, response: str, task: Mapping[str, Any]) -> str:
        config, options = self._options(task)
        answer = task.get("answer")
        if options.steps:
            response = "\n".join(f"[{k}] {text}" for k, (text, _) in enumerate(step_spans(response), 1))
        return self._rubric(config, options).format(
            question=question_of(task) or "", answer="(none given)" if answer in (None, "") else str(answer),
            response=response, score_min=f"{config.score_min:g}", score_max=f"{config.score_max:g}")

    def _client(self, config: JudgeConfig) -> openai.OpenAI:
        import openai

        key = config.key()
        with self._clients_lock:
            ident = (config.base_url, key, config.timeout_s)
            if ident not in self._clients:
                self._clients[ident] = openai.OpenAI(base_url=config.base_url, api_key=key, timeout=config.timeout_s,
                                                     max_retries=0)  # retries are ours: explicit back-off below
            return self._clients[ident]

    def score(self, response: str, task: Mapping[str, Any]) -> Verdict:
        import openai

        retried = (openai.APIConnectionError, openai.RateLimitError, openai.InternalServerError)  # timeouts too
        config, options = self._options(task)
        prompt = self.prompt(response, task)
        try:
            client = self._client(config)
        except ValueError as exc:
            return Verdict(config.failure_reward, f"judge failed: judge.{exc}")
        attempts = config.max_retries + 1
        for attempt in range(attempts):
            try:
                reply = client.chat.completions.create(
                    model=options.model or config.model, messages=[{"role": "user", "content": prompt}],
                    max_tokens=options.max_tokens or config.max_tokens, temperature=config.temperature)
            except retried as exc:
                if attempt + 1 < attempts:
                    self._sleep(min(config.backoff_s * 2 ** attempt, config.backoff_max_s))
                    continue
                return Verdict(config.failure_reward,
                               f"judge unreachable after {attempts} attempt{'s' * (attempts > 1)}: {_why(exc)}")
            except openai.OpenAIError as exc:  # 4xx and the like: a retry cannot fix it
                return Verdict(config.failure_reward, f"judge refused (attempt {attempt + 1}): {_why(exc)}")
            return self._verdict(config, reply, step_spans(response) if options.steps else [])
        raise AssertionError("unreachable")  # the loop always returns

    @staticmethod
    def _verdict(config: JudgeConfig, reply: Any, steps: list[tuple[str, int]]) -> Verdict:
        text = (reply.choices[0].message.content or "") if getattr(reply, "choices", None) else ""
        score = parse_score(text)
        if score is None:
            tail = " ".join(text.split())[-120:]
            return Verdict(config.failure_reward, f"judge reply has no parsable score (want 'SCORE: <n>'): {tail!r}")

        def reward(value: float) -> float:
            clamped = min(max(value, config.score_min), config.score_max)
            return (clamped - config.score_min) / (config.score_max - config.score_min)

        scored = parse_step_scores(text)
        found = tuple(StepVerdict(end, reward(scored[k])) for k, (_, end) in enumerate(steps, 1) if k in scored)
        unscored = f"; {len(steps) - len(found)} of {len(steps)} steps unscored" if len(found) < len(steps) else ""
        return Verdict(reward(score), f"judge score {score:g} on [{config.score_min:g}, {config.score_max:g}]"
                       f"{unscored}", found)


def _why(exc: Exception) -> str:
    status = getattr(exc, "status_code", None)
    return f"{type(exc).__name__}{f' {status}' if status else ''}: {str(exc)[:200]}"
