"""Workload files: write the JSONL format, and read it or a published CSV trace into one list
of requests on one clock, with the options every tool shares.

Why one loader: ``quanta simulate``, ``quanta bench serve``/``workload`` and Locust must see
the same requests from the same file, so row selection (``limit``), time and token scaling and
the policy for rows too long for the model live here, not in each tool. The formats are in
``quanta.workloads.jsonl`` (``.jsonl`` or any other suffix) and
``quanta.workloads.csv_traces`` (``.csv``: BurstGPT or Azure, told apart by the header).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from quanta.workloads.arrivals import arrival_times
from quanta.workloads.csv_traces import read_csv_trace
from quanta.workloads.jsonl import estimate_tokens, read_jsonl, write_jsonl
from quanta.workloads.model import FileRow, WorkloadError, WorkloadRequest
from quanta.workloads.transforms import (
    TOO_LONG,
    TooLong,
    fit_to_model,
    rebase,
    scale_time,
    scale_tokens,
)


def save_workload(path: str | Path, requests: Sequence[WorkloadRequest]) -> Path:
    """Write the JSONL workload file (see ``quanta.workloads.jsonl``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(path, requests)
    return path


def load_workload(
    path: str | Path,
    *,
    rate: float | None = None,
    cv: float = 1.0,
    seed: int = 0,
    count_tokens: Callable[[str], int] | None = None,
    limit: int | None = None,
    time_scale: float = 1.0,
    token_scale: float = 1.0,
    too_long: TooLong = "error",
    max_len: int | None = None,
) -> list[WorkloadRequest]:
    """Read a JSONL workload or a CSV trace, ordered by arrival.

    Rows without times get arrivals from ``rate``/``cv`` (seeded), which is then required.
    A ``prompt`` without ``prompt_tokens`` is measured with ``count_tokens`` (default: about
    4 characters per token, an estimate; the server counts the real tokens of sent text).

    Then, in this order: the first ``limit`` requests by arrival are kept (None: all);
    prompt lengths are multiplied by ``token_scale`` and arrival times divided by
    ``time_scale`` (``scale_tokens``, ``scale_time``); with ``max_len``, a request whose
    prompt + output exceeds it is handled by ``too_long`` (``fit_to_model``): an error that
    names ``path:line``, dropped, or clipped.
    """
    if too_long not in TOO_LONG:
        raise WorkloadError(f"too_long must be one of {', '.join(TOO_LONG)}, got {too_long!r}")
    if limit is not None and limit < 0:
        raise WorkloadError(f"limit must be >= 0, got {limit}")
    path = Path(path)
    if not path.is_file():  # every consumer (CLI, Locust, bench) reports it in one line
        raise WorkloadError(f"{path}: no such workload file")
    if path.suffix.lower() == ".csv":
        rows = read_csv_trace(path)
    else:
        rows = read_jsonl(path, count_tokens or estimate_tokens)
    if not rows:
        raise WorkloadError(f"{path}: no requests")
    timed = sorted(_on_one_clock(path, rows, rate, cv, seed), key=lambda p: p[1].arrival_time)
    picked = timed[:limit]  # NOTE: a stable sort: ties keep the file's order
    lines = [line for line, _ in picked]
    reqs = scale_time(scale_tokens([r for _, r in picked], token_scale), time_scale)
    if max_len is None:
        return reqs
    out = []
    for line, r in zip(lines, reqs, strict=True):
        try:
            fitted = fit_to_model(r, max_len, too_long)
        except WorkloadError as exc:
            raise WorkloadError(f"{path}:{line}: request {r.request_id!r}: {exc}") from None
        if fitted is not None:
            out.append(fitted)
    if reqs and not out:
        raise WorkloadError(f"{path}: no request fits max_len {max_len} (too_long={too_long!r})")
    return out


def _on_one_clock(
    path: Path, rows: list[FileRow], rate: float | None, cv: float, seed: int
) -> list[tuple[int, WorkloadRequest]]:
    """(line, request with its arrival time) of every row, in file order; request ids must
    be unique."""
    untimed = [row.line for row in rows if row.time is None]
    if untimed and len(untimed) < len(rows):
        raise WorkloadError(f"{path}:{untimed[0]}: no arrival_time/timestamp, unlike other rows")
    if untimed:
        if rate is None:
            raise WorkloadError(f"{path}: no arrival times in the file; give a rate")
        times = arrival_times(len(rows), rate, random.Random(seed), cv)
    else:
        times = [row.time for row in rows]  # type: ignore[misc]
    reqs = [replace(row.request, arrival_time=t) for row, t in zip(rows, times, strict=True)]
    if not untimed and any(row.clock for row in rows):
        reqs = rebase(reqs)
    seen: dict[str, int] = {}
    for row, r in zip(rows, reqs, strict=True):
        if r.request_id in seen:
            raise WorkloadError(
                f"{path}:{row.line}: request_id {r.request_id!r} already used on line "
                f"{seen[r.request_id]}"
            )
        seen[r.request_id] = row.line
    return [(row.line, r) for row, r in zip(rows, reqs, strict=True)]
