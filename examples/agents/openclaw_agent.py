"""OpenClaw, unchanged, as the agent under training: each episode is one headless `openclaw agent exec` whose only
model provider is meshrl's gateway (an OpenAI-compatible base URL and a session key in OpenClaw's own config).

The CLI comes from npm (`examples/openclaw/install.sh`, run on first use: Node 24 and openclaw into .openclaw/).
Every episode gets an empty workspace and its own OpenClaw home (state, sessions), asks the task's question,
and is scored on OpenClaw's final message (1 for the right number, 0.1 for a wrong one, 0 for none), posted to
the gateway as the episode's reward.

    python examples/agents/openclaw_agent.py --base-url http://127.0.0.1:8000 --episodes 4 --task addition
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import arguments, play  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
INSTALL = ROOT / "examples" / "openclaw" / "install.sh"
PROVIDER = "meshrl"
_RUNNING: set[subprocess.Popen] = set()  # episodes in flight: their process groups die with this agent


def openclaw_config(base_url: str, api_key: str, model: str, context_window: int, max_tokens: int) -> dict:
    """An OpenClaw config whose one provider is the gateway; minimal tools, no bootstrap files (a short prompt)."""
    return {"models": {"providers": {PROVIDER: {
                "baseUrl": base_url.rstrip("/") + "/v1", "apiKey": api_key, "api": "openai-completions",
                "models": [{"id": model, "name": model, "contextWindow": context_window, "maxTokens": max_tokens}]}}},
            "tools": {"profile": "minimal"}, "agents": {"defaults": {"skipBootstrap": True}}}


def ensure_openclaw(folder: Path) -> Path:
    """The openclaw binary in `folder`, installed there first if it is not."""
    binary = folder / "node_modules" / ".bin" / "openclaw"
    if not (folder / ".installed").exists():
        subprocess.run(["bash", str(INSTALL), str(folder)], check=True, timeout=1200)
    return binary


class Slots:
    """Episode folders at fixed paths, one per episode running at once, emptied between episodes.

    OpenClaw's system prompt names the working directory about two thirds of the way in: a fresh random
    folder per episode made every episode's prompt differ from there on, so the engine's prefix cache served
    only the part before it (1,184 of ~3,000 tokens measured). With the same path again, a later episode in the
    slot shares the whole system prompt and the tool list with the earlier ones (only its question, date and
    session id differ, at the end)."""

    def __init__(self, n: int) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="openclaw-"))
        self.free: queue.Queue[Path] = queue.Queue()
        for k in range(n):
            self.free.put(self.root / f"slot-{k}")

    @contextmanager
    def take(self) -> Iterator[Path]:
        slot = self.free.get(timeout=3600)   # never more takers than slots: play runs `parallel` at a time
        try:
            shutil.rmtree(slot, ignore_errors=True)
            slot.mkdir()
            yield slot
        finally:
            shutil.rmtree(slot, ignore_errors=True)
            self.free.put(slot)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def run_episode(binary: Path, config: dict, message: str, model: str, timeout: float,
                slots: Slots | None = None) -> dict:
    """One `openclaw agent exec` in a slot's folder (a folder of its own without `slots`); its JSON result. The
    whole process group is killed past `timeout`."""
    own = slots is None
    slots = slots or Slots(1)
    try:
        with slots.take() as scratch:
            return _run_in(scratch, binary, config, message, model, timeout)
    finally:
        if own:
            slots.close()


def _run_in(scratch: Path, binary: Path, config: dict, message: str, model: str, timeout: float) -> dict:
    """The episode with its workspace and OpenClaw home in `scratch`."""
    work, home = scratch / "workspace", scratch / "home"
    work.mkdir()
    home.mkdir()
    (home / "config.json").write_text(json.dumps(config))
    env = {**os.environ, "HOME": str(home), "PATH": f"{binary.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.Popen([str(binary), "agent", "exec", message, "--config", str(home / "config.json"),
                             "--model", f"{PROVIDER}/{model}", "--cwd", str(work), "--json", "--code-mode", "direct"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True, preexec_fn=_die_with_agent)
    _RUNNING.add(proc)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        proc.communicate()
        raise RuntimeError(f"openclaw did not finish the episode within {timeout:g}s") from None
    finally:
        _RUNNING.discard(proc)
    if proc.returncode != 0:
        raise RuntimeError(f"openclaw exited {proc.returncode}: {err.strip()[-2000:]}")
    try:
        result = json.loads(out)
    except ValueError:
        raise RuntimeError(f"openclaw printed no JSON result: {out.strip()[-2000:]}") from None
    if not result.get("ok"):
        raise RuntimeError(f"openclaw reports a failed episode: {json.dumps(result)[:2000]}")
    return result


def _die_with_agent() -> None:
    """In the child before exec: SIGKILL when this agent dies, even by SIGKILL (Linux PR_SET_PDEATHSIG)."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _stop_on_sigterm() -> None:
    """OpenClaw runs in its own process group (its Node children with it), so a SIGTERM to this agent (the
    launcher stopping the run) must take those groups down itself."""
    def stop(signum, _frame):
        for proc in list(_RUNNING):
            _kill_group(proc)
        sys.exit(128 + signum)
    signal.signal(signal.SIGTERM, stop)


def extra_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--openclaw-dir", default=os.environ.get("MESHRL_OPENCLAW_DIR", str(ROOT / ".openclaw")),
                   help="where Node 24 and openclaw are installed (installed on first use)")
    p.add_argument("--episode-timeout", type=float, default=900.0, help="seconds one OpenClaw episode may take")
    p.add_argument("--context-window", type=int, default=8192, help="the model's context, as OpenClaw is told")


def main() -> None:
    args = arguments(__doc__, extra_flags)
    _stop_on_sigterm()
    binary = ensure_openclaw(Path(args.openclaw_dir))
    slots = Slots(args.parallel)

    def episode(key: str, model: str, question: str, max_turns: int, max_tokens: int, *, system, use_tools):
        # OpenClaw brings its own system prompt and tools; the task's are not sent. max_turns is OpenClaw's to decide.
        config = openclaw_config(args.base_url, key, model, args.context_window, max_tokens)
        result = run_episode(binary, config, f"{question} Reply with 'Answer: <number>'.", model,
                             args.episode_timeout, slots)
        return result.get("final") or "", int(result.get("assistantTurns") or 0), \
            int((result.get("bridgeCalls") or {}).get("call") or 0)

    try:
        play(args, lambda key: key, episode)
    finally:
        slots.close()


if __name__ == "__main__":
    main()
