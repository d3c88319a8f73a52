"""The import layers, each checked in a fresh interpreter: the simulator runs without the
live benchmarks, and the workloads and metrics both of them share stay pure Python."""

from __future__ import annotations

import json
import subprocess
import sys


def loaded(imports: str, packages: tuple[str, ...]) -> list[str]:
    """The modules of ``packages`` (and their submodules) that ``import <imports>`` loads."""
    code = (
        f"import json, sys, {imports}; "
        f"print(json.dumps(sorted(m for m in sys.modules "
        f"if any(m == p or m.startswith(p + '.') for p in {packages!r}))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_the_simulator_does_not_import_the_benchmarks():
    assert loaded("quanta.sim, quanta.sim.cli, quanta.sim.repro", ("quanta.bench",)) == []


def test_workloads_and_metrics_are_pure_python():
    heavy = ("torch", "numpy", "typer", "quanta.bench", "quanta.sim")
    assert loaded("quanta.workloads, quanta.metrics", heavy) == []
