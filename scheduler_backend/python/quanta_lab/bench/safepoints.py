"""``quanta bench safepoints``: what layer safepoints cost a step, and how soon they stop one.

Two steps are timed on the real runner: one prefill of N tokens and one decode step of B
sequences with C tokens of context each. For each safepoint interval k, (a) the step with an
abort signal that is never raised against the step with no signal (median of R runs, the
configurations interleaved so drift hits them alike): the overhead of checking; and (b) the
step with the signal raised by a timer thread at a uniformly random point inside it: the
time from the raise until ``execute`` returns, stopped at a safepoint ("abort") or, when the
raise came after the last safepoint, finished ("wait" counts both: what an arriving request
waits for). ConServe reports 4% overhead and 5.41 ms to stop at k=8 for Llama-2-7B on an A100.

Make a model with ``quanta make-model opt-125m --out checkpoints/opt-125m``.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from quanta.core.output import SchedulerOutput
    from quanta.runner import ModelRunner

BLOCK_SIZE = 16


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    """Add ``bench safepoints``."""
    bench_app.command("safepoints")(bench_safepoints)


def bench_safepoints(
    model: Annotated[
        Path,
        typer.Option(
            exists=True,
            file_okay=False,
            help="checkpoint dir (quanta make-model opt-125m --out checkpoints/opt-125m)",
        ),
    ],
    prefill_tokens: Annotated[int, typer.Option(min=1, help="tokens of the prefill step")] = 512,
    decode_batch: Annotated[int, typer.Option(min=1, help="sequences of the decode step")] = 16,
    decode_context: Annotated[
        int, typer.Option(min=1, help="context tokens of each decoding sequence")
    ] = 256,
    intervals: Annotated[str, typer.Option(help="comma-separated safepoint intervals")] = "1,4,8",
    repeats: Annotated[int, typer.Option(min=1, help="timed runs per configuration")] = 20,
    trials: Annotated[int, typer.Option(min=1, help="raised signals per interval")] = 30,
    dtype: Annotated[str | None, typer.Option(help="float32, bfloat16 or float16")] = None,
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N")] = "cpu",
    threads: Annotated[int | None, typer.Option(min=1, help="torch threads")] = None,
    seed: Annotated[int, typer.Option(help="seeds the tokens and the raise times")] = 0,
    output: Annotated[Path | None, typer.Option(help="also write the report as JSON")] = None,
) -> None:
    """Overhead of safepoint checks and the latency of stopping a step at one."""
    try:
        ks = sorted({int(k) for k in intervals.split(",") if k.strip()})
    except ValueError:
        raise typer.BadParameter("integers, e.g. 1,4,8", param_hint="--intervals") from None
    if not ks or ks[0] < 1:
        raise typer.BadParameter("intervals must be >= 1", param_hint="--intervals")
    report = run_safepoint_bench(
        model,
        prefill_tokens=prefill_tokens,
        decode_batch=decode_batch,
        decode_context=decode_context,
        intervals=ks,
        repeats=repeats,
        trials=trials,
        dtype=dtype,
        device=device,
        threads=threads,
        seed=seed,
    )
    _print(report)
    if output is not None:
        output.write_text(json.dumps(report, indent=2))


@dataclass(frozen=True, slots=True)
class SafepointRow:
    """One step at one interval (``None``: no signal, the baseline); times in ms."""

    workload: str  # prefill | decode
    interval: int | None
    step_ms: float  # median of the unraised (or absent) signal's runs
    checks: int = 0  # safepoints a step passes
    added_us: float | None = None  # Python time the walk and its checks add to a step
    overhead_pct: float | None = None  # step_ms over the baseline's, in percent
    abort_ms_mean: float | None = None  # raise -> StepAborted out of execute
    abort_ms_p50: float | None = None
    abort_ms_max: float | None = None
    wait_ms_mean: float | None = None  # raise -> execute returned or raised, every trial
    aborted: int | None = None  # trials that stopped at a safepoint
    trials: int | None = None


def run_safepoint_bench(
    model_dir: Path,
    *,
    prefill_tokens: int,
    decode_batch: int,
    decode_context: int,
    intervals: list[int],
    repeats: int,
    trials: int,
    dtype: str | None = None,
    device: str = "cpu",
    threads: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Measure both steps at every interval; the report as a JSON-ready dict."""
    import torch
    from quanta.runner import ModelRunner

    if threads:
        torch.set_num_threads(threads)
    rng = random.Random(seed)
    per_seq = -(-(decode_context + 1) // BLOCK_SIZE)
    runner = ModelRunner(
        model_dir,
        num_device_blocks=-(-prefill_tokens // BLOCK_SIZE) + decode_batch * per_seq,
        num_host_blocks=0,
        block_size=BLOCK_SIZE,
        dtype=dtype,
        device=device,
    )
    steps = _steps(runner, prefill_tokens, decode_batch, decode_context, rng)
    rows: list[SafepointRow] = []
    for workload, step in steps.items():
        rows.extend(_measure(runner, workload, step, intervals, repeats, trials, rng))
    cfg = runner.model_config
    return {
        "model": str(model_dir),
        "family": cfg.family,
        "num_layers": cfg.num_layers,
        "device": str(runner.device),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "linear_kernel": runner.linear_kernel,
        "attention_kernel": runner.attention_kernel,
        "threads": torch.get_num_threads(),
        "prefill_tokens": prefill_tokens,
        "decode_batch": decode_batch,
        "decode_context": decode_context,
        "repeats": repeats,
        "seed": seed,
        "rows": [asdict(r) for r in rows],
    }


def _steps(
    runner: ModelRunner, prefill: int, batch: int, context: int, rng: random.Random
) -> dict[str, SchedulerOutput]:
    """The prefill step and the decode step, on disjoint blocks."""
    from quanta.core.output import ScheduledSeq, SchedulerOutput

    cfg = runner.model_config
    longest = max(prefill, context + 1)
    if longest > cfg.max_model_len:
        raise typer.BadParameter(f"{longest} tokens exceed the model's {cfg.max_model_len}")
    blocks = iter(range(runner.num_device_blocks))

    def seq(i: int, num_tokens: int, start: int) -> ScheduledSeq:
        table = tuple(next(blocks) for _ in range(-(-(start + num_tokens) // BLOCK_SIZE)))
        return ScheduledSeq(
            request_id=f"s{i}",
            token_ids=tuple(rng.randrange(cfg.vocab_size) for _ in range(num_tokens)),
            start_pos=start,
            block_table=table,
            sample=True,
            temperature=0.0,
            top_p=1.0,
            top_k=0,
            seed=i,
            output_index=0,
        )

    return {
        "prefill": SchedulerOutput(seqs=(seq(0, prefill, 0),)),
        "decode": SchedulerOutput(seqs=tuple(seq(1 + i, 1, context) for i in range(batch))),
    }


def _measure(
    runner: ModelRunner,
    workload: str,
    step: SchedulerOutput,
    intervals: list[int],
    repeats: int,
    trials: int,
    rng: random.Random,
) -> list[SafepointRow]:
    from quanta.core.safepoint import AbortSignal

    configs: list[int | None] = [None, *intervals]
    times: dict[int | None, list[float]] = {k: [] for k in configs}
    for r in range(repeats + 2):  # two warm-up rounds
        for k in configs[r % len(configs) :] + configs[: r % len(configs)]:
            so = step
            if k is not None:
                so, runner.safepoint_interval = replace(step, abort=AbortSignal()), k
            started = time.perf_counter()
            runner.execute(so)
            _sync(runner)
            if r >= 2:
                times[k].append(time.perf_counter() - started)
    base = statistics.median(times[None])
    layers = runner.model_config.num_layers
    rows = [SafepointRow(workload, None, 1000 * base)]
    for k in intervals:
        runner.safepoint_interval = k
        median = statistics.median(times[k])
        waits = _abort_trials(runner, step, trials, median, rng)
        stops = [ms for ms, aborted in waits if aborted]
        rows.append(
            SafepointRow(
                workload,
                k,
                1000 * median,
                checks=(layers - 1) // k,
                added_us=_walk_cost(runner, k),
                overhead_pct=100 * (median / base - 1),
                abort_ms_mean=statistics.fmean(stops) if stops else None,
                abort_ms_p50=statistics.median(stops) if stops else None,
                abort_ms_max=max(stops) if stops else None,
                wait_ms_mean=statistics.fmean(ms for ms, _ in waits) if waits else None,
                aborted=len(stops),
                trials=len(waits),
            )
        )
    return rows


def _walk_cost(runner: ModelRunner, interval: int, rounds: int = 2000) -> float:
    """Microseconds per step that walking the layers with safepoints (the generator and the
    unraised checks) adds to the plain walk, timed without running the layers: the overhead
    free of the step's own noise."""
    from quanta.core.safepoint import AbortSignal
    from quanta.runner.models.safepoints import walk_layers

    inner = runner.model.model
    layers = inner.decoder.layers if hasattr(inner, "decoder") else inner.layers
    runner.safepoint_interval = interval
    safepoints = runner.safepoints_for(AbortSignal(), time.perf_counter())
    best = {}
    for with_checks in (False, True):
        sp = safepoints if with_checks else None
        runs = []
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(rounds):
                for _ in walk_layers(layers, sp):
                    pass
            runs.append((time.perf_counter() - started) / rounds)
        best[with_checks] = min(runs)
    return 1e6 * (best[True] - best[False])


_MIN_DRAWS = 60
_SWITCH_INTERVAL_S = 1e-4


def _abort_trials(
    runner: ModelRunner, step: SchedulerOutput, trials: int, step_s: float, rng: random.Random
) -> list[tuple[float, bool]]:
    """(ms from the raise until execute ended, whether it stopped at a safepoint) for
    ``trials`` raises at uniform points of a ``step_s`` step; a raise that came after the
    step ended is drawn again (at most ``3 * trials`` draws, and at least 60).

    NOTE: the timer thread needs the GIL to raise, and by default waits up to Python's 5 ms
    switch interval for it, so on a step of a few ms (a tiny model) most raises landed after
    the step. The trials run with a 0.1 ms interval: what they measure is how soon a raised
    signal stops the step, not how soon another thread gets the GIL."""
    switch = sys.getswitchinterval()
    sys.setswitchinterval(_SWITCH_INTERVAL_S)
    try:
        return _draw_trials(runner, step, trials, step_s, rng)
    finally:
        sys.setswitchinterval(switch)


def _draw_trials(
    runner: ModelRunner, step: SchedulerOutput, trials: int, step_s: float, rng: random.Random
) -> list[tuple[float, bool]]:
    from quanta.core.safepoint import AbortSignal, StepAborted

    out: list[tuple[float, bool]] = []
    for _ in range(max(3 * trials, _MIN_DRAWS)):
        if len(out) == trials:
            break
        signal, go, raised = AbortSignal(), threading.Event(), list[float]()
        delay = rng.uniform(0.0, step_s)

        def timer(
            signal: AbortSignal = signal,
            go: threading.Event = go,
            delay: float = delay,
            raised: list[float] = raised,
        ) -> None:
            go.wait()
            time.sleep(delay)
            raised.append(time.perf_counter())
            signal.raise_at(raised[-1])

        thread = threading.Thread(target=timer, daemon=True)
        thread.start()
        go.set()
        try:
            runner.execute(replace(step, abort=signal))
            aborted = False
        except StepAborted:
            aborted = True
        _sync(runner)
        ended = time.perf_counter()
        thread.join()
        if raised[0] <= ended:
            out.append((1000 * (ended - raised[0]), aborted))
    return out


def _sync(runner: ModelRunner) -> None:
    """Wait for the GPU, so a stopped step's queued layers count in its latency."""
    if runner.device.type == "cuda":
        import torch

        torch.cuda.synchronize(runner.device)


def _print(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(
        f"{Path(report['model']).name} ({report['num_layers']} layers): prefill "
        f"{report['prefill_tokens']} tokens, decode {report['decode_batch']} x "
        f"{report['decode_context']}; {report['device']}, {report['dtype']}, linears "
        f"{report['linear_kernel']}, decode attention {report['attention_kernel']}, "
        f"{report['threads']} threads; step times: median of {report['repeats']}"
    )
    table = Table()
    columns = ("step", "k", "step ms", "overhead", "added us", "abort ms mean/p50/max")
    for col in (*columns, "wait ms", "stopped"):
        table.add_column(col, justify="right")
    for r in report["rows"]:
        stops = (r["abort_ms_mean"], r["abort_ms_p50"], r["abort_ms_max"])
        table.add_row(
            r["workload"],
            "-" if r["interval"] is None else f"{r['interval']} ({r['checks']})",
            _ms(r["step_ms"]),
            "" if r["overhead_pct"] is None else f"{r['overhead_pct']:+.1f}%",
            "" if r["added_us"] is None else f"{r['added_us']:.1f}",
            "" if stops[0] is None else "/".join(_ms(v) for v in stops),
            _ms(r["wait_ms_mean"]),
            "" if r["trials"] is None else f"{r['aborted']}/{r['trials']}",
        )
    console.print(table)
    console.print(
        "k (checks per step); overhead: against the step with no signal (noise included); "
        "added us: the layer "
        "walk's Python time with the checks, without the layers; abort: raise -> StepAborted "
        "out of execute; wait: raise -> execute ended, stopped or finished"
    )


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}" if value >= 100 else f"{value:.2f}"
