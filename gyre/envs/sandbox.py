"""Runs untrusted Python against hidden tests, isolated by the OS (bubblewrap), judged outside.

What is enforced, and by what:
  - filesystem (bubblewrap mount namespace): the program sees a private root that holds only
    /usr (read-only; /lib, /lib64, /bin, /sbin as on the host: symlinks into /usr, or
    read-only binds), a fresh /proc (its own PID namespace only), a minimal /dev, a private
    /tmp (tmpfs of ``tmp_bytes``), and /sandbox, its working directory: a tmpfs of
    ``scratch_bytes`` holding a read-only copy of solution.py. No /etc, /root, /home, project
    or host /tmp, and no host directory it can write: the judge's directory (made empty by
    the judge, or refused; solution.py written there without following links) is never
    bound. The root and /dev are remounted read-only, so /sandbox and /tmp are the only
    writable places;
  - keys: the launcher joins a fresh session keyring after dropping privileges, so the
    judge's keyring (inherited through exec) is out of reach, and the user keyrings belong to
    the run's own user namespace: no key of the judge can be read or revoked, and none
    planted outlives the run;
  - identity: as root, the program runs as a uid of its own (``UID_BASE`` + a slot held with a
    lock file for the run, so concurrent runs, in this process or others, never share one)
    with no supplementary groups; without root, bubblewrap runs unprivileged through user
    namespaces (where the kernel allows them) and the program keeps this user's uid, its
    process count bounded inside its own user namespace (Linux >= 5.14 counts it there) and
    nothing swept by uid (its PID namespace ends it); :func:`privileged` says which and the
    first use logs it in one line. Either way it runs in a new user namespace with every
    capability dropped and further user namespaces disabled;
  - namespaces: ``--unshare-all`` (user, PID, network, IPC, UTS, cgroup): no network
    interface but a private loopback, no host Unix sockets (no host path, and the abstract
    namespace is per network namespace), no view of or signals to host processes;
  - lifetime: the program is a child of the init of a fresh PID namespace, and the kernel
    kills every process in it when that init exits, so nothing (setsid'd, double-forked,
    daemonised) outlives the run; ``--die-with-parent`` makes that init die with bwrap, and
    bwrap with the launcher, which dies with this process. The launcher is also the child
    subreaper that reaps bwrap's init, so no zombie is left to the host's PID 1, and it exits
    only when the whole sandbox is gone. The run's uid is then swept (any process left is
    killed) as a backstop, and ``run_tests`` returns only when it has no process left;
  - resources (rlimits, set before bubblewrap starts and inherited by everything inside):
    processes/threads (RLIMIT_NPROC, counted per uid, hence the uid per run), address space
    per process (RLIMIT_AS), CPU seconds per process (RLIMIT_CPU: SIGXCPU, SIGKILL one second
    later), size of any written file (RLIMIT_FSIZE), open files (RLIMIT_NOFILE), no core
    dumps; plus a wall-clock limit after which the whole sandbox is killed, and a budget of
    output bytes: stdout and stderr share one pipe that this process reads in bounded chunks,
    killing the run once the budget is passed (status ``output_limit``), so the judge's memory
    stays bounded whatever the program prints;
  - judging: the expected answers and reference solutions never enter the sandbox. The runner
    inside gets only the function name and the inputs (on stdin, then replaced by /dev/null)
    and prints each call's result as a marked line, ``<MARK><i> value <json>`` or
    ``<MARK><i> error <ExceptionName>``. Everything it prints is untrusted: the program can
    print marked lines too. This process parses them robustly (a malformed, out-of-range or
    duplicate line is an error for that test, never an exception) and compares outside, as
    strictly as ever: ``type(got) is type(expected) and got == expected`` on JSON values (so
    bool, int and float stay distinct; tuples are compared as lists, dict keys as strings; a
    value JSON cannot encode, like an object whose ``__eq__`` is always True, fails). A forged
    line can only claim a value, which is then checked like any other; a forged line next to
    the runner's own line for the same test makes that test an error.
How the sandbox starts: never with ``os.fork`` (nor a ``preexec_fn``, which forces one) in this
process, because JAX is multithreaded here and a forked child that runs Python code before
exec can deadlock. It is spawned (vfork + exec in CPython's subprocess) as a tiny trusted
launcher, ``python -I -S -B -c LAUNCHER``, which sets the rlimits, drops to the run's uid
(setgroups, setgid, setuid), sets its parent-death signal and child-subreaper flag, spawns
``bwrap ... /usr/bin/python3 -I -S -B -c RUNNER`` and reaps until no child is left (SIGTERM
makes it kill bwrap first: how a run is stopped). rlimits and credentials are inherited, so
they hold before any untrusted code runs. The interpreter inside must live under /usr (the
project's own one usually is not reachable by the run's uid). A launcher or sandbox that
cannot start raises OSError (an infrastructure error, not a verdict on the code); the runner
prints a start line before any untrusted code runs, so the program cannot fake that.
Availability: ``isolation_available()`` (on first use, then cached) checks for ``bwrap``, a
Python under /usr and a reachable temporary directory, then runs a
probe through the whole path, once more if it fails (a busy machine can fail one run); the
reason it gives names each failure. Where it fails, ``require_isolation()`` (CodeEnv calls it
when constructed) and ``run_tests`` raise SandboxUnavailable: nothing ever runs unconfined.
Totals: where this process sits in a cgroup with the memory and pids controllers (v1, or v2
with both delegated below it), each run gets its own (``total_memory_bytes``, ``processes``;
the launcher joins it before dropping privileges) and a run killed at that limit is reported
``memory``; where not, memory is bounded per process only (RLIMIT_AS times the process
limit), which :func:`totals` says in one line (logged once, with how the sandbox runs). Disk
is bounded in total by the two tmpfs mounts (``scratch_bytes`` + ``tmp_bytes``, memory).
Not enforced: CPU is per process, so several processes can use several cores until the wall
limit; a
program that catches SIGXCPU is killed by SIGKILL a second later and reported ``killed``;
kernel bugs reachable from an unprivileged user namespace are out of scope (no seccomp filter).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import functools
import itertools
import json
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

log = logging.getLogger(__name__)

MARK = "@@gyre-sandbox@@ "
LAUNCH_MARK = "@@gyre-launch-failed@@ "
LAUNCH_FAILED = 125
UID_BASE = 1_812_000_000  # far from the usual subordinate-uid ranges (100000...)
UID_POOL = 65536
SANDBOX = "/sandbox"  # the scratch directory's path inside
INSTALL_HINT = "install bubblewrap (scripts/install_sandbox.sh, or apt-get install bubblewrap)"
_MARK_B = MARK.encode()
_START = b"\n" + _MARK_B + b"start\n"
_CHUNK = 65536
_NAME = re.compile(rb"[A-Za-z_][A-Za-z0-9_.]{0,99}")
_INDEX = re.compile(rb"[0-9]{1,9}")

# keyctl(2)'s syscall number per machine (glibc has no wrapper); elsewhere the launcher fails.
KEYCTL_NR = {"x86_64": 250, "aarch64": 219, "riscv64": 219, "ppc64le": 280, "s390x": 280}

# Trusted, runs first as root: rlimits, then drop to the run's uid, then start bubblewrap and
# reap everything until no child is left (as a child subreaper, so the sandbox's init, which
# bwrap leaves behind, is reaped here and the run ends only once the sandbox is gone). SIGTERM
# makes it kill bwrap (whose --die-with-parent takes the sandbox down) and go on reaping.
# argv: cpu mem fsize nofile nproc uid cgroups program [args...] (uid -1: unprivileged, keep
# this user's; cgroups: the run's cgroup.procs files joined by ",", or "-"). After dropping privileges it joins a fresh,
# empty session keyring: the judge's (inherited through exec) is never reachable inside.
# Kept tiny: the address-space limit already applies to it once set.
LAUNCHER = rf"""
import ctypes, os, resource as R, signal, sys
try:
    cpu, mem, fsize, nofile, nproc, uid = map(int, sys.argv[1:7])
    parent, libc = os.getppid(), ctypes.CDLL(None, use_errno=True)
    for procs in sys.argv[7].split(",") if sys.argv[7] != "-" else ():
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    for res, lim in ((R.RLIMIT_CPU, (cpu, cpu + 1)), (R.RLIMIT_AS, (mem, mem)),
                     (R.RLIMIT_FSIZE, (fsize, fsize)), (R.RLIMIT_CORE, (0, 0)),
                     (R.RLIMIT_NOFILE, (nofile, nofile))):
        R.setrlimit(res, lim)
    if uid >= 0:  # root: the run's own uid, whose process count RLIMIT_NPROC bounds
        R.setrlimit(R.RLIMIT_NPROC, (nproc, nproc))
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        if os.getresuid() != (uid,) * 3 or os.getresgid() != (uid,) * 3 or os.getgroups():
            raise OSError("could not drop privileges")
    keyctl = {KEYCTL_NR}.get(os.uname().machine)
    if keyctl is None or libc.syscall(keyctl, 1, None) < 0:  # KEYCTL_JOIN_SESSION_KEYRING
        raise OSError(ctypes.get_errno(), "could not join a fresh session keyring")
    # After setuid, which clears the parent-death signal: die with the parent; be the reaper.
    if libc.prctl(1, signal.SIGKILL, 0, 0, 0) or libc.prctl(36, 1, 0, 0, 0):
        raise OSError(ctypes.get_errno(), "prctl failed")
    if os.getppid() != parent:
        os._exit(137)
    child = None
    def stop(signum, frame):
        if child is None:
            os._exit(137)
        try:
            os.kill(child, signal.SIGKILL)
        except OSError:
            pass
    signal.signal(signal.SIGTERM, stop)
    child = os.posix_spawn(sys.argv[8], sys.argv[8:], {{}})
except BaseException as exc:
    os.write(1, ("{LAUNCH_MARK}" + repr(exc) + "\n").encode())
    os._exit({LAUNCH_FAILED})
code = 1
while True:
    try:
        pid, status = os.wait()
    except ChildProcessError:
        break
    if pid == child:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # bwrap is gone; finish reaping
        code = os.waitstatus_to_exitcode(status)
        code = code if code >= 0 else 128 - code
os._exit(code)
"""

# Untrusted territory: runs inside the sandbox with the program, which can read and change
# anything here. It only ever gets the inputs; its output is parsed, never believed.
RUNNER = rf"""
import json, os, sys

def emit(text):
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except BaseException:
            pass
    data = ("\n{MARK}" + text + "\n").encode()
    while data:
        try:
            data = data[os.write(1, data):]
        except InterruptedError:
            pass
        except BaseException:
            return

FN, INPUTS, NPROC = json.loads(sys.stdin.buffer.readline())
os.dup2(os.open("/dev/null", os.O_RDONLY), 0)
if NPROC:  # unprivileged: the process count of this user namespace (Linux >= 5.14)
    import resource
    resource.setrlimit(resource.RLIMIT_NPROC, (NPROC, NPROC))
emit("start")
sys.path.insert(0, "{SANDBOX}")
try:
    fn = getattr(__import__("solution"), FN)
except BaseException as exc:
    emit("load-error " + type(exc).__name__)
    os._exit(0)
emit("loaded")
for i, args in enumerate(INPUTS):
    try:
        got = fn(*args)
    except BaseException as exc:
        emit("%d error %s" % (i, type(exc).__name__))
        continue
    try:
        text = json.dumps(got)
    except BaseException as exc:
        emit("%d unserializable %s" % (i, type(exc).__name__))
        continue
    emit("%d value %s" % (i, text))
os._exit(0)
"""


class SandboxUnavailable(RuntimeError):
    """OS isolation (bubblewrap) cannot run here: the code task must not start."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: int = 2  # per process
    wall_seconds: float = 5.0
    memory_bytes: int = 512 * 2**20  # address space per process
    file_bytes: int = 2**20  # largest file it may write
    processes: int = 16  # processes + threads of the run's uid (4 are the sandbox's own)
    open_files: int = 64
    output_bytes: int = 2**20  # stdout + stderr, result lines included
    tmp_bytes: int = 16 * 2**20  # the private /tmp (tmpfs, memory)
    scratch_bytes: int = 16 * 2**20  # /sandbox, its working directory (tmpfs, memory)
    total_memory_bytes: int = 2**30  # every process of the run together (its cgroup)


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """status: 'ok' (tests ran), 'timeout' (wall clock or CPU limit), 'memory', 'output_limit',
    'killed' (ended by another signal), 'error' (the code did not load, or exited without
    reporting every test). results: one entry per test, 'pass', 'fail' or
    'error:<ExceptionName>' (also error:Duplicate / error:Malformed for bad result lines);
    empty unless every test reported. outputs: the value each test returned, as this judge
    read it (None where there was none), whatever the status. uid: the run's uid."""

    status: str
    results: tuple[str, ...]
    detail: str = ""
    outputs: tuple = ()
    uid: int = -1

    @property
    def passed(self) -> int:
        return sum(r == "pass" for r in self.results)


# ---------------------------------------------------------------- availability and commands


def _reachable(path: str) -> bool:
    """Whether every directory above ``path`` (and it) can be traversed by any user."""
    real = os.path.realpath(path)
    parts = real.split(os.sep)
    try:
        return all(
            os.stat(os.sep.join(parts[:i]) or os.sep).st_mode & 0o001
            for i in range(1, len(parts) + 1)
        )
    except OSError:
        return False


def _inner_python() -> str | None:
    for cand in ("/usr/bin/python3", "/usr/local/bin/python3"):
        real = os.path.realpath(cand)
        if real.startswith("/usr/") and os.access(real, os.X_OK) and _reachable(real):
            return cand
    return None


@functools.cache
def _tools() -> tuple[str | None, str | None]:
    """(bwrap, the Python used inside)."""
    bwrap = shutil.which("bwrap") or shutil.which("bwrap", path="/usr/bin:/bin")
    return bwrap, _inner_python()


def _system_dirs() -> list[str]:
    """bwrap arguments for /usr and the top-level dirs that point into it on the host."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = "/" + name
        if os.path.islink(host):
            args += ["--symlink", os.readlink(host), host]
        elif os.path.isdir(host):
            args += ["--ro-bind", host, host]
    return args


def _command(workdir: str, uid: int, limits: SandboxLimits, cgroups=()) -> list[str]:
    bwrap, python = _tools()
    if bwrap is None or python is None:
        raise SandboxUnavailable(f"no bwrap or no Python under /usr; {INSTALL_HINT}")
    sandbox = [
        bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
        "--new-session", "--cap-drop", "ALL", "--hostname", "sandbox",
        "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", SANDBOX,
        "--setenv", "LANG", "C.UTF-8",
        *_system_dirs(), "--proc", "/proc", "--dev", "/dev",
        "--size", str(int(limits.tmp_bytes)), "--tmpfs", "/tmp",
        "--size", str(int(limits.scratch_bytes)), "--tmpfs", SANDBOX,
        "--ro-bind", os.path.join(workdir, "solution.py"), f"{SANDBOX}/solution.py",
        "--chdir", SANDBOX,
        "--remount-ro", "/dev", "--remount-ro", "/",
        "--", python, "-I", "-S", "-B", "-c", RUNNER,
    ]  # fmt: skip
    rlimits = (max(1, int(limits.cpu_seconds)), limits.memory_bytes, limits.file_bytes,
               limits.open_files, limits.processes, uid)  # fmt: skip
    launcher = [sys.executable, "-I", "-S", "-B", "-c", LAUNCHER]
    return [*launcher, *map(str, map(int, rlimits)), ",".join(cgroups) or "-", *sandbox]


def privileged() -> bool:
    """Root: each run under its own uid. Else unprivileged bubblewrap (user namespaces): each
    run as this user's uid, mapped in its own user namespace, its process count bounded in
    that namespace, its processes ended by its PID namespace (nothing to sweep by uid)."""
    return os.geteuid() == 0


def _lock_dir() -> str:
    path = os.path.join(tempfile.gettempdir(), f"gyre-sandbox-uids-{os.geteuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022 or not stat.S_ISDIR(st.st_mode):
        raise OSError(f"sandbox uid lock directory {path} is not private to this user")
    return path


def _pids_of(uid: int) -> list[int]:
    """Live (not zombie) processes whose real uid is ``uid``."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                fields = dict(ln.split(b":", 1) for ln in f.read().splitlines() if b":" in ln)
            zombie = fields[b"State"].strip().startswith(b"Z")
            if int(fields[b"Uid"].split()[0]) == uid and not zombie:
                pids.append(int(name))
        except (OSError, ValueError, KeyError, IndexError):
            pass
    return pids


def _acquire_uid() -> tuple[int, int]:
    """(uid, lock fd): a uid no other run (here or in another process) holds, with no process.
    The lock is a flock on a per-uid file, released when the fd closes (or the process dies).
    Unprivileged: (-1, a descriptor to close), every run keeping this user's uid."""
    if not privileged():
        return -1, os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    locks = _lock_dir()
    start = (os.getpid() * 64) % UID_POOL
    for k in range(UID_POOL):
        uid = UID_BASE + (start + k) % UID_POOL
        fd = os.open(os.path.join(locks, str(uid)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        if _pids_of(uid):  # someone else's processes: not ours to use (nor to kill)
            os.close(fd)
            continue
        return uid, fd
    raise OSError("no free sandbox uid")


def _sweep(uid: int) -> bool:
    """Kills what is left of the run's uid (a backstop: the PID namespace should have done it).
    True when nothing is left (unprivileged, uid -1: the PID namespace alone ends the run)."""
    if uid < 0:
        return True
    pids = _pids_of(uid)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return not pids


def _prepare(workdir: str, source: str) -> None:
    """Writes solution.py into ``workdir``, which must be an empty directory (not a link):
    nothing is followed, nothing already there is overwritten or chmod-ed. The program never
    writes here (it gets a copy on a tmpfs), and the directory stays the judge's."""
    if not _reachable(os.path.dirname(os.path.realpath(workdir))):
        raise ValueError(f"the directories above {workdir} must be reachable by other users")
    try:
        fd = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"sandbox_dir {workdir} is not a directory (a link?): {e}") from e
    try:
        if os.listdir(fd):
            raise ValueError(f"sandbox_dir {workdir} is not empty: the judge writes only into "
                             "a fresh directory")  # fmt: skip
        os.fchmod(fd, 0o755)  # the run's uid reads solution.py through it
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with os.fdopen(os.open("solution.py", flags, 0o644, dir_fd=fd), "w") as f:
            os.fchmod(f.fileno(), 0o644)
            f.write(source)
    finally:
        os.close(fd)


CGROUP_ROOT = "/sys/fs/cgroup"
_RUNS = itertools.count()  # names the cgroups of unprivileged runs (they share one uid)


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup per controller ('' for the unified v2 hierarchy)."""
    out = {}
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c] = path
    return out


def _cgroup_dirs(name: str) -> list[tuple[str, dict[str, str]]]:
    """Where a run's cgroup goes, with its limit files -> [(directory, {file: key})]: v1's
    memory and pids hierarchies, else v2's unified one with both controllers enabled below
    this process's cgroup."""
    own = _own_cgroups()
    if "memory" in own and "pids" in own:
        return [(os.path.join(CGROUP_ROOT, "memory", own["memory"].lstrip("/"), name),
                 {"memory.limit_in_bytes": "memory"}),
                (os.path.join(CGROUP_ROOT, "pids", own["pids"].lstrip("/"), name),
                 {"pids.max": "pids"})]  # fmt: skip
    if "" in own:
        base = os.path.join(CGROUP_ROOT, own[""].lstrip("/"))
        with contextlib.suppress(OSError), open(os.path.join(base, "cgroup.subtree_control")) as f:
            if {"memory", "pids"} <= set(f.read().split()):
                return [(os.path.join(base, name), {"memory.max": "memory", "pids.max": "pids"})]
    return []


def _make_cgroup(uid: int, limits: SandboxLimits) -> tuple[list[str], str | None]:
    """The run's cgroup (total memory, processes), made for ``uid`` -> (its cgroup.procs files
    for the launcher to join, None) or ([], why there is none)."""
    name = f"gyre-sandbox-{uid}" if uid >= 0 else f"gyre-sandbox-u{os.getpid()}-{next(_RUNS)}"
    dirs = _cgroup_dirs(name)
    if not dirs:
        return [], "this process has no cgroup with the memory and pids controllers"
    values = {"memory": limits.total_memory_bytes, "pids": limits.processes}
    made = []
    try:
        for path, files in dirs:
            with contextlib.suppress(FileExistsError):
                os.mkdir(path, 0o700)
            made.append(path)
            for name, key in files.items():
                with open(os.path.join(path, name), "w") as f:
                    f.write(str(int(values[key])))
    except OSError as e:
        _remove_cgroup(made)
        return [], f"cannot make a cgroup ({e.strerror or e}: {e.filename})"
    return [os.path.join(p, "cgroup.procs") for p in made], None


def _remove_cgroup(procs: list[str]) -> None:
    """Removes the run's cgroup; the kernel may keep one busy a moment after its last process
    is reaped, so each removal is retried for up to a second (a leftover is reused by the
    next run of that uid)."""
    for path in procs:
        path = os.path.dirname(path) if path.endswith("cgroup.procs") else path
        deadline = time.monotonic() + 1.0
        while os.path.isdir(path):
            try:
                os.rmdir(path)
            except OSError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)


def _oom_killed(procs: list[str]) -> bool:
    """Whether the run's cgroup hit its memory limit (v1: failcnt; v2: an oom_kill event)."""
    for path in procs:
        base = os.path.dirname(path)
        with contextlib.suppress(OSError, ValueError):
            if os.path.exists(os.path.join(base, "memory.failcnt")):
                with open(os.path.join(base, "memory.failcnt")) as f:
                    return int(f.read()) > 0
            with open(os.path.join(base, "memory.events")) as f:
                events = dict(line.split() for line in f if line.strip())
                return int(events.get("oom_kill", 0)) > 0
    return False


@functools.cache
def totals() -> str:
    """One line: what bounds a run's totals here (a cgroup, or only per-process limits)."""
    procs, why = _make_cgroup(UID_BASE + UID_POOL + os.geteuid(), SandboxLimits())
    _remove_cgroup(procs)
    if why is None:
        return ("run totals: memory and processes of each run bounded by its own cgroup; "
                "disk by its tmpfs scratch and /tmp")  # fmt: skip
    return (f"run totals: {why}, so memory is bounded per process only (address space x "
            "processes); disk by its tmpfs scratch and /tmp")  # fmt: skip


def _payload(function: str, tests, limits: SandboxLimits, uid: int) -> bytes:
    nproc = 0 if uid >= 0 else int(limits.processes)  # unprivileged: set inside, see RUNNER
    return (json.dumps([function, [list(args) for args, _ in tests], nproc]) + "\n").encode()


PROBE_TRIES = 2  # a probe run that fails is tried once more: a busy machine can fail one


def _probe_once(timeout: float) -> str | None:
    """Runs one tiny program through the whole sandbox path; None when it passed, else why not."""
    tests, uid, lock, workdir = [((2,), 3)], None, None, None
    try:
        uid, lock = _acquire_uid()
        workdir = tempfile.mkdtemp(prefix="gyre-sbx-probe-")
        _prepare(workdir, "def f(x):\n    return x + 1\n")
        r = subprocess.run(_command(workdir, uid, SandboxLimits()),
                           input=_payload("f", tests, SandboxLimits(), uid),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout,
                           start_new_session=True, cwd="/", env={})  # fmt: skip
        if not r.stdout.startswith(_START) or _judge(r.stdout[: 2**16], tests)[0] != ["pass"]:
            tail = " ".join(r.stdout[-300:].decode(errors="replace").split())
            return f"exit {r.returncode}: {tail or 'no output'}"
    except (OSError, subprocess.SubprocessError, SandboxUnavailable) as exc:
        return repr(exc)
    finally:
        deadline = time.monotonic() + 5
        while uid is not None and not _sweep(uid) and time.monotonic() < deadline:
            time.sleep(0.01)
        if lock is not None:
            os.close(lock)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
    return None


def _missing() -> str | None:
    """What this machine lacks for the sandbox (checked without running anything), or None."""
    bwrap, python = _tools()
    if bwrap is None:
        return "bubblewrap (bwrap) is not installed"
    if python is None:
        return "no Python interpreter under /usr (e.g. /usr/bin/python3) to run inside"
    if not _reachable(tempfile.gettempdir()):
        return f"the temporary directory {tempfile.gettempdir()} is not reachable"
    return None


@functools.cache
def isolation_available() -> tuple[bool, str]:
    """(whether the bubblewrap sandbox works here, why not: one line). Checked on first use and
    cached for the process: what the machine lacks, then a probe run through the whole path,
    tried ``PROBE_TRIES`` times (the later with a longer timeout) before it counts as failed."""
    missing = _missing()
    if missing is not None:
        return False, missing
    failures = []
    for attempt in range(PROBE_TRIES):
        why = _probe_once(timeout=30.0 * (attempt + 1))
        if why is None:
            return True, ""
        failures.append(f"try {attempt + 1}: {why}")
        if attempt + 1 < PROBE_TRIES:
            time.sleep(0.5)  # let a passing shortage (uids, namespaces, memory) clear
    return False, f"a probe run in bubblewrap failed {len(failures)} times ({'; '.join(failures)})"


def require_isolation() -> None:
    """Raises SandboxUnavailable (one line, saying how to fix it) unless the sandbox works;
    the first time it does, says in one line how it runs and what bounds a run's totals."""
    ok, reason = isolation_available()
    if not ok:
        reason = " ".join(reason.split())  # one line
        raise SandboxUnavailable(f"code task sandbox unavailable: {reason}; {INSTALL_HINT}")
    _announce()


@functools.cache
def _announce() -> None:
    how = ("bubblewrap started as root, each run as its own uid" if privileged() else
           "bubblewrap unprivileged (user namespaces), each run as this user's uid")  # fmt: skip
    log.warning("code sandbox: %s in a fresh user namespace and session keyring; %s", how,
                totals())  # fmt: skip


# ---------------------------------------------------------------------------------- judge


def _expected(value):
    """The expected value as it would come back through JSON (tuples -> lists, ...)."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError, RecursionError):
        return value


def _same(got, expected) -> bool:
    try:
        return type(got) is type(expected) and bool(got == expected)
    except Exception:
        return False


def _judge(out: bytes, tests) -> tuple[list[str], list, dict]:
    """Per-test verdicts and values from the runner's (untrusted) output; never raises."""
    n = len(tests)
    lines: list[list[tuple[bytes, bytes]]] = [[] for _ in range(n)]
    info = {"load_error": None, "loaded": False, "stray": 0}
    for line in out.split(b"\n"):
        if not line.startswith(_MARK_B):
            continue
        parts = line[len(_MARK_B) :].split(b" ", 2)
        if parts == [b"loaded"]:
            info["loaded"] = True
        elif parts[0] == b"load-error" and len(parts) == 2:
            name = parts[1] if _NAME.fullmatch(parts[1]) else b"Malformed"
            info["load_error"] = info["load_error"] or name.decode()
        elif _INDEX.fullmatch(parts[0]) and int(parts[0]) < n:
            i = int(parts[0])
            lines[i].append((parts[1], parts[2]) if len(parts) == 3 else (b"malformed", b""))
        elif parts != [b"start"]:
            info["stray"] += 1
    verdicts, outputs = [], []
    for (_, expected), got_lines in zip(tests, lines):
        value = None
        if not got_lines:
            verdict = "error:NoResult"
        elif len(got_lines) > 1:
            verdict = "error:Duplicate"
        else:
            kind, payload = got_lines[0]
            verdict = "error:Malformed"
            if kind == b"value":
                try:
                    value = json.loads(payload)
                    verdict = "pass" if _same(value, _expected(expected)) else "fail"
                except Exception:
                    value = None
            elif kind == b"error" and _NAME.fullmatch(payload):
                verdict = "error:" + payload.decode()
            elif kind == b"unserializable":
                verdict = "fail"
        verdicts.append(verdict)
        outputs.append(value)
    info["complete"] = all(lines)
    return verdicts, outputs, info


def _signal_of(code: int) -> int | None:
    if code < 0:
        return -code
    if 128 < code < 128 + 65:  # bwrap reports a command killed by signal s as 128 + s
        return code - 128
    return None


def _tail(out: bytes) -> str:
    text = b"\n".join(ln for ln in out[-4096:].split(b"\n") if not ln.startswith(_MARK_B))
    return text.decode(errors="replace").strip()[-200:]


def _classify(code, out: bytes, tests, limits, timed_out, over, uid) -> SandboxResult:
    verdicts, outputs, info = _judge(out, tests)
    outs = tuple(outputs)
    if timed_out:
        return SandboxResult("timeout", (), f"killed after {limits.wall_seconds} s wall", outs, uid)
    if over:
        return SandboxResult(
            "output_limit", (), f"killed past {limits.output_bytes} bytes of output", outs, uid
        )
    if not out.startswith(_START):
        text = out[:600].decode(errors="replace")
        if text.startswith(LAUNCH_MARK):
            raise OSError(f"sandbox launcher failed: {text[len(LAUNCH_MARK) :].strip()}")
        raise OSError(f"sandbox did not start (exit code {code}): {text.strip()}")
    sig = _signal_of(code)
    if sig == signal.SIGXCPU:
        return SandboxResult("timeout", (), "killed at the CPU-time limit", outs, uid)
    complete = info["complete"] and info["load_error"] is None
    memory_error = info["load_error"] == "MemoryError" or "error:MemoryError" in verdicts
    if memory_error or (not complete and b"MemoryError" in out):
        results = tuple(verdicts) if complete else ()
        return SandboxResult("memory", results, "MemoryError at the memory limit", outs, uid)
    if sig is not None:
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return SandboxResult("killed", (), f"killed by {name}: {_tail(out)}", outs, uid)
    if info["load_error"] is not None:
        detail = f"could not load the solution: {info['load_error']}"
        return SandboxResult("error", (), detail, outs, uid)
    if not info["loaded"]:
        detail = f"exited (code {code}) while loading the solution: {_tail(out)}"
        return SandboxResult("error", (), detail, outs, uid)
    if not complete:
        missing = [i for i, v in enumerate(verdicts) if v == "error:NoResult"]
        detail = f"exited (code {code}) without results for tests {missing}: {_tail(out)}"
        return SandboxResult("error", (), detail, outs, uid)
    return SandboxResult("ok", tuple(verdicts), "", outs, uid)


# ---------------------------------------------------------------------------------- running


def _stop(proc) -> None:
    """Asks the launcher to kill bwrap (whose --die-with-parent takes the sandbox with it) and
    reap what is left; the launcher itself keeps running until that is done."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGTERM)


async def _finish(proc, uid: int) -> None:
    """Reaps the sandbox: output drained to EOF (discarded), the launcher waited for, the uid
    empty; escalates to SIGKILL for all of them if that takes too long."""
    deadline = time.monotonic() + 5
    with contextlib.suppress(TimeoutError, OSError):
        while await asyncio.wait_for(proc.stdout.read(_CHUNK), deadline - time.monotonic()):
            pass
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(proc.wait(), max(0.01, deadline - time.monotonic()))
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while not _sweep(uid):
        if time.monotonic() > deadline:
            raise OSError(f"processes of sandbox uid {uid} survived the run")
        await asyncio.sleep(0.005)
    if proc.returncode is None:
        await proc.wait()


async def run_tests(source: str, function: str, tests, limits: SandboxLimits = SandboxLimits(),
                    sandbox_dir: str | None = None) -> SandboxResult:  # fmt: skip
    """Runs ``function`` from ``source`` on the inputs of each (args, expected) test in a fresh
    sandbox and judges the results here.

    Raises SandboxUnavailable when bubblewrap cannot run here, OSError when the sandbox itself
    cannot start (an infrastructure error, never caused by the code).
    sandbox_dir: write solution.py into this directory (existing, empty, not a link, reachable
    by other users; else ValueError) instead of a temporary one; it stays the judge's, and
    the program sees only a read-only copy of the file in its tmpfs scratch.
    """
    require_isolation()
    tests = list(tests)
    uid, lock = _acquire_uid()
    workdir = sandbox_dir or tempfile.mkdtemp(prefix="gyre-sbx-")
    proc, cgroup = None, []
    try:
        _prepare(workdir, source)
        cgroup, _ = _make_cgroup(uid, limits)  # none: totals() said so once
        # No preexec_fn: the launcher applies the limits, so subprocess never forks this
        # (multithreaded) process; start_new_session makes the launcher a group leader.
        proc = await asyncio.create_subprocess_exec(
            *_command(workdir, uid, limits, cgroup), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True, cwd="/", env={},
        )  # fmt: skip
        buf, over = bytearray(), False

        async def feed():
            with contextlib.suppress(OSError):  # the runner may be gone already
                proc.stdin.write(_payload(function, tests, limits, uid))
                await proc.stdin.drain()
            with contextlib.suppress(OSError):
                proc.stdin.close()

        async def pump():
            nonlocal over
            while chunk := await proc.stdout.read(_CHUNK):
                room = limits.output_bytes - len(buf)
                buf.extend(chunk[:room])
                if len(chunk) > room:
                    over = True
                    _stop(proc)
                    return
            await proc.wait()

        timed_out = False
        try:
            await asyncio.wait_for(asyncio.gather(feed(), pump()), limits.wall_seconds)
        except TimeoutError:
            timed_out = True
            _stop(proc)
        await _finish(proc, uid)
        result = _classify(proc.returncode, bytes(buf), tests, limits, timed_out, over, uid)
        if result.status == "killed" and _oom_killed(cgroup):
            detail = f"killed at the run's total memory limit ({limits.total_memory_bytes} bytes)"
            result = dataclasses.replace(result, status="memory", detail=detail)
        return result
    finally:
        if proc is not None and proc.returncode is None:  # cancelled, or failed above
            _stop(proc)
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(_finish(proc, uid), 10)
        _sweep(uid)
        _remove_cgroup(cgroup)
        os.close(lock)
        if sandbox_dir is None:
            shutil.rmtree(workdir, ignore_errors=True)
