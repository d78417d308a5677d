"""The escape suite: hostile programs run in the real sandbox, each asserting containment (the right status, no
`ESCAPED` attempt, nothing left running, no host file changed, no secret in the output). Short deadlines keep it
fast. bwrap missing is a failure, not a skip: `make setup` installs it (scripts/install_bwrap.sh)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import glob
import os
import pathlib
import socket
import subprocess
import time
import uuid

import pytest

from services.reward.sandbox import Limits, SandboxConfig, SandboxUnavailable
from tests.reward.escapes import hostile

ROOT = pathlib.Path(__file__).resolve().parents[3]
LIMITS = Limits(timeout_s=2.0, cpu_s=3, memory_mb=256, nproc=32, fsize_mb=8, tmp_mb=16, max_output_bytes=256 << 10)


@pytest.fixture(scope="module")
def sandbox():
    try:
        return SandboxConfig(limits=LIMITS, concurrency=2).build()
    except SandboxUnavailable as exc:
        pytest.fail(f"{exc} -- the escape suite needs bubblewrap: scripts/install_bwrap.sh (run by make setup)")


def sandbox_processes(uids: list[int]) -> list[str]:
    found = []
    for status in glob.glob("/proc/[0-9]*/status"):
        with contextlib.suppress(OSError):
            text = pathlib.Path(status).read_text()
            uid = int(text.split("\nUid:")[1].split()[0])
            if uid in uids:
                found.append(text.split("\n")[0] + " " + status)
    return found


def processes_with(marker: str) -> list[str]:
    found = []
    for cmdline in glob.glob("/proc/[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            if marker.encode() in pathlib.Path(cmdline).read_bytes():
                found.append(cmdline)
    return found


@pytest.fixture(autouse=True)
def nothing_left_running(sandbox):
    yield
    deadline = time.monotonic() + 3
    while (left := sandbox_processes(sandbox.uids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"sandbox processes outlived the run: {left}"


def contained(result, status: str = "ok") -> list[str]:
    """The run's lines, after asserting its status and that no attempt printed ESCAPED."""
    lines = result.stdout.splitlines()
    assert result.status == status, (result.status, result.exit_code, result.stderr[-2000:])
    escaped = [line for line in lines if line.startswith("ESCAPED")]
    assert not escaped, escaped
    return lines


def blocked(lines: list[str], label: str) -> None:
    assert any(line.startswith(f"BLOCKED {label} ") for line in lines), (label, lines)


def free_listener(port: int = 0) -> socket.socket | None:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        return None  # taken (a real NATS, say): the sandbox must not reach that one either
    sock.listen(8)
    sock.setblocking(False)
    return sock


def accepted_nothing(sock: socket.socket | None) -> bool:
    if sock is None:
        return True
    try:
        sock.accept()
    except BlockingIOError:
        return True
    return False


@pytest.mark.parametrize("ports", [[0], [4222], [50051, 50052, 50053], [8000, 8080]],
                         ids=["free-port", "nats-4222", "grpc-5005x", "gateway"])
def test_loopback_ports_are_unreachable(sandbox, ports):
    listeners = [free_listener(port) for port in ports]
    real_ports = [sock.getsockname()[1] if sock else port for sock, port in zip(listeners, ports, strict=True)]
    try:
        lines = contained(sandbox.run(hostile.CONNECT.format(ports=real_ports)))
        for port in real_ports:
            blocked(lines, f"tcp 127.0.0.1:{port}")
            blocked(lines, f"tcp localhost:{port}")
        assert all(accepted_nothing(sock) for sock in listeners)
    finally:
        for sock in filter(None, listeners):
            sock.close()


def test_outside_addresses_and_dns_are_unreachable(sandbox):
    lines = contained(sandbox.run(hostile.OUTSIDE.format()))
    for label in ("tcp 1.1.1.1:53", "tcp 8.8.8.8:443", "tcp 172.17.0.1:4222", "dns", "udp"):
        blocked(lines, label)
    assert "interfaces ['lo']" in lines


def test_a_fork_bomb_hits_nproc_and_the_deadline(sandbox):
    result = sandbox.run(hostile.FORK_BOMB)
    assert result.status == "timeout" and result.wall_seconds < LIMITS.timeout_s + 5  # the kill itself is quick; a loaded machine is not
    assert subprocess.run(["true"]).returncode == 0  # the host can still start processes


@pytest.mark.parametrize("program", [hostile.MEMORY_BOMB, hostile.MEMORY_CREEP], ids=["at-once", "creeping"])
def test_a_memory_bomb_is_out_of_memory(sandbox, program):
    result = sandbox.run(program)
    assert result.status == "memory" and "MemoryError" in result.stderr


def test_disk_fill_stops_at_the_file_size_and_tmpfs_limits(sandbox):
    lines = contained(sandbox.run(hostile.DISK_FILL))
    stopped = next(line for line in lines if line.startswith("stopped"))
    assert stopped.split()[2] == str(errno.EFBIG) and int(stopped.split()[3]) <= LIMITS.fsize_mb << 20
    many = next(line for line in lines if line.startswith("many stopped"))
    assert many.split()[2] in (str(errno.ENOSPC), str(errno.EFBIG)) and int(many.split()[3]) <= LIMITS.tmp_mb // 4


def test_writes_outside_the_private_tmp_change_no_host_file(sandbox, tmp_path):
    host_files = [tmp_path / "host.txt", pathlib.Path("/tmp") / f"meshrl-escape-{uuid.uuid4().hex}.txt"]
    for path in host_files:
        path.write_text("original")
    try:
        program = hostile.WRITE_OUTSIDE.format(host_paths=[str(p) for p in host_files], project=str(ROOT))
        lines = contained(sandbox.run(program))
        for label in ("write /usr/bin/pwned", "write /etc/passwd", "write /pwned", f"write {ROOT}/pwned",
                      "write /sandbox/main.py", "mkdir /work", "chmod /usr"):
            blocked(lines, label)
        assert all(path.read_text() == "original" for path in host_files)
        assert not (ROOT / "pwned").exists() and not pathlib.Path("/usr/bin/pwned").exists()
    finally:
        host_files[1].unlink()


def test_root_files_and_other_users_files_are_not_there(sandbox, tmp_path):
    secret = tmp_path / "root-only"
    secret.write_text("root secret")
    secret.chmod(0o600)
    program = hostile.READ_ROOT_FILES.format(project=str(ROOT), host_file=str(secret))
    result = sandbox.run(program)
    lines = contained(result)
    for label in ("read /etc/shadow", "read /etc/passwd", "read /root/.ssh/id_rsa", "read /work", f"read {ROOT}",
                  f"read {secret}"):
        blocked(lines, label)
    assert "root secret" not in result.stdout
    root = next(line for line in lines if line.startswith("root "))
    assert set(eval(root[5:])) <= {"bin", "dev", "lib", "lib32", "lib64", "libx32", "proc", "sandbox", "sbin",
                                   "tmp", "usr"}
    uid = next(line for line in lines if line.startswith("uid ")).split()[1:]
    assert "0" not in uid and int(uid[0]) in (sandbox.uids or [os.getuid()])  # root: a uid of its own per slot
    assert next(line for line in lines if line.startswith("caps ")).split()[1] == "0000000000000000"


def test_no_process_environment_or_secret_is_readable(sandbox, monkeypatch):
    secret = f"meshrl-secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("MESHRL_ESCAPE_SECRET", secret)
    result = sandbox.run(hostile.PROC_ENVIRON.format(host_pid=os.getpid()))
    assert result.status == "ok", result.stderr
    assert secret not in result.stdout + result.stderr and "MESHRL" not in result.stdout
    pids = next(line for line in result.stdout.splitlines() if line.startswith("pids "))
    assert str(os.getpid()) not in eval(pids[5:])  # the host's processes are not even visible
    env = eval(result.stdout.splitlines()[0])
    assert set(env) <= {"PATH", "HOME", "TMPDIR", "LANG", "PWD", "LC_CTYPE"}


def test_killing_the_parent_only_reaches_the_sandbox(sandbox):
    result = sandbox.run(hostile.KILL_PARENT.format(host_pid=os.getpid()))
    lines = result.stdout.splitlines()
    assert not [line for line in lines if line.startswith("ESCAPED")], lines
    blocked(lines, "kill host pid")
    blocked(lines, "kill host pid group")
    assert result.status in ("ok", "killed")  # kill(-1) may take the program itself down; the test process lives on


def test_ptrace_cannot_reach_the_parent(sandbox):
    lines = contained(sandbox.run(hostile.PTRACE.format(host_pid=os.getpid())))
    for label in ("ptrace attach host pid", "ptrace seize host pid", "host /proc mem"):
        blocked(lines, label)


@pytest.mark.parametrize("parent_tail,delay,status", [("", 0.5, "ok"), ("time.sleep(60)", 2.5, "timeout")],
                         ids=["parent-exits", "parent-past-deadline"])
def test_a_detached_daemon_does_not_outlive_the_run(sandbox, parent_tail, delay, status):
    listener = free_listener()
    marker = f"meshrl-daemon-{uuid.uuid4().hex}"
    try:
        body = hostile.DAEMON_BODY.format(delay=delay, port=listener.getsockname()[1])
        result = sandbox.run(hostile.DAEMON.format(daemon=body, marker=marker, parent_tail=parent_tail))
        assert result.status == status and "parent done" in result.stdout
        assert not processes_with(marker)
        time.sleep(delay + 0.5 if status == "ok" else 1.0)  # past the moment the daemon would act
        assert not processes_with(marker) and accepted_nothing(listener)
    finally:
        listener.close()


def test_rlimits_cannot_be_raised(sandbox):
    result = sandbox.run(hostile.SETRLIMIT.format())
    lines = contained(result, "memory")
    for name in ("RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_NPROC", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_CORE"):
        blocked(lines, f"raise {name}")


def test_symlinks_and_hardlinks_lead_nowhere(sandbox, tmp_path):
    host_file = tmp_path / "host-secret"
    host_file.write_text("host secret")
    result = sandbox.run(hostile.LINKS.format(project=str(ROOT), host_file=str(host_file), host_pid=os.getpid()))
    lines = contained(result)
    credentials = next(line for line in (ROOT / "services/common/credentials.py").read_text().splitlines() if line)
    assert "host secret" not in result.stdout and credentials not in result.stdout
    for label in ("hardlink /usr/bin/python3", "hardlink /proc/self/exe", "rename out of /tmp"):
        blocked(lines, label)
    assert sum(line.startswith("BLOCKED symlink") for line in lines) == 6


def test_ctypes_syscalls_cannot_leave_the_namespaces(sandbox):
    lines = contained(sandbox.run(hostile.CTYPES))
    for label in ("unshare user", "unshare net", "unshare mount", "mount tmpfs", "umount /usr", "remount /usr rw",
                  "setuid 0", "chroot", "setns", "reboot", "sethostname"):
        blocked(lines, label)


@pytest.mark.parametrize("program", [hostile.IGNORE_SIGNALS, hostile.SLEEP, hostile.CPU_THREADS],
                         ids=["ignores-signals", "sleeps", "cpu-threads"])
def test_runaway_programs_end_at_the_deadline(sandbox, program):
    result = sandbox.run(program)
    assert result.status == "timeout" and result.wall_seconds < LIMITS.timeout_s + 5  # the kill itself is quick; a loaded machine is not
    assert "woke up" not in result.stdout


def test_huge_output_is_capped(sandbox):
    result = sandbox.run(hostile.HUGE_OUTPUT)
    assert result.status == "ok" and result.truncated
    assert len(result.stdout) == len(result.stderr) == LIMITS.max_output_bytes


def test_endless_output_is_capped_and_stopped(sandbox):
    result = sandbox.run(hostile.ENDLESS_OUTPUT)
    assert result.status == "timeout" and result.truncated
    assert len(result.stdout) == len(result.stderr) == LIMITS.max_output_bytes


def test_the_project_and_its_run_secrets_are_out_of_reach(sandbox):
    host_paths = [str(ROOT / "services/common/credentials.py"), *sorted(glob.glob(str(ROOT / "runs/*/*")))[:10]]
    result = sandbox.run(hostile.PROJECT_IMPORT.format(project=str(ROOT), host_paths=host_paths))
    lines = contained(result)
    blocked(lines, "import services.common.credentials")
    blocked(lines, "import with the project on sys.path")
    assert "found []" in lines
    for path in host_paths:
        blocked(lines, f"read {path}")


def test_no_descriptor_is_inherited(sandbox):
    result = sandbox.run(hostile.FDS)
    assert result.stdout.strip() == "fds [0, 1, 2, 3]"  # 3: the listing's own


def test_the_sandbox_and_a_code_verifier_still_work_after_the_suite(sandbox):
    from services.reward.verifiers.code_io import CodeIOVerifier

    assert sandbox.run("print(input())", "still here").stdout == "still here\n"
    verdict = CodeIOVerifier(sandbox).score("print(sum(map(int, input().split())))",
                                            {"cases": [{"input": "2 3", "output": "5"}]})
    assert verdict.reward == 1.0, verdict.detail


def test_host_unix_sockets_and_raw_sockets_are_unreachable(sandbox, tmp_path):
    abstract = f"\0meshrl-escape-{uuid.uuid4().hex}"
    servers = [socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)]
    path = str(tmp_path / "host.sock")
    try:
        for server, address in zip(servers, (abstract, path), strict=True):
            server.bind(address)
            server.listen(1)
            server.setblocking(False)
        lines = contained(sandbox.run(hostile.UNIX_SOCKETS.format(abstract=abstract, path=path)))
        for label in ("abstract unix socket", "filesystem unix socket", "unix /run/docker.sock", "raw socket",
                      "packet socket"):
            blocked(lines, label)
        assert all(accepted_nothing(server) for server in servers)
    finally:
        for server in servers:
            server.close()


def test_descriptors_stop_at_nofile(sandbox):
    result = sandbox.run(hostile.DESCRIPTOR_BOMB)
    code, count = result.stdout.split()[1:]
    assert result.status == "ok" and int(code) == errno.EMFILE and int(count) < LIMITS.nofile


def test_threads_stop_at_nproc(sandbox):
    result = sandbox.run(hostile.THREAD_BOMB)
    assert result.status == "ok", result.stderr
    assert result.stdout.startswith("stopped") and int(result.stdout.split()[2]) < LIMITS.nproc


def test_a_run_cannot_see_or_kill_a_concurrent_run(sandbox):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        neighbour = pool.submit(sandbox.run, hostile.NEIGHBOUR, b"", "python", 10.0)
        time.sleep(0.3)
        killer = sandbox.run(hostile.NEIGHBOUR_KILLER)
        assert killer.status == "ok" and "visible ['1']" in killer.stdout  # its own /bin/sh init only
        assert neighbour.result().stdout == "survived\n"
