"""Which decode-attention kernel runs: ``varlen_decode`` eagerly, or fused by torch.compile.

Eagerly, the packed decode attention makes one pass over the batch's gathered K/V per op
(gather, cast, product, sum, exp, weighted sum): at batch 32 on OPT-125M that was about 55% of
a bf16 decode step. Inductor fuses the ops into one C++ loop per pass and measured 6x faster
(1.1 ms against 6.8 ms per layer, batch 32, contexts 100-130). It needs a C++ compiler at run
time and compiles once per process and model shape (about 20 s the first time on this
machine, seconds once Inductor's on-disk cache has it), so:

- ``auto`` compiles where a C++ compiler is found and the device is a CPU, else eager;
- the compile happens at load, on a dummy batch, so no request waits for it, and a failure
  falls back to eager with a warning rather than failing the model;
- ``QUANTA_ATTENTION_KERNEL`` (eager|compiled) overrides ``auto``, like the dtype default.
"""

from __future__ import annotations

import logging
import os
import shutil
import time

import torch

from quanta.core.config import AttentionKernel
from quanta.runner.attention import DecodeKernel, varlen_decode

log = logging.getLogger(__name__)

ATTENTION_KERNEL_ENV = "QUANTA_ATTENTION_KERNEL"
_compiled: DecodeKernel | None = None


def resolve_attention_kernel(kernel: AttentionKernel, device: torch.device) -> str:
    """``eager`` or ``compiled`` for this device (``auto``: see the module docstring)."""
    if kernel == "auto":
        override = os.environ.get(ATTENTION_KERNEL_ENV, "").strip()
        if override:
            if override not in ("eager", "compiled"):
                raise ValueError(f"{ATTENTION_KERNEL_ENV}={override!r}: use eager or compiled")
            return override
        compiler = shutil.which("c++") or shutil.which("g++")
        return "compiled" if device.type == "cpu" and compiler else "eager"
    return kernel


def decode_kernel(
    kernel: str, *, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[DecodeKernel, str]:
    """(the kernel, the name of what runs): compiles and warms ``compiled`` up now, or falls
    back to eager if compiling fails."""
    if kernel != "compiled":
        return varlen_decode, "eager"
    started = time.perf_counter()
    try:
        compiled = _compile()
        _warm_up(compiled, heads, kv_heads, head_dim, dtype)
    except Exception as exc:  # no working toolchain: slower, never broken
        log.warning("compiling decode attention failed, running it eagerly: %s", exc)
        return varlen_decode, "eager"
    log.info("decode attention compiled in %.1f s", time.perf_counter() - started)
    return compiled, "compiled"


def _compile() -> DecodeKernel:
    """One compiled ``varlen_decode`` per process: Dynamo keeps a graph per dtype and
    grouped-query layout, with every size dynamic."""
    global _compiled
    if _compiled is None:
        # NOTE: sizes that happen to be equal (a batch of 64 rows and head_dim 64) must not
        # become a guard, or a later step recompiles (seconds) when they differ.
        import torch.fx.experimental._config as fx_config

        fx_config.use_duck_shape = False
        _compiled = torch.compile(varlen_decode, dynamic=True)
    return _compiled


def _warm_up(
    fn: DecodeKernel, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    """Run ``fn`` on batches of different sizes, so the compiled graphs are the dynamic ones
    every later step reuses: Dynamo specialises a size it first sees (hence two sizes), and
    sizes 0/1 always get a graph of their own (one decode row; one row with one slot, a
    one-token prompt), which would otherwise compile during a request. Tensors
    are made as the runner makes them (the KV cache outside inference mode, the rest inside),
    since a compiled graph is also specialised to that."""
    # [layers, K/V, blocks, block_size, kv_heads, head_dim], then one layer's flat view
    tier = torch.zeros(2, 2, 7, 5, kv_heads, head_dim, dtype=dtype)
    cache = tier[0].view(2, 35, kv_heads, head_dim)
    with torch.inference_mode():
        for rows, per_row in ((3, 5), (4, 7), (1, 6), (1, 1)):
            queries = torch.zeros(rows, heads, head_dim, dtype=dtype)
            owner = torch.arange(rows).repeat_interleave(per_row)
            slots = torch.arange(rows * per_row)
            fn(queries, cache[0], cache[1], slots, owner, 1.0)
