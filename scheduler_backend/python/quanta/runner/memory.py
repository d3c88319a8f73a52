"""How much of a CUDA device's memory the KV cache gets: vLLM's ``gpu_memory_utilization``.

The engine may use ``utilization`` of the device's total memory in all: weights,
activations, CUDA graphs and the KV cache. The KV cache gets what the rest leaves, measured
rather than guessed, in this order (``ModelRunner.sized_by_memory``):

1. the device's free memory before anything is loaded (other processes hold the rest: if
   they leave less than the budget, the start fails, as vLLM's does);
2. what this process holds once the weights are loaded (the weights, the CUDA context's
   growth, library workspaces);
3. the peak a profiling forward of the largest step (``max_num_batched_tokens`` tokens,
   logits for ``max_num_seqs`` rows) allocates above that;
4. the pool CUDA graphs will hold, known before the KV cache is allocated although the graphs
   are captured after it (their kernels read the cache's addresses);

and ``kv_bytes = total * utilization - (loaded + peak activation + graph pool)``.

The arithmetic is pure: ``DeviceMemory`` is what the runner reads the numbers through
(``quanta.runner.devices.CudaMemory`` on CUDA, a stand-in in tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from quanta.core.sizes import format_size

# The flag users raise or lower, named in every error.
FLAG = "--gpu-memory-utilization"


class DeviceMemory(Protocol):
    """A device's memory as the sizing reads it."""

    def total(self) -> int:
        """The device's memory in bytes."""
        ...

    def free(self) -> int:
        """Bytes free on the device now, after this process has given back the cached
        blocks nothing uses (so what it holds is what its live tensors and libraries hold)."""
        ...

    def start_peak(self) -> None:
        """Start measuring the peak of this process's allocations from their level now."""
        ...

    def peak(self) -> int:
        """The most this process allocated above the level at ``start_peak``, in bytes."""
        ...


class MemoryBudgetError(ValueError):
    """The budget ``utilization`` gives cannot hold the engine: the message says how much
    is needed and which flag to change."""


@dataclass(frozen=True, slots=True)
class MemoryUse:
    """What start-up measured on the device, in bytes."""

    total: int
    free_at_start: int  # free before this engine loaded anything
    loaded: int  # this process's use once the weights are loaded: weights, context, workspaces
    weights: int  # the weights alone, of ``loaded`` (for the log)
    peak_activation: int  # the profiling forward's peak above ``loaded``
    graph_pool: int = 0  # what the CUDA graphs will hold (0: the runner captures none)

    @property
    def non_kv(self) -> int:
        """Everything but the KV cache."""
        return self.loaded + self.peak_activation + self.graph_pool


def kv_cache_bytes(use: MemoryUse, utilization: float) -> int:
    """The bytes the KV cache may take: the budget (``utilization`` of the total) less what
    the engine needs besides. Raises ``MemoryBudgetError`` when other processes leave less
    free than the budget, when the weights alone exceed it, or when nothing is left."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    budget = int(use.total * utilization)
    if use.free_at_start < budget:
        raise MemoryBudgetError(
            f"{format_size(use.free_at_start)} of the device's {format_size(use.total)} are "
            f"free at start (other processes hold the rest), less than {FLAG} {utilization} "
            f"asks for ({format_size(budget)}); lower {FLAG} to at most "
            f"{_floor(use.free_at_start / use.total)} or free the device"
        )
    if use.loaded > budget:
        raise MemoryBudgetError(
            f"the weights alone need {format_size(use.loaded)} once loaded "
            f"({format_size(use.weights)} of tensors), more than {FLAG} {utilization} gives "
            f"({format_size(budget)} of {format_size(use.total)}); raise {FLAG} above "
            f"{_ceil(use.non_kv / use.total)}, or use a smaller model or a quantized engine"
        )
    kv = budget - use.non_kv
    if kv <= 0:
        raise MemoryBudgetError(
            f"nothing is left for the KV cache: the weights take {format_size(use.loaded)} "
            f"and the largest step's activations {format_size(use.peak_activation)}"
            + (f", CUDA graphs {format_size(use.graph_pool)}" if use.graph_pool else "")
            + f", of the {format_size(budget)} {FLAG} {utilization} gives; raise {FLAG} above "
            f"{_ceil(use.non_kv / use.total)} or lower --max-num-batched-tokens"
        )
    return kv


def kv_cache_blocks(use: MemoryUse, utilization: float, bytes_per_block: int) -> int:
    """Whole blocks of ``bytes_per_block`` in ``kv_cache_bytes``; at least one, else
    ``MemoryBudgetError`` with the memory one block needs."""
    blocks = kv_cache_bytes(use, utilization) // bytes_per_block
    if blocks < 1:
        raise MemoryBudgetError(
            f"the KV cache's share of {FLAG} {utilization} holds no block of "
            f"{format_size(bytes_per_block)}; raise {FLAG} above "
            f"{_ceil((use.non_kv + bytes_per_block) / use.total)}"
        )
    return blocks


def describe_kv_sizing(
    use: MemoryUse, utilization: float, blocks: int, bytes_per_block: int
) -> str:
    """The start-up log line: what was found and what the KV cache got (vLLM's
    "# GPU blocks")."""
    graphs = f", CUDA graphs {format_size(use.graph_pool)}" if use.graph_pool else ""
    return (
        f"device memory: {format_size(use.total)} total, {FLAG} {utilization} "
        f"({format_size(int(use.total * utilization))}); weights {format_size(use.weights)} "
        f"({format_size(use.loaded)} in use once loaded), activation peak "
        f"{format_size(use.peak_activation)}{graphs}; KV cache "
        f"{format_size(blocks * bytes_per_block)}: {blocks} device blocks"
    )


def _ceil(fraction: float) -> str:
    """A fraction rounded up to the hundredth a user would type."""
    return f"{min(1.0, -(-int(fraction * 10000) // 100) / 100):.2f}"


def _floor(fraction: float) -> str:
    return f"{int(fraction * 100) / 100:.2f}"
