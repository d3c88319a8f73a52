"""``quanta bench load``: model load time and peak memory, engine directory vs checkpoint.

Why a child process per load: ``ru_maxrss`` is a high-water mark that never comes down, and a
second load in the same process would find the page cache, the allocator and torch's lazy
state already warm. A fresh interpreter imports torch and the runner first, records its
baseline, then times ``ModelRunner(...)`` alone, so the numbers are the load's and nothing else.

Both sources load into the same dtype (the engine's, unless told otherwise), so a checkpoint
load pays the cast the engine build did ahead of time. Rounds alternate which source goes
first, after one discarded warm-up load of each, so page cache and machine noise hit both
alike; the best time counts (noise only ever adds) and the median shows the spread. The peak
is the most any run's resident memory grew during the load: next to the weights' own bytes it
says whether original weights stayed resident beside converted ones.

NOTE: safetensors hands out tensors that are views of the file's memory map, so a load that
needs no cast reads nothing: its pages come in at the first forward pass. So each child also
reads every weight once after the load (``ready_s``: what the first step would pay), and the
speed-up and the peak are taken at that point, when both sources hold the same weights.
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SOURCES = ("checkpoint", "engine")
_MANIFEST = "quanta_engine.json"  # quanta.build.manifest.MANIFEST_FILE, without pydantic
_MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class LoadRun:
    """What one child process measured (all sizes in bytes)."""

    load_s: float
    ready_s: float  # load_s plus reading every weight once, as the first step does
    baseline_rss_bytes: int  # high-water mark after imports, before the load
    peak_rss_bytes: int  # high-water mark after the load
    weights_bytes: int  # the loaded parameters, a tied one counted once
    file_bytes: int  # the safetensors files read
    threads: int  # torch.get_num_threads() in the child


@dataclass(frozen=True, slots=True)
class LoadRow:
    """One source's summary over ``runs`` timed loads."""

    source: str
    path: str
    dtype: str
    runs: int
    best_load_s: float
    median_load_s: float
    best_ready_s: float
    peak_rss_growth_bytes: int  # max over runs of peak minus baseline
    weights_bytes: int
    file_bytes: int
    speedup: float  # checkpoint best ready / this source's best ready (1.0 for the checkpoint)
    threads: int


def engine_dtype(engine: Path) -> str:
    """The dtype the engine was built in (``quanta_engine.json``); float32 when unrecorded."""
    manifest = engine / _MANIFEST
    if not manifest.is_file():
        return "float32"
    return str(json.loads(manifest.read_text()).get("dtype", "float32"))


def run_load_bench(
    checkpoint: Path,
    engine: Path,
    *,
    dtype: str | None,
    repeat: int,
    threads: int | None,
    output: Path | None,
) -> list[dict[str, Any]]:
    """Time ``repeat`` fresh loads of each source, print a table and the machine, and write
    the rows as JSON to ``output`` when given. ``dtype`` None: the engine's own."""
    if repeat < 1:
        raise ValueError("repeat must be at least 1")
    dtype = dtype or engine_dtype(engine)
    paths = {"checkpoint": checkpoint, "engine": engine}
    for source in SOURCES:  # warm-up: page cache and first-touch costs, discarded
        measure_load(paths[source], dtype, threads)
    runs: dict[str, list[LoadRun]] = {source: [] for source in SOURCES}
    for round_index in range(repeat):
        # NOTE: the order flips each round, so neither source always runs right after the other.
        order = SOURCES if round_index % 2 == 0 else SOURCES[::-1]
        for source in order:
            runs[source].append(measure_load(paths[source], dtype, threads))
    best_checkpoint = min(run.ready_s for run in runs["checkpoint"])
    rows = [
        _summarize(source, paths[source], dtype, runs[source], best_checkpoint)
        for source in SOURCES
    ]
    _print(rows, checkpoint, engine)
    result = [asdict(row) for row in rows]
    if output is not None:
        output.write_text(json.dumps(result, indent=2) + "\n")
    return result


def measure_load(model_dir: Path, dtype: str, threads: int | None) -> LoadRun:
    """Load ``model_dir`` once in a fresh interpreter (``_child``) and return its numbers."""
    command = [sys.executable, "-m", __name__, str(model_dir), dtype, str(threads or 0)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"loading {model_dir} failed (exit {done.returncode}):\n{done.stderr[-2000:]}"
        )
    # NOTE: the report is the last stdout line; anything a library prints comes before it.
    return LoadRun(**json.loads(done.stdout.strip().splitlines()[-1]))


def machine() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _summarize(
    source: str, path: Path, dtype: str, runs: list[LoadRun], best_checkpoint: float
) -> LoadRow:
    times = [run.load_s for run in runs]
    best = min(times)
    return LoadRow(
        source=source,
        path=str(path),
        dtype=dtype,
        runs=len(runs),
        best_load_s=best,
        median_load_s=statistics.median(times),
        best_ready_s=min(run.ready_s for run in runs),
        peak_rss_growth_bytes=max(run.peak_rss_bytes - run.baseline_rss_bytes for run in runs),
        weights_bytes=runs[0].weights_bytes,
        file_bytes=runs[0].file_bytes,
        speedup=best_checkpoint / min(run.ready_s for run in runs),
        threads=runs[0].threads,
    )


def _print(rows: list[LoadRow], checkpoint: Path, engine: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"load {checkpoint.name} vs engine {engine.name} into {rows[0].dtype}, "
        f"best of {rows[0].runs} fresh processes (sizes in MiB)"
    )
    columns = ("source", "load s", "median", "ready s", "vs checkpoint", "peak RSS growth")
    columns = (*columns, "weights")
    for name in (*columns, "peak / weights", "files read"):
        table.add_column(name, justify="left" if name == "source" else "right")
    for r in rows:
        table.add_row(
            r.source,
            f"{r.best_load_s:.3f}",
            f"{r.median_load_s:.3f}",
            f"{r.best_ready_s:.3f}",
            f"{r.speedup:.2f}x",
            f"{r.peak_rss_growth_bytes / _MiB:.1f}",
            f"{r.weights_bytes / _MiB:.1f}",
            f"{r.peak_rss_growth_bytes / r.weights_bytes:.2f}",
            f"{r.file_bytes / _MiB:.1f}",
        )
    console = Console()
    console.print(table)
    console.print(
        "load: ModelRunner(...) returns; ready: every weight read once after it (the first "
        f"step's reads); best of each. machine: {machine()}, {rows[0].threads} torch threads"
    )


def _child(model_dir: str, dtype: str, threads: int) -> None:
    """One measured load; the only place torch is imported. Prints one JSON line."""
    import resource
    import time

    import torch

    from quanta.runner.model_runner import ModelRunner
    from quanta.runner.models.loader import checkpoint_files

    if threads > 0:
        torch.set_num_threads(threads)
    # NOTE: ru_maxrss is KiB on Linux (bytes on macOS, where this bench is not meant to run).
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    started = time.perf_counter()
    runner = ModelRunner(model_dir, num_device_blocks=1, num_host_blocks=0, dtype=dtype)
    load_s = time.perf_counter() - started
    # A tied head is its embedding's tensor: count each tensor's memory once.
    params = runner.model.named_parameters(remove_duplicate=False)
    tensors = {p.data_ptr(): p for _, p in params}
    with torch.inference_mode():
        for p in tensors.values():
            p.sum()
    ready_s = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report = LoadRun(
        load_s=load_s,
        ready_s=ready_s,
        baseline_rss_bytes=baseline,
        peak_rss_bytes=peak,
        weights_bytes=sum(p.nbytes for p in tensors.values()),
        file_bytes=sum(path.stat().st_size for path in checkpoint_files(model_dir)),
        threads=torch.get_num_threads(),
    )
    print(json.dumps(asdict(report)))


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], int(sys.argv[3]))
