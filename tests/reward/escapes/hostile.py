"""Hostile programs for the escape suite. Each prints `ESCAPED <what>` for an attempt that worked and
`BLOCKED <what> <error>` for one that failed; `{placeholders}` are filled in by the test."""

from __future__ import annotations

PRELUDE = '''
import os, sys

def attempt(label, fn):
    try:
        fn()
    except BaseException as exc:
        print("BLOCKED", label, type(exc).__name__, flush=True)
    else:
        print("ESCAPED", label, flush=True)
'''

CONNECT = PRELUDE + '''
import socket
for port in {ports}:
    attempt(f"tcp 127.0.0.1:{{port}}", lambda: socket.create_connection(("127.0.0.1", port), timeout=1))
    attempt(f"tcp localhost:{{port}}", lambda: socket.create_connection(("localhost", port), timeout=1))
'''

OUTSIDE = PRELUDE + '''
import socket
for host, port in [("1.1.1.1", 53), ("8.8.8.8", 443), ("151.101.0.223", 443), ("10.0.0.1", 80), ("172.17.0.1", 4222)]:
    attempt(f"tcp {{host}}:{{port}}", lambda: socket.create_connection((host, port), timeout=1))
attempt("dns", lambda: socket.getaddrinfo("pypi.org", 443))
def udp():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.sendto(b"x", ("8.8.8.8", 53))
attempt("udp", udp)
print("interfaces", [name for _, name in socket.if_nameindex()])
'''

FORK_BOMB = '''
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
'''

MEMORY_BOMB = "x = bytearray(8 * 1024 ** 3)\n"

MEMORY_CREEP = '''
chunks = []
while True:
    chunks.append(bytearray(16 * 1024 * 1024))
'''

DISK_FILL = '''
import os
written = 0
try:
    with open("/tmp/fill", "wb") as f:
        while True:
            f.write(b"x" * (1 << 20))
            f.flush()
            written += 1 << 20
except OSError as exc:
    print("stopped", type(exc).__name__, exc.errno, written, flush=True)
n = 0
try:
    while True:
        with open(f"/tmp/many{n}", "wb") as f:
            f.write(b"y" * (4 << 20))
        n += 1
except OSError as exc:
    print("many stopped", exc.errno, n, flush=True)
'''

WRITE_OUTSIDE = PRELUDE + '''
for path in {host_paths}:  # host files: not visible; under /tmp the write lands in the private tmpfs
    def write(path=path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write("pwned")
    try:
        write()
        print("tmpfs write", path, flush=True)
    except OSError as exc:
        print("BLOCKED write", path, type(exc).__name__, flush=True)
for path in ["/usr/bin/pwned", "/usr/lib/pwned", "/etc/passwd", "/pwned", "/root/pwned", "/proc/sys/kernel/hostname",
             {project!r} + "/pwned", "/sandbox/main.py", "/dev/pwned"]:
    def write(path=path):
        with open(path, "w") as f:
            f.write("pwned")
    attempt("write " + path, write)
attempt("mkdir /work", lambda: os.makedirs("/work/main"))
attempt("chmod /usr", lambda: os.chmod("/usr/bin", 0o777))
'''

READ_ROOT_FILES = PRELUDE + '''
for path in ["/etc/shadow", "/etc/passwd", "/etc/hostname", "/root/.bash_history", "/root/.ssh/id_rsa",
             "/home", "/var/log", "/run", "/work", {project!r}, {host_file!r}]:
    attempt("read " + path, lambda: print(open(path).read()) if not os.path.isdir(path) else print(os.listdir(path)))
print("root", sorted(os.listdir("/")))
print("uid", os.getuid(), os.geteuid(), os.getgid())
print("caps", [line for line in open("/proc/self/status") if line.startswith("CapEff")][0].split()[1])
'''

PROC_ENVIRON = '''
import os
found = []
for pid in os.listdir("/proc"):
    if pid.isdigit() or pid in ("self", "thread-self"):
        for what in ("environ", "cmdline"):
            try:
                found.append(open(f"/proc/{{pid}}/{{what}}", "rb").read().decode(errors="replace"))
            except OSError as exc:
                found.append(f"{{pid}}/{{what}}: {{type(exc).__name__}}")
for pid in ({host_pid}, os.getppid(), 1):
    try:
        found.append(open(f"/proc/{{pid}}/environ", "rb").read().decode(errors="replace"))
    except OSError as exc:
        found.append(f"{{pid}}: {{type(exc).__name__}}")
print(dict(os.environ))
print("pids", sorted(p for p in os.listdir("/proc") if p.isdigit()))
print("\\n".join(found))
'''

KILL_PARENT = PRELUDE + '''
import signal
attempt("kill host pid", lambda: os.kill({host_pid}, signal.SIGKILL))
attempt("kill host pid group", lambda: os.killpg({host_pid}, signal.SIGKILL))
# the sandbox's own pid 1 (bwrap's helper) and every process of its uid: allowed or not, only the sandbox could die
for label, fn in [("ppid", lambda: os.kill(os.getppid(), signal.SIGKILL)), ("pid 1", lambda: os.kill(1, signal.SIGKILL)),
                  ("every process", lambda: os.kill(-1, signal.SIGKILL))]:
    try:
        fn()
        print("INFO kill", label, "returned", flush=True)
    except OSError as exc:
        print("INFO kill", label, type(exc).__name__, flush=True)
print("alive", flush=True)
'''

PTRACE = PRELUDE + '''
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
PTRACE_ATTACH, PTRACE_SEIZE = 16, 0x4206
def ptrace(request, pid):
    if libc.ptrace(request, pid, None, None) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
attempt("ptrace attach host pid", lambda: ptrace(PTRACE_ATTACH, {host_pid}))
attempt("ptrace seize host pid", lambda: ptrace(PTRACE_SEIZE, {host_pid}))
attempt("host /proc mem", lambda: open("/proc/{host_pid}/mem", "rb").read(16))
'''

DAEMON = '''
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", {daemon!r}, {marker!r}])
    os._exit(0)
print("parent done", flush=True)
{parent_tail}
'''

DAEMON_BODY = '''
import os, socket, sys, time
for fd in (0, 1, 2):
    os.close(fd)  # a real daemon lets go of the output pipes: the run cannot wait for it through them
time.sleep({delay})
open("/tmp/still-alive", "w").write(sys.argv[1])
socket.create_connection(("127.0.0.1", {port}), timeout=1).sendall(sys.argv[1].encode())
'''

SETRLIMIT = PRELUDE + '''
import resource
for name in ("RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_NPROC", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_CORE"):
    which = getattr(resource, name)
    soft, hard = resource.getrlimit(which)
    attempt(f"raise {{name}}", lambda: resource.setrlimit(which, (resource.RLIM_INFINITY, resource.RLIM_INFINITY)))
    if hard != resource.RLIM_INFINITY:
        attempt(f"raise {{name}} hard+1", lambda: resource.setrlimit(which, (hard + 1, hard + 1)))
x = bytearray(1024 ** 3)
'''

LINKS = PRELUDE + '''
def via_symlink(target):
    link = f"/tmp/link{{abs(hash(target))}}"
    os.symlink(target, link)
    print(open(link).read())
for target in [{project!r} + "/services/common/credentials.py", {host_file!r}, "/etc/shadow",
               "/proc/1/root/etc/shadow", "/proc/self/root/../../etc/shadow", "/proc/{host_pid}/root/etc/shadow"]:
    attempt("symlink " + target, lambda: via_symlink(target))
def hardlink(src, dst):
    os.link(src, dst)
    with open(dst, "a") as f:
        f.write("pwned")
attempt("hardlink /usr/bin/python3", lambda: hardlink("/usr/bin/python3", "/tmp/py"))
attempt("hardlink /proc/self/exe", lambda: hardlink("/proc/self/exe", "/tmp/exe"))
attempt("rename out of /tmp", lambda: os.rename("/tmp", "/usr/tmp2"))
'''

CTYPES = PRELUDE + '''
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWPID = 0x00020000, 0x10000000, 0x40000000, 0x20000000
def call(name, *args):
    if getattr(libc, name)(*args) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
attempt("unshare user", lambda: call("unshare", CLONE_NEWUSER))
attempt("unshare user+net", lambda: call("unshare", CLONE_NEWUSER | CLONE_NEWNET))
attempt("unshare net", lambda: call("unshare", CLONE_NEWNET))
attempt("unshare mount", lambda: call("unshare", CLONE_NEWNS))
attempt("mount tmpfs", lambda: call("mount", b"none", b"/usr", b"tmpfs", 0, None))
attempt("umount /usr", lambda: call("umount2", b"/usr", 2))
attempt("remount /usr rw", lambda: call("mount", None, b"/usr", None, 0x20 | 0x1000, None))
attempt("setuid 0", lambda: call("setuid", 0))
attempt("chroot", lambda: call("chroot", b"/tmp"))
attempt("setns", lambda: call("setns", os.open("/proc/1/ns/net", os.O_RDONLY), 0))
attempt("reboot", lambda: call("reboot", 0x01234567))
attempt("sethostname", lambda: call("sethostname", b"pwned", 5))
'''

IGNORE_SIGNALS = '''
import signal
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGXCPU, signal.SIGALRM):
    signal.signal(sig, signal.SIG_IGN)
while True:
    pass
'''

SLEEP = "import time\ntime.sleep(60)\nprint('woke up')\n"

CPU_THREADS = '''
import threading
def burn():
    while True:
        pass
for _ in range(8):
    threading.Thread(target=burn).start()
'''

HUGE_OUTPUT = '''
import sys
chunk = "x" * (1 << 20)
for _ in range(40):
    sys.stdout.write(chunk)
    sys.stderr.write(chunk)
print("end")
'''

ENDLESS_OUTPUT = '''
import os
chunk = b"y" * (1 << 16)
while True:
    os.write(1, chunk)
    os.write(2, chunk)
'''

PROJECT_IMPORT = PRELUDE + '''
import glob
attempt("import services.common.credentials", lambda: __import__("services.common.credentials"))
sys.path[:0] = [{project!r}, "/work/main", "/work"]
attempt("import with the project on sys.path", lambda: __import__("services.common.credentials"))
print("found", glob.glob({project!r} + "/runs/*/*") + glob.glob("/work/*/runs/*/*") + glob.glob("/*/secret*"))
for path in {host_paths}:
    attempt("read " + path, lambda: print(open(path).read()))
'''

FDS = '''
import os
print("fds", sorted(int(fd) for fd in os.listdir("/proc/self/fd")))
'''

UNIX_SOCKETS = PRELUDE + '''
import socket
def connect(address):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1)
    s.connect(address)
attempt("abstract unix socket", lambda: connect({abstract!r}))
attempt("filesystem unix socket", lambda: connect({path!r}))
for path in ["/run/docker.sock", "/var/run/docker.sock", "/run/systemd/private", "/tmp/.X11-unix/X0"]:
    attempt("unix " + path, lambda: connect(path))
attempt("raw socket", lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP))
attempt("packet socket", lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW))
'''

DESCRIPTOR_BOMB = '''
import os
opened = []
try:
    while True:
        opened.append(os.open("/dev/null", os.O_RDONLY))
except OSError as exc:
    print("stopped", exc.errno, len(opened))
'''

THREAD_BOMB = '''
import threading, time
started = 0
try:
    while True:
        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
        started += 1
except (RuntimeError, MemoryError) as exc:
    print("stopped", type(exc).__name__, started, flush=True)
import os
os._exit(0)
'''

NEIGHBOUR_KILLER = '''
import os, signal
others = [p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]
print("visible", others)
for pid in range(2, 32768):
    if pid != os.getpid():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
print("done")
'''

NEIGHBOUR = "import time\ntime.sleep(3)\nprint('survived')\n"
