"""Megatron-style sharding of a loaded model for one tensor-parallel rank, as its layers
declare their splits (``tensor_parallel()``, ``quanta.runner.layers.parallel``).

Every rank loads the checkpoint, then keeps its share (``shard_model``) before the projections
are fused: attention heads (for grouped-query models whole KV groups, so each rank's query
heads read only its own KV heads) and MLP columns are column-parallel; the attention output
and MLP down projections are row-parallel, each followed by one all-reduce (``RowParallel``);
the embedding and the LM head are split by vocabulary (``VocabParallelEmbedding``,
``ParallelHead``). Norms, positions and biases of column-parallel products are per rank or
replicated; a row-parallel product's bias is added once, by rank 0.

Why slice after loading rather than load slices: it keeps one loader for every checkpoint
format (safetensors, quantized parts, tied heads); a rank briefly holds the whole model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from quanta.runner.models.config import ModelConfig


@dataclasses.dataclass(frozen=True, slots=True)
class Rank:
    """Where this process sits in its tensor-parallel group."""

    rank: int
    world: int

    def span(self, total: int) -> slice:
        """This rank's contiguous share of ``total`` (which ``check_divisible`` vouched for)."""
        size = total // self.world
        return slice(self.rank * size, (self.rank + 1) * size)


def check_divisible(config: ModelConfig, world: int) -> None:
    """Refuse a split that would cut a head, a KV group or an MLP column block unevenly,
    naming the dimension, before any process starts."""
    if world < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world}")
    dims = {
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "intermediate_size": config.intermediate_size,
    }
    for name, value in dims.items():
        if value % world:
            raise ValueError(
                f"tensor_parallel_size {world} does not divide the model's {name} ({value})"
            )


def rank_config(config: ModelConfig, rank: Rank) -> ModelConfig:
    """What one rank's KV cache and attention kernels see: its heads only."""
    shape = config.shape.model_copy(
        update={
            "num_heads": config.num_heads // rank.world,
            "num_kv_heads": config.num_kv_heads // rank.world,
            "intermediate_size": config.intermediate_size // rank.world,
        }
    )
    return dataclasses.replace(config, shape=shape)


def _keep(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    setattr(module, name, nn.Parameter(tensor.contiguous(), requires_grad=False))


def _columns(linear: nn.Linear, segments: tuple[int, ...], rank: Rank) -> None:
    """Column-parallel: keep this rank's share of each segment of the output features
    (weight rows, bias entries); a fused product's parts are split each on its own."""
    rows, start = [], 0
    for width in segments:
        share = rank.span(width)
        rows.append(torch.arange(start + share.start, start + share.stop))
        start += width
    index = torch.cat(rows)
    _keep(linear, "weight", linear.weight[index])
    if linear.bias is not None:
        _keep(linear, "bias", linear.bias[index])
    linear.out_features = linear.weight.shape[0]


def _rows(linear: nn.Linear, cols: slice, rank: Rank) -> None:
    """Row-parallel: keep the input features ``cols``; the bias stays on rank 0 only, since
    the all-reduce sums every rank's output."""
    _keep(linear, "weight", linear.weight[:, cols])
    if linear.bias is not None and rank.rank != 0:
        _keep(linear, "bias", torch.zeros_like(linear.bias))
    linear.in_features = linear.weight.shape[1]


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the token embedding; ids outside them read zeros, and the
    all-reduce sums the one rank that holds each id."""

    def __init__(self, weight: torch.Tensor, start: int, vocab_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start = start
        self.vocab_size = vocab_size

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        dist.all_reduce(out)
        return out


class RowParallel(nn.Module):
    """A row-parallel product and its all-reduce; ``add`` puts the residual in after the
    sum (a fused residual add would add it once per rank)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        dist.all_reduce(out)
        return out

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.forward(x).add_(residual)


class ParallelHead(nn.Module):
    """The LM head split by vocabulary. On rank 0 ``forward`` hands the rows to the other
    ranks (``exchange``), computes its own columns and returns the gathered logits; the
    other ranks answer through ``local`` (``quanta.runner.tensor_parallel.worker``)."""

    def __init__(
        self, weight: nn.Parameter, vocab_size: int, exchange: Callable[..., torch.Tensor]
    ) -> None:
        super().__init__()
        self.weight = weight
        self.vocab_size = vocab_size
        self.exchange = exchange

    def local(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.exchange(hidden, self.local)[:, : self.vocab_size]


def _vocab_shard(weight: torch.Tensor, rank: Rank) -> tuple[torch.Tensor, int]:
    """This rank's rows of a ``[vocab, d]`` table, zero-padded so every rank holds the same
    number (gathering needs equal shapes); and the first id it holds."""
    vocab = weight.shape[0]
    size = -(-vocab // rank.world)
    start = rank.rank * size
    rows = weight[start : min(start + size, vocab)]
    if rows.shape[0] < size:
        rows = torch.cat((rows, rows.new_zeros(size - rows.shape[0], weight.shape[1])))
    return rows.contiguous(), start


def shard_model(
    model: nn.Module, config: ModelConfig, rank: Rank, exchange: Callable[..., torch.Tensor]
) -> ModelConfig:
    """Keep this rank's share of every weight of a loaded, not yet fused model; returns the
    rank's config (its heads). Call ``wrap_row_parallel`` after fusing."""
    check_divisible(config, rank.world)
    local = rank_config(config, rank)
    for module in list(model.modules()):
        plan = getattr(module, "tensor_parallel", None)
        if plan is None:
            continue
        for name, split in plan().items():
            linear = getattr(module, name)
            if split.kind == "columns":
                _columns(linear, split.segments, rank)
            else:
                _rows(linear, rank.span(split.segments[0]), rank)
        if hasattr(module, "num_heads"):
            module.num_heads = local.num_heads
        if hasattr(module, "num_kv_heads"):
            module.num_kv_heads = local.num_kv_heads
    embedding_path = getattr(model, "embedding", None)
    if embedding_path is None:
        raise ValueError(f"tensor parallelism is not implemented for {config.family!r} models")
    embed_owner_name, _, embed_name = embedding_path.rpartition(".")
    embed_owner = model.get_submodule(embed_owner_name)
    table: torch.Tensor = getattr(embed_owner, embed_name).weight
    shard, start = _vocab_shard(table, rank)
    embedding = VocabParallelEmbedding(shard, start, config.vocab_size)
    setattr(embed_owner, embed_name, embedding)
    if config.tie_word_embeddings:
        head_weight = embedding.weight
    else:
        head_weight = nn.Parameter(_vocab_shard(model.lm_head.weight, rank)[0], requires_grad=False)
    model.lm_head = ParallelHead(head_weight, config.vocab_size, exchange)
    model.tie_weights = lambda: None  # the head is tied above, to the shard
    return local


def wrap_row_parallel(model: nn.Module, config: ModelConfig) -> None:
    """Put the all-reduce after each row-parallel product (once fused: the fused modules
    replaced the ``nn.Linear``s ``shard_model`` cut), as each layer declares them."""
    for module in list(model.modules()):
        plan = getattr(module, "tensor_parallel", None)
        if plan is None:
            continue
        for name, split in plan().items():
            if split.kind == "rows":
                setattr(module, name, RowParallel(getattr(module, name)))
