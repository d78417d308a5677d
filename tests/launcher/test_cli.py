"""The `meshrl` command: the installed console script, `python -m launcher`, every subcommand's --help, and
what each subcommand hands its work to (the stack, a bench module, a converter script) with those stubbed."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from launcher import cli
from launcher.stack import ROOT

SUBCOMMANDS = ("run", "up", "down", "status", "chaos", "report", "bench", "algorithms", "model", "supervise")


def test_the_installed_console_script_lists_the_subcommands():
    script = pathlib.Path(sys.executable).parent / "meshrl"
    assert script.exists(), "no meshrl console script in the venv: `make setup` installs it (pip install -e .)"
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, cwd="/", timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: meshrl")
    for name in SUBCOMMANDS:
        assert f"\n    {name}" in out.stdout


def test_python_dash_m_launcher_is_the_same_command():
    out = subprocess.run([sys.executable, "-m", "launcher", "algorithms", "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: python -m launcher algorithms")


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_each_subcommand_has_help(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([name, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: meshrl {name}")
    assert "--help" in out


def test_bench_finds_the_modules_that_define_main(tmp_path):
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "plain.py").write_text("def main() -> None:\n    pass\n")
    (tmp_path / "coroutine.py").write_text("async def main(args) -> None:\n    pass\n")
    (tmp_path / "helpers.py").write_text("def mainly() -> None:\n    pass\n\nclass A:\n    def main(self): ...\n")
    assert cli.bench_names(tmp_path) == ["coroutine", "plain"]
    assert {"weights", "gateway", "fuzz"} <= set(cli.bench_names())


@pytest.fixture
def calls(monkeypatch):
    seen = []

    def call(cmd, cwd=None):
        seen.append((cmd, cwd))
        return 3

    monkeypatch.setattr(cli.subprocess, "call", call)
    return seen


def test_bench_runs_the_module_with_its_own_arguments(calls):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "fuzz", "--cases", "5", "--help"])
    assert exit_.value.code == 3  # the module's exit status
    assert calls == [([sys.executable, "-m", "bench.fuzz", "--cases", "5", "--help"], ROOT)]


def test_bench_refuses_an_unknown_name(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "nosuch"])
    assert exit_.value.code == 2
    assert "invalid choice: 'nosuch'" in capsys.readouterr().err


def test_model_runs_its_converter_script(calls, monkeypatch, tmp_path):
    (tmp_path / "convert_tiny.py").write_text("")
    monkeypatch.setattr(cli, "SCRIPTS_DIR", tmp_path)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["model", "tiny", "--out", "x"])
    assert exit_.value.code == 3
    assert calls == [([sys.executable, str(tmp_path / "convert_tiny.py"), "--out", "x"], ROOT)]


def test_model_without_a_converter_is_a_clear_error(calls):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["model", "nosuch"])
    assert "no converter for 'nosuch'" in str(exit_.value.code)
    assert "scripts/convert_nosuch.py does not exist" in str(exit_.value.code)
    assert calls == []


def test_algorithms_prints_the_presets_table(capsys):
    from services.trainer.algorithms.__main__ import format_presets

    with pytest.raises(SystemExit) as exit_:
        cli.main(["algorithms"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == format_presets() + "\n"


def test_run_hands_its_options_to_the_stack(monkeypatch):
    seen = {}

    def run(config, **kwargs):
        seen.update(config=config, **kwargs)
        return {"completed": False}

    monkeypatch.setattr(cli, "run", run)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", "--config", "configs/x.yaml", "--seed", "3", "--nats", "cluster"])
    assert exit_.value.code == 1  # a run that did not complete
    assert seen == {"config": "configs/x.yaml", "name": "seed3", "seed": 3, "algo": "", "ports": cli.DEFAULT_PORTS,
                    "nats_mode": "cluster", "runs_root": None}


def test_run_on_random_ports_under_another_folder(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(cli, "run", lambda config, **kwargs: seen.update(kwargs) or {"completed": True})
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", "--random-ports", "--runs-root", str(tmp_path)])
    assert exit_.value.code == 0
    assert seen["runs_root"] == tmp_path and set(seen["ports"]) == set(cli.DEFAULT_PORTS)
    assert seen["ports"]["nats"] != cli.DEFAULT_PORTS["nats"] or seen["ports"]["rollout"] != 50051


def test_an_interrupted_command_exits_128_plus_the_signal(monkeypatch):
    from launcher.shutdown import Interrupted

    def run(config, **kwargs):
        raise Interrupted(15)

    monkeypatch.setattr(cli, "run", run)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run"])
    assert exit_.value.code == 143


def test_up_without_config_leaves_the_choice_to_up(monkeypatch):
    seen = {}
    monkeypatch.setattr(cli, "up", lambda config, **kwargs: seen.update(config=config))
    with pytest.raises(SystemExit):
        cli.main(["up"])
    assert seen == {"config": None}
