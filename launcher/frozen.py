"""The run's frozen models (`frozen_models` in a run file): each served by `services.rollout.frozen` beside the
stack, never trained, for the agents to call (a tau2 user simulator, a judge). The agents find each one in
their environment: MESHRL_FROZEN_<NAME>_URL (the OpenAI base URL, with /v1) and MESHRL_FROZEN_<NAME>_KEY_FILE
(its admin key's file)."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

from launcher.processes import popen, terminate_all
from services.common.errors import FieldError
from services.common.net import free_port

# its own key, generated in its folder: neither the launcher's key nor its key file
from services.rollout.gateway.config import ADMIN_KEY_ENV, ADMIN_KEY_FILE, ADMIN_KEY_FILE_ENV

ROOT = pathlib.Path(__file__).resolve().parent.parent
_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")


@dataclasses.dataclass(kw_only=True)
class FrozenModel:
    model: str                       # a built-in name or a Hugging Face model directory, as the run's `model`
    max_context: int = 8192
    max_batch: int = 16
    dtype: str = "float32"
    max_tokens_cap: int = 512        # bounds every call's max_tokens
    torch_threads: int = 1

    def __post_init__(self) -> None:
        for name in ("max_context", "max_batch", "max_tokens_cap"):
            if getattr(self, name) < 1:
                raise FieldError(name, f"must be >= 1, got {getattr(self, name)}")


def check_names(models: dict) -> None:
    for name in models:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise FieldError(f"frozen_models.{name}", "names are lower-case letters, digits and _ (at most 32), "
                                                      "starting with a letter")


class FrozenModels:
    """Starts each model's server, waits until it answers, gives the agents' environment, stops them."""

    def __init__(self, models: dict[str, FrozenModel], paths: dict[str, pathlib.Path], run_dir: pathlib.Path) -> None:
        self.models, self.paths, self.run_dir = models, paths, run_dir
        self.ports = {name: free_port() for name in models}
        self._procs: dict[str, subprocess.Popen] = {}

    def start(self, timeout: float) -> None:
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        for name, m in self.models.items():
            with open(self.run_dir / "logs" / f"frozen-{name}.log", "ab") as log:
                self._procs[name] = popen(
                    [sys.executable, "-m", "services.rollout.frozen", "--model-path", str(self.paths[name]),
                     "--port", str(self.ports[name]), "--max-context", str(m.max_context),
                     "--max-batch", str(m.max_batch), "--dtype", m.dtype, "--max-tokens-cap", str(m.max_tokens_cap),
                     "--torch-threads", str(m.torch_threads), "--run-dir", str(self.key_dir(name))],
                    cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                    env={k: v for k, v in os.environ.items() if k not in (ADMIN_KEY_ENV, ADMIN_KEY_FILE_ENV)})
        deadline = time.monotonic() + timeout
        for name in self.models:
            self._wait(name, deadline)

    def key_dir(self, name: str) -> pathlib.Path:
        return self.run_dir / "frozen" / name

    def _wait(self, name: str, deadline: float) -> None:
        url = f"http://127.0.0.1:{self.ports[name]}/health"
        while time.monotonic() < deadline:
            if self._procs[name].poll() is not None:
                raise RuntimeError(f"frozen model {name!r} exited with {self._procs[name].returncode} at start; see "
                                   f"{self.run_dir / 'logs' / f'frozen-{name}.log'}")
            try:
                with urllib.request.urlopen(url, timeout=2):
                    return
            except (urllib.error.URLError, OSError):
                time.sleep(0.2)
        raise TimeoutError(f"frozen model {name!r} did not answer {url} in time (startup_timeout_seconds)")

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}/v1"

    def key_file(self, name: str) -> pathlib.Path:
        return self.key_dir(name) / ADMIN_KEY_FILE

    def env(self) -> dict[str, str]:
        out = {}
        for name in self.models:
            prefix = f"MESHRL_FROZEN_{name.upper()}"
            out[f"{prefix}_URL"] = self.url(name)
            out[f"{prefix}_KEY_FILE"] = str(self.key_file(name))
        return out

    def serve_reference(self, trainer: dict) -> None:
        """The trainer's `reference.served` (one of these models, e.g. a distillation teacher) as its url and key."""
        reference = trainer.get("reference")
        if isinstance(reference, dict) and reference.get("served"):
            name = reference["served"]
            reference.update(url=self.url(name), key_file=str(self.key_file(name)))

    def stop(self, timeout: float = 10.0) -> dict[str, int | None]:
        terminate_all(list(self._procs.values()), timeout)
        return {name: proc.returncode for name, proc in self._procs.items()}
