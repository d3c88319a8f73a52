"""docs/architecture.md stays true: every file or folder it names exists, and its stage table
names every stage the policies define."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "scheduler_backend" / "python" / "quanta"
LAB = PACKAGE.parent  # the lab's paths start at quanta_lab/, beside the package
DOC = ROOT / "docs" / "architecture.md"
# A path in backticks: at least one "/" or a file suffix, no spaces or call syntax.
_PATH = re.compile(r"`([\w.-]+(?:/[\w.-]*)*\.(?:py|c|md|toml|sh|pbtxt|template)|[\w.-]+/[\w./-]*)`")


def named_paths() -> list[str]:
    return sorted(set(_PATH.findall(DOC.read_text(encoding="utf-8"))))


def test_every_path_the_architecture_names_exists():
    paths = named_paths()
    assert len(paths) >= 40, paths  # the pattern still finds the doc's paths
    missing = [p for p in paths if not any((d / p).exists() for d in (PACKAGE, LAB, ROOT))]
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_the_stage_table_has_every_stage():
    from dataclasses import fields

    from quanta.policies.systems import Stages

    # a builder's Stages: one field per slot, and "observers" for the observer stage
    STAGES = [f.name.removesuffix("s") if f.name == "observers" else f.name for f in fields(Stages)]
    text = DOC.read_text(encoding="utf-8")
    table = text[text.index("## Scheduling stages") :]
    rows = {line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ")}
    assert set(STAGES) <= rows, set(STAGES) - rows
