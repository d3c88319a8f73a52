"""``quanta bench decode-profile`` and ``quanta bench loop`` (Typer): where the engine's and
the loop's own time goes, for whoever works on the kernels or the loop.

The measurements (``quanta_lab.bench.decode_profile``, ``quanta_lab.bench.loop_overhead``)
load torch, so they are imported inside the commands.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from quanta.cli_options import LinearKernelOpt


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    """Add ``bench decode-profile`` and ``bench loop``."""
    bench_app.command("decode-profile")(bench_decode_profile)
    bench_app.command("loop")(bench_loop)


def bench_decode_profile(
    model: Annotated[Path, typer.Option(help="checkpoint or engine dir")],
    dtype: Annotated[str | None, typer.Option(help="float32 or bfloat16")] = None,
    context: Annotated[int, typer.Option(min=1, help="tokens of context before the step")] = 96,
    repeat: Annotated[int, typer.Option(min=1, help="runs per timing; the best counts")] = 20,
    linear_kernel: Annotated[
        LinearKernelOpt, typer.Option(help="projections: auto, native, onednn or torch")
    ] = LinearKernelOpt.auto,
) -> None:
    """Where a batch-1 decode step's time goes, per layer, against the bandwidth bound."""
    from quanta_lab.bench.decode_profile import print_profile, profile_decode

    print_profile(profile_decode(model, dtype or "auto", context, repeat, linear_kernel.value))


def bench_loop(
    model: Annotated[Path, typer.Option(help="checkpoint dir (its tokenizer detokenizes)")],
    batch: Annotated[int, typer.Option(min=1, help="requests decoding together")] = 32,
    prompt_len: Annotated[int, typer.Option(min=1, help="prompt tokens per request")] = 128,
    gen_len: Annotated[int, typer.Option(min=4, help="generated tokens per request")] = 256,
    policy: Annotated[str, typer.Option(help="scheduling policy")] = "fcfs",
) -> None:
    """The loop's own time per decode step, with a runner that does no math."""
    from quanta_lab.bench.loop_overhead import measure_loop_overhead

    r = measure_loop_overhead(model, batch, prompt_len, gen_len, policy)
    typer.echo(
        f"loop overhead, batch {r.batch}, policy {r.policy}, {r.decode_steps} decode steps: "
        f"median {r.step_us_median:.0f} us/step (p90 {r.step_us_p90:.0f}), "
        f"{r.per_request_us:.1f} us per request per step"
    )
