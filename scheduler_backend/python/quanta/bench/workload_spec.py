"""What a benchmark replays: a workload file, or how to generate one (seeded), from the
command-line options ``quanta bench serve`` and ``quanta bench workload`` share."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import typer

from quanta.workloads import TooLong, WorkloadRequest


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """What to replay: a file, or how to generate requests (seeded)."""

    source: str | None = None  # a JSONL/CSV file or a dataset name; None: uniform lengths
    num_requests: int | None = None  # None: all of a file, or 32 generated
    seed: int = 0
    cv: float = 1.0
    prompt_tokens: tuple[int, int] = (16, 64)
    output_tokens: tuple[int, int] = (8, 32)
    tenants: str = "default"
    priority_class: str = "online"
    max_len: int = 2048  # the model's: prompt + output must fit
    time_scale: float = 1.0  # a file's: its inter-arrival times are divided by it
    token_scale: float = 1.0  # a file's: its prompt lengths are multiplied by it
    too_long: TooLong = "error"  # a file's rows that do not fit max_len

    def build(self, rate: float | None) -> list[WorkloadRequest]:
        """The requests at ``rate`` (None: a file's own times; required to generate)."""
        from quanta import workloads as wl

        if self.source is not None and self.source not in wl.DATASETS:
            if not Path(self.source).is_file():
                known = ", ".join(sorted(wl.DATASETS))
                raise wl.WorkloadError(f"{self.source!r} is neither a file nor a dataset ({known})")
            if rate is not None and self.time_scale != 1.0:
                raise wl.WorkloadError("a file is stretched to --rate or sped up by --time-scale")
            rows = wl.load_workload(
                self.source,
                rate=rate,
                cv=self.cv,
                seed=self.seed,
                limit=self.num_requests,
                time_scale=self.time_scale,
                token_scale=self.token_scale,
                too_long=self.too_long,
                max_len=self.max_len,
            )
            rows = wl.rebase(rows)
            if rate is None or not any(r.arrival_time for r in rows):
                return rows
            if math.isinf(rate):
                return [replace(r, arrival_time=0.0) for r in rows]
            return wl.scale_to_rate(rows, rate)
        if self.time_scale != 1.0 or self.token_scale != 1.0:
            raise wl.WorkloadError(
                "--time-scale and --token-scale rescale a workload file; a generated "
                "workload's rate is --rate and its lengths are the dataset's or the ranges'"
            )
        if rate is None:
            raise wl.WorkloadError("a generated workload needs --rate")
        lengths = self.source or wl.UniformLengths(self.prompt_tokens, self.output_tokens)
        tenants = [
            replace(t, priority_class=self.priority_class) for t in wl.tenant_mix(self.tenants)
        ]
        return wl.synthesize(
            32 if self.num_requests is None else self.num_requests,
            arrivals=rate,
            cv=self.cv,
            lengths=lengths,
            tenants=tenants,
            seed=self.seed,
            max_len=self.max_len,
            id_prefix=f"s{self.seed}-r",
        )


def spec_from_options(
    source: str | None,
    num_requests: int | None,
    seed: int,
    cv: float,
    prompt_tokens: str,
    output_tokens: str,
    tenants: str,
    priority_class: str,
    max_len: int = 2048,
    time_scale: float = 1.0,
    token_scale: float = 1.0,
    too_long: TooLong = "error",
) -> WorkloadSpec:
    """The ``WorkloadSpec`` of the shared command-line options."""
    return WorkloadSpec(
        source=source,
        num_requests=num_requests,
        seed=seed,
        cv=cv,
        prompt_tokens=parse_range(prompt_tokens, "--prompt-tokens"),
        output_tokens=parse_range(output_tokens, "--output-tokens"),
        tenants=tenants,
        priority_class=priority_class,
        max_len=max_len,
        time_scale=time_scale,
        token_scale=token_scale,
        too_long=too_long,
    )


def parse_range(text: str, option: str) -> tuple[int, int]:
    """``lo:hi`` of a length option, with 0 < lo <= hi."""
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise typer.BadParameter(f"{option} takes lo:hi, got {text!r}") from None
    if not 0 < lo <= hi:
        raise typer.BadParameter(f"{option} needs 0 < lo <= hi, got {text!r}")
    return lo, hi
