"""``quanta bench decode-profile``: where one decode step's time goes, per layer.

A decode step of a small model at batch 1 reads every weight once and does little arithmetic
with it, so its floor is the bytes of weights read divided by the memory bandwidth one thread
gets. This measures that floor and the step against it, for one row or ``rows`` rows (each a
sequence of ``context`` tokens; at 8 and 32 rows the products and the attention's reads of the
KV cache take over from the dispatch):

- ``bandwidth``: one thread streaming a buffer as large as the weights (a sum over it), so the
  cache cannot hold it; the best of ``repeat`` passes.
- ``step``: the model's forward pass for one token, then the LM head, as the runner runs them
  (through the decode chain where it runs: ``quanta.runner.decode_chain``), and ``layered``:
  the same step dispatched layer by layer from Python.
- ``products``: every layer's projections and the LM head run back to back on one row, with
  nothing between them: the weight-streaming part of the step.
- ``chain``: where the decode chain runs, its own per-part times of the step (norms, each
  product, rotary, the K/V store, attention, activation), which it takes when asked.
- a per-part breakdown of the layer-by-layer step, taken with forward hooks on the
  projections, norms, attention and MLP modules (the hooks add their own few microseconds per
  call, so the parts sum to a little more than ``layered``); attention and the MLP's
  activation are their module's time less the products inside it.
- ``ops``: how many torch operators one step dispatches (each costs microseconds of dispatch
  at batch 1 whatever its size).

Every time is the calling thread's CPU time (``time.thread_time``; torch runs one thread
here), the best of ``repeat`` runs: on a shared machine a wall clock also counts the time other
processes hold the core, which can triple a step; CPU time leaves out only that, and still
counts what they cost this thread through the shared caches and memory bus.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from quanta.core.config import LinearKernel
from quanta.runner.decode_chain import PARTS, layer_by_layer
from quanta.runner.model_runner import ModelRunner
from quanta.runner.projection import Projection
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

_BLOCK = 16


@dataclass(frozen=True, slots=True)
class _Seq:
    """A ``PagedSeq``: one sequence's new tokens at ``start_pos`` over ``block_table``."""

    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    hidden: bool = False


@dataclass(frozen=True, slots=True)
class DecodeProfile:
    """Milliseconds per decode step (``parts`` per layer in microseconds) and the bound."""

    dtype: str
    linear_kernel: str
    layer_path: str
    context: int
    rows: int
    weight_bytes: int
    bandwidth_gbs: float
    bound_ms: float
    step_ms: float
    layered_step_ms: float
    products_ms: float
    ops_per_step: int
    parts_us: dict[str, float]
    chain_parts_us: dict[str, float]  # empty where the chain does not run

    @property
    def share_of_bound(self) -> float:
        return self.bound_ms / self.step_ms


def stream_bandwidth(num_bytes: int, repeat: int = 5) -> float:
    """GB/s one thread reads: the best of ``repeat`` sums over a ``num_bytes`` fp32 buffer
    (fp32 so the sum's arithmetic keeps up with the loads)."""
    buf = torch.ones(num_bytes // 4, dtype=torch.float32)
    best = min(_timed(buf.sum) for _ in range(repeat))
    return num_bytes / best / 1e9


def weight_bytes(model: nn.Module) -> int:
    """Bytes a decode step reads of the projections and the LM head (the embedding row and
    the norms' weights are too small to count)."""
    return sum(
        t.numel() * t.element_size()
        for m in model.modules()
        if isinstance(m, Projection)
        for t in _tensors(m)
    )


def _tensors(m: nn.Module) -> list[torch.Tensor]:
    """A projection's own weights, whether kept as parameters or as packed buffers."""
    return [*m.parameters(recurse=False), *(b for b in m.buffers(recurse=False) if b is not None)]


def profile_decode(
    model_dir: Path,
    dtype: str,
    context: int = 96,
    repeat: int = 20,
    linear_kernel: LinearKernel = "auto",
    rows: int = 1,
) -> DecodeProfile:
    """Profile one decode step of ``rows`` rows at ``context`` tokens of context each (one
    thread)."""
    torch.set_num_threads(1)
    blocks = -(-(context + 1) // _BLOCK)
    runner = ModelRunner(
        model_dir,
        num_device_blocks=blocks * rows,
        num_host_blocks=0,
        dtype=dtype,
        linear_kernel=linear_kernel,
    )
    model = runner.model
    tables = [tuple(range(r * blocks, (r + 1) * blocks)) for r in range(rows)]
    with torch.inference_mode():
        for r, table in enumerate(tables):  # distinct prompts: each row its own context
            prompt = _Seq(tuple(range(4 + r, 4 + r + context)), 0, table)
            batch = runner._prepare([prompt], blocks * rows)
            model(batch.input_ids, batch.positions, runner.device_kv_cache, batch.meta)
        step = runner._prepare([_Seq((5,), context, table) for table in tables], blocks * rows)

        def run() -> None:
            hidden = model(step.input_ids, step.positions, runner.device_kv_cache, step.meta)
            model.compute_logits(hidden).float().max(dim=-1)

        step_s = _best(run, repeat)
        chain_parts = _chain_parts(model, run, repeat)
        with _CountOps() as counter:
            run()
        with layer_by_layer(model):
            layered_s = _best(run, repeat)
            parts = _parts(model, run, repeat)
        products_s = _best(_products(model, runner.dtype, rows), repeat)
    nbytes = weight_bytes(model)
    bandwidth = stream_bandwidth(nbytes)
    return DecodeProfile(
        dtype=str(runner.dtype).removeprefix("torch."),
        linear_kernel=runner.linear_kernel,
        layer_path=runner.layer_path,
        context=context,
        rows=rows,
        weight_bytes=nbytes,
        bandwidth_gbs=bandwidth,
        bound_ms=nbytes / bandwidth / 1e6,
        step_ms=step_s * 1e3,
        layered_step_ms=layered_s * 1e3,
        products_ms=products_s * 1e3,
        ops_per_step=counter.count,
        parts_us={k: v * 1e6 / runner.model_config.num_layers for k, v in parts.items()},
        chain_parts_us={
            k: v * 1e6 / runner.model_config.num_layers for k, v in chain_parts.items()
        },
    )


def _products(model: nn.Module, dtype: torch.dtype, rows: int) -> Callable[[], None]:
    """All the step's products on ``rows`` rows of ``dtype`` (the activations'; a quantized
    product's own tensors are int8), back to back."""
    calls = []
    for m in model.modules():
        if isinstance(m, Projection):
            calls.append((m, torch.ones(rows, m.in_features, dtype=dtype)))

    def run() -> None:
        for m, x in calls:
            m(x)

    return run


def _chain_parts(model: nn.Module, run: Callable[[], None], repeat: int) -> dict[str, float]:
    """Seconds per step in each of the chain's parts (its own CPU-time laps), from the run
    whose parts sum least; empty where the chain does not run the step."""
    chain = getattr(getattr(model, "decoder", None), "chain", None)
    if chain is None:
        return {}
    best: torch.Tensor | None = None
    try:
        for _ in range(repeat):
            chain.timings = torch.zeros(len(PARTS), dtype=torch.float64)
            run()
            if best is None or chain.timings.sum() < best.sum():
                best = chain.timings
    finally:
        chain.timings = None
    assert best is not None
    if not best.any():  # the chain did not take this step
        return {}
    return dict(zip(PARTS, best.tolist(), strict=True))


# part name -> the decoder layer's submodule it is timed on (a plain MLP's, as OPT's, is
# ``up_proj``); the two norms are the layer's ``norms``, whatever its family calls them
_PARTS = {
    "qkv": "self_attn.qkv_proj",
    "o": "self_attn.o_proj",
    "attention+rope": "self_attn",
    "gate_up": "mlp.gate_up_proj",
    "down": "mlp.down_proj",
    "silu*mul": "mlp",
    "input_norm": "",
    "post_norm": "",
}


def _parts(model: nn.Module, run: Callable[[], None], repeat: int) -> dict[str, float]:
    """Seconds per step in each part over all layers, plus the LM head and what is left of
    the forward pass (embedding, rope tables, the loop between layers)."""
    totals: dict[str, float] = defaultdict(float)
    handles = []
    decoder = model.decoder  # type: ignore[union-attr]
    for layer in decoder.layers:
        for part, path in _PARTS.items():
            if not path:
                module = layer.norms[part == "post_norm"]
            elif part == "gate_up" and getattr(layer.mlp, "gate_up_proj", None) is None:
                module = layer.mlp.up_proj
            else:
                module = layer.get_submodule(path)
            handles += _time_module(module, part, totals)
    handles += _time_module(model.lm_head, "lm_head", totals)  # type: ignore[arg-type]
    handles += _time_module(decoder, "forward", totals)
    best: dict[str, float] = {}
    try:
        for _ in range(repeat):  # the parts of the run whose forward pass was quickest
            totals.clear()
            run()
            if not best or totals["forward"] < best["forward"]:
                best = dict(totals)
    finally:
        for h in handles:
            h.remove()
    best["attention+rope"] -= best["qkv"] + best["o"]
    best["silu*mul"] -= best["gate_up"] + best["down"]
    inside = sum(v for k, v in best.items() if k not in ("forward", "lm_head"))
    best["between ops"] = best.pop("forward") - inside
    return best


def _time_module(module: nn.Module, part: str, totals: dict[str, float]) -> list[Any]:
    started: list[float] = []

    def pre(*_: Any) -> None:
        started.append(time.thread_time())

    def post(*_: Any) -> None:
        totals[part] += time.thread_time() - started.pop()

    return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]


class _CountOps(TorchDispatchMode):
    """Counts the aten operators dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += 1
        return func(*args, **(kwargs or {}))


def _best(fn: Callable[[], None], repeat: int) -> float:
    fn()
    return min(_timed(fn) for _ in range(repeat))


def _timed(fn: Callable[[], Any]) -> float:
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def print_profile(p: DecodeProfile) -> None:
    """The profile as the plain lines docs/results/benchmarks.md quotes."""
    print(
        f"dtype {p.dtype}, linear kernel {p.linear_kernel}, layers {p.layer_path}, "
        f"context {p.context}, {p.rows} row(s), one thread"
    )
    unit = "token" if p.rows == 1 else "step"
    print(
        f"weights read per {unit} {p.weight_bytes / 1e6:.1f} MB, one-thread stream "
        f"{p.bandwidth_gbs:.1f} GB/s -> bound {p.bound_ms:.2f} ms/{unit} "
        f"({1e3 * p.rows / p.bound_ms:.1f} tok/s)"
    )
    print(
        f"decode step {p.step_ms:.2f} ms ({1e3 * p.rows / p.step_ms:.1f} tok/s) = "
        f"{100 * p.share_of_bound:.0f}% of the bound; products alone {p.products_ms:.2f} ms; "
        f"{p.ops_per_step} torch ops per step"
    )
    if p.chain_parts_us:
        print("decode chain, per layer (us):")
        for part, us in sorted(p.chain_parts_us.items(), key=lambda kv: -kv[1]):
            print(f"  {part:16s} {us:8.1f}")
    print(
        f"layer by layer: decode step {p.layered_step_ms:.2f} ms "
        f"({1e3 * p.rows / p.layered_step_ms:.1f} tok/s), broken down per layer (us):"
    )
    for part, us in sorted(p.parts_us.items(), key=lambda kv: -kv[1]):
        print(f"  {part:16s} {us:8.1f}")
