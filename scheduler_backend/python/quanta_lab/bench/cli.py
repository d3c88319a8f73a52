"""``quanta bench decode-profile`` and ``quanta bench loop`` (Typer): where the engine's and
the loop's own time goes, for whoever works on the kernels or the loop.

The measurements (``quanta_lab.bench.decode_profile``, ``quanta_lab.bench.loop_overhead``)
load torch, so they are imported inside the commands.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from quanta.config.cli import options_from
from quanta.config.models import EngineArgs, SchedulerArgs


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    """Add ``bench decode-profile`` and ``bench loop``."""
    bench_app.command("decode-profile")(bench_decode_profile)
    bench_app.command("loop")(bench_loop)


@options_from(
    engine=EngineArgs,
    only={"engine": ("dtype", "linear_kernel")},
    defaults={"linear_kernel": "auto"},
)
def bench_decode_profile(
    model: Annotated[Path, typer.Option(help="checkpoint or engine dir")],
    context: Annotated[int, typer.Option(min=1, help="tokens of context before the step")] = 96,
    repeat: Annotated[int, typer.Option(min=1, help="runs per timing; the best counts")] = 20,
    rows: Annotated[int, typer.Option(min=1, help="sequences decoding in the step")] = 1,
    *,
    engine: EngineArgs,
) -> None:
    """Where a decode step's time goes, per layer, against the bandwidth bound."""
    from quanta_lab.bench.decode_profile import print_profile, profile_decode

    kernel = engine.linear_kernel or "auto"
    print_profile(profile_decode(model, engine.dtype or "auto", context, repeat, kernel, rows))


@options_from(scheduler=SchedulerArgs, only={"scheduler": ("policy",)}, defaults={"policy": "fcfs"})
def bench_loop(
    model: Annotated[Path, typer.Option(help="checkpoint dir (its tokenizer detokenizes)")],
    batch: Annotated[int, typer.Option(min=1, help="requests decoding together")] = 32,
    prompt_len: Annotated[int, typer.Option(min=1, help="prompt tokens per request")] = 128,
    gen_len: Annotated[int, typer.Option(min=4, help="generated tokens per request")] = 256,
    *,
    scheduler: SchedulerArgs,
) -> None:
    """The loop's own time per decode step, with a runner that does no math."""
    from quanta_lab.bench.loop_overhead import measure_loop_overhead

    policy = scheduler.policy or "fcfs"
    r = measure_loop_overhead(model, batch, prompt_len, gen_len, policy)
    typer.echo(
        f"loop overhead, batch {r.batch}, policy {r.policy}, {r.decode_steps} decode steps: "
        f"median {r.step_us_median:.0f} us/step (p90 {r.step_us_p90:.0f}), "
        f"{r.per_request_us:.1f} us per request per step"
    )
