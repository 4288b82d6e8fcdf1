"""Test setup: 8 fake CPU devices (set before anything touches a JAX backend), the hypothesis
profiles, and the ``sandbox`` marker: such a test needs the code task's sandbox, checked when
the first one runs (never at import); where it is unavailable the test is skipped with the
reason, and in CI (``CI=true``) it fails instead: a green CI run has run every one of them."""

import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# One persistent XLA cache for the session, in a fresh folder (JAX reads these variables when
# it is imported): the xdist workers and every process a test starts (launch.py, benchmarks,
# python -m gyre.plan, notebook kernels, Ray actors) inherit it, so a program is compiled once
# per session rather than once per worker and process. A process keeps the folder its first
# compile used: in a worker that is this one; a subprocess given --config.mesh.cache_dir uses
# that. JAX_COMPILATION_CACHE_DIR set beforehand is used instead (and kept).
_XLA_CACHE_MADE = None
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    _XLA_CACHE_MADE = tempfile.mkdtemp(prefix="gyre-test-xla-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _XLA_CACHE_MADE
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", False)

CI = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")

# Hypothesis profiles, chosen with HYPOTHESIS_PROFILE (or --hypothesis-profile):
#   dev       the default outside CI: new random examples each run, failures kept in .hypothesis/;
#   ci        the default with CI=true: derandomized (the same examples every run), no database;
#   thorough  THOROUGH_FACTOR times each test's max_examples, randomized, to hunt for bugs.
# No per-example deadline in any: JAX compiles inside examples, and timing on a shared machine
# says nothing about correctness.
THOROUGH_FACTOR = 10
settings.register_profile("dev", deadline=None)
settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile("thorough", max_examples=100 * THOROUGH_FACTOR, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if CI else "dev"))


# Tests that take a minute or more on CI's 2 cores, longest first ("file" or "file::test"
# prefixes of a test's id; a module's xdist_group unit goes where its first test does). They
# are collected first, and pyproject.toml's --no-loadscope-reorder makes pytest-xdist hand its
# units out in collection order (by default it sends the xdist_group units first, largest
# first, and the single tests after them): the two quick starts (~4 minutes each) start at
# once, one on each worker, and the short tests fill the end instead of a long one.
RUN_FIRST = ("test_chat_quickstart.py", "test_quickstart.py", "test_ray_cluster.py",
             "test_gpu_check.py", "test_controller.py::test_kill_mid_step", "test_faults.py",
             "test_controller.py::test_ctrl_c", "test_code_set_strength.py",
             "test_chat_experiments.py", "test_tree_schedule.py", "test_controller.py",
             "test_checkpoint.py", "test_attention.py")  # fmt: skip


def _run_first(item) -> int:
    name = f"{item.path.name}::{item.name}"
    return next((i for i, p in enumerate(RUN_FIRST) if name.startswith(p)), len(RUN_FIRST))


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own hook
def pytest_collection_modifyitems(config, items):
    items.sort(key=_run_first)  # stable: else as found
    _xdist_groups(config, items)
    _thorough(items)


def _xdist_groups(config, items):
    """``--dist loadgroup`` sends the tests marked ``xdist_group(name)`` to one worker by the
    ``@name`` that pytest-xdist appends to their node ids. pytest-xdist 3.8 appends it by
    assigning ``item._nodeid``, which pytest 9.2 no longer reads (the id is ``item._id``): the
    marks did nothing, and a module's fixture was built on both workers. Appended here where
    that happened (a worker of a loadgroup run, an id without its ``@``)."""
    if not getattr(config.option, "loadgroup", False):  # set in xdist's workers only
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})  # fmt: skip
        if names and "@" not in item.nodeid and hasattr(item, "_id"):
            item._id = type(item._id).parse(f"{item.nodeid}@{'_'.join(names)}")


def _thorough(items):
    """Under the thorough profile, multiplies each test's own ``max_examples`` (most tests set
    one, which a profile alone does not override)."""
    if settings.get_current_profile_name() != "thorough":
        return
    done = set()
    for item in items:
        fn = getattr(getattr(item, "obj", None), "__func__", getattr(item, "obj", None))
        own = getattr(fn, "_hypothesis_internal_use_settings", None)  # what @settings gave it
        if own is None or id(fn) in done:
            continue
        done.add(id(fn))
        fn._hypothesis_internal_use_settings = settings(
            own, max_examples=own.max_examples * THOROUGH_FACTOR
        )
    for cls in {item.cls for item in items if item.cls is not None}:  # state machines
        own = getattr(cls, "settings", None)
        if isinstance(own, settings):
            cls.settings = settings(own, max_examples=own.max_examples * THOROUGH_FACTOR)


@pytest.fixture(scope="session", autouse=True)
def _session_xla_cache():
    """One tiny compile before any test's, so that the persistent cache this process fixes at
    its first compile is the session's (not the folder of whichever run.main came first)."""
    jax.jit(lambda x: x + 1)(0.0).block_until_ready()


@pytest.fixture(scope="session")
def xla_cache() -> str:
    """The session's persistent XLA cache: the ``--config.mesh.cache_dir`` of the runs a test
    starts as subprocesses, so that they load what other tests compiled already."""
    return os.environ["JAX_COMPILATION_CACHE_DIR"]


@pytest.fixture(scope="session")
def tiny_warm(tmp_path_factory) -> str:
    """A warm-start cache (``--config.sft.dir``) for the session's tiny quick-start launches
    (test_controller, test_faults: one recipe), so that a worker trains that warm start once,
    not once per module. One per worker: two processes never write one cache."""
    return str(tmp_path_factory.mktemp("tiny_warm"))


def _sandbox_why_not() -> str | None:
    from gyre.envs.sandbox import INSTALL_HINT, isolation_available

    ok, why = isolation_available()  # probed once per process (a failed probe is retried once)
    return None if ok else f"sandbox unavailable: {why}; {INSTALL_HINT}"


def pytest_runtest_setup(item):
    if item.get_closest_marker("sandbox") is None:
        return
    why = _sandbox_why_not()
    if why is not None:
        if CI:
            pytest.fail(f"{why} (CI=true: a sandbox test may not be skipped)", pytrace=False)
        pytest.skip(why)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI, a sandbox test skipped by any other route (a skipif, a skip inside) fails too."""
    report = yield
    if CI and report.skipped and item.get_closest_marker("sandbox") is not None:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = (
            f"sandbox test skipped in CI (CI=true), which counts as a failure: {reason}"
        )
    return report


def pytest_unconfigure(config):
    if _XLA_CACHE_MADE is not None:  # the process that made it (xdist's controller, or -n 0)
        shutil.rmtree(_XLA_CACHE_MADE, ignore_errors=True)
