"""The suite's pytest-xdist scheduler when a worker dies: the run ends, the test that killed
the worker fails once, and every other test runs (``module_scheduling``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]  # module_scheduling.py lives at the top of tests/

CONFTEST = """
from module_scheduling import ModuleScheduling

def pytest_xdist_make_scheduler(config, log):
    return ModuleScheduling(config, log, {"test_shared_a.py", "test_shared_b.py"}, "shared")
"""

MODULES = {
    # a finished unit on the worker that dies: queued again by pytest-xdist 3.8, as an empty
    # batch no worker reports on
    "test_a_first.py": "def test_one(): pass\ndef test_two(): pass\ndef test_three(): pass\n",
    "test_b_crash.py": (
        "import os\n"
        "def test_before(): pass\n"
        "def test_crash(): os._exit(3)\n"
        "def test_after(): pass\n"
    ),
    # a unit of one test: a replacement worker given only this never starts it
    "test_c_single.py": "def test_alone(): pass\n",
    "test_d_last.py": "def test_last_one(): pass\ndef test_last_two(): pass\n",
    "test_shared_a.py": "def test_shared_a(): pass\n",
    "test_shared_b.py": "def test_shared_b(): pass\n",
}


@pytest.mark.parametrize("workers", [1, 2])
def test_a_run_survives_a_worker_that_dies(tmp_path: Path, workers: int) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    for name, source in MODULES.items():
        (tmp_path / name).write_text(source)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-n",
            str(workers),
            "--dist",
            "loadscope",
            "--no-loadscope-reorder",
            "-rA",
            "-o",
            "addopts=",
        ],
        cwd=tmp_path,
        env={"PYTHONPATH": str(TESTS), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,  # the stock scheduler never ends this run
    )
    out = run.stdout
    assert "1 failed, 10 passed" in out, out + run.stderr
    assert "FAILED test_b_crash.py::test_crash" in out
    for module, source in MODULES.items():
        for line in source.splitlines():
            if line.startswith("def test_") and "crash" not in line:
                assert f"PASSED {module}::{line[4:].split('(')[0]}" in out, out
