"""Published CSV traces, told apart by their header: BurstGPT and Azure's LLM inference trace.

BurstGPT (``Timestamp, Model, Request tokens, Response tokens, Total tokens, Log Type``):
``Timestamp`` is seconds on the trace's clock, ``Model`` becomes the app, ``Log Type`` the
tenant; rows with 0 request or response tokens (failed requests in BurstGPT) are skipped.

Azure LLM inference trace (``TIMESTAMP, ContextTokens, GeneratedTokens``): Azure Public Dataset
(AzureLLMInferenceDataset2023), CC BY 4.0; Patel et al., "Splitwise: Efficient generative LLM
inference using phase splitting", ISCA 2024. ``TIMESTAMP`` is a date-time such as
``2023-11-16 18:15:46.6805900`` (any number of fractional digits; a plain number of seconds
works too), and a request arrives that many seconds after the first row; ``ContextTokens`` is
the prompt length, ``GeneratedTokens`` the output length. The trace has no prompt text, no
tenants and no apps: requests get the defaults. Rows with 0 tokens carry no request to replay
and are skipped, as in BurstGPT.

Either way a bad row stops loading with ``path:line: problem``.
"""

from __future__ import annotations

import csv
import datetime as dt
import re
from collections.abc import Mapping
from pathlib import Path

from quanta.workloads.model import (
    FileRow,
    WorkloadError,
    WorkloadRequest,
    parse_count,
    parse_number,
)

BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_DATETIME = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:[.,](\d+))?(?:Z|[+-]00:?00)?"
)
_NS = 10**9


def read_csv_trace(path: Path) -> list[FileRow]:
    """The trace's requests in file order: Azure's if its header names any Azure column,
    else BurstGPT's."""
    with path.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        columns = [c.strip() for c in reader.fieldnames or []]
        reader.fieldnames = columns
        azure = any(c in columns for c in AZURE_COLUMNS)
        need = AZURE_COLUMNS if azure else BURSTGPT_COLUMNS
        missing = [c for c in need if c not in columns]
        if missing:
            name = "Azure trace" if azure else "BurstGPT"
            hint = "" if azure else f" (or an Azure trace's {list(AZURE_COLUMNS)})"
            raise WorkloadError(f"{path}:1: {name} header lacks {missing}; need {list(need)}{hint}")
        rows: list[FileRow] = []
        first_ns: int | None = None
        for row in reader:
            line = reader.line_num
            try:
                _check_columns(row)
                if azure:
                    ns = _azure_time_ns(row["TIMESTAMP"])
                    first_ns = ns if first_ns is None else first_ns
                    req = _azure_request(row, len(rows))
                    when = (ns - first_ns) / _NS
                else:
                    when = parse_number(row["Timestamp"], "Timestamp", minimum=0.0)
                    req = _burstgpt_request(row, len(rows))
            except WorkloadError as exc:
                raise WorkloadError(f"{path}:{line}: {exc}") from None
            if req is not None:
                # NOTE: a trace's clock, rebased by the loader: an unsorted file's earliest
                # row arrives at 0 even when it is not the first (the Azure times may be < 0).
                rows.append(FileRow(line, req, when, True))
    return rows


def _check_columns(row: Mapping[str, str | None]) -> None:
    if None in row or any(v is None for v in row.values()):
        raise WorkloadError("wrong number of columns")


def _burstgpt_request(row: Mapping[str, str | None], index: int) -> WorkloadRequest | None:
    n_in = parse_count(row["Request tokens"], "Request tokens", minimum=0)
    n_out = parse_count(row["Response tokens"], "Response tokens", minimum=0)
    total = row.get("Total tokens")
    if total not in (None, "") and parse_count(total, "Total tokens", minimum=0) != n_in + n_out:
        raise WorkloadError(f"Total tokens {total} != Request tokens + Response tokens")
    if n_in == 0 or n_out == 0:  # BurstGPT logs failed requests with 0 tokens: not replayable
        return None
    return WorkloadRequest(
        0.0,
        n_in,
        n_out,
        request_id=f"r{index}",
        app=(row.get("Model") or "default").strip() or "default",
        tenant=(row.get("Log Type") or "default").strip() or "default",
    )


def _azure_request(row: Mapping[str, str | None], index: int) -> WorkloadRequest | None:
    n_in = parse_count(row["ContextTokens"], "ContextTokens", minimum=0)
    n_out = parse_count(row["GeneratedTokens"], "GeneratedTokens", minimum=0)
    if n_in == 0 or n_out == 0:
        return None
    return WorkloadRequest(0.0, n_in, n_out, request_id=f"r{index}")


def _azure_time_ns(text: str | None) -> int:
    """Nanoseconds since 0001-01-01 of ``2023-11-16 18:15:46.6805900``, exactly (a float of
    seconds since 1970 would lose the last digits), or of a plain number of seconds."""
    value = (text or "").strip()
    match = _DATETIME.fullmatch(value)
    if match is None:
        try:
            seconds = parse_number(value, "TIMESTAMP", minimum=0.0)
        except WorkloadError:
            raise WorkloadError(
                f"TIMESTAMP must be a date-time like 2023-11-16 18:15:46.6805900 or seconds, "
                f"got {text!r}"
            ) from None
        return round(seconds * _NS)
    year, month, day, hour, minute, second = (int(g) for g in match.groups()[:6])
    try:
        days = dt.date(year, month, day).toordinal()
    except ValueError as exc:
        raise WorkloadError(f"TIMESTAMP {text!r}: {exc}") from None
    if hour > 23 or minute > 59 or second > 60:
        raise WorkloadError(f"TIMESTAMP {text!r}: time of day out of range")
    fraction = (match.group(7) or "")[:9].ljust(9, "0")
    return ((days * 24 + hour) * 60 + minute) * 60 * _NS + second * _NS + int(fraction)
