"""Which decode-attention kernel runs: the native C kernel, ``varlen_decode`` fused by
torch.compile, or ``varlen_decode`` eagerly.

- ``native`` (``quanta.runner.native_decode``) reads each row's slots in place from the paged
  cache with no per-call set-up beyond a ctypes call. It is single-threaded.
- ``compiled``: Inductor fuses ``varlen_decode``'s passes into C++ loops (6x eager at batch
  32), but every call pays Dynamo's guards (~75 us), so batches of up to
  ``ROW_BY_ROW_DECODE_ROWS`` rows attend row by row through SDPA instead.
- ``eager`` runs the same ops one by one, and is what any machine can run.

Measured per layer of OPT-125M, one thread (``docs/results/benchmarks.md``): the native kernel
is the fastest at every batch size measured, in fp32 and bf16. It stays the fastest where torch runs
two threads, although it uses one: on SmolLM2 (bf16, 2 threads) a decode step took 24.3 /
31.5 / 107.6 ms at batch 1 / 8 / 32 against the compiled kernel's 27.1 / 38.5 / 177.9 (the
compiled loops' threads do not make up for Dynamo's guards and their gathers). So ``auto``
picks ``native`` on CPU for fp32 and bf16 where a C compiler is found, whatever the thread
count; else ``compiled`` where a C++ compiler is found; else ``eager``. A kernel that cannot
be built falls back down that list with a warning, never failing the model.
``QUANTA_ATTENTION_KERNEL`` (native|compiled|eager) overrides ``auto``, like the dtype default.

Both torch kernels compile or build at load, on a dummy batch, so no request waits for it.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from quanta.core.config import AttentionKernel
from quanta.runner import native_decode
from quanta.runner.attention import DecodeBatch, DecodeKernel

log = logging.getLogger(__name__)

ATTENTION_KERNEL_ENV = "QUANTA_ATTENTION_KERNEL"
_KERNELS = ("native", "compiled", "eager")
_compiled: Callable[..., torch.Tensor] | None = None

# Decode batches of at most this many rows attend row by row through SDPA rather than through
# ``varlen_decode``. Measured per layer of OPT-125M (contexts of 110, one thread, bf16), the
# compiled kernel costs 170 us at one row (its Dynamo guards and launch alone ~75 us) where
# one gather and SDPA take 48 us; the two are even at 8 rows and the kernel wins past them.
ROW_BY_ROW_DECODE_ROWS = 8


def resolve_attention_kernel(
    kernel: AttentionKernel, device: torch.device, dtype: torch.dtype = torch.float32
) -> str:
    """``native``, ``compiled`` or ``eager`` for this device and dtype (``auto``: see the
    module docstring)."""
    if kernel != "auto":
        return kernel
    override = os.environ.get(ATTENTION_KERNEL_ENV, "").strip()
    if override:
        if override not in _KERNELS:
            raise ValueError(f"{ATTENTION_KERNEL_ENV}={override!r}: use one of {_KERNELS}")
        return override
    if device.type != "cpu":
        return "eager"
    if native_decode.supports(dtype, device) and native_decode.compiler():
        return "native"
    return "compiled" if shutil.which("c++") or shutil.which("g++") else "eager"


def decode_kernel(
    kernel: str,
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | None = None,
) -> tuple[DecodeKernel, str]:
    """(the kernel, the name of what runs): builds ``native`` or compiles and warms up
    ``compiled`` now, falling back to the next kernel down if that fails."""
    device = device or torch.device("cpu")
    if kernel == "native":
        if native_decode.supports(dtype, device):
            native = native_decode.load()
            if native is not None:
                return native_decode.NativeDecodeKernel(native), "native"
        else:
            log.warning("native decode attention runs fp32 and bf16 on CPU, not %s", dtype)
        kernel = "compiled"
    if kernel == "compiled":
        started = time.perf_counter()
        try:
            compiled = _compile()
            _warm_up(compiled, heads, kv_heads, head_dim, dtype)
        except Exception as exc:  # no working toolchain: slower, never broken
            log.warning("compiling decode attention failed, running it eagerly: %s", exc)
        else:
            log.info("decode attention compiled in %.1f s", time.perf_counter() - started)
            return _torch_kernel(compiled), "compiled"
    return _torch_kernel(varlen_decode), "eager"


def _torch_kernel(fn: Callable[..., torch.Tensor]) -> DecodeKernel:
    def attend(
        rows: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        batch: DecodeBatch,
        scale: float,
    ) -> torch.Tensor:
        if len(batch.lens) <= ROW_BY_ROW_DECODE_ROWS:
            return row_by_row_decode(rows, key_cache, value_cache, batch, scale)
        return fn(rows, key_cache, value_cache, batch.slots, batch.owner, scale)

    return attend


def row_by_row_decode(
    rows: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    batch: DecodeBatch,
    scale: float,
) -> torch.Tensor:
    """Few rows: gather every row's own slots once (so, as in ``varlen_decode``, no stale slot
    is ever read), then one SDPA call per row over its slice."""
    keys = key_cache.index_select(0, batch.slots).to(rows.dtype).transpose(0, 1)  # [KVH, N, D]
    vals = value_cache.index_select(0, batch.slots).to(rows.dtype).transpose(0, 1)
    queries = rows.unsqueeze(2)  # [B, H, 1, D]
    gqa = rows.shape[1] != keys.shape[0]
    out = torch.empty_like(rows)
    start = 0
    for i, length in enumerate(batch.lens):
        end = start + length
        attn = F.scaled_dot_product_attention(
            queries[i : i + 1],
            keys[None, :, start:end],
            vals[None, :, start:end],
            scale=scale,
            enable_gqa=gqa,
        )
        out[i] = attn[0, :, 0]
        start = end
    return out


def varlen_decode(
    rows: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    owner: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of B query rows ``[B, H, D]`` over their packed contexts: scores per (slot,
    head), a softmax per row's segment, then the weighted sum of its values. Scores and
    weights are fp32 whatever the cache dtype. Caches are flat ``[slots, KVH, D]``.

    Written as whole-tensor ops so ``torch.compile`` can fuse it into one loop (``_compile``);
    run eagerly it makes one pass per op."""
    heads, kv_heads = rows.shape[1], key_cache.shape[1]
    keys = key_cache.index_select(0, slots).float()  # [N, KVH, D]
    vals = value_cache.index_select(0, slots).float()
    if heads != kv_heads:  # grouped-query: each KV head serves heads // kv_heads query heads
        keys = keys.repeat_interleave(heads // kv_heads, dim=1)
        vals = vals.repeat_interleave(heads // kv_heads, dim=1)
    queries = rows.float()
    scores = (queries.index_select(0, owner) * keys).sum(-1) * scale  # [N, H]
    num_rows = queries.shape[0]
    peak = torch.full((num_rows, heads), float("-inf"), device=rows.device)
    peak = peak.scatter_reduce(0, owner[:, None].expand(-1, heads), scores, "amax")
    weights = torch.exp(scores - peak.index_select(0, owner))
    total = torch.zeros((num_rows, heads), device=rows.device).index_add(0, owner, weights)
    out = torch.zeros((num_rows, heads, queries.shape[2]), device=rows.device)
    out = out.index_add(0, owner, weights[:, :, None] * vals)
    return (out / total[:, :, None]).to(rows.dtype)


def _compile() -> Callable[..., torch.Tensor]:
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
    fn: Callable[..., torch.Tensor], heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
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
