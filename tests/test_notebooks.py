"""The analysis notebooks run top to bottom (nbclient) on a tiny real run's workdir, and with
no workdir at all; the stored notebooks carry no outputs."""

import glob
import os
import sys

import nbformat
import pytest
from nbclient import NotebookClient

import experiments.quickstart as quickstart
from gyre import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
# figures each notebook draws from a complete workdir, and with none
FIGURES = {"quickstart": 3, "scheduler_timeline": 4, "trees": 4}
FIGURES_WITHOUT_RUN = {"quickstart": 0, "scheduler_timeline": 1}


def test_every_notebook_is_known_and_stored_without_outputs():
    names = [os.path.splitext(os.path.basename(p))[0] for p in NOTEBOOKS]
    assert sorted(names) == sorted(FIGURES)
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        assert nb.metadata.kernelspec.name == "python3", path
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, (path, cell.source)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A tiny two-step elastic run: everything a notebook reads."""
    base = tmp_path_factory.mktemp("notebooks")
    cfg = quickstart.get_config("tiny")
    cfg.mesh.cell_size = 4  # two cells: fewer programs to compile
    cfg.mesh.cache_dir = str(base / "xla")
    cfg.sft.dir = str(base / "warm")
    run.main(cfg, str(base / "run"))
    return str(base / "run")


def execute(name: str, workdir: str, monkeypatch) -> tuple[nbformat.NotebookNode, str]:
    """Runs notebooks/<name>.ipynb in a fresh python3 kernel from notebooks/ (as Jupyter does);
    returns the executed notebook and all its text output."""
    monkeypatch.setenv("GYRE_WORKDIR", workdir)  # the kernel inherits this environment
    nb = nbformat.read(os.path.join(ROOT, "notebooks", f"{name}.ipynb"), as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell("import sys; print('KERNEL', sys.executable)"))
    client = NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": os.path.join(ROOT, "notebooks")}})  # fmt: skip
    client.execute()  # raises CellExecutionError naming the cell on any error
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert f"KERNEL {sys.executable}" in text  # the kernel is this venv's interpreter
    return nb, text


def figures(nb) -> int:
    return sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))


@pytest.mark.slow
def test_notebooks_run_on_a_real_workdir(workdir, monkeypatch):
    # One test for all three, so under pytest-xdist only one worker makes the tiny run.
    for name in sorted(FIGURES):
        nb, text = execute(name, workdir, monkeypatch)
        assert figures(nb) == FIGURES[name], name
        assert "NO RUN" not in text and "NO REAL RUN" not in text, name
        if name != "trees":  # the trees notebook makes its own executions
            assert workdir in text, name


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FIGURES_WITHOUT_RUN))
def test_notebook_says_when_there_is_no_workdir(name, tmp_path, monkeypatch):
    missing = str(tmp_path / "no-such-run")
    nb, text = execute(name, missing, monkeypatch)
    assert f"no workdir at {missing}" in text
    assert figures(nb) == FIGURES_WITHOUT_RUN[name]  # the simulated charts still draw
