"""The import layers, each checked in a fresh interpreter: the simulator runs without the
live benchmarks, the serving package without the lab (whose commands come in through an
entry point), and the workloads and metrics all of them share stay pure Python."""

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
    benchmarks = ("quanta.bench", "quanta_lab.bench")
    assert loaded("quanta.sim, quanta.sim.cli, quanta_lab.sim.repro", benchmarks) == []


def test_the_serving_commands_do_not_import_the_lab():
    commands = "quanta.sim.cli, quanta.bench.serve_cli, quanta.bench.load_cli"
    assert loaded(commands, ("quanta_lab",)) == []


def test_a_broken_command_plugin_is_a_warning_not_a_broken_cli():
    code = (
        "import importlib.metadata as md\n"
        "entry = md.EntryPoint('broken', 'quanta_no_such_module:register', 'quanta.commands')\n"
        "md.entry_points = lambda group: [entry] if group == 'quanta.commands' else []\n"
        "from typer.testing import CliRunner\n"
        "from quanta.cli import app\n"
        "result = CliRunner().invoke(app, ['simulate', '--help'])\n"
        "print(result.exit_code, 'validate' in result.output)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["0", "False"]  # simulate works; the lab's validate is missing
    assert "'broken' commands" in out.stderr and "quanta_no_such_module" in out.stderr


def test_workloads_and_metrics_are_pure_python():
    heavy = ("torch", "numpy", "typer", "quanta.bench", "quanta.sim")
    assert loaded("quanta.workloads, quanta.metrics", heavy) == []
