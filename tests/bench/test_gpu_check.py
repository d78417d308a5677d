"""bench.gpu_check on the CPU: the same checks the GPU machine runs, each in its own subprocess; every one passes
here except megatron-core's forward and the SGLang server, which need CUDA (reported as skipped)."""

from __future__ import annotations

import json

import pytest

from bench import gpu_check


@pytest.mark.full  # ~85 s: each check's subject has its own tests in make test; this runs the GPU script's wiring
def test_every_check_passes_on_cpu(capsys):
    code = gpu_check.main(["--device", "cpu"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    by_name = {r["check"]: r for r in lines}
    assert list(by_name) == list(gpu_check.CHECKS)
    for name, result in by_name.items():
        assert set(result) >= {"check", "ok", "seconds", "detail"}
        if name in ("megatron", "megatron_train"):   # their forward needs CUDA
            assert result["ok"] or result.get("skipped"), result
        elif name == "sglang":                       # needs CUDA: never runs here
            assert result.get("skipped") and "CUDA" in result["detail"], result
        else:
            assert result["ok"], result
    assert code == 0
    assert by_name["engine"]["detail"]["with_both_versions"] > 0


def test_a_failing_or_hanging_check_is_reported_and_the_others_still_run(monkeypatch, capsys):
    def fake(name, device, timeout):
        if name == "engine":
            return {"check": name, "ok": False, "seconds": timeout, "detail": f"timed out after {timeout:.0f}s"}
        return {"check": name, "ok": True, "seconds": 0.1, "detail": {}}

    monkeypatch.setattr(gpu_check, "run_isolated", fake)
    assert gpu_check.main(["--device", "cpu", "--timeout", "3"]) == 1
    out = capsys.readouterr().out
    assert len([line for line in out.splitlines() if line.startswith("{")]) == len(gpu_check.CHECKS)
    assert "FAILED" in out


def test_an_exception_in_a_check_becomes_a_failed_result(monkeypatch):
    def broken(device):
        raise RuntimeError("boom")

    monkeypatch.setitem(gpu_check.CHECKS, "engine", broken)
    result = gpu_check.run_one("engine", "cpu")
    assert result["ok"] is False and result["detail"] == "RuntimeError: boom" and result["check"] == "engine"


def test_a_missing_device_fails_each_check_by_name():
    result = gpu_check.run_one("trainer_step", "gpu")
    assert result["ok"] is False and result["detail"].startswith("FieldError: device: ")  # a ValueError naming its field
