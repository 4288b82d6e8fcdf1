"""The sandbox shares nothing with its judge: no keyring, no directory it could plant a link
in, no unbounded totals, and nothing of a hidden test reaches the agent."""

import asyncio
import ctypes
import os
import shutil
import tempfile
import textwrap

import pytest

from gyre.envs import sandbox as sb
from gyre.envs.code import CodeEnv
from gyre.envs.sandbox import SandboxLimits, SandboxResult, run_tests

sandboxed = pytest.mark.sandbox  # availability: tests/conftest.py

# (add_key, request_key, keyctl) syscall numbers
SYSCALLS = {"x86_64": (248, 249, 250), "aarch64": (217, 218, 219)}


def run(src, tests=(((), None),), fn="probe", sandbox_dir=None, **limits):
    limits = SandboxLimits(**limits)
    return asyncio.run(run_tests(textwrap.dedent(src), fn, tests, limits, sandbox_dir))


@sandboxed
@pytest.mark.skipif(os.uname().machine not in SYSCALLS, reason="keyctl numbers for x86_64/arm64")
def test_the_judges_session_keyring_is_out_of_reach():
    add_key, _, keyctl = SYSCALLS[os.uname().machine]
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(keyctl, 1, None) > 0  # this process: a fresh session keyring of its own
    session = libc.syscall(keyctl, 0, ctypes.c_long(-3), 0)
    key = libc.syscall(add_key, b"user", b"gyre-judge-secret", b"s3cret", 6, ctypes.c_long(-3))
    assert key > 0
    src = f"""
        import ctypes, os
        def probe(key):
            add_key, request_key, keyctl = {SYSCALLS[os.uname().machine]!r}
            libc = ctypes.CDLL(None, use_errno=True)
            buf = ctypes.create_string_buffer(64)
            return {{
                "session": libc.syscall(keyctl, 0, ctypes.c_long(-3), 0),
                "read": libc.syscall(keyctl, 11, key, buf, 64),
                "find": libc.syscall(request_key, b"user", b"gyre-judge-secret", None, 0),
                "revoke": libc.syscall(keyctl, 3, key),
                "planted": libc.syscall(request_key, b"user", b"gyre-plant", None, 0),
                "plant": libc.syscall(add_key, b"user", b"gyre-plant", b"x", 1,
                                      ctypes.c_long(-4)),  # its user keyring
            }}
    """
    first = run(src, [((key,), None)])
    second = run(src, [((key,), None)])  # after a run that planted a key
    for res in (first, second):
        seen = res.outputs[0]
        assert res.status == "ok" and seen["session"] not in (session, -1), (res, seen)
        assert seen["read"] == seen["find"] == seen["revoke"] == -1, seen
    assert first.outputs[0]["plant"] > 0 and second.outputs[0]["planted"] == -1
    buf = ctypes.create_string_buffer(64)
    assert libc.syscall(keyctl, 11, key, buf, 64) == 6 and buf.raw[:6] == b"s3cret"  # intact


@sandboxed
def test_a_sandbox_dir_that_is_not_empty_or_is_a_link_is_refused(tmp_path):
    victim = tmp_path / "host.txt"
    victim.write_text("keep")
    os.chmod(victim, 0o600)
    for setup in ("link_inside", "other_file", "dir_is_link"):
        workdir = tempfile.mkdtemp(prefix="gyre-sbx-test-")
        try:
            target = workdir
            if setup == "link_inside":  # a run left solution.py -> a host file behind
                os.symlink(victim, os.path.join(workdir, "solution.py"))
            elif setup == "other_file":
                open(os.path.join(workdir, "notes.txt"), "w").close()
            else:
                target = workdir + "-link"
                os.symlink(workdir, target)
            with pytest.raises(ValueError, match="sandbox_dir"):
                run("def probe():\n    return 1\n", sandbox_dir=target)
        finally:
            if os.path.islink(workdir + "-link"):
                os.unlink(workdir + "-link")
            shutil.rmtree(workdir)
    assert victim.read_text() == "keep" and victim.stat().st_mode & 0o777 == 0o600


@sandboxed
def test_a_run_cannot_fill_the_host_disk(monkeypatch):
    made, mkdtemp = [], tempfile.mkdtemp  # the folders this process makes, the run's among them

    def recorded(*args, **kwargs):
        made.append(mkdtemp(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(tempfile, "mkdtemp", recorded)
    before = set(os.listdir(tempfile.gettempdir()))
    res = run("""
        def probe():
            written = 0
            for i in range(64):  # 64 MiB in files of 1 MiB, the per-file limit
                try:
                    with open("f%d" % i, "wb") as f:
                        f.write(b"x" * (2**20 - 1))
                    written += 1
                except OSError as exc:
                    return [written, type(exc).__name__]
            return [written, None]
    """)  # fmt: skip
    assert res.status == "ok", res
    written, error = res.outputs[0]
    assert written <= 16 and error == "OSError", res.outputs  # the 16 MiB scratch is full
    assert made and not any(os.path.exists(d) for d in made)  # the run's scratch is gone
    # Nothing else left in the host's temp folder: a sandbox another xdist worker runs now
    # makes gyre-sbx-* folders of its own meanwhile (its test checks that it removes them).
    left = {
        n for n in set(os.listdir(tempfile.gettempdir())) - before if not n.startswith("gyre-sbx-")
    }
    assert left <= {f"gyre-sandbox-uids-{os.geteuid()}"}


@sandboxed
def test_the_memory_of_all_its_processes_together_is_bounded():
    if "cgroup" not in sb.totals():
        pytest.skip(sb.totals())
    res = run("""
        import os, select
        def probe():
            r, w = os.pipe()
            kids = []
            for _ in range(3):  # 3 x 400 MiB, each under the 512 MiB per process
                pid = os.fork()
                if pid == 0:
                    data = b"x" * (400 * 2**20)
                    os.write(w, b"+")
                    os.read(os.open("/dev/null", os.O_RDONLY), 1)
                    select.select([], [], [])  # hold it
                kids.append(pid)
            ready = 0
            while ready < 3:
                if select.select([r], [], [], 0.05)[0]:
                    ready += len(os.read(r, 3))
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid:
                    return "a child died: signal %d" % os.WTERMSIG(status)
            return "all held"
    """, wall_seconds=20, cpu_seconds=10)  # fmt: skip
    assert res.status == "memory" or res.outputs[0] == "a child died: signal 9", res


def test_the_byte_code_task_reports_counts_only():
    leaky = SandboxResult("ok", ("error:Leak_hidden_input_42", "pass"), "", ("secret", 1))
    failed = SandboxResult("error", (), "exited (code 1): printed hidden input 'secret'")
    assert CodeEnv._report(leaky, 2) == "[tests 1/2 passed]"
    assert CodeEnv._report(failed, 2) == "[tests not run: error]"


def _chat_env():
    from gyre.envs.code_chat import CodeChatEnv

    env = CodeChatEnv(max_runs=8)
    for name in sorted(env.problems):  # a problem whose hidden inputs are distinctive text
        p = env.problems[name]
        state = env.reset(env.make_tasks(0, 1)[0])
        state.problem = p
        words = {str(a) for args, _ in p.tests for a in args if isinstance(a, str) and len(a) > 4}
        words -= {w for w in words if w in env.task_text(state)}
        if words:
            return env, state, words
    raise AssertionError("no problem with distinctive hidden inputs")


@sandboxed
@pytest.mark.parametrize("how", ["return", "print_and_exit", "exception_name"])
def test_hidden_test_inputs_never_reach_the_model(how):
    env, state, words = _chat_env()
    fn = state.problem.name
    body = {
        "return": "return repr(__main__.INPUTS)",
        "print_and_exit": "print(repr(__main__.INPUTS)); sys.stdout.flush(); os._exit(1)",
        "exception_name": "raise type(''.join(c if c.isalnum() else '_' for c in "
        "repr(__main__.INPUTS[1:]))[:90], (Exception,), {})()",  # past the first example
    }[how]
    source = f"import __main__, os, sys\ndef {fn}(*args):\n    {body}\n"
    step = asyncio.run(env.answer(state, f"```python\n{source}```"))
    assert step.kind in ("ok", "fail"), step
    assert "Test run 1" in step.text
    plain = lambda text: "".join(c if c.isalnum() else "_" for c in text)
    leaked = [w for w in words if w in step.text or plain(w) in plain(step.text)]
    assert not leaked, (leaked, step.text)


UNPRIVILEGED_JUDGE = """
import asyncio, json, os, sys, textwrap
sys.path.insert(0, sys.argv[1])
from gyre.envs import sandbox as sb  # the standard library only: this Python needs nothing else

def run(src, tests, fn="probe", **limits):
    return asyncio.run(sb.run_tests(textwrap.dedent(src), fn, tests, sb.SandboxLimits(**limits)))

out = {"privileged": sb.privileged(), "available": sb.isolation_available()[0]}
out["verdicts"] = list(run("def add(a, b):\\n    return a + b\\n", [((1, 2), 3), ((2, 2), 5)],
                           "add").results)
fork = run('''
    import os
    def sleeper():  # a process that would outlive the run if anything could
        try:
            os.setsid()
            os.execv("/usr/bin/sleep", ["sleep", TOKEN])
        finally:
            os._exit(1)
    def probe():
        n = 0
        try:
            for _ in range(200):
                if os.fork() == 0:
                    sleeper()
                n += 1
        except OSError as e:
            return [n, type(e).__name__]
        return [n, None]
'''.replace("TOKEN", repr(sys.argv[2])), [((), None)])
out["fork"] = fork.outputs[0]
seen = run('''
    import os
    def probe():
        out = {}
        open("/tmp/" + sys.argv[2], "w").write("x")  # its own /tmp: the host's has none
        # the checkout's README is read (host content; under /tmp a write would land in the
        # sandbox's own /tmp), the rest are listed or written
        for p in ("/etc/passwd", "/root", sys.argv[1] + "/README.md", "/home"):
            try:
                if p.endswith("README.md"):
                    open(p).read()
                else:
                    os.listdir(p) if os.path.isdir(p) else open(p, "w").write("x")
                out[p] = "ok"
            except BaseException as e:
                out[p] = type(e).__name__
        return out
'''.replace("sys.argv[1]", repr(sys.argv[1])).replace("sys.argv[2]", repr(sys.argv[2])),
           [((), None)])
out["host"] = seen.outputs[0]
print(json.dumps(out))
"""


@sandboxed
@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv") or not os.path.exists("/usr/bin/python3"),
    reason="becomes an unprivileged user with setpriv (needs root here)",
)
def test_the_sandbox_runs_unprivileged_through_user_namespaces(tmp_path):
    """The judge as 'nobody' (no root, no cgroup of its own), with the system Python: bubblewrap
    through user namespaces; the limits, the private filesystem and the PID namespace hold."""
    import json
    import subprocess
    import uuid

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    token = f"{uuid.uuid4().int % 10**6 + 10**6}.{os.getpid()}"  # a unique sleep length
    out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                          "--reset-env", "/usr/bin/python3", "-I", "-c", UNPRIVILEGED_JUDGE,
                          root, token], cwd="/", capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["privileged"] is False and seen["available"] is True
    assert seen["verdicts"] == ["pass", "fail"]
    made, error = seen["fork"]
    assert error == "BlockingIOError" and made < 16, seen["fork"]  # 16 processes in all
    assert all(v != "ok" for v in seen["host"].values()), seen["host"]
    assert not os.path.exists(os.path.join(tempfile.gettempdir(), token))
    assert "unprivileged (user namespaces)" in out.stderr  # the one line saying how it runs
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if token.encode() in f.read():
                    left.append(pid)
        except OSError:
            pass
    assert not left, left  # nothing outlived its run
