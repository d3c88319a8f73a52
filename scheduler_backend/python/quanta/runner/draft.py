"""Draft-model speculation: a smaller model of the same vocabulary that keeps its own paged
K/V and proposes the next tokens of each speculating request after every step.

The draft's cache has the target's geometry in blocks (the same number of blocks of the same
size, in both tiers), so the core's one block table serves both models: every block copy
(swap, checkpoint, prefix offload) is made in both caches, and a prefix-cache hit finds the
draft's K/V beside the target's in the same block. The draft runs over every step's tokens
(prompt chunks, decode tokens, the drafts being verified) so its cache is complete wherever
the target's is; then, for each request that asked (``ScheduledSeq.num_proposals``), it
decodes greedily from the step's newest token, writing through the lookahead slots the core
reserved, and the proposals go back to the core as next step's drafts. Greedy proposals are
one-token proposals, which the target's verification accepts exactly when its own sample
equals them (``runner/speculative.py``), so the output is the target's alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from quanta.core.output import SchedulerOutput
from quanta.runner.models.config import ModelConfig

if TYPE_CHECKING:
    from quanta.runner.model_runner import ModelRunner


class _Step:
    """Tokens from ``position`` on through a block table (a ``PagedSeq``)."""

    __slots__ = ("block_table", "hidden", "start_pos", "token_ids")

    def __init__(
        self, tokens: tuple[int, ...], position: int, block_table: tuple[int, ...]
    ) -> None:
        self.token_ids = tokens
        self.start_pos = position
        self.block_table = block_table
        self.hidden = False


class DraftModel:
    """The draft's weights and caches, driven by the target's runner each step."""

    def __init__(self, model_dir: str | Path, runner: ModelRunner, target: ModelConfig) -> None:
        """``runner`` runs the draft's weights over the target runner's blocks (same block
        count, block size, dtype, device and kernels), so both caches have the same blocks."""
        self.runner = runner
        config = runner.model_config
        if config.vocab_size > target.vocab_size:
            raise ValueError(
                f"draft model {model_dir}: vocabulary of {config.vocab_size} tokens, more "
                f"than the target's {target.vocab_size}; a draft must share the tokenizer"
            )
        self.model_dir = str(model_dir)
        self.vocab_size = config.vocab_size

    def copy(self, pairs: tuple[tuple[int, int], ...], to_host: bool) -> None:
        """The block copies the target makes, in the draft's caches."""
        r = self.runner
        if to_host:
            r._copy_blocks(pairs, r.device_kv_cache, r.host_kv_cache)
        else:
            r._copy_blocks(pairs, r.host_kv_cache, r.device_kv_cache)

    def run(
        self,
        so: SchedulerOutput,
        newest: Sequence[int | None],
        accepted: Sequence[int],
    ) -> tuple[tuple[int, ...], ...]:
        """Bring the draft's cache up to the step's output, then propose after each asking
        seq's newest token (``newest[i]``, sampled after ``accepted[i]`` drafts); a proposal
        tuple per seq (empty where none was asked).

        One pass takes every seq's tokens that stand (rejected drafts left out) and, for an
        asking seq, its newest token too, whose row gives the first proposal; the rest are
        decoded one token a pass."""
        r = self.runner
        chunks: list[_Step] = []
        asking: list[tuple[int, int, int]] = []  # (seq index, its newest token's row, position)
        num_rows = 0
        for i, (s, token) in enumerate(zip(so.seqs, newest, strict=True)):
            if s.hidden:
                continue
            kept = s.token_ids[: s.num_new_tokens - s.num_draft_tokens + accepted[i]]
            if s.num_proposals and token is not None:
                kept = (*kept, token)
                asking.append((i, num_rows + len(kept) - 1, s.start_pos + len(kept) - 1))
            chunks.append(_Step(kept, s.start_pos, s.block_table))
            num_rows += len(kept)
        out: list[tuple[int, ...]] = [()] * len(so.seqs)
        if not chunks:
            return tuple(out)
        with torch.inference_mode():
            batch = r._prepare(chunks, r.num_device_blocks)
            hidden = r.model(batch.input_ids, batch.positions, r.device_kv_cache, batch.meta)
            if not asking:
                return tuple(out)
            index = torch.tensor([row for _, row, _ in asking], device=hidden.device)
            first = _greedy(r.model.compute_logits(hidden.index_select(0, index)))
            starts = [
                (pos, so.seqs[i].block_table, so.seqs[i].num_proposals) for i, _, pos in asking
            ]
            proposals = self._more(starts, first)
        for (i, _, _), proposal in zip(asking, proposals, strict=True):
            out[i] = proposal
        return tuple(out)

    def _more(
        self, starts: list[tuple[int, tuple[int, ...], int]], first: list[int]
    ) -> list[tuple[int, ...]]:
        """Greedy decoding after each first proposal (``starts``: the newest token's position,
        the block table, the proposals wanted), all seqs together, one token a pass."""
        r = self.runner
        proposals = [[token] for token in first]
        for step in range(1, max(wanted for _, _, wanted in starts)):
            live = [j for j, (_, _, wanted) in enumerate(starts) if len(proposals[j]) < wanted]
            steps = [_Step((proposals[j][-1],), starts[j][0] + step, starts[j][1]) for j in live]
            batch = r._prepare(steps, r.num_device_blocks)
            hidden = r.model(batch.input_ids, batch.positions, r.device_kv_cache, batch.meta)
            for j, pick in zip(live, _greedy(r.model.compute_logits(hidden)), strict=True):
                proposals[j].append(pick)
        return [tuple(p) for p in proposals]


def _greedy(logits: torch.Tensor) -> list[int]:
    """Each row's most likely token (the draft proposes greedily)."""
    return logits.float().max(dim=-1).indices.tolist()
