"""Sandbox (bubblewrap): correct verdicts judged outside, every escape a hostile review found
closed (files, processes, sockets, reads, forged results, output, limits), and started without
forking this (JAX-multithreaded) process. Tests that run programs are marked ``sandbox``:
tests/conftest.py skips them, with the reason, where the sandbox cannot run here (fails them in
CI). No wall-clock bound is asserted: each limit shows as the status it produces (a run that
waited for what it should not have would end as a ``timeout`` at its generous wall limit)."""

import asyncio
import os
import shutil
import socket
import tempfile
import textwrap
import time
import tracemalloc
import uuid
import warnings

import jax
import pytest

from gyre.envs import code, sandbox
from gyre.envs.sandbox import (
    MARK,
    SandboxLimits,
    SandboxUnavailable,
    isolation_available,
    run_tests,
)

FORKS = []  # one entry per Python-level fork (os.fork, or subprocess with a preexec_fn)
os.register_at_fork(before=lambda: FORKS.append(1))

TESTS = [((1, 2), 3), ((2, 2), 4)]
FAST = dict(wall_seconds=10.0)  # generous: nothing in these tests should get near it


sandboxed = pytest.mark.sandbox  # availability: tests/conftest.py


def run(src, tests=TESTS, fn="add", sandbox_dir=None, **limits):
    limits = SandboxLimits(**{**FAST, **limits})
    return asyncio.run(run_tests(textwrap.dedent(src), fn, tests, limits, sandbox_dir))


def probe(body, **limits):
    """Runs ``def probe(): <body>`` once; returns (result, what it returned)."""
    src = "def probe():\n" + textwrap.indent(textwrap.dedent(body), "    ")
    res = run(src, [((), None)], "probe", **limits)
    assert res.status == "ok", res
    return res, res.outputs[0]


def live_pids(uid):
    """Processes (not zombies) whose real uid is ``uid``, read from /proc here."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(ln.split(":", 1) for ln in f.read().splitlines() if ":" in ln)
        except OSError:
            continue
        if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith("Z"):
            found.append(int(pid))
    return found


def cmdlines_with(token):
    hits = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if token.encode() in f.read():
                    hits.append(int(pid))
        except OSError:
            pass
    return hits


@pytest.fixture
def open_dir():
    """A world-writable directory in the host's /tmp: only the sandbox itself protects it."""
    path = tempfile.mkdtemp(prefix="gyre-outside-")
    os.chmod(path, 0o777)
    yield path
    shutil.rmtree(path)


# ------------------------------------------------------------------------- verdicts


@sandboxed
def test_verdicts_per_test():
    res = run("def add(a, b):\n    return a + b\n")
    assert (res.status, res.results, res.outputs) == ("ok", ("pass", "pass"), (3, 4))
    res = run("def add(a, b):\n    return 3\n")
    assert (res.status, res.results, res.passed) == ("ok", ("pass", "fail"), 1)
    assert run("def add(a, b):\n    return 1 / 0\n").results == ("error:ZeroDivisionError",) * 2
    res = run("def add(a, b) return")
    assert (res.status, res.results) == ("error", ()) and "SyntaxError" in res.detail
    res = run("def other(a, b):\n    return a + b\n")
    assert res.status == "error" and "AttributeError" in res.detail
    res = run("import sys\nsys.exit(0)\n")
    assert res.status == "error" and "SystemExit" in res.detail


@sandboxed
def test_types_are_compared_strictly_through_json():
    src = "def f(x):\n    return x\n"
    cases = [((True,), 1), ((1,), True), ((1,), 1.0), ((1.0,), 1), ((None,), 0), (("1",), 1)]
    assert run(src, cases, "f").results == ("fail",) * len(cases)
    same = [((True,), True), ((1,), 1), ((2.5,), 2.5), (("s",), "s"), (([1, [2]],), [1, [2]]),
            (({"k": 1},), {"k": 1}), ((None,), None)]  # fmt: skip
    assert run(src, same, "f").results == ("pass",) * len(same)


@sandboxed
def test_an_always_equal_object_does_not_pass():
    for base in ("object", "int", "str", "list"):
        src = f"class Eq({base}):\n    def __eq__(self, o): return True\n    def __ne__(self, o): return False\n"
        src += "def add(a, b):\n    return Eq()\n"
        res = run(src)
        assert (res.status, res.passed) == ("ok", 0), (base, res)


# ------------------------------------------------------------------------ filesystem


@sandboxed
def test_cannot_create_change_or_delete_anything_on_the_host(open_dir, tmp_path):
    outside = os.path.join(open_dir, "outside.txt")
    with open(outside, "w") as f:
        f.write("keep")
    os.chmod(outside, 0o666)
    os.chmod(tmp_path, 0o777)
    token = uuid.uuid4().hex
    tmp_name = f"/tmp/gyre-escape-{token}"
    body = f"""
        import os, sqlite3, subprocess, sys
        import __main__
        __main__.__dict__["sandboxed"] = False  # no in-process guard to switch off any more
        out = {{}}
        def attempt(name, f):
            try:
                r = f()
                out[name] = "ok" if r in (None, 0) or not isinstance(r, int) else "status %d" % r
            except BaseException as exc:
                out[name] = type(exc).__name__
        def db(path):
            sqlite3.connect(path).execute("create table t(x)")
        def write(path):
            with open(path, "w") as f:
                f.write("x")
        attempt("open_dir", lambda: write({open_dir!r} + "/new.txt"))
        attempt("tmp_path", lambda: write({str(tmp_path)!r} + "/new.txt"))
        attempt("sqlite_open_dir", lambda: db({open_dir!r} + "/x.db"))
        attempt("sqlite_tmp_path", lambda: db({str(tmp_path)!r} + "/x.db"))
        attempt("sqlite_tmp", lambda: db({tmp_name!r} + ".db"))
        attempt("private_tmp", lambda: write({tmp_name!r} + ".txt"))
        attempt("remove", lambda: os.remove({outside!r}))
        attempt("rename", lambda: os.rename({outside!r}, "stolen.txt"))
        attempt("root", lambda: write("/escape.txt"))
        attempt("usr", lambda: write("/usr/escape.txt"))
        attempt("dev", lambda: write("/dev/shm/escape.txt"))
        attempt("os_system", lambda: os.system("echo x > {open_dir}/sh.txt"))
        sh = ["/bin/sh", "-c", "echo x > {tmp_path}/sh.txt"]
        attempt("subprocess_sh", lambda: subprocess.run(sh).returncode)
        attempt("sh_private_tmp", lambda: os.system("touch {tmp_name}.sh"))
        attempt("fork_exec", lambda: subprocess.Popen(["/usr/bin/touch", {open_dir!r} + "/t"]).wait())
        attempt("inside", lambda: write("notes.txt"))
        out["read_back"] = open("notes.txt").read()
        return out
    """
    workdir = tempfile.mkdtemp(prefix="gyre-sbx-test-")
    try:
        src = "def probe():\n" + textwrap.indent(textwrap.dedent(body), "    ")
        res = run(src, [((), None)], "probe", sandbox_dir=workdir)
        assert res.status == "ok", res
        seen = res.outputs[0]
        assert seen["read_back"] == "x"  # writing its own (tmpfs) directory works ...
        assert os.listdir(workdir) == ["solution.py"]  # ... and never reaches the judge's
    finally:
        shutil.rmtree(workdir)
    assert seen["inside"] == seen["private_tmp"] == seen["sqlite_tmp"] == "ok", seen
    assert seen["sh_private_tmp"] == "ok", seen
    for name in ("open_dir", "tmp_path", "sqlite_open_dir", "sqlite_tmp_path", "remove", "rename",
                 "root", "usr", "dev"):  # fmt: skip
        assert seen[name] not in ("ok", "status 0"), (name, seen)
    for name in ("os_system", "subprocess_sh", "fork_exec"):  # the shell runs; its writes fail
        assert seen[name].startswith("status "), (name, seen)
    assert os.listdir(open_dir) == ["outside.txt"] and os.listdir(tmp_path) == []
    with open(outside) as f:
        assert f.read() == "keep"
    assert not [p for p in os.listdir("/tmp") if token in p]  # its /tmp was private


@sandboxed
def test_cannot_read_the_host():
    project = os.path.dirname(os.path.dirname(os.path.abspath(code.__file__)))
    paths = ["/etc/passwd", "/etc", os.path.abspath(code.__file__), project, "/root", "/home",
             os.path.expanduser("~"), os.getcwd()]  # fmt: skip
    res, seen = probe(f"""
        import os
        out = {{}}
        for p in {paths!r}:
            try:
                out[p] = "read:" + (open(p).read(20) if os.path.isfile(p) else repr(os.listdir(p)))
            except BaseException as exc:
                out[p] = type(exc).__name__
        out["/"] = sorted(os.listdir("/"))
        out["uid"] = [os.getuid(), os.geteuid(), os.getgid(), os.getgroups()]
        out["env"] = dict(os.environ)
        return out
    """)
    for p in paths:
        assert not seen[p].startswith("read:"), (p, seen[p])
    assert set(seen["/"]) <= {"bin", "dev", "lib", "lib32", "lib64", "libx32", "proc", "sandbox",
                              "sbin", "tmp", "usr"}, seen["/"]  # fmt: skip
    assert seen["uid"] == [res.uid, res.uid, res.uid, []] and res.uid > 0
    assert set(seen["env"]) <= {"PATH", "HOME", "LANG", "PWD"}, seen["env"]


@sandboxed
def test_file_size_limit():
    """Python ignores SIGXFSZ, so a write past RLIMIT_FSIZE fails with OSError (EFBIG)."""
    src = """
        import os
        def add(a, b):
            try:
                open('big.bin', 'wb').write(b'x' * 2**21)
            except OSError:
                return os.path.getsize('big.bin')
    """
    res = run(src, file_bytes=2**20)
    assert res.outputs == (2**20, 2**20)


@sandboxed
def test_limits_and_user_seen_by_the_untrusted_code():
    limits = dict(cpu_seconds=3, memory_bytes=300 * 2**20, file_bytes=12345, processes=9,
                  open_files=33)  # fmt: skip
    res, seen = probe("""
        import os, resource
        names = ("CPU", "AS", "FSIZE", "CORE", "NOFILE", "NPROC")
        return [list(resource.getrlimit(getattr(resource, "RLIMIT_" + r))) for r in names]
    """, **limits)  # fmt: skip
    assert seen == [[3, 4], [300 * 2**20] * 2, [12345] * 2, [0, 0], [33, 33], [9, 9]]
    import resource

    assert resource.getrlimit(resource.RLIMIT_AS) != (300 * 2**20,) * 2  # not ours


# ------------------------------------------------------------------------- processes


@sandboxed
def test_no_process_outlives_the_run():
    """setsid'd, double-forked, spawned through subprocess (_posixsubprocess.fork_exec) and
    backgrounded by a shell: all gone when run_tests returns, without waiting for them."""
    token = f"{time.time() % 1000 + 100:.6f}"  # a unique sleep length to find them by
    body = f"""
        import os, subprocess, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv("/bin/sleep", ["sleep", "{token}"])
            os._exit(0)
        subprocess.Popen(["/bin/sleep", "{token}"], start_new_session=True)
        subprocess.run(["/bin/sh", "-c", "nohup /bin/sleep {token} >/dev/null 2>&1 &"])
        return "spawned"
    """
    res, seen = probe(body, wall_seconds=30)  # "ok", not "timeout": it did not wait for them
    assert seen == "spawned"
    assert live_pids(res.uid) == [] and cmdlines_with(token) == []


@sandboxed
def test_fork_bomb_is_contained():
    src = """
        import os, signal
        def add(a, b):
            n = 0
            while True:
                try:
                    pid = os.fork()
                except OSError:
                    return n
                if pid == 0:
                    while True:  # each child bombs on, then waits
                        try:
                            os.fork()
                        except OSError:
                            signal.pause()
                n += 1
    """
    res = run(src, [((1, 2), 3)], processes=12, wall_seconds=30)  # "ok": ended before the wall
    assert res.status == "ok" and res.outputs[0] < 12
    assert live_pids(res.uid) == []


@sandboxed
def test_concurrent_runs_get_their_own_uid_so_a_fork_bomb_starves_nobody_else():
    bomb = "import os\ndef add(a, b):\n    while True:\n        os.fork()\n"
    good = "def add(a, b):\n    return a + b\n"
    limits = SandboxLimits(processes=8, wall_seconds=2.0)

    async def both():
        return await asyncio.gather(run_tests(bomb, "add", TESTS, limits),
                                    run_tests(good, "add", TESTS, limits))  # fmt: skip

    bombed, fine = asyncio.run(both())
    assert fine.results == ("pass", "pass") and bombed.passed == 0
    assert bombed.uid != fine.uid and live_pids(bombed.uid) == live_pids(fine.uid) == []


# --------------------------------------------------------------------------- network


@sandboxed
def test_no_host_sockets_nor_network(open_dir):
    path = os.path.join(open_dir, "host.sock")
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(path)
    os.chmod(path, 0o777)
    abstract = socket.socket(socket.AF_UNIX)
    abstract_name = f"\0gyre-test-{uuid.uuid4().hex}"
    abstract.bind(abstract_name)
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    listeners = [unix, abstract, tcp]
    for s in listeners:
        s.listen(8)
        s.setblocking(False)
    try:
        _, seen = probe(f"""
            import socket
            out = {{}}
            for name, family, addr in (("unix", socket.AF_UNIX, {path!r}),
                                       ("abstract", socket.AF_UNIX, {abstract_name!r}),
                                       ("tcp", socket.AF_INET, ("127.0.0.1", {tcp.getsockname()[1]})),
                                       ("internet", socket.AF_INET, ("1.1.1.1", 53))):
                s = socket.socket(family)
                s.settimeout(1)
                try:
                    s.connect(addr)
                    out[name] = "connected"
                except BaseException as exc:
                    out[name] = type(exc).__name__
            return out
        """)
        assert "connected" not in seen.values(), seen
        for s in listeners:
            with pytest.raises(BlockingIOError):
                s.accept()
    finally:
        for s in listeners:
            s.close()


# --------------------------------------------------------------------------- judging


@sandboxed
def test_expected_answers_are_nowhere_the_program_can_look():
    """The program searches everything it can reach (objects, frames, modules, argv, environ,
    stdin, files, /proc) for the expected answer; it finds the input (so the search works),
    never the answer."""
    secret, canary = f"EXPECTED-{uuid.uuid4().hex}", f"INPUT-{uuid.uuid4().hex}"
    src = textwrap.dedent(f"""
        import gc, os, stat, sys
        def look(arg):
            gc.collect()  # not to find its own leftovers from the previous test
            wanted = {{"secret": "".join(reversed({secret[::-1]!r})),
                      "canary": "".join(reversed({canary[::-1]!r}))}}
            mine = {{id(wanted)}} | {{id(w) for w in wanted.values()}}
            needles = {{k: (w, w.encode()) for k, w in wanted.items()}}
            mine |= {{id(n) for pair in needles.values() for n in pair}} | {{id(needles)}}
            hits = {{k: set() for k in wanted}}
            def check(x, where):
                if id(x) in mine:
                    return
                for k, (s, b) in needles.items():
                    if (isinstance(x, str) and s in x) or (isinstance(x, (bytes, bytearray)) and b in x):
                        hits[k].add(where)
            def scan(obj, where):
                if isinstance(obj, dict):
                    for kv in obj.items():
                        for x in kv:
                            check(x, where)
                elif isinstance(obj, (list, tuple, set, frozenset)):
                    for x in obj:
                        check(x, where)
            for obj in gc.get_objects():
                if id(obj) not in mine:
                    scan(obj, "objects")
            for frame in sys._current_frames().values():
                while frame is not None:
                    scan(frame.f_locals, "frames")
                    scan(frame.f_globals, "frames")
                    scan(frame.f_code.co_consts, "frames")
                    frame = frame.f_back
            for name, mod in list(sys.modules.items()):
                scan(vars(mod), "modules")
            scan(sys.argv, "argv")
            scan(getattr(sys, "orig_argv", []), "argv")
            scan(dict(os.environ), "environ")
            check(os.read(0, 1 << 20), "stdin")
            paths = ["/proc/self/cmdline", "/proc/self/environ", "/proc/1/cmdline",
                     "/proc/1/environ"] + ["/proc/%s/cmdline" % p for p in os.listdir("/proc")
                                           if p.isdigit()]
            for top in ("/sandbox", "/tmp", "/dev"):
                for d, _, files in os.walk(top):
                    paths += [os.path.join(d, f) for f in files]
            for p in paths:
                try:
                    if not stat.S_ISREG(os.stat(p).st_mode):  # not pipes (its own stdout)
                        continue
                    with open(p, "rb") as f:
                        check(f.read(1 << 20), "file " + p)
                except OSError:
                    pass
            return {{k: sorted(v) for k, v in hits.items()}}
    """)
    tests = [((canary,), secret), ((canary,), secret + "-2")]
    res = run(src, tests, "look")
    assert res.status == "ok" and res.results == ("fail", "fail")
    assert res.outputs[0]["secret"] == [] and res.outputs[1]["secret"] == [], res.outputs
    assert "objects" in res.outputs[0]["canary"], res.outputs  # the search does find things


MALFORMED = [
    f"\n{MARK}0 value {{\n".encode(),
    f"\n{MARK}0\n".encode(),
    f"\n{MARK}x value 3\n".encode(),
    f"\n{MARK}99999999999 value 3\n".encode(),
    f"\n{MARK}-1 value 3\n".encode(),
    f"\n{MARK}1 error ../../x\n".encode(),
    f"\n{MARK}1 value ".encode() + b"\xff\xfe\n",
    f"\n{MARK}0 value ".encode() + b"[" * 100000 + b"\n",
    f"\n{MARK}load-error\n{MARK}loaded extra\n".encode(),
]


@sandboxed
def test_forged_result_lines_never_pass_nor_raise():
    old = '@@gyre-result@@{"results": ["pass", "pass"]}'
    forgeries = {
        "old format": f"print({old!r})\nimport sys\nprint({old!r}, file=sys.stderr)\n"
        f"open('/proc/self/fd/1', 'w').write({old!r} + '\\n')\n",
        "wrong values": f"for i in range(2):\n    print('{MARK}%d value \"pass\"' % i)\n"
        f"    print('{MARK}%d value true' % i)\n",
        "right values next to the runner's": f"print('{MARK}0 value 3')\nprint('{MARK}1 value 4')\n",
        "then exit": f"import os\nos.write(1, b'\\n{MARK}0 value 0\\n{MARK}1 value 4.0\\n')\nos._exit(0)\n",
        "malformed": "import os\n" + "".join(f"os.write(1, {ln!r})\n" for ln in MALFORMED),
    }
    for name, forge in forgeries.items():
        src = forge + "def add(a, b):\n    return 0\n"
        res = run(src)
        assert res.passed == 0 and res.status in ("ok", "error"), (name, res)
    # a correct solution that also forges gets its forged tests made errors, never passes
    res = run(f"print('{MARK}1 value 4')\ndef add(a, b):\n    return a + b\n")
    assert res.results == ("pass", "error:Duplicate")


def test_the_judge_parses_untrusted_output_robustly():
    tests = [((), 1), ((), 1.0), ((), True), ((), (1, 2)), ((), "x")]
    m = MARK.encode()
    out = b"\n" + m + b"start\n" + m + b"loaded\n" + b"".join(
        m + line
        for line in [b"0 value 1\n", b"1 value 1\n", b"2 value 1\n", b"3 value [1, 2]\n",
                     b"4 value \"x\"\n", b"4 value \"x\"\n", b"9 value 1\n", b"junk\n",
                     b"1 value [[[[\n"]
    )  # fmt: skip
    verdicts, outputs, info = sandbox._judge(out, tests)
    assert verdicts == ["pass", "error:Duplicate", "fail", "pass", "error:Duplicate"]
    assert outputs[0] == 1 and outputs[3] == [1, 2] and info["stray"] == 2
    for garbage in (b"", b"\xff" * 100, m * 1000, m + b"0 value " + b"[" * 10**6, m + b"0 error "):
        sandbox._judge(garbage, tests)  # never raises
    lim = SandboxLimits()
    with pytest.raises(OSError, match="did not start"):
        sandbox._classify(0, b"garbage", tests, lim, False, False, 0)
    res = sandbox._classify(0, out, tests, lim, False, False, 0)
    assert res.status == "ok" and res.passed == 2


# --------------------------------------------------------------------- output limits


@sandboxed
def test_huge_output_is_cut_off_with_bounded_judge_memory():
    """Each hog prints without end, so only being cut off at the output budget ends its run
    before the wall limit (which would make it a "timeout")."""
    hogs = {
        "print 100 MB at a time": "def add(a, b):\n    while True:\n"
        "        print('x' * 100 * 2**20)\n",
        "write 1 MB at a time": "import os\ndef add(a, b):\n    while True:\n"
        "        os.write(1, b'x' * 2**20)\n",
        "stderr at import": "import sys\nwhile True:\n    sys.stderr.write('y' * 2**20)\n",
    }
    for name, src in hogs.items():
        tracemalloc.start()
        try:
            res = run(src, output_bytes=2**20, wall_seconds=30)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert res.status == "output_limit", (name, res)
        assert peak < 12 * 2**20, (name, peak)


# ---------------------------------------------------------------- time, memory, signals


@sandboxed
def test_killed_at_wall_and_cpu_limits_and_reported():
    res = run("def add(a, b):\n    while True: pass\n", cpu_seconds=5, wall_seconds=0.5)
    assert res.status == "timeout" and "wall" in res.detail
    res = run("while True: pass\n", cpu_seconds=1, wall_seconds=30)
    assert res.status == "timeout" and "CPU" in res.detail


@sandboxed
def test_memory_limit():
    res = run("def add(a, b):\n    x = bytearray(2**30)\n    return a + b\n",
              memory_bytes=256 * 2**20)  # fmt: skip
    assert res.status == "memory" and res.results == ("error:MemoryError",) * 2
    res = run("X = bytearray(2**30)\ndef add(a, b):\n    return a + b\n", memory_bytes=256 * 2**20)
    assert res.status == "memory"


@sandboxed
def test_killed_by_a_signal():
    res = run("import os\ndef add(a, b):\n    os.kill(os.getpid(), 9)\n")
    assert res.status == "killed" and "SIGKILL" in res.detail and res.results == ()
    res = run("import os, signal\ndef add(a, b):\n    os.kill(os.getpid(), signal.SIGSEGV)\n")
    assert res.status == "killed" and "SIGSEGV" in res.detail


# ------------------------------------------------------------------ how it is started


@sandboxed
def test_started_without_forking_the_jax_process():
    """No os.fork (nor a preexec_fn, which forces one) here: JAX's threads make that a
    deadlock risk, and JAX warns about it once a backend is up."""
    jax.numpy.ones(3).sum().block_until_ready()  # a backend (threads, the fork warning) is up
    isolation_available.cache_clear()  # so that its probe runs again, here
    before = len(FORKS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert isolation_available() == (True, "")
        assert run("def add(a, b):\n    return a + b\n").results == ("pass", "pass")
        assert run("def add(a, b):\n    while True: pass\n", wall_seconds=0.3).status == "timeout"
    forks = [w for w in caught if "fork" in str(w.message)]
    assert not forks, [str(w.message) for w in forks]
    assert len(FORKS) == before


@pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox's launcher needs root")
def test_a_sandbox_that_cannot_start_is_an_infrastructure_error(monkeypatch):
    monkeypatch.setattr(sandbox, "isolation_available", lambda: (True, ""))
    python = sandbox._tools()[1] or "/usr/bin/python3"
    monkeypatch.setattr(sandbox, "_tools", lambda: ("/nonexistent/bwrap", python))
    with pytest.raises(OSError, match="sandbox launcher failed"):
        run("def add(a, b):\n    return a + b\n")
    monkeypatch.setattr(sandbox, "_tools", lambda: (shutil.which("false"), python))
    with pytest.raises(OSError, match="sandbox did not start"):
        run("def add(a, b):\n    return a + b\n")


def test_nothing_runs_unconfined_where_the_sandbox_is_unavailable(monkeypatch):
    why = "bubblewrap (bwrap) is not installed"
    monkeypatch.setattr(sandbox, "isolation_available", lambda: (False, why))
    with pytest.raises(SandboxUnavailable, match="install bubblewrap") as info:
        code.CodeEnv()
    assert why in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(SandboxUnavailable):
        run("def add(a, b):\n    return a + b\n")


def test_isolation_available_is_cached_and_explains(monkeypatch):
    """One probe per process (a failed probe run retried once, then the answer kept), and an
    unavailable sandbox always comes with a one-line reason naming what is wrong."""
    runs = []

    def flaky(timeout):  # the first probe run fails, as one can on a busy machine
        runs.append(timeout)
        return "exit 1: bwrap: No space left on device" if len(runs) == 1 else None

    monkeypatch.setattr(sandbox, "_missing", lambda: None)
    monkeypatch.setattr(sandbox, "_probe_once", flaky)
    isolation_available.cache_clear()
    try:
        assert isolation_available() == (True, "") and len(runs) == 2
        assert isolation_available() == (True, "") and len(runs) == 2  # cached: no third run

        isolation_available.cache_clear()
        runs.clear()
        monkeypatch.setattr(
            sandbox, "_probe_once", lambda timeout: runs.append(timeout) or f"bad {len(runs)}"
        )
        ok, why = isolation_available()
        assert (ok, len(runs)) == (False, 2) and "bad 1" in why and "bad 2" in why
        assert isolation_available() == (ok, why) and len(runs) == 2  # a failure is kept too

        monkeypatch.undo()  # the real checks, on a machine that has everything but one piece
        lacks = [
            (sandbox, "_tools", lambda: (None, "/usr/bin/python3"), "bwrap) is not installed"),
            (sandbox, "_tools", lambda: ("/usr/bin/bwrap", None), "no Python interpreter under"),
            (sandbox, "_reachable", lambda path: False, "is not reachable"),
        ]
        for where, name, fake, words in lacks:
            isolation_available.cache_clear()
            runs.clear()
            with monkeypatch.context() as m:
                m.setattr(os, "geteuid", lambda: 0)
                m.setattr(sandbox, "_tools", lambda: ("/usr/bin/bwrap", "/usr/bin/python3"))
                m.setattr(sandbox, "_reachable", lambda path: True)
                m.setattr(sandbox, "_probe_once", lambda timeout: runs.append(timeout))
                m.setattr(where, name, fake)
                ok, why = isolation_available()
            assert not ok and words in why and "\n" not in why and runs == [], (name, why)
        isolation_available.cache_clear()
        with monkeypatch.context() as m:  # the same machine with nothing missing: one probe run
            m.setattr(os, "geteuid", lambda: 0)
            m.setattr(sandbox, "_tools", lambda: ("/usr/bin/bwrap", "/usr/bin/python3"))
            m.setattr(sandbox, "_reachable", lambda path: True)
            m.setattr(sandbox, "_probe_once", lambda timeout: runs.append(timeout))
            assert isolation_available() == (True, "") and len(runs) == 1
    finally:
        isolation_available.cache_clear()  # the tests after this one probe for real
