"""Sandbox: correct verdicts, no writes outside its directory, killed at time and memory limits,
and started without forking this (JAX-multithreaded) process."""

import asyncio
import os
import resource
import shutil
import tempfile
import warnings

import jax
import pytest

from gyre.envs import sandbox
from gyre.envs.sandbox import SandboxLimits, network_isolated, run_tests

FORKS = []  # one entry per Python-level fork (os.fork, or subprocess with a preexec_fn)
os.register_at_fork(before=lambda: FORKS.append(1))

TESTS = [((1, 2), 3), ((2, 2), 4)]


def run(src, **limits):
    return asyncio.run(run_tests(src, "add", TESTS, SandboxLimits(**limits)))


@pytest.fixture
def open_dir():
    """A world-writable directory outside the sandbox: only the sandbox itself protects it."""
    path = tempfile.mkdtemp(prefix="gyre-outside-")
    os.chmod(path, 0o777)
    yield path
    shutil.rmtree(path)


def test_verdicts_per_test():
    assert run("def add(a, b):\n    return a + b\n").results == ("pass", "pass")
    res = run("def add(a, b):\n    return 3\n")
    assert (res.status, res.results, res.passed) == ("ok", ("pass", "fail"), 1)
    assert run("def add(a, b):\n    return 1 / 0\n").results == ("error:ZeroDivisionError",) * 2
    res = run("def add(a, b) return")
    assert res.status == "error" and "SyntaxError" in res.detail


def test_an_always_equal_object_does_not_pass():
    src = "class Eq:\n    def __eq__(self, o): return True\ndef add(a, b):\n    return Eq()\n"
    assert run(src).passed == 0


def test_cannot_write_or_delete_outside_its_directory(open_dir):
    outside = os.path.join(open_dir, "outside.txt")
    with open(outside, "w") as f:
        f.write("keep")
    os.chmod(outside, 0o666)
    target = os.path.join(open_dir, "new.txt")
    escape = "/tmp/gyre_sbx_escape"
    attempts = [
        f"open({target!r}, 'w').write('x')",
        "open('../gyre_sbx_escape', 'w').write('x')",
        f"import os; os.remove({outside!r})",
        f"import os; os.rename({outside!r}, 'stolen.txt')",
        f"import os; os.close(os.open({target!r}, os.O_WRONLY | os.O_CREAT))",
        f"import os; os.system('touch {escape}')",
        "import subprocess; subprocess.run(['true'])",
    ]
    for stmt in attempts:
        res = run(f"def add(a, b):\n    {stmt}\n    return a + b\n")
        assert res.results == ("error:PermissionError",) * 2, stmt
    assert os.listdir(open_dir) == ["outside.txt"]
    with open(outside) as f:
        assert f.read() == "keep"
    assert not os.path.exists(escape)
    inside = run("def add(a, b):\n    open('notes.txt', 'w').write('ok')\n    return a + b\n")
    assert inside.results == ("pass", "pass")  # writing inside the sandbox is fine


def test_no_network():
    res = run(
        "def add(a, b):\n    import socket\n    socket.create_connection(('1.1.1.1', 53), 1)\n"
    )
    assert res.results == ("error:PermissionError",) * 2
    assert isinstance(network_isolated(), bool)


def test_killed_at_wall_and_cpu_limits_and_reported():
    res = run("def add(a, b):\n    while True: pass\n", cpu_seconds=5, wall_seconds=0.3)
    assert res.status == "timeout" and "wall" in res.detail
    res = run("import time\nt = time.process_time()\nwhile True: pass\n", cpu_seconds=1,
              wall_seconds=30)  # fmt: skip
    assert res.status == "timeout" and "CPU" in res.detail


def test_memory_limit():
    res = run("def add(a, b):\n    x = bytearray(2**30)\n    return a + b\n",
              memory_bytes=256 * 2**20)  # fmt: skip
    assert res.status == "memory" and res.results == ("error:MemoryError",) * 2
    assert run("X = bytearray(2**30)\ndef add(a, b):\n    return a + b\n",
               memory_bytes=256 * 2**20).status == "memory"  # fmt: skip


def test_file_size_limit():
    """Python ignores SIGXFSZ, so a write past RLIMIT_FSIZE fails with OSError (EFBIG)."""
    workdir = tempfile.mkdtemp(prefix="gyre-sbx-test-")
    try:
        src = "def add(a, b):\n    open('big.bin', 'wb').write(b'x' * 2**21)\n    return a + b\n"
        res = asyncio.run(run_tests(src, "add", TESTS, SandboxLimits(file_bytes=2**20), workdir))
        assert res.results == ("error:OSError",) * 2
        assert os.path.getsize(os.path.join(workdir, "big.bin")) == 2**20
    finally:
        shutil.rmtree(workdir)


def test_limits_and_user_seen_by_the_untrusted_code():
    limits = SandboxLimits(cpu_seconds=3, memory_bytes=300 * 2**20, file_bytes=12345)
    expected = [[3, 4], [limits.memory_bytes] * 2, [12345] * 2, [0, 0]]
    src = (
        "import resource\n"
        "def limits():\n"
        "    open('mine.txt', 'w').write('x')\n"
        "    return [list(resource.getrlimit(getattr(resource, 'RLIMIT_' + r)))\n"
        "            for r in ('CPU', 'AS', 'FSIZE', 'CORE')]\n"
    )
    workdir = tempfile.mkdtemp(prefix="gyre-sbx-test-")
    try:
        res = asyncio.run(run_tests(src, "limits", [((), expected)], limits, workdir))
        assert res.results == ("pass",), res
        owner = os.stat(os.path.join(workdir, "mine.txt")).st_uid
        assert owner == (sandbox.NOBODY if sandbox.interpreter()[1] else os.geteuid())
    finally:
        shutil.rmtree(workdir)
    assert resource.getrlimit(resource.RLIMIT_AS) != (limits.memory_bytes,) * 2  # not ours


def test_started_without_forking_the_jax_process():
    """No os.fork (nor a preexec_fn, which forces one) here: JAX's threads make that a
    deadlock risk, and JAX warns about it once a backend is up."""
    jax.numpy.ones(3).sum().block_until_ready()  # a backend (threads, the fork warning) is up
    network_isolated.cache_clear()  # so that its probe runs again, here
    before = len(FORKS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert isinstance(network_isolated(), bool)
        assert run("def add(a, b):\n    return a + b\n").results == ("pass", "pass")
        assert run("def add(a, b):\n    while True: pass\n", wall_seconds=0.3).status == "timeout"
    forks = [w for w in caught if "fork" in str(w.message)]
    assert not forks, [str(w.message) for w in forks]
    assert len(FORKS) == before


def test_a_launcher_that_cannot_start_is_an_infrastructure_error(monkeypatch):
    monkeypatch.setattr(sandbox, "network_isolated", lambda: True)
    monkeypatch.setattr(sandbox, "_unshare", lambda: "/nonexistent/unshare")
    with pytest.raises(OSError, match="sandbox launcher failed"):
        run("def add(a, b):\n    return a + b\n")
