"""docs/config.md is generated from the code (scripts/config_doc.py) and cannot drift: it must
equal what the generator writes now, every key must have a meaning, and a key added without
one (a new spec field behind a config line, uncommented) is caught."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def doc():
    spec = importlib.util.spec_from_file_location("config_doc", ROOT / "scripts" / "config_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_key_has_a_meaning(doc):
    assert doc.missing_meanings() == [], (
        "comment these keys in gyre/config.py or on their spec field, or add them to "
        "DESCRIPTIONS in scripts/config_doc.py"
    )


def test_docs_config_md_is_current(doc):
    assert (ROOT / "docs" / "config.md").read_text() == doc.render(), (
        "docs/config.md is stale: run python scripts/config_doc.py"
    )


def test_it_lists_every_key_with_its_default_interval_and_choices(doc):
    from gyre.config import BOUNDS, default_config

    rows = {r["key"]: r for r in doc.describe()}
    cfg = default_config()
    assert set(rows) == set(doc.flat_defaults())
    assert rows["train.lr"]["default"] == cfg.train.lr
    assert rows["train.lr"]["interval"] == str(BOUNDS["train.lr"])
    assert "elastic" in rows["scheduler.policy"]["interval"]  # the choices validate accepts
    assert "`ledger`" in rows["env.name"]["interval"]
    # meanings come from the code: a comment in config.py, one on the spec field
    assert "nothing progresses" in rows["run.watchdog_s"]["meaning"]
    assert "devices per cell" in rows["mesh.cell_size"]["meaning"]


def test_a_key_added_without_a_meaning_is_caught(doc, monkeypatch):
    import gyre.config as config

    made = config.default_config

    def with_a_new_knob():
        c = made()
        c.scheduler.new_knob = 1.5  # a spec field's config line, with no comment anywhere
        return c

    monkeypatch.setattr(config, "default_config", with_a_new_knob)
    assert "scheduler.new_knob" in doc.missing_meanings()
    assert "scheduler.new_knob" in doc.render()  # and the reference would be stale
