"""The layer table of docs/architecture.md, as import-linter checks it (``[tool.importlinter]``
in pyproject.toml): every import, direct or through others, runs down the table, the serving
package never imports the lab, and the scheduler's side never imports torch.

Unlike the fresh-interpreter checks of ``test_layering.py``, this reads the source, so an
import inside a function that no test calls counts as much as one at the top of a module."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_imports_keep_the_layer_contracts():
    lint = Path(sys.executable).parent / "lint-imports"
    out = subprocess.run(
        [str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert " 0 broken" in out.stdout, out.stdout
