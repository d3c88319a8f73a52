"""``quanta profile``: measure the real engine and fit the cost model's coefficients.

FastServe profiles iteration time per model and hardware before serving (its skip-join needs
the prefill time of a prompt before running it). We time ``ModelRunner.execute`` directly on
hand-built steps: prefills of growing length, decode batches of growing size and context,
block copies of growing count, then fit the ``CostModel`` formula by least squares and
report how far the fit is from each measurement. With a calibration time the fit is then
redone on the steps of a short real serving replay (``quanta_lab.sim.calibrate``), which the
sweep alone predicts about 20% short. Loads torch (inside the function).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from quanta.core.output import ScheduledSeq, SchedulerOutput
from quanta.core.request import blocks_for
from quanta.costmodel import CostModel
from quanta.sim.driver import StepSample

from quanta_lab.sim.calibrate import calibration_steps, refit, report


def _seq(
    rid: str, tokens: int, start: int, table: tuple[int, ...], hidden: bool = False
) -> ScheduledSeq:
    return ScheduledSeq(
        rid,
        tuple(4 + (i % 97) for i in range(tokens)),
        start,
        table,
        True,
        0.0,
        1.0,
        0,
        0,
        0,
        hidden=hidden,
    )


def _median_time(run: Callable[[], object], repeats: int, timer: Callable[[], float]) -> float:
    run()  # warm-up: allocator, kernels, caches
    times = []
    for _ in range(repeats):
        t0 = timer()
        run()
        times.append(timer() - t0)
    return statistics.median(times)


def _lstsq(columns: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    coef, *_ = np.linalg.lstsq(np.array(columns, dtype=float).T, np.array(y), rcond=None)
    return [max(0.0, float(c)) for c in coef]


def profile_engine(
    model_dir: Path,
    *,
    dtype: str | None = None,
    device: str = "cpu",
    block_size: int = 16,
    repeats: int = 3,
    max_batch: int = 32,
    timer: Callable[[], float] = time.perf_counter,
    echo: Callable[[str], object] = print,
    calibration_s: float = 0.0,
    max_num_seqs: int = 8,
    step_repeats: int = 1,
    calibration_scale: float = 0.25,
) -> CostModel:
    """Time the engine at ``model_dir`` and return the fitted profile.

    ``timer`` is wall time by default; on a shared CPU with one torch thread
    ``time.thread_time`` keeps other processes' load out of the numbers. With
    ``calibration_s`` > 0 the fit is refined on about that much engine time of a real
    serving replay with ``max_num_seqs`` sequences per batch and ShareGPT-like lengths times
    ``calibration_scale``.
    """
    model, sweep = _sweep(model_dir, dtype, device, block_size, repeats, max_batch, timer, echo)
    if calibration_s <= 0:
        return model
    loop = calibration_steps(
        Path(model_dir),
        model,
        seconds=calibration_s,
        timer=timer,
        max_num_seqs=max_num_seqs,
        dtype=dtype,
        device=device,
        step_repeats=step_repeats,
        scale=calibration_scale,
        block_size=block_size,
    )
    echo(report(model, loop, block_size).line("sweep fit on a serving replay"))
    model = refit(model, sweep, loop, block_size)
    model = model.model_copy(
        update={"source": f"{model.source}, refitted on {len(loop)} steps of a serving replay"}
    )
    echo(report(model, loop, block_size).line("calibrated fit on the same replay"))
    echo(report(model, sweep, block_size).line("calibrated fit on the sweep"))
    return model


def _sweep(
    model_dir: Path,
    dtype: str | None,
    device: str,
    block_size: int,
    repeats: int,
    max_batch: int,
    timer: Callable[[], float],
    echo: Callable[[str], object],
) -> tuple[CostModel, list[StepSample]]:
    """Hand-built steps one shape at a time, and the profile fitted to them alone."""
    from quanta.runner import ModelRunner, load_model_config

    cfg = load_model_config(model_dir)
    max_len = cfg.max_model_len
    lens = [n for n in (8, 32, 64, 128, 256, 512, 1024, 2048) if n < max_len]
    contexts = [c for c in (32, 128, 512) if c < max_len]
    batches = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= max_batch]
    per_seq_blocks = blocks_for(max(contexts) + 1, block_size)
    device_blocks = max(blocks_for(max(lens), block_size), max(batches) * per_seq_blocks)
    copies = [1, 8, 32, min(128, device_blocks)]
    runner = ModelRunner(
        model_dir,
        num_device_blocks=device_blocks,
        num_host_blocks=max(copies),
        block_size=block_size,
        dtype=dtype,
        device=device,
    )
    table = tuple(range(device_blocks))

    def timed(so: SchedulerOutput) -> float:
        return _median_time(lambda: runner.execute(so), repeats, timer)

    prefill = [(n, timed(SchedulerOutput((_seq("p", n, 0, table),)))) for n in lens]
    decode = []
    for ctx in contexts:
        for b in batches:
            tables = [table[i * per_seq_blocks : (i + 1) * per_seq_blocks] for i in range(b)]
            seqs = tuple(_seq(f"d{i}", 1, ctx, t) for i, t in enumerate(tables))
            decode.append((b, b * (ctx + 1), timed(SchedulerOutput(seqs))))
    swap = [
        (k, timed(SchedulerOutput((), swap_out=tuple((i, i) for i in range(k))))) for k in copies
    ]
    hidden = {}
    if runner.capabilities.hidden_cache:
        hidden = _fit_hidden(timed, contexts, min(4, max(batches)), per_seq_blocks, table)
        rho = hidden["hidden_projection_per_token_s"] * block_size
        echo(
            f"hidden cache: +{1e3 * hidden['hidden_projection_per_token_s'] * 1000:.2f} ms per "
            f"step per 1000 cached tokens; rho = {1e6 * rho:.1f} us per block of {block_size}"
        )

    bytes_per_block = runner.bytes_per_block
    # Measured, so the fit's weight read already is the quantized one; recorded so that a
    # profile says which weights it streamed (``CostModel.with_weight_bytes``).
    from quanta.runner.models import build_model_skeleton
    from quanta.runner.quantized import resident_weight_bytes

    params = sum(p.numel() for p in build_model_skeleton(runner.model_config).parameters())
    common = dict(
        name=f"measured-{Path(model_dir).name}",
        source=f"quanta profile of {model_dir} on {device} ({runner.dtype}, quantized "
        f"{runner.quantized_kernel}), median of {repeats} runs per point, least-squares fit",
        weight_bytes_per_param=resident_weight_bytes(runner.model) / max(1, params),
        swap_overlaps_compute=False,  # the runner copies blocks inside execute()
        kv_bytes_per_token=max(1, bytes_per_block // block_size),
        device_kv_bytes=device_blocks * bytes_per_block,
        host_kv_bytes=4 * device_blocks * bytes_per_block,
        max_model_len=max_len,
        **_fit_swap(swap, bytes_per_block),
        **hidden,
    )
    fits = [CostModel(**common, **coef) for coef in _fit_compute(prefill, decode)]
    model = min(fits, key=lambda m: _median_error(m, prefill, decode))
    _report(model, prefill, decode, swap, block_size, echo)
    return model, _as_samples(prefill, decode)


def _as_samples(
    prefill: list[tuple[int, float]], decode: list[tuple[int, int, float]]
) -> list[StepSample]:
    """The sweep's points in the shape of recorded steps, so one fit takes both."""
    alone = [StepSample(((n, 0),), 0, t) for n, t in prefill]
    batches = [StepSample(((1, c // b - 1),) * b, 0, t) for b, c, t in decode]
    return alone + batches


def _fit_hidden(
    timed: Callable[[SchedulerOutput], float],
    contexts: list[int],
    batch: int,
    per_seq_blocks: int,
    table: tuple[int, ...],
) -> dict[str, float]:
    """Apt-Serve's rho: the same decode batch with K/V caches and with hidden caches; the
    difference (their past K and V projected again) against the cached tokens, through 0."""
    tokens, extra = [], []
    for ctx in contexts:
        tables = [table[i * per_seq_blocks : (i + 1) * per_seq_blocks] for i in range(batch)]
        kv, hid = (
            timed(SchedulerOutput(tuple(_seq(f"h{i}", 1, ctx, t, h) for i, t in enumerate(tables))))
            for h in (False, True)
        )
        tokens.append(batch * ctx)
        extra.append(hid - kv)
    (per_token,) = _lstsq([tokens], extra)
    return {"hidden_projection_per_token_s": per_token}


def _fit_swap(swap: list[tuple[int, float]], bytes_per_block: int) -> dict[str, float]:
    latency, per_block = _lstsq([[1.0] * len(swap), [k for k, _ in swap]], [t for _, t in swap])
    bandwidth = bytes_per_block / per_block if per_block > 0 else 1e12
    return {"swap_latency_s": latency, "swap_bandwidth": bandwidth}


def _fit_compute(
    prefill: list[tuple[int, float]], decode: list[tuple[int, int, float]]
) -> list[dict[str, float]]:
    """Two readings of the same measurements: a GPU-like roofline (the decode intercept is
    the weight read, which a long prefill's compute hides) and an additive one (the intercept
    is fixed overhead every step pays, as on a CPU). The caller keeps the better fit."""
    intercept, per_seq, kv_read = _lstsq(
        [[1.0] * len(decode), [b for b, _, _ in decode], [c for _, c, _ in decode]],
        [t for *_, t in decode],
    )
    big = [(n, t) for n, t in prefill if n >= 32] or prefill
    columns = [[n for n, _ in big], [n * (n + 1) / 2 for n, _ in big]]
    roof_compute, roof_attn = _lstsq(columns, [t - per_seq for _, t in big])
    add_compute, add_attn = _lstsq(columns, [t - per_seq - intercept for _, t in big])
    shared = {"per_seq_s": per_seq, "kv_read_per_token_s": kv_read}
    return [
        {
            **shared,
            "step_overhead_s": 0.0,
            "weights_read_s": intercept,
            "compute_per_token_s": roof_compute,
            "attn_per_pair_s": roof_attn,
        },
        {
            **shared,
            "step_overhead_s": intercept,
            "weights_read_s": 0.0,
            "compute_per_token_s": add_compute,
            "attn_per_pair_s": add_attn,
        },
    ]


def _errors(
    model: CostModel, prefill: list[tuple[int, float]], decode: list[tuple[int, int, float]]
) -> list[float]:
    return [abs(model.prefill_time(n) - t) / t for n, t in prefill] + [
        abs(model.decode_time(b, c) - t) / t for b, c, t in decode
    ]


def _median_error(
    model: CostModel, prefill: list[tuple[int, float]], decode: list[tuple[int, int, float]]
) -> float:
    return statistics.median(_errors(model, prefill, decode))


def _report(
    model: CostModel,
    prefill: list[tuple[int, float]],
    decode: list[tuple[int, int, float]],
    swap: list[tuple[int, float]],
    block_size: int,
    echo: Callable[[str], object],
) -> None:
    """Measured vs fitted, so a poor fit is visible rather than silently used."""
    for n, t in prefill:
        fit = model.prefill_time(n)
        echo(f"prefill {n:5d} tokens: {1e3 * t:8.2f} ms measured, {1e3 * fit:8.2f} ms fitted")
    for b, ctx, t in decode:
        fit = model.decode_time(b, ctx)
        echo(
            f"decode  {b:3d} x {ctx // b:4d} ctx: {1e3 * t:8.2f} ms measured, "
            f"{1e3 * fit:8.2f} ms fitted"
        )
    for k, t in swap:
        echo(
            f"swap    {k:4d} blocks: {1e3 * t:8.2f} ms measured, "
            f"{1e3 * model.swap_time(k, block_size):8.2f} ms fitted"
        )
    errors = _errors(model, prefill, decode)
    echo(
        f"min iteration time {1e3 * model.min_iteration_time:.2f} ms; "
        f"median fit error {100 * statistics.median(errors):.0f}%, "
        f"max {100 * max(errors):.0f}%"
    )
