"""A torch-free runner whose next token depends on the KV it reads through block tables.

Its "KV cache" stores the token id computed at each slot; sampling hashes the context it
reads back, so any bookkeeping bug (a wrong block table, a lost swap copy, a stale block)
changes the output. That makes preemption-invariance tests meaningful without a model.
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from collections import Counter

from quanta.core.output import RunnerCapabilities, RunnerOutput, ScheduledSeq, SchedulerOutput
from quanta.core.overlap import PLACEHOLDER, StepHandle, StepNotRun, fill, sampled_ids
from quanta.core.safepoint import StepAborted


class HashRunner:
    capabilities = RunnerCapabilities()

    def __init__(
        self,
        num_device_blocks: int,
        num_host_blocks: int,
        block_size: int,
        vocab: int = 50,
        fail_on: set[str] | None = None,
        keep_sources: bool = False,
    ) -> None:
        self.block_size = block_size
        # NOTE: a copy's source is wiped, so a stale read shows, unless the prefix cache may
        # read it again (a freed named block stays valid where it is)
        self.keep_sources = keep_sources
        self.vocab = vocab
        self.device = [[-1] * block_size for _ in range(num_device_blocks)]
        self.host = [[-1] * block_size for _ in range(num_host_blocks)]
        self.fail_on = fail_on or set()
        self.steps: list[SchedulerOutput] = []

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        assert not any(PLACEHOLDER in s.token_ids for s in so.seqs), "a placeholder ran"
        self.steps.append(so)
        if self.fail_on & {s.request_id for s in so.seqs}:
            raise RuntimeError("injected failure")
        for d, h in so.swap_out:
            self.host[h] = list(self.device[d])
        for d, _ in so.swap_out:
            if not self.keep_sources:
                self.device[d] = [-1] * self.block_size  # a stale read would now show
        for h, d in so.swap_in:
            self.device[d] = list(self.host[h])
        for h, _ in so.swap_in:
            if not self.keep_sources:
                self.host[h] = [-1] * self.block_size
        sampled: list[int | None] = []
        accepted: list[int] = []
        proposals: dict[int, tuple[int, ...]] = {}
        for s in so.seqs:
            for i, tok in enumerate(s.token_ids):
                pos = s.start_pos + i
                self.device[s.block_table[pos // self.block_size]][pos % self.block_size] = tok
            if not s.sample:
                sampled.append(None)
                accepted.append(0)
                continue
            ctx = [
                self.device[s.block_table[p // self.block_size]][p % self.block_size]
                for p in range(s.context_len)
            ]
            assert -1 not in ctx, f"{s.request_id} read an unwritten slot"
            # NOTE: drafts verify as a model would: row i's token is what the context up to
            # it hashes to, and drafts count while they equal it
            k = s.num_draft_tokens
            drafts = s.token_ids[len(s.token_ids) - k :] if k else ()
            n = 0
            token = self._next(ctx[: s.context_len - k], s)
            while n < k and drafts[n] == token:
                n += 1
                token = self._next(ctx[: s.context_len - k + n], s)
            accepted.append(n)
            sampled.append(token)
            if s.num_proposals:
                proposals[len(sampled) - 1] = self._propose(ctx[: s.context_len - k + n], token, s)
        if so.abort is not None and so.abort.is_set():
            # NOTE: after the step's slots were written, as a real layer loop stopped half-way
            # leaves them: a later step must overwrite them, and no checkpoint copy is made
            raise StepAborted(layer=1)
        for d, h in so.checkpoint:
            self.host[h] = list(self.device[d])
        return RunnerOutput(
            tuple(s.request_id for s in so.seqs),
            tuple(sampled),
            num_accepted=tuple(accepted) if any(accepted) else (),
            proposals=tuple(proposals.get(i, ()) for i in range(len(sampled))) if proposals else (),
        )

    def _propose(self, ctx: list[int], token: int, s: ScheduledSeq) -> tuple[int, ...]:
        """A draft model's proposals after ``token``: what the context will hash to, with
        every proposal whose hash is odd off by one, so drafts are partly right. The slots a
        draft model writes them through must be in the block table."""
        position = len(ctx)  # the newest token's
        assert len(s.block_table) * self.block_size >= position + s.num_proposals, (
            f"{s.request_id}: no lookahead slots for {s.num_proposals} proposals"
        )
        ctx = [*ctx, token]
        out: list[int] = []
        for _ in range(s.num_proposals):
            right = self._next(ctx, s)
            guess = right if right % 2 == 0 or len(out) == 0 else (right + 1) % self.vocab
            out.append(guess)
            ctx.append(guess)
        return tuple(out)

    def _next(self, ctx: list[int], s: ScheduledSeq) -> int:
        """The token that follows ``ctx``: a hash of everything read."""
        digest = hashlib.sha256(repr((ctx, s.seed if s.temperature else 0)).encode())
        return int.from_bytes(digest.digest()[:4], "little") % self.vocab


class SafepointHashRunner(HashRunner):
    """A ``HashRunner`` that offers layer safepoints; ``during_step`` runs inside each step
    (before its safepoint), as a request arriving mid-step would."""

    capabilities = RunnerCapabilities(layer_safepoints=True)

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.during_step: list = []  # callables taking the SchedulerOutput; each runs once

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        if self.during_step and so.seqs:
            self.during_step.pop(0)(so)
        return super().execute(so)


class DeviceHashRunner(HashRunner):
    """A ``HashRunner`` behind a simulated device: ``launch`` queues a step on the device's
    own thread, where it takes ``step_seconds``; its sampled ids stay there (the next step's
    placeholders are filled from them on the device) and reach the host only through the
    step's ``result()``, once the step has ended. So a loop that needed a token before the
    step that samples it ended would block (or, reading a placeholder, fail the hash).

    ``num_launched_busy`` counts steps launched while an earlier one had not ended (the
    overlap happened); ``placeholder_rows`` each request's rows launched with a token the
    host did not know yet."""

    def __init__(self, *args: object, step_seconds: float = 0.002, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.step_seconds = step_seconds
        self.num_launched_busy = 0
        self.placeholder_rows: Counter[str] = Counter()
        self._unfinished = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue[_DeviceStep] = queue.Queue()
        threading.Thread(target=self._run, name="fake-device", daemon=True).start()

    def launch(self, so: SchedulerOutput, previous: StepHandle | None) -> StepHandle:
        self.placeholder_rows.update(s.request_id for s in so.seqs if PLACEHOLDER in s.token_ids)
        with self._lock:
            self.num_launched_busy += self._unfinished > 0
            self._unfinished += 1
        step = _DeviceStep(so, previous)
        self._queue.put(step)
        return step

    def _run(self) -> None:
        while True:
            step = self._queue.get()
            time.sleep(self.step_seconds)
            try:
                so = step.so
                if step.previous is not None:
                    prev = step.previous
                    if not isinstance(prev, _DeviceStep) or prev.error is not None:
                        raise StepNotRun("the step before this one failed")
                    so = fill(so, prev.device_ids)
                out = self.execute(so)
                step.device_ids = sampled_ids(out)
                step.out = out
            except BaseException as exc:
                step.error = exc
            with self._lock:
                self._unfinished -= 1
            step.ended.set()


class _DeviceStep:
    """A step on the simulated device: its output is the host's only after it ends."""

    def __init__(self, so: SchedulerOutput, previous: StepHandle | None) -> None:
        self.so, self.previous = so, previous
        self.ended = threading.Event()
        self.device_ids: dict[str, int] = {}  # read only on the device
        self.out: RunnerOutput | None = None
        self.error: BaseException | None = None

    def result(self) -> RunnerOutput:
        self.ended.wait()
        if self.error is not None:
            raise self.error
        assert self.out is not None
        return self.out


def decode_chars(ids: list[int] | tuple[int, ...]) -> str:
    """A toy tokenizer: id i is the character chr(ord('a') + i % 26)."""
    return "".join(chr(ord("a") + i % 26) for i in ids)
