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

import torch

from quanta.core.output import ScheduledSeq, SchedulerOutput
from quanta.runner.models.config import ModelConfig


class _Step:
    """One decode token of a proposal (a ``PagedSeq``)."""

    __slots__ = ("block_table", "hidden", "start_pos", "token_ids")

    def __init__(self, token: int, position: int, block_table: tuple[int, ...]) -> None:
        self.token_ids = (token,)
        self.start_pos = position
        self.block_table = block_table
        self.hidden = False


class DraftModel:
    """The draft's weights and caches, driven by the target's runner each step."""

    def __init__(self, model_dir: str | Path, target: ModelConfig, **runner_args: object) -> None:
        """``runner_args`` are the target runner's (blocks, block size, dtype, device,
        kernels), so both caches have the same blocks."""
        from quanta.runner.model_runner import ModelRunner

        self.runner = ModelRunner(model_dir, **runner_args)  # type: ignore[arg-type]
        config = self.runner.model_config
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
        """Compute the step's K/V in the draft's cache, then propose after each asking seq's
        newest token (``newest[i]``, sampled after ``accepted[i]`` drafts); a proposal tuple
        per seq (empty where none was asked)."""
        r = self.runner
        seqs = [s for s in so.seqs if not s.hidden]
        with torch.inference_mode():
            if seqs:
                batch = r._prepare(seqs, r.num_device_blocks)
                r.model(batch.input_ids, batch.positions, r.device_kv_cache, batch.meta)
            asking = [
                (i, s, token)
                for i, (s, token) in enumerate(zip(so.seqs, newest, strict=True))
                if s.num_proposals and token is not None and not s.hidden
            ]
            out: list[tuple[int, ...]] = [()] * len(so.seqs)
            if asking:
                for i, proposal in zip(
                    (i for i, _, _ in asking), self._propose(asking, accepted), strict=True
                ):
                    out[i] = proposal
        return tuple(out)

    def _propose(
        self, asking: list[tuple[int, ScheduledSeq, int]], accepted: Sequence[int]
    ) -> list[tuple[int, ...]]:
        """Greedy decoding of every asking seq together, ``num_proposals`` tokens each."""
        r = self.runner
        tokens = [token for _, _, token in asking]
        # the newest token's position: after the real token and the accepted drafts
        positions = [
            s.start_pos + s.num_new_tokens - s.num_draft_tokens + accepted[i] for i, s, _ in asking
        ]
        wanted = [s.num_proposals for _, s, _ in asking]
        proposals: list[list[int]] = [[] for _ in asking]
        for step in range(max(wanted)):
            live = [j for j in range(len(asking)) if len(proposals[j]) < wanted[j]]
            steps = [_Step(tokens[j], positions[j] + step, asking[j][1].block_table) for j in live]
            batch = r._prepare(steps, r.num_device_blocks)
            hidden = r.model(batch.input_ids, batch.positions, r.device_kv_cache, batch.meta)
            logits = r.model.compute_logits(hidden)
            picks = logits.float().max(dim=-1).indices.tolist()
            for j, pick in zip(live, picks, strict=True):
                proposals[j].append(pick)
                tokens[j] = pick
        return [tuple(p) for p in proposals]
