"""``quanta bench load`` at tiny size: both sources measured in fresh processes, through the
function and through the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from quanta.bench.load import run_load_bench
from quanta.build.engine_build import BuildOptions, build_engine_dir
from quanta.cli import app
from typer.testing import CliRunner

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory, opt_tiny: Path) -> tuple[Path, Path]:
    """An opt-tiny checkpoint and the engine built from it (float32, the CPU default)."""
    checkpoint = opt_tiny
    engine = tmp_path_factory.mktemp("load") / "engine"
    build_engine_dir(checkpoint, engine, BuildOptions(kv_cache_memory=1 << 24, host_cache_memory=0))
    return checkpoint, engine


def _check(rows: list[dict], dtype: str) -> None:
    assert [row["source"] for row in rows] == ["checkpoint", "engine"]
    for row in rows:
        assert row["dtype"] == dtype
        assert row["runs"] == 1
        assert 0 < row["best_load_s"] <= row["median_load_s"]
        assert row["best_load_s"] <= row["best_ready_s"]
        assert row["peak_rss_growth_bytes"] >= 0
        assert row["weights_bytes"] > 0
    assert rows[0]["weights_bytes"] == rows[1]["weights_bytes"]
    assert rows[0]["speedup"] == 1.0
    assert rows[1]["speedup"] == pytest.approx(rows[0]["best_ready_s"] / rows[1]["best_ready_s"])


def test_both_sources_load_into_the_engines_dtype(sources: tuple[Path, Path]) -> None:
    checkpoint, engine = sources
    rows = run_load_bench(checkpoint, engine, dtype=None, repeat=1, threads=1, output=None)
    _check(rows, "float32")


def test_the_command_writes_json(sources: tuple[Path, Path], tmp_path: Path) -> None:
    checkpoint, engine = sources
    output = tmp_path / "load.json"
    args = ["bench", "load", "--checkpoint", str(checkpoint), "--engine", str(engine)]
    args += ["--dtype", "bfloat16", "--repeat", "1", "--output", str(output)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "machine:" in result.output
    rows = json.loads(output.read_text())
    _check(rows, "bfloat16")
    # both float32 sources hold twice the bf16 weights' bytes, plus their headers
    assert all(row["file_bytes"] >= 2 * row["weights_bytes"] for row in rows)


def test_the_command_refuses_an_unknown_dtype(sources: tuple[Path, Path]) -> None:
    checkpoint, engine = sources
    args = ["bench", "load", "--checkpoint", str(checkpoint), "--engine", str(engine)]
    result = CliRunner().invoke(app, [*args, "--dtype", "int8"])
    assert result.exit_code == 2
    assert "--dtype" in result.output
