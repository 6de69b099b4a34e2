"""Run untrusted generated code (HumanEval / MBPP completions) in a restricted subprocess.

Threat model. The code comes from a language model, not from an adversary who studies this file: we
defend against accidents and careless programs (infinite loops, memory blow-ups, deleting or overwriting
files, network calls, killing other processes, fork storms), and we make deliberate escape hard, not
impossible. Do not run code from untrusted humans with this.

Two isolation levels; :func:`isolation_level` reports which one works on the running machine:

``namespace`` (Linux, root or CAP_SYS_ADMIN, ``unshare`` and ``setpriv`` from util-linux on PATH)
    ``unshare --mount --net --pid --ipc --uts --fork --mount-proc --kill-child``:
    - network: a fresh network namespace with no interface up -> every connect fails (ENETUNREACH);
    - filesystem: in the private mount namespace every mount is remounted read-only, then a fresh
      size-limited tmpfs is mounted on /tmp and becomes the program's cwd (the private temporary
      directory; it vanishes with the namespace). Writes anywhere else fail with EROFS;
    - processes: a PID namespace, so the program sees and can signal only its own processes, and killing
      the namespace's init (on timeout) kills everything it started;
    - privileges: before exec, ``setpriv`` clears the capability bounding set and sets no_new_privs, so
      the program (still uid 0) cannot remount, mount, or regain capabilities.
``audit`` (any other machine)
    A plain subprocess started in a private temporary directory (its cwd), plus an in-process Python
    audit hook (``sys.addaudithook``) that raises on socket creation/connection, on opening a file for
    writing outside the directory, on rename/remove/mkdir/chmod outside it, and on fork/exec/subprocess.
    This is a guard against accidents only: C extensions or ``ctypes`` can bypass audit hooks.

In both levels: ``resource.setrlimit`` caps address space (memory), CPU seconds, file size, open files
and core dumps; a wall-clock timeout kills the whole process group; the interpreter runs in isolated
mode (``-I``: no user site, no PYTHON* env vars, no cwd on sys.path) with a minimal environment; and the
audit hook is installed in ``namespace`` mode too, as a second layer. Not covered: CPU/memory
consumption of the machine within the limits, and a kernel exploit.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

#: Default limits for one program.
TIMEOUT_S = 10.0
MEMORY_MB = 1024
FILE_SIZE_MB = 16
TMPFS_MB = 64

_NAMESPACE_SCRIPT = r"""
set -e
awk '{print $2}' /proc/self/mounts | sort -u | while read -r mp; do
  mount -o remount,bind,ro "$mp" 2>/dev/null || true
done
mount -t tmpfs -o size=__TMPFS__m,mode=1777 tmpfs /tmp
cat > /tmp/__main__.py
cd /tmp
exec setpriv --bounding-set=-all --inh-caps=-all --no-new-privs -- __PYTHON__ -I -B /tmp/__main__.py </dev/null
"""

# Prepended to every program: the audit-hook guard. Written without imports the program could shadow.
_GUARD = textwrap.dedent(r'''
    import sys as _sys, os as _os
    def _fbs_guard():
        root = _os.path.realpath(_os.getcwd())
        def inside(path):
            try:
                p = _os.path.realpath(_os.fsdecode(path) if not isinstance(path, int) else root)
            except Exception:
                return False
            return p == root or p.startswith(root + _os.sep)
        blocked_prefixes = ("socket.", "subprocess.", "os.fork", "os.exec", "os.posix_spawn",
                            "os.spawn", "os.system", "os.kill", "os.killpg", "pty.", "ctypes.dlopen")
        path_events = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
                       "os.truncate", "os.symlink", "os.link", "shutil.rmtree", "os.utime"}
        def hook(event, args):
            if event.startswith(blocked_prefixes):
                raise PermissionError(f"sandbox: {event} is not allowed")
            if event == "open" and args and args[0] is not None and not isinstance(args[0], int):
                mode = args[1] if len(args) > 1 and isinstance(args[1], str) else "r"
                flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
                writing = any(c in mode for c in "wax+") or flags & (_os.O_WRONLY | _os.O_RDWR | _os.O_CREAT)
                if writing and not inside(args[0]):
                    raise PermissionError(f"sandbox: write outside the working directory: {args[0]}")
            elif event in path_events:
                for a in args[:2]:
                    if isinstance(a, (str, bytes, _os.PathLike)) and not inside(a):
                        raise PermissionError(f"sandbox: {event} outside the working directory: {a}")
        _sys.addaudithook(hook)
    _fbs_guard()
    del _fbs_guard
''')


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """Outcome of one program: ``passed`` means exit status 0 within the limits."""

    passed: bool
    status: str
    """"passed", "failed" (non-zero exit), "timeout" (wall clock) or "killed" (signal, e.g. CPU limit)."""
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float


@functools.lru_cache(maxsize=None)
def isolation_level() -> str:
    """"namespace" when the unshare-based sandbox works on this machine, else "audit"."""
    if sys.platform != "linux" or not (shutil.which("unshare") and shutil.which("setpriv")):
        return "audit"
    try:
        r = run_program("print('ok')", timeout=20.0, level="namespace")
    except OSError:
        return "audit"
    return "namespace" if r.passed and r.stdout.strip() == "ok" else "audit"


def _limits(memory_mb: int, cpu_s: int, file_mb: int):
    def apply() -> None:
        mem = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_DATA, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb * 1024 * 1024,) * 2)
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def run_program(
    source: str,
    timeout: float = TIMEOUT_S,
    memory_mb: int = MEMORY_MB,
    level: str | None = None,
    file_size_mb: int = FILE_SIZE_MB,
    guard: bool = True,
) -> SandboxResult:
    """Run ``source`` as a Python program in the sandbox and report how it ended.

    ``guard=False`` leaves out the audit hook (tests use it to check the OS-level layer alone).
    """
    level = level or isolation_level()
    program = (_GUARD + "\n" + source) if guard else source
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0", "HOME": "/tmp"}
    limits = _limits(memory_mb, max(1, int(timeout) + 1), file_size_mb)
    workdir = None
    if level == "namespace":
        script = (_NAMESPACE_SCRIPT.replace("__TMPFS__", str(TMPFS_MB))
                  .replace("__PYTHON__", sys.executable))
        argv = ["unshare", "--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--mount-proc",
                "--propagation", "private", "--kill-child=SIGKILL", "--", "/bin/sh", "-c", script]
        cwd = "/"
    elif level == "audit":
        workdir = tempfile.mkdtemp(prefix="fbs-sandbox-")
        with open(os.path.join(workdir, "__main__.py"), "w") as f:
            f.write(program)
        argv = [sys.executable, "-I", "-B", "__main__.py"]
        env["HOME"] = workdir
        cwd = workdir
    else:
        raise ValueError(f"unknown sandbox level {level!r}")
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, preexec_fn=limits, start_new_session=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(program.encode() if level == "namespace" else b"", timeout=timeout)
        status = "passed" if proc.returncode == 0 else ("killed" if proc.returncode < 0 else "failed")
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        status = "timeout"
    finally:
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
    elapsed = time.perf_counter() - start
    return SandboxResult(passed=status == "passed", status=status, returncode=proc.returncode,
                         stdout=out.decode(errors="replace")[-4000:], stderr=err.decode(errors="replace")[-4000:],
                         seconds=elapsed)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
