"""Token bitmasks of a step's structured-output rows, filled while the forward pass runs.

A request's grammar state is final when its step starts (the core advances it only when a
token is committed), so the runner starts filling the masks on a worker thread before the
forward pass and applies them to the logits once the LM head has run. xgrammar releases the
GIL while it fills, so on a CPU the fill overlaps the model's own threads' work.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from quanta.core.output import ScheduledSeq
from quanta.core.structured import TokenConstraint
from quanta.structured.grammar import XGrammarConstraint


@dataclass(frozen=True, slots=True)
class PendingMasks:
    """Masks being filled: ``rows`` are positions among the step's sampled rows (the rows
    of its logits), each with its own mask row."""

    rows: tuple[int, ...]
    bitmask: Future[torch.Tensor]


class GrammarMasks:
    """Fills and applies the masks; one per runner (it owns a worker thread, started on the
    first structured step)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._pool: ThreadPoolExecutor | None = None

    def start(self, seqs: Sequence[ScheduledSeq]) -> PendingMasks | None:
        """Begin the masks of the rows of ``seqs`` that sample under a grammar, or None."""
        sampled = [seq for seq in seqs if seq.sample]
        constrained = [
            (j, seq.processing.constraint)
            for j, seq in enumerate(sampled)
            if seq.processing is not None and seq.processing.constraint is not None
        ]
        if not constrained:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        rows = tuple(j for j, _ in constrained)
        grammars = [c for _, c in constrained]
        return PendingMasks(rows, self._pool.submit(self._fill, grammars, len(sampled), rows))

    def apply(self, logits: torch.Tensor, pending: PendingMasks) -> None:
        """Set every forbidden token's logit of the constrained rows to -inf, in place."""
        import xgrammar as xgr

        bitmask = pending.bitmask.result()
        if bitmask.device != logits.device:
            bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(
            logits, bitmask, vocab_size=self.vocab_size, indices=list(pending.rows)
        )

    def _fill(
        self, grammars: list[TokenConstraint], num_rows: int, rows: tuple[int, ...]
    ) -> torch.Tensor:
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(num_rows, self.vocab_size)
        for grammar, row in zip(grammars, rows, strict=True):
            if not isinstance(grammar, XGrammarConstraint):
                raise TypeError(f"no mask for a {type(grammar).__name__} constraint")
            grammar.fill_mask(bitmask, row)
        return bitmask

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
