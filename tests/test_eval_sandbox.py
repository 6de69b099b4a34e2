"""The code-execution sandbox: time, memory, filesystem and network limits (both isolation levels)."""

import os
import socket
import uuid
from pathlib import Path

import pytest

from fbs.eval.sandbox import isolation_level, run_program

LEVELS = ["audit"] + (["namespace"] if isolation_level() == "namespace" else [])


@pytest.fixture(params=LEVELS)
def level(request):
    return request.param


def test_passing_and_failing_programs(level):
    assert run_program("assert sum([1, 2]) == 3\nprint('hi')", level=level).passed
    r = run_program("assert 1 == 2", level=level)
    assert r.status == "failed" and "AssertionError" in r.stderr


def test_infinite_loop_is_killed(level):
    r = run_program("while True:\n    pass", timeout=1.5, level=level)
    assert r.status in ("timeout", "killed") and not r.passed
    assert r.seconds < 10


def test_memory_limit(level):
    r = run_program("x = bytearray(600 * 1024 * 1024)\nprint(len(x))", memory_mb=256, level=level)
    assert not r.passed and "MemoryError" in r.stderr


@pytest.mark.parametrize("guard", [True, False])
def test_writes_outside_the_directory_are_blocked(level, guard, tmp_path):
    if level == "audit" and not guard:
        pytest.skip("the audit level has no OS-level filesystem isolation")
    target = Path.cwd() / f"fbs-sandbox-escape-{uuid.uuid4().hex}.txt"
    r = run_program(f"open({str(target)!r}, 'w').write('x')", level=level, guard=guard)
    try:
        assert not r.passed and not target.exists()
    finally:
        target.unlink(missing_ok=True)
    # inside its own directory the program may write and read back
    ok = run_program("open('out.txt', 'w').write('data')\nassert open('out.txt').read() == 'data'", level=level, guard=guard)
    assert ok.passed, ok.stderr


@pytest.mark.parametrize("guard", [True, False])
def test_network_is_blocked(level, guard):
    if level == "audit" and not guard:
        pytest.skip("the audit level blocks sockets only through the audit hook")
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    try:
        r = run_program(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n", level=level, guard=guard)
    finally:
        srv.close()
    assert not r.passed
    assert ("PermissionError" in r.stderr) or ("unreachable" in r.stderr.lower()) or ("Errno" in r.stderr)


def test_subprocess_and_kill_are_blocked_by_the_guard(level):
    assert not run_program("import subprocess\nsubprocess.run(['true'])", level=level).passed
    assert not run_program(f"import os\nos.kill({os.getpid()}, 0)", level=level).passed


@pytest.mark.skipif(isolation_level() != "namespace", reason="needs the namespace sandbox")
def test_namespace_hides_host_processes():
    r = run_program("import os\nprint(os.getpid(), len([p for p in os.listdir('/proc') if p.isdigit()]))",
                    level="namespace", guard=False)
    pid, n = map(int, r.stdout.split())
    assert pid == 1 and n <= 2
