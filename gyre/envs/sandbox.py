"""Runs untrusted Python against hidden tests in a subprocess sandbox.

What is enforced, and how (honestly, without container tooling):
  - resource limits: CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS), size of any written
    file (RLIMIT_FSIZE), no core dumps; plus a wall-clock limit after which the whole process
    group (the child runs in a new session) is killed;
  - filesystem: the child runs in a fresh temporary directory; an audit hook installed before
    the solution is imported denies opening files for writing, and removing, renaming,
    linking, chmod-ing or creating anything, outside that directory, and denies
    subprocess/exec/fork, sockets, ctypes and chdir. When this process is root, the child also
    drops to uid/gid 65534 (nobody) when a world-executable interpreter exists, so the OS
    refuses writes outside world-writable places too;
  - network: the child runs in a new network namespace (``unshare -rn``, no interfaces)
    where the OS allows it (``network_isolated()`` says whether it does); the audit hook
    denies sockets regardless.
How the child starts: never with ``os.fork`` (nor a ``preexec_fn``, which forces one) in this
process, because JAX is multithreaded here and a forked child that runs Python code before
exec can deadlock on a lock some other thread held at the fork. The child is spawned with no
``preexec_fn`` (so CPython's subprocess, 3.10+ on Linux, uses vfork + exec and runs only
async-signal-safe C code in between) as a tiny trusted launcher, ``python -I -S -B -c
LAUNCHER``, which sets the rlimits, drops privileges (setgroups, setgid, setuid) and then
execs ``[unshare -rn] python _runner.py``; rlimits and credentials survive exec, so they hold
before any untrusted code runs. A launcher that cannot set up exits with LAUNCH_FAILED and a
marked message, and ``run_tests`` raises OSError (an infrastructure error, not a verdict on
the code).
Not enforced: RLIMIT_NPROC (per-user, so it would count unrelated processes; fork is denied
by the hook instead); the audit hook is a guard against accidental and naive escapes, not a
determined adversary inside the interpreter (e.g. one that inspects the runner's frames).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

NOBODY = 65534
RESULT_MARK = "@@gyre-result@@"
LAUNCH_MARK = "@@gyre-launch-failed@@"
LAUNCH_FAILED = 125

# Trusted, runs first in the child: rlimits, then drop privileges, then exec the real command.
# argv: cpu_seconds memory_bytes file_bytes drop(0/1) program [args...]. Kept tiny: the
# address-space limit already applies to it once set (exec then starts a fresh image).
LAUNCHER = rf"""
import os, resource, sys
try:
    cpu, mem, fsize, drop = map(int, sys.argv[1:5])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if drop:
        os.setgroups([])
        os.setgid({NOBODY})
        os.setuid({NOBODY})
    os.execv(sys.argv[5], sys.argv[5:])
except BaseException as exc:
    os.write(2, ("{LAUNCH_MARK}" + repr(exc) + "\n").encode())
    os._exit({LAUNCH_FAILED})
"""

RUNNER = (
    r"""
import json, os, sys
SANDBOX = os.path.realpath(os.getcwd())
FN, TESTS = json.loads(sys.stdin.readline())
_write, _res = os.write, os.dup(1)
for fd, name in ((1, "_stdout.txt"), (2, "_stderr.txt")):  # the solution's output stays inside
    os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
DENY = ("subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.fork", "os.forkpty",
        "socket.", "ctypes.", "os.chdir", "os.chroot", "pty.", "os.kill", "os.killpg")
PATH_EVENTS = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link",
               "os.truncate", "os.chmod", "os.chown", "os.utime", "shutil.rmtree",
               "shutil.copyfile", "shutil.move", "os.mkfifo", "os.mknod"}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

def _inside(path):
    if isinstance(path, int):
        return True  # an already open descriptor
    real = os.path.realpath(os.fsdecode(path))
    return real == SANDBOX or real.startswith(SANDBOX + os.sep)

def _hook(event, args):
    if event.startswith(DENY):
        raise PermissionError(f"sandbox: {event} denied")
    if event == "open":
        path, mode, flags = args
        writing = bool(mode and any(c in mode for c in "wax+")) or bool((flags or 0) & WRITE_FLAGS)
        if path is not None and writing and not _inside(path):
            raise PermissionError(f"sandbox: writing {path!r} denied")
    elif event in PATH_EVENTS:
        for arg in args:
            if isinstance(arg, (str, bytes, os.PathLike)) and not _inside(arg):
                raise PermissionError(f"sandbox: {event} on {arg!r} denied")

sys.addaudithook(_hook)
sys.path.insert(0, SANDBOX)
out = {"results": []}
try:
    import solution
    fn = getattr(solution, FN)
    for args, expected in TESTS:
        try:
            got = fn(*args)
            ok = type(got) is type(expected) and got == expected
            out["results"].append("pass" if ok else "fail")
        except BaseException as exc:
            out["results"].append("error:" + type(exc).__name__)
except BaseException as exc:
    out["load_error"] = type(exc).__name__
_write(_res, ("\n"""
    + RESULT_MARK
    + r"""" + json.dumps(out) + "\n").encode())
"""
)


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: int = 2
    wall_seconds: float = 5.0
    memory_bytes: int = 512 * 2**20
    file_bytes: int = 2**20


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """status: 'ok' (tests ran), 'timeout', 'memory', 'output_limit', 'error' (the code did
    not load: syntax error, missing function...), 'crash'. results: one entry per test,
    'pass', 'fail' or 'error:<ExceptionName>' (empty unless the tests ran)."""

    status: str
    results: tuple[str, ...]
    detail: str = ""

    @property
    def passed(self) -> int:
        return sum(r == "pass" for r in self.results)


def _world_executable(path: str) -> bool:
    real = os.path.realpath(path)
    parts = real.split(os.sep)
    dirs = [os.sep.join(parts[:i]) or os.sep for i in range(1, len(parts))]
    return all(os.stat(d).st_mode & 0o001 for d in dirs) and bool(os.stat(real).st_mode & 0o001)


@functools.cache
def interpreter() -> tuple[str, bool]:
    """(python path, drop to nobody?): drop only as root and with a world-executable python."""
    if os.geteuid() != 0:
        return sys.executable, False
    for cand in (sys.executable, shutil.which("python3"), "/usr/bin/python3"):
        if cand and os.path.exists(cand) and _world_executable(cand):
            return cand, True
    return sys.executable, False


def _launch(python: str, drop: bool, limits: SandboxLimits, argv: list[str]) -> list[str]:
    """The command that runs ``argv`` (argv[0] an absolute path) under ``limits``, as nobody
    when ``drop``: the launcher applies both in the child, so the parent never forks."""
    cpu = max(1, int(limits.cpu_seconds))
    return [python, "-I", "-S", "-B", "-c", LAUNCHER, str(cpu), str(int(limits.memory_bytes)),
            str(int(limits.file_bytes)), str(int(drop)), *argv]  # fmt: skip


def _unshare() -> str | None:
    return shutil.which("unshare")


@functools.cache
def network_isolated() -> bool:
    """Whether ``unshare -rn`` works here for the sandbox's user."""
    unshare, true = _unshare(), shutil.which("true")
    if unshare is None or true is None:
        return False
    python, drop = interpreter()
    try:
        cmd = _launch(python, drop, SandboxLimits(), [unshare, "-rn", true])
        r = subprocess.run(cmd, capture_output=True, timeout=10, start_new_session=True)
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0


async def run_tests(source: str, function: str, tests, limits: SandboxLimits = SandboxLimits(),
                    sandbox_dir: str | None = None) -> SandboxResult:  # fmt: skip
    """Runs ``function`` from ``source`` on each (args, expected) test in a fresh sandbox.

    Raises OSError only when the sandbox itself cannot start (an infrastructure error).
    sandbox_dir: use this (existing, empty) directory instead of a temporary one.
    """
    python, drop = interpreter()
    workdir = sandbox_dir or tempfile.mkdtemp(prefix="gyre-sbx-")
    try:
        if drop:
            os.chown(workdir, NOBODY, NOBODY)
        with open(os.path.join(workdir, "solution.py"), "w") as f:
            f.write(source)
        with open(os.path.join(workdir, "_runner.py"), "w") as f:
            f.write(RUNNER)
        argv = [python, "-I", "-S", "-B", "_runner.py"]
        unshare = _unshare() if network_isolated() else None
        if unshare is not None:
            argv = [unshare, "-rn", *argv]
        # No preexec_fn: the launcher applies the limits, so subprocess never forks this
        # (multithreaded) process; start_new_session makes the child a group leader to kill.
        proc = await asyncio.create_subprocess_exec(
            *_launch(python, drop, limits, argv), cwd=workdir, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
            env={"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0"},
        )  # fmt: skip
        payload = (json.dumps([function, [list(t) for t in tests]]) + "\n").encode()
        try:
            out, err = await asyncio.wait_for(proc.communicate(payload), limits.wall_seconds)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            return SandboxResult("timeout", (), f"killed after {limits.wall_seconds} s wall")
        err_text = err.decode(errors="replace")
        if proc.returncode == LAUNCH_FAILED and err_text.startswith(LAUNCH_MARK):
            raise OSError(f"sandbox launcher failed: {err_text[len(LAUNCH_MARK) :].strip()}")
        return _classify(proc.returncode, out.decode(errors="replace"), err_text)
    finally:
        if sandbox_dir is None:
            shutil.rmtree(workdir, ignore_errors=True)


def _classify(code: int, out: str, err: str) -> SandboxResult:
    if code in (-signal.SIGXCPU, -signal.SIGKILL):
        return SandboxResult("timeout", (), "killed at the CPU-time limit")
    if code == -signal.SIGXFSZ:
        return SandboxResult("output_limit", (), "killed at the file-size limit")
    line = next((ln for ln in reversed(out.splitlines()) if ln.startswith(RESULT_MARK)), None)
    if line is None:
        status = "memory" if "MemoryError" in err else "crash"
        return SandboxResult(status, (), f"exit code {code}: {err.strip()[-300:]}")
    data = json.loads(line[len(RESULT_MARK) :])
    results = tuple(data["results"])
    if data.get("load_error") == "MemoryError" or "error:MemoryError" in results:
        return SandboxResult("memory", results, "MemoryError at the memory limit")
    if "load_error" in data:
        return SandboxResult("error", results, f"could not load the solution: {data['load_error']}")
    return SandboxResult("ok", results)
