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
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_time: float
    input_len: int
    output_len: int


@dataclass(frozen=True, slots=True)
class LengthDist:
    """Independent log-normal input and output lengths with the given means."""

    mean_input: float
    mean_output: float
    sigma_input: float
    sigma_output: float

    def sample(self, rng: random.Random, max_len: int) -> tuple[int, int]:
        mu_in = math.log(self.mean_input) - self.sigma_input**2 / 2
        mu_out = math.log(self.mean_output) - self.sigma_output**2 / 2
        while True:
            n_in = max(1, round(rng.lognormvariate(mu_in, self.sigma_input)))
            n_out = max(1, round(rng.lognormvariate(mu_out, self.sigma_output)))
            if n_in + n_out <= max_len:
                return n_in, n_out


DATASETS: dict[str, LengthDist] = {
    "sharegpt": LengthDist(161, 338, sigma_input=1.0, sigma_output=0.9),
    "alpaca": LengthDist(19, 58, sigma_input=0.6, sigma_output=0.8),
}


def arrival_times(n: int, rate: float, rng: random.Random, cv: float = 1.0) -> list[float]:
    """Arrivals of a renewal process with mean rate ``rate``: Poisson for ``cv == 1``, else
    Gamma inter-arrivals with shape 1/CV^2 (smaller shape is burstier)."""
    if rate <= 0 or cv <= 0:
        raise ValueError(f"need rate > 0 and cv > 0, got rate={rate}, cv={cv}")
    shape = 1.0 / cv**2
    t, out = 0.0, []
    for _ in range(n):
        t += rng.gammavariate(shape, 1.0 / (rate * shape))
        out.append(t)
    return out


def with_io_ratio(trace: list[TraceRequest], ratio: float, max_len: int) -> list[TraceRequest]:
    """FastServe Fig. 14: the same jobs with mean input / mean output = ``ratio``.

    Every input length is scaled by one factor and every output length by another, so each
    distribution keeps its shape (and inputs stay independent of outputs) while the mean
    total length is preserved; lengths are then clipped to [1, max_len - 1] and to the model.
    """
    if ratio <= 0 or not trace:
        raise ValueError("need ratio > 0 and a non-empty trace")
    mean_in = sum(r.input_len for r in trace) / len(trace)
    mean_out = sum(r.output_len for r in trace) / len(trace)
    total = mean_in + mean_out
    a, b = total * ratio / (1 + ratio) / mean_in, total / (1 + ratio) / mean_out
    out = []
    for r in trace:
        n_in = min(max_len - 1, max(1, round(r.input_len * a)))
        n_out = min(max_len - n_in, max(1, round(r.output_len * b)))
        out.append(replace(r, input_len=n_in, output_len=n_out))
    return out


def make_workload(
    name_or_path: str,
    num_requests: int,
    rate: float,
    *,
    seed: int = 0,
    cv: float = 1.0,
    max_len: int = 2048,
) -> list[TraceRequest]:
    """A dataset name (``sharegpt``, ``alpaca``) or a trace file. A file's first
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
