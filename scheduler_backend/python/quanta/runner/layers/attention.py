"""Grouped-query self-attention with the options the served families need: q/k/v biases,
per-head q/k RMSNorm, partial rotation or none (OPT's learned positions), a sliding window
and logit soft-capping.

q, k and v are one product once fused (HF's three linears, or Phi-3's one ``qkv_proj``).
Attention runs through ``quanta.runner.attention.paged_attention`` (its native prefill and
decode kernels) whenever the window covers every context of the step and no soft-cap is set;
otherwise ``windowed_attention`` below runs HF's eager sequence over the paged cache, but for
decode rows under the native decode kernel, which takes the window and the soft-cap itself
(as the decode chain calls it).
"""

from __future__ import annotations

import torch
from torch import nn

from quanta.families.config import ModelConfig
from quanta.runner.attention import AttentionMetadata, attend_natively, paged_attention
from quanta.runner.layer_ops import TorchLayerOps
from quanta.runner.layers.norms import RMSNorm
from quanta.runner.layers.parallel import Split
from quanta.runner.layers.rotary import rotary_dim
from quanta.runner.linear import ProjectionFactory
from quanta.runner.native_decode import NativeDecodeKernel

Rope = tuple[torch.Tensor, torch.Tensor]


class Attention(nn.Module):
    """Loads HF's q/k/v/o projections (or a fused ``qkv_proj``); after ``fuse`` q, k and v
    are one product and the output projection is ``o_proj`` whatever the checkpoint calls it
    (``out_name``: OPT's ``out_proj``). ``rotary`` False rotates nothing."""

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        *,
        fused: bool = False,
        rotary: bool = True,
        out_name: str = "o_proj",
    ) -> None:
        super().__init__()
        dim = config.hidden_size
        qkv_bias = config.attention_bias or config.qkv_bias
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.rotary_dim = rotary_dim(config) if rotary else 0
        self.window = config.sliding_window(layer)
        self.softcap = config.attn_logit_softcapping
        scalar = config.query_pre_attn_scalar
        self.scale = (scalar if scalar is not None else self.head_dim) ** -0.5
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.fused = fused
        if fused:
            self.qkv_proj: nn.Module | None = nn.Linear(dim, q_width + 2 * kv_width, qkv_bias)
        else:
            self.q_proj = nn.Linear(dim, q_width, bias=qkv_bias)
            self.k_proj = nn.Linear(dim, kv_width, bias=qkv_bias)
            self.v_proj = nn.Linear(dim, kv_width, bias=qkv_bias)
            self.qkv_proj = None
        # The output projection's attribute: the checkpoint's name until ``fuse``, then o_proj.
        self.out_name = out_name
        self.add_module(out_name, nn.Linear(q_width, dim, bias=config.attention_bias))
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.ops: TorchLayerOps = TorchLayerOps()

    def tensor_parallel(self) -> dict[str, Split]:
        """Heads (whole KV groups) by columns, the output projection by rows."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.fused:
            return {"qkv_proj": Split.columns(q, kv, kv), self.out_name: Split.rows(q)}
        return {
            "q_proj": Split.columns(q),
            "k_proj": Split.columns(kv),
            "v_proj": Split.columns(kv),
            self.out_name: Split.rows(q),
        }

    def fuse(self, make: ProjectionFactory) -> int:
        if self.fused:
            self.qkv_proj = make([self.qkv_proj])  # type: ignore[list-item]
        else:
            self.qkv_proj = make([self.q_proj, self.k_proj, self.v_proj])
            del self.q_proj, self.k_proj, self.v_proj
        out = getattr(self, self.out_name)
        delattr(self, self.out_name)
        self.o_proj: nn.Module = make([out])
        self.out_name = "o_proj"
        return 2 if self.fused else 4

    def _rotated(self, x: torch.Tensor, rope: Rope | None) -> tuple[torch.Tensor, ...]:
        """q ``[T, H, D]``, k and v ``[T, KVH, D]`` of ``x``, q and k rotated: views of the
        fused product's columns, rotated in place (q's and k's heads in one call); ``rope``
        is None where nothing rotates."""
        assert self.qkv_proj is not None, "call fuse() after loading the weights"
        qkv = self.qkv_proj(x)
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        tokens, q_width, kv_width = qkv.shape[0], heads * dim, kv_heads * dim
        qk = qkv[:, : q_width + kv_width].view(tokens, heads + kv_heads, dim)
        if self.qk_norm:
            q = self.q_norm(qk[:, :heads].reshape(-1, dim)).view(tokens, heads, dim)
            k = self.k_norm(qk[:, heads:].reshape(-1, dim)).view(tokens, kv_heads, dim)
            qk = torch.cat((q, k), dim=1)
        if rope is not None:  # all of each head, or a partial rotation's share
            self.ops.rope_(qk[..., : self.rotary_dim], *rope)
        v = qkv[:, q_width + kv_width :].view(tokens, kv_heads, dim)
        return qk[:, :heads], qk[:, heads:], v

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope | None,
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
        past_rope: Rope | None = None,
    ) -> torch.Tensor:
        """``attention(x)``, its output projection included (the residual add is the next
        norm's)."""
        q, k, v = self._rotated(x, rope)
        # NOTE: the Triton kernels (``meta.paged``, CUDA) take the window and the cap
        # themselves; elsewhere such a layer has its own path
        if meta.paged is None and (
            self.softcap is not None or not _window_covers(self.window, meta)
        ):
            out = windowed_attention(q, k, v, layer_cache, meta, self.scale, self.window,
                                     self.softcap, self.ops)  # fmt: skip
            return self.o_proj(out.flatten(1))

        def project_kv(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """K (rotated to each token's position) and V of cached attention inputs; the
            fused product also computes q, which is dropped."""
            assert past_rope is not None or rope is None
            _, k_past, v_past = self._rotated(h, past_rope)
            return k_past, v_past

        out = paged_attention(
            q.contiguous() if self.qk_norm else q,
            k,
            v,
            layer_cache,
            meta,
            scale=self.scale,
            hidden_input=x,
            project_kv=project_kv,
            ops=self.ops,
            window=self.window,
            softcap=self.softcap,
        )
        return self.o_proj(out.flatten(1))


def _window_covers(window: int, meta: AttentionMetadata) -> bool:
    """Whether every context of the step fits in the window (full attention then equals it)."""
    if not window:
        return True
    longest = max((chunk.context_len for chunk in meta.prefills), default=0)
    if meta.decode is not None:
        longest = max(longest, *meta.decode.lens)
    if meta.hidden is not None:
        longest = max(longest, meta.hidden.past_positions.numel() + 1)
    return longest <= window


def windowed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int,
    softcap: float | None,
    ops: TorchLayerOps,
) -> torch.Tensor:
    """Store this step's K/V (through ``ops``), then attend each row over the last ``window``
    positions up to its own (all with ``window`` 0), soft-capping the scores: HF's eager
    sequence, fp32 softmax included. q: [T, H, D]; k, v: [T, KVH, D] -> [T, H, D]."""
    if meta.hidden is not None:
        raise NotImplementedError(
            "the hidden cache does not serve sliding-window or soft-capped attention"
        )
    _, num_blocks, block_size, kv_heads, head_dim = layer_cache.shape
    flat = layer_cache.view(2, num_blocks * block_size, kv_heads, head_dim)
    ops.store_kv_(flat, meta.slot_mapping, k, v)
    out = torch.empty_like(q)
    native = meta.prefill_kernel
    for chunk in meta.prefills:
        if native is not None and attend_natively(
            native, chunk, q, out, flat, block_size, scale, window, softcap
        ):
            continue
        rows = q[chunk.token_start : chunk.token_end]
        base = chunk.window_start_block * block_size  # its first held block's first position
        keys = layer_cache[0].index_select(0, chunk.block_ids).flatten(0, 1)
        vals = layer_cache[1].index_select(0, chunk.block_ids).flatten(0, 1)
        keys, vals = keys[: chunk.context_len - base], vals[: chunk.context_len - base]
        first = chunk.context_len - rows.shape[0]
        q_pos = torch.arange(first, chunk.context_len) - base  # NOTE: masks see differences only
        out[chunk.token_start : chunk.token_end] = _attend(
            rows, keys, vals, q_pos, scale, window, softcap
        )
    decode = meta.decode
    if decode is not None and isinstance(decode.kernel, NativeDecodeKernel):
        # The native kernel attends over the window and soft-caps as the decode chain does.
        rows = q.index_select(0, decode.token_index)
        attended = decode.kernel(rows, flat[0], flat[1], decode, scale, window, softcap)
        out.index_copy_(0, decode.token_index, attended)
    elif decode is not None:
        bounds = decode.bounds.tolist()
        for b, row in enumerate(decode.token_index.tolist()):
            slots = decode.slots[bounds[b] : bounds[b + 1]]
            if window:
                slots = slots[-window:]
            out[row] = _attend(
                q[row : row + 1],
                flat[0].index_select(0, slots),
                flat[1].index_select(0, slots),
                torch.tensor([slots.numel() - 1]),
                scale,
                0,
                softcap,
            )[0]
    return out


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    vals: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    window: int,
    softcap: float | None,
) -> torch.Tensor:
    """Rows ``q`` [n, H, D] at positions ``q_pos`` of a context ``keys``/``vals`` [L, KVH, D]
    (positions counted from the context's first key) -> [n, H, D]."""
    groups = q.shape[1] // keys.shape[1]
    keys = keys.to(q.dtype).repeat_interleave(groups, dim=1)
    vals = vals.to(q.dtype).repeat_interleave(groups, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, keys) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    k_pos = torch.arange(keys.shape[0], device=q.device)
    q_pos = q_pos.to(q.device)
    visible = k_pos[None, :] <= q_pos[:, None]
    if window:
        visible &= q_pos[:, None] - k_pos[None, :] < window
    scores = scores.masked_fill(~visible, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("hnl,lhd->nhd", weights, vals)
