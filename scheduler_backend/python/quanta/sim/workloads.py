"""Seeded request traces: synthetic length distributions, arrival processes, trace files.

ShareGPT and Alpaca cannot be downloaded here, so their lengths are *approximations*: log-normal
input and output lengths whose means are the commonly quoted ones (OPT tokenizer; vLLM paper):
ShareGPT 161 input / 338 output tokens with a long tail, Alpaca 19 / 58 with a short one. The
spreads (sigma) are our choice, picked so ShareGPT shows the heavy tail that makes FCFS suffer
head-of-line blocking. Samples are redrawn until prompt + output fits the model. Real traces
can be given as JSONL (``input_len``/``output_len``, optional ``arrival_time``; the
``prompt_tokens``/``output_tokens`` names of ``quanta.bench`` workload files work too) or as a
BurstGPT CSV (``Timestamp``, ``Request tokens``, ``Response tokens``).
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

# NOTE: the generators live in ``quanta.bench.workloads`` (one workload format for bench,
# simulator and load tests); this module keeps the simulator's names and its trace helpers.
from quanta.bench.workloads import (
    DATASETS,
    LengthDist,
    TraceRequest,
    arrival_times,
    with_io_ratio,
)

__all__ = [
    "DATASETS",
    "LengthDist",
    "TraceRequest",
    "arrival_times",
    "load_trace",
    "make_workload",
    "save_trace",
    "with_io_ratio",
]


def make_workload(
    name_or_path: str,
    num_requests: int,
    rate: float,
    *,
    seed: int = 0,
    cv: float = 1.0,
    max_len: int = 2048,
) -> list[TraceRequest]:
    """A dataset name (``sharegpt``, ``alpaca``, ...) or a trace file. A file's first
    ``num_requests`` rows are used, its times shifted so the first arrival is at 0; a file
    without timestamps gets arrivals from ``rate``/``cv``. Rows too long for ``max_len`` are
    dropped from files and redrawn for datasets."""
    rng = random.Random(seed)
    if name_or_path in DATASETS:
        dist = DATASETS[name_or_path]
        lengths = [dist.sample(rng, max_len) for _ in range(num_requests)]
        times = arrival_times(num_requests, rate, rng, cv)
        return [TraceRequest(t, i, o) for t, (i, o) in zip(times, lengths, strict=True)]
    path = Path(name_or_path)
    if not path.is_file():
        known = ", ".join(sorted(DATASETS))
        raise ValueError(f"workload {name_or_path!r} is neither a dataset ({known}) nor a file")
    rows = load_trace(path)[:num_requests]
    if any(t is None for t, _, _ in rows):
        times = arrival_times(len(rows), rate, rng, cv)
        rows = [(t, i, o) for t, (_, i, o) in zip(times, rows, strict=True)]
    t0 = min((t for t, _, _ in rows), default=0.0)
    trace = [TraceRequest(float(t) - t0, i, o) for t, i, o in rows]  # type: ignore[arg-type]
    return [r for r in trace if r.input_len + r.output_len <= max_len]


def load_trace(path: Path) -> list[tuple[float | None, int, int]]:
    """(arrival or None, input_len, output_len) rows of a JSONL or BurstGPT CSV file."""
    if path.suffix == ".csv":
        with path.open(newline="") as f:
            return [
                (float(row["Timestamp"]), int(row["Request tokens"]), int(row["Response tokens"]))
                for row in csv.DictReader(f)
                if int(row["Request tokens"]) > 0 and int(row["Response tokens"]) > 0
            ]
    rows: list[tuple[float | None, int, int]] = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            t = obj.get("arrival_time", obj.get("timestamp"))
            n_in = _first(obj, "input_len", "prompt_tokens", "input_tokens")
            n_out = _first(obj, "output_len", "output_tokens", "max_tokens")
            rows.append((None if t is None else float(t), int(n_in), int(n_out)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{lineno}: need input_len and output_len ({exc})") from exc
    return rows


def _first(obj: dict[str, object], *keys: str) -> object:
    """The first of ``keys`` present (``quanta.bench`` workload files name them differently)."""
    for key in keys:
        if key in obj:
            return obj[key]
    raise KeyError(keys[0])


def save_trace(trace: list[TraceRequest], path: Path) -> None:
    lines = (
        json.dumps(
            {"arrival_time": r.arrival_time, "input_len": r.input_len, "output_len": r.output_len}
        )
        for r in trace
    )
    path.write_text("\n".join(lines) + "\n")
