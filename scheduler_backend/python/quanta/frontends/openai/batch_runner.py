"""Runs batch lines through the gateway as offline requests, a bounded number at a time.

Each line goes through ``Gateway.answer`` — the validation and Triton forwarding of the
``/v1/completions`` and ``/v1/chat/completions`` routes — with ``priority_class`` forced to
``offline``, so the scheduler fills spare capacity with it and online traffic keeps its SLOs.
One semaphore bounds the lines in flight over all batches: a batch of thousands opens a few
dozen streams, not thousands.

Why a line is retried rather than failed on a 503 or a 429: Triton unreachable, a model being
unloaded or drained, or a policy throttling offline work are states of the server, not faults
of the request; the line waits (exponential backoff) until Triton takes it, so a Triton
restart costs the batch time, never lines. Any other error is the line's own and goes to the
error file, as OpenAI's Batch API reports it.

Resuming: the store keeps every line's state, so after a restart ``resume`` picks up each
unfinished batch and runs only its pending lines; a committed line never runs again. Shutting
down cancels the lines in flight without committing them, which leaves them pending.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from quanta.frontends.openai.batch_store import ACTIVE, BatchStore, PendingLine, Status
from quanta.frontends.openai.errors import OpenAIError

log = logging.getLogger(__name__)

Answer = Callable[..., Awaitable[dict[str, Any]]]
"""``(endpoint, body[, owner]) -> response body``; raises ``OpenAIError`` as the route would.
``owner`` (given when the batch has one) is the tenant of the key that created the batch, which
its lines run as."""

RETRIED = frozenset({429, 503})  # the server's state, not the request's fault
EXPIRED = {
    "code": "batch_expired",
    "message": "This request could not be executed before the completion window expired.",
}


@dataclass(frozen=True, slots=True)
class Backoff:
    """Waits between tries of a line the server could not take."""

    initial_s: float = 0.5
    max_s: float = 30.0
    factor: float = 2.0


def output_line(line: PendingLine, status: int, request_id: str, body: dict[str, Any]) -> Any:
    """One line of an output or error file, in OpenAI's shape."""
    return {
        "id": f"batch_req_{uuid.uuid4().hex[:24]}",
        "custom_id": line.custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": None,
    }


class BatchRunner:
    """Runs batches of one ``BatchStore``; every method is called on the gateway's loop."""

    def __init__(
        self,
        store: BatchStore,
        answer: Answer,
        *,
        concurrency: int,
        backoff: Backoff | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self._answer = answer
        self._slots = asyncio.Semaphore(concurrency)
        self._backoff = backoff or Backoff()
        self._clock = clock
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._cancelling: set[str] = set()
        self._outage = False  # lines wait for the server to come back

    async def resume(self) -> list[str]:
        """Start every batch an earlier run left unfinished; their ids."""
        ids = await asyncio.to_thread(self.store.active_batches)
        for batch_id in ids:
            log.info("resuming batch %s", batch_id)
            self.start(batch_id)
        return ids

    def start(self, batch_id: str) -> None:
        """Run the batch's pending lines in the background, then finalize it."""
        if batch_id not in self._tasks:
            task = asyncio.create_task(self._run(batch_id), name=f"quanta-{batch_id}")
            self._tasks[batch_id] = task
            task.add_done_callback(lambda _: self._tasks.pop(batch_id, None))

    async def cancel(self, batch_id: str) -> bool:
        """Stop dispatching and cancel the lines in flight; False if the batch was not
        running. The batch is ``cancelling`` until its files are written, then ``cancelled``."""
        moved = await asyncio.to_thread(
            self.store.set_status, batch_id, "cancelling", only_from=("validating", "in_progress")
        )
        if moved:
            self._cancelling.add(batch_id)
            task = self._tasks.get(batch_id)
            if task is None:  # not running here (yet): finalize now
                self.start(batch_id)
            else:
                task.cancel()
        return moved

    async def close(self) -> None:
        """Stop every batch, leaving the lines in flight pending for the next start."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- one batch -----------------------------------------------------------------------------
    async def _run(self, batch_id: str) -> None:
        try:
            outcome = await self._outcome(batch_id)
        except asyncio.CancelledError:
            if batch_id not in self._cancelling:
                raise  # shutting down: the batch resumes at the next start
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            outcome = "cancelled"
        self._cancelling.discard(batch_id)
        if outcome is None:
            return
        if outcome == "completed":
            await asyncio.to_thread(
                self.store.set_status, batch_id, "finalizing", only_from=("in_progress",)
            )
        unfinished = EXPIRED if outcome == "expired" else None
        await asyncio.to_thread(self.store.finalize, batch_id, outcome, unfinished)
        log.info("batch %s %s", batch_id, outcome)

    async def _outcome(self, batch_id: str) -> Status | None:
        """Run the batch's pending lines; how it ends (None: it had already ended)."""
        batch = await asyncio.to_thread(self.store.batch, batch_id)
        if batch is None or batch["status"] not in ACTIVE:
            return None
        if batch["status"] == "cancelling":
            return "cancelled"
        lines = await asyncio.to_thread(self.store.pending_lines, batch_id)
        owner = await asyncio.to_thread(self.store.batch_owner, batch_id)
        if lines:
            try:
                async with asyncio.timeout(max(batch["expires_at"] - self._clock(), 0.0)):
                    await self._dispatch(batch_id, batch["endpoint"], lines, owner)
            except TimeoutError:
                return "expired"
        return "completed"

    async def _dispatch(
        self, batch_id: str, endpoint: str, lines: list[PendingLine], owner: str | None = None
    ) -> None:
        """Every line, in input order, at most ``concurrency`` at once over all batches;
        returns when all are committed. Cancelled: the lines in flight are too."""
        in_flight: set[asyncio.Task[None]] = set()
        try:
            for line in lines:
                await self._slots.acquire()
                task = asyncio.create_task(self._line(batch_id, endpoint, line, owner))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
            while in_flight:
                await asyncio.wait(set(in_flight))
        finally:
            for task in in_flight:
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)

    async def _line(
        self, batch_id: str, endpoint: str, line: PendingLine, owner: str | None = None
    ) -> None:
        """Answer one line and commit it (the slot it holds is released at the end)."""
        try:
            ok, result = await self._result(endpoint, line, owner)
            commit = asyncio.ensure_future(
                asyncio.to_thread(self.store.finish_line, batch_id, line.index, ok, result)
            )
            try:
                await asyncio.shield(commit)
            except asyncio.CancelledError:
                await commit  # NOTE: a result is in the store before its batch is finalized
                raise
        finally:
            self._slots.release()

    async def _result(
        self, endpoint: str, line: PendingLine, owner: str | None = None
    ) -> tuple[bool, dict[str, Any]]:
        """The line's output line, and whether it succeeded; waits out server outages."""
        body = {**line.body, "priority_class": "offline"}
        extra = () if owner is None else (owner,)
        delay = self._backoff.initial_s
        while True:
            try:
                response = await self._answer(endpoint, body, *extra)
            except OpenAIError as exc:
                if exc.status not in RETRIED:
                    return False, output_line(line, exc.status, _request_id(), exc.body())
                if not self._outage:
                    self._outage = True
                    log.warning(
                        "batch lines wait for the server (%d: %s); retrying with backoff",
                        exc.status,
                        exc.message,
                    )
                await asyncio.sleep(max(delay, exc.retry_after or 0.0))
                delay = min(delay * self._backoff.factor, self._backoff.max_s)
                continue
            except Exception as exc:  # a gateway bug fails the line, not the batch
                log.exception("batch line %s failed", line.custom_id)
                error = OpenAIError(500, f"internal error: {exc}")
                return False, output_line(line, 500, _request_id(), error.body())
            if self._outage:
                self._outage = False
                log.warning("the server takes batch lines again")
            return True, output_line(line, 200, str(response.get("id", _request_id())), response)


def _request_id() -> str:
    return f"req_{uuid.uuid4().hex[:24]}"
