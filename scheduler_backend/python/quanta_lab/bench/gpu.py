"""The prepared GPU run: Quanta, HF continuous batching and HF ``generate`` on real shapes.

``bench/gpu/run.sh`` calls this (``quanta bench gpu``) on a lent GPU machine that has a few
minutes and no network, so everything it measures fits one time budget the run enforces:

- the card's copy bandwidth and GEMM rate (``gpu_card``), measured first;
- for each preset (LLaMA-3.2-1B, LLaMA-3-8B, OPT-13B by default), random weights of its shape
  made on the device (no checkpoint), and each engine in turn at each batch size, with the
  same prompts: Quanta through its whole loop (``quanta.bench.engine``), then HF's model with
  ``generate_batch`` (transformers 5's continuous batching: paged attention, CUDA graphs) and
  with ``generate``. One engine holds the device at a time, so OPT-13B's weights and a batch of
  64's K/V fit beside no second copy.

The budget is shared out as the run goes: each preset gets an equal part of what is left, each
engine an equal part of its preset's, and a point starts only if the last one, scaled to the
new batch, would still end inside it. So a slow engine loses its largest batches rather than
the whole run its later presets; what was cut is listed, never silently absent.

Per point it reports decode and prefill tokens/s, the decode step as a multiple of the
bandwidth bound (weights plus the batch's K/V over the measured bandwidth), Quanta's prefill
as a share of the measured GEMM rate in model FLOPs, and Quanta's ratios to both peers.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from quanta.bench.engine import (
    STEP_TOKENS,
    BenchPlan,
    ModelSource,
    bench_engine_config,
    load_hf,
    model_source,
    paired_seconds,
    run_quanta,
    time_hf_generate,
)
from quanta.build.presets import get_preset
from quanta.frontends.engine import Engine, build_engine
from quanta.metrics import json_safe
from quanta.runner.model_runner import resolve_dtype
from rich.console import Console
from rich.table import Table

from quanta_lab.bench.gpu_card import Card, ShapeCost, measure_card, synchronize

ENGINES = ("quanta", "hf-cb", "hf-generate")
PEERS = ENGINES[1:]
# Tokens in one page (block) of HF's continuous-batching cache: its default, under either of
# the names transformers 5 has given it (block_size, then page_size)
_CB_PAGE_TOKENS = 256


@dataclass(frozen=True, slots=True)
class Settings:
    """What one run measures."""

    device: str
    presets: tuple[str, ...]
    batches: tuple[int, ...]
    prompt_len: int
    gen_len: int
    dtype: str = "bfloat16"
    engines: tuple[str, ...] = ENGINES
    budget_s: float = 270.0
    repeat: int = 1
    copy_mib: int = 1024
    gemm_n: int = 8192

    def __post_init__(self) -> None:
        unknown = sorted(set(self.engines) - set(ENGINES))
        if unknown:
            raise ValueError(f"unknown engines {unknown}; known: {', '.join(ENGINES)}")
        if self.gen_len < 2:
            raise ValueError("gen_len must be at least 2: decode is the tokens after the first")


@dataclass(frozen=True, slots=True)
class Timing:
    """One engine at one batch: seconds of the batch's prefill and of its decode steps."""

    prefill_s: float
    decode_s: float


@dataclass
class Point:
    """One preset at one batch size, every engine that ran it."""

    preset: str
    batch: int
    bound_step_s: float
    timings: dict[str, Timing] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # engine -> why it has no timing


class Budget:
    """The seconds left for timings, shared out so a later preset and engine get their part."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.deadline = clock() + seconds

    def part(self, parts_left: int, until: float | None = None) -> float:
        """A deadline ``1/parts_left`` of the way from now to ``until`` (the run's end)."""
        end = self.deadline if until is None else until
        now = self.clock()
        return now + max(end - now, 0.0) / parts_left


class Pacer:
    """Lets a point start only if it should end before the phase's deadline: the previous
    point's seconds, scaled by the batch sizes, is the estimate (decode grows slower than
    the batch, so it errs long)."""

    def __init__(self, deadline: float, clock: Callable[[], float]) -> None:
        self.deadline, self.clock = deadline, clock
        self._last: tuple[int, float] | None = None

    def allows(self, batch: int) -> bool:
        estimate = 0.0 if self._last is None else self._last[1] * batch / self._last[0]
        return self.clock() + estimate <= self.deadline

    def timed(self, batch: int, measure: Callable[[], Timing]) -> Timing:
        start = self.clock()
        timing = measure()
        self._last = (batch, self.clock() - start)
        return timing


def run_gpu_bench(settings: Settings, tests: str | None = None) -> dict[str, Any]:
    """Measure the card, then every preset and engine within the budget: the report as JSON
    data (``print_report`` shows it). ``tests``: what the GPU tests said, kept beside it."""
    device = torch.device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    card = measure_card(device, dtype, copy_mib=settings.copy_mib, gemm_n=settings.gemm_n)
    budget = Budget(settings.budget_s)
    context = settings.prompt_len + settings.gen_len / 2  # a decode step's mean context
    report = []
    for i, preset in enumerate(settings.presets):
        cost = ShapeCost.of(preset, dtype)
        points = [
            Point(preset, b, cost.decode_bound_s(b, context, card.bandwidth))
            for b in settings.batches
        ]
        preset_end = budget.part(len(settings.presets) - i)
        with model_source(None, preset) as source:
            for j, name in enumerate(settings.engines):
                pacer = Pacer(budget.part(len(settings.engines) - j, preset_end), budget.clock)
                _run_engine(name, source, points, settings, pacer)
                _release(device)
        report += [_point_report(p, settings, cost, card) for p in points]
    return {
        "card": asdict(card),
        "settings": asdict(settings),
        "versions": _versions(),
        "tests": tests,
        "points": report,
    }


Measure = Callable[[list[list[int]]], Timing]


def _run_engine(
    name: str, source: ModelSource, points: list[Point], settings: Settings, pacer: Pacer
) -> None:
    """Load engine ``name``, time it at ``points``, unload it. NOTE: a function of its own so
    that nothing of the engine outlives it: a name left bound to its timing function would
    hold the weights while the next engine loads."""
    try:
        with _engine(name, source, settings) as measure:
            _time_points(name, measure, points, settings, pacer)
    except Exception as exc:  # NOTE: an engine that cannot load costs only itself
        for point in points:
            point.skipped.setdefault(name, f"failed to load: {_said(exc)}")


def _time_points(
    name: str, measure: Measure, points: list[Point], settings: Settings, pacer: Pacer
) -> None:
    """Time one engine at each point the pacer lets start; the others say why they have none.
    An engine that fails (HF's continuous batching does not run OPT, say) is not tried again
    at the preset's larger batches."""
    device = torch.device(settings.device)
    failed: str | None = None
    for point in points:
        if failed is not None:
            point.skipped[name] = failed
            continue
        if not pacer.allows(point.batch):
            point.skipped[name] = "time budget"
            continue
        prompts = _prompts(point.batch, settings.prompt_len, _vocab(point.preset))
        try:
            point.timings[name] = pacer.timed(point.batch, lambda p=prompts: measure(p))
        except torch.OutOfMemoryError:
            point.skipped[name] = "out of device memory"
            _release(device)
        except Exception as exc:  # NOTE: one engine's failure must not cost the run the rest
            point.skipped[name] = f"failed: {_said(exc)}"
            failed = f"not run: failed at batch {point.batch}"


@contextlib.contextmanager
def _engine(name: str, source: ModelSource, settings: Settings) -> Iterator[Measure]:
    """Engine ``name`` loaded on the device with ``source``'s random weights, as a function
    from prompts to their timing; unloaded on exit."""
    device = torch.device(settings.device)
    if name == "quanta":
        plan = BenchPlan(list(settings.batches), STEP_TOKENS)
        seq_len = settings.prompt_len + settings.gen_len
        config = bench_engine_config(
            source, plan, seq_len, dtype=settings.dtype, device=settings.device
        )
        engine = build_engine(config)
        try:
            yield lambda prompts: _time_quanta(engine, prompts, settings)
        finally:
            engine.runner.close()
        return
    # continuous batching warns at every call (a kept manager, no EOS): both are meant
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    model = load_hf(source, resolve_dtype(settings.dtype, device), device)
    if name == "hf-cb":
        yield lambda prompts: _time_continuous(model, prompts, settings)
    else:
        yield lambda prompts: _time_generate(model, prompts, settings)


def _time_quanta(engine: Engine, prompts: list[list[int]], settings: Settings) -> Timing:
    """Quanta's loop, as ``quanta bench engine`` times it: rounds of a prefill-only run (one
    token) and a full one back to back (``_paired``)."""
    run_quanta(engine, prompts[:1], 2)  # warm-up
    return _paired(
        [
            (run_quanta(engine, prompts, 1)[0], run_quanta(engine, prompts, settings.gen_len)[0])
            for _ in range(settings.repeat)
        ]
    )


def _time_generate(model: torch.nn.Module, prompts: list[list[int]], settings: Settings) -> Timing:
    """HF ``generate`` (one padded batch, its dynamic cache), timed as Quanta is."""
    time_hf_generate(model, prompts[:1], 2)  # warm-up
    return _paired(
        [
            (
                time_hf_generate(model, prompts, 1),
                time_hf_generate(model, prompts, settings.gen_len),
            )
            for _ in range(settings.repeat)
        ]
    )


def _paired(rounds: list[tuple[float, float]]) -> Timing:
    """The rounds' seconds as ``quanta bench engine`` takes them (``paired_seconds``)."""
    return Timing(*paired_seconds(rounds))


def _time_continuous(
    model: torch.nn.Module, prompts: list[list[int]], settings: Settings
) -> Timing:
    """HF ``generate_batch``: a short first call (two tokens) starts its manager for this batch
    and captures its prefill and decode graphs, kept for the timed calls; each timed call's
    prefill is its requests' arrival to the last first token and its decode the rest, from the
    tokens' own timestamps, so the manager's start and stop are not counted (as Quanta's
    engine start is not).

    Its limits are this batch's (requests, pages a request spans), set rather than hinted, so
    the short call sizes what the long ones use; its cache is sized from the batch's tokens,
    as Quanta's is (twice them, and 16 pages, for what its warm-up takes): left to size itself
    from free memory, every call spent seconds before its first token on the CPU."""
    from transformers.generation import ContinuousBatchingConfig, GenerationConfig

    pages = -(-(settings.prompt_len + settings.gen_len) // _CB_PAGE_TOKENS)
    per_request = pages + 1 + (pages + 1) % 2  # as HF rounds its own: even, one spare
    limits = ContinuousBatchingConfig(
        num_blocks=2 * len(prompts) * pages + 16,
        max_requests_per_batch=len(prompts),
        max_blocks_per_request=per_request,
    )

    def call(max_new_tokens: int) -> Timing:
        out = model.generate_batch(  # type: ignore[operator]
            inputs=prompts,
            generation_config=GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False),
            continuous_batching_config=limits,
            persistent_manager=True,
            progress_bar=False,
            record_timestamps=True,
        )
        done = list(out.values())
        failed = [o.error for o in done if o.error is not None]
        if failed or len(done) != len(prompts):
            raise RuntimeError(f"generate_batch answered {len(done)} of {len(prompts)}: {failed}")
        start = min(o.created_time for o in done)
        first = max(o.timestamps[0] for o in done)
        return Timing(first - start, max(o.timestamps[-1] for o in done) - first)

    try:
        call(2)
        timings = [call(settings.gen_len) for _ in range(settings.repeat)]
    finally:
        model.destroy_cached_continuous_batching_manager()  # type: ignore[operator]
    return min(timings, key=lambda t: t.prefill_s + t.decode_s)


def _prompts(batch: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """The same token ids for every engine (random weights: any ids will do)."""
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(prompt_len)] for _ in range(batch)]


def _said(exc: BaseException) -> str:
    """An error in one line, for the report."""
    lines = str(exc).splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def _vocab(preset: str) -> int:
    return get_preset(preset).shape.vocab_size


def _release(device: torch.device) -> None:
    """Hand an unloaded engine's memory back, so the next one has the whole device."""
    gc.collect()
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.empty_cache()


def _point_report(
    point: Point, settings: Settings, cost: ShapeCost, card: Card
) -> dict[str, object]:
    b, prompt, decoded = point.batch, settings.prompt_len, settings.gen_len - 1
    engines = {}
    for name, t in point.timings.items():
        step = t.decode_s / decoded
        engines[name] = {
            "prefill_tps": b * prompt / t.prefill_s,
            "decode_tps": b * decoded / t.decode_s,
            "step_ms": step * 1e3,
            "step_over_bound": step / point.bound_step_s,
            "prefill_of_gemm_peak": cost.prefill_flops(b, prompt) / t.prefill_s / card.gemm_flops,
        }
    ratios = {}
    ours = engines.get("quanta")
    for peer in PEERS:
        if ours is not None and peer in engines:
            for what in ("decode", "prefill"):
                ratios[f"{what}_vs_{peer}"] = ours[f"{what}_tps"] / engines[peer][f"{what}_tps"]
    return {
        "preset": point.preset,
        "batch": b,
        "bound_step_ms": point.bound_step_s * 1e3,
        "engines": engines,
        "ratios": ratios,
        "skipped": point.skipped,
    }


def _versions() -> dict[str, str]:
    import platform

    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def print_report(report: dict[str, Any], console: Console | None = None) -> None:
    """The run as two tables, decode and prefill: each engine's tokens/s (and decode step as
    a multiple of the bandwidth bound), then Quanta's ratio to each peer."""
    console = console or Console(width=160)  # the rows are wide; logs wrap them less
    card, settings = report["card"], report["settings"]
    console.print(
        f"{card['name']}: copy {card['bandwidth'] / 1e12:.2f} TB/s (read + written), "
        f"GEMM {card['gemm_flops'] / 1e12:.1f} TFLOP/s ({settings['dtype']}); "
        f"prompt {settings['prompt_len']}, generate {settings['gen_len']}",
        highlight=False,
    )
    if report.get("tests"):
        console.print(f"GPU tests: {report['tests']}", highlight=False)
    names = settings["engines"]
    decode = Table(title="decode tok/s (step ms, x bandwidth bound)")
    prefill = Table(title="prefill tok/s (quanta: share of the GEMM rate)")
    for table in (decode, prefill):
        table.add_column("shape")
        table.add_column("batch", justify="right")
    decode.add_column("bound ms", justify="right")
    for table in (decode, prefill):
        for name in names:
            table.add_column(name, justify="right")
        for peer in PEERS:
            table.add_column(f"vs {peer}", justify="right")
    for p in report["points"]:
        engines, ratios = p["engines"], p["ratios"]
        head = [p["preset"], str(p["batch"])]
        decode.add_row(
            *head,
            f"{p['bound_step_ms']:.2f}",
            *(_decode_cell(engines.get(n)) for n in names),
            *(_ratio(ratios.get(f"decode_vs_{peer}")) for peer in PEERS),
        )
        prefill.add_row(
            *head,
            *(_prefill_cell(engines.get(n), n == "quanta") for n in names),
            *(_ratio(ratios.get(f"prefill_vs_{peer}")) for peer in PEERS),
        )
    console.print(decode)
    console.print(prefill)
    for p in report["points"]:
        for name, why in p["skipped"].items():
            console.print(f"not measured: {p['preset']} batch {p['batch']} {name}: {why}")


def _decode_cell(row: dict[str, float] | None) -> str:
    if row is None:
        return "-"
    return f"{row['decode_tps']:.0f} ({row['step_ms']:.2f}, {row['step_over_bound']:.2f}x)"


def _prefill_cell(row: dict[str, float] | None, with_peak: bool) -> str:
    if row is None:
        return "-"
    peak = f" ({row['prefill_of_gemm_peak']:.0%})" if with_peak else ""
    return f"{row['prefill_tps']:.0f}{peak}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def write_report(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_safe(report), indent=2) + "\n")  # NaN: null
