"""Async gRPC streaming to Triton: one bidirectional stream per request, cancellable.

Why one stream per request: cancelling a gRPC call is how a client tells Triton to cancel the
requests on it (the backend then sees ``is_cancelled()`` and aborts, freeing the KV blocks), so a
stream of its own makes "this client went away" cancel exactly its request. The streams share
one channel (HTTP/2 multiplexes them). ``tritonclient.grpc.aio`` does the framing; its request
iterator yields the one request and ends, which half-closes the stream while Triton goes on
sending responses until the final one.

Used by the OpenAI gateway and by ``quanta bench serve``'s gRPC transport.

Where ``quanta serve`` supervises the Triton server in this process, its state
(``quanta.frontends.triton.supervisor_state``) is read first: while the server is down or
restarting, a request fails at once as unavailable with the seconds until it is expected
back, readiness is false, and after each restart the channel is opened afresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

from quanta.frontends.triton.client import grpc_inputs, grpc_outputs, has_batch_dim
from quanta.frontends.triton.supervisor_state import DEFAULT_RETRY_S, state_for


class UpstreamError(RuntimeError):
    """Triton answered with an error, or could not be reached (``unavailable``); then
    ``retry_after`` says in how many seconds it is worth trying again."""

    def __init__(
        self, message: str, *, unavailable: bool = False, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.unavailable = unavailable
        if retry_after is None and unavailable:
            retry_after = DEFAULT_RETRY_S
        self.retry_after = retry_after


class TritonGrpc:
    """A gRPC channel to one Triton server; create and use it inside one event loop."""

    def __init__(self, url: str, *, timeout_s: float | None = None) -> None:
        self.url = url.split("://", 1)[1] if "://" in url else url
        self.timeout_s = timeout_s
        self._client: Any = None
        self._batch_dims: dict[str, bool] = {}
        self._restarts = 0  # the supervisor's restart count when the channel was opened
        self._closing: set[asyncio.Task[Any]] = set()  # old channels being closed

    @property
    def client(self) -> Any:
        # NOTE: created on first use, so the channel binds to the loop that runs the requests.
        state = state_for(self.url)
        if state is not None and state.restarts != self._restarts and state.available:
            # Why: a channel that saw the server die backs its reconnects off for seconds,
            # so it would refuse requests for a while after the server is back.
            self._restarts = state.restarts
            self._drop_client()
        if self._client is None:
            import tritonclient.grpc.aio as grpcaio

            self._client = grpcaio.InferenceServerClient(self.url)
        return self._client

    def unavailable(self) -> UpstreamError | None:
        """The error for a request sent now, when the supervisor knows the server cannot
        take it (down, restarting or given up); None when it may."""
        state = state_for(self.url)
        if state is None or state.available:
            return None
        return UpstreamError(
            f"{state.describe()}; retry later", unavailable=True, retry_after=state.retry_after()
        )

    def _drop_client(self) -> None:
        old, self._client = self._client, None
        if old is not None:
            with contextlib.suppress(RuntimeError):  # no running loop: left to the collector
                task = asyncio.get_running_loop().create_task(old.close())
                self._closing.add(task)  # NOTE: held, or the task may be collected unfinished
                task.add_done_callback(self._closing.discard)

    def stream(
        self, model: str, inputs: dict[str, Any], *, request_id: str | None = None
    ) -> GenerationStream:
        """The responses of one request; nothing is sent until it is first iterated."""
        return GenerationStream(self, model, inputs, request_id or uuid.uuid4().hex)

    async def batch_dim(self, model: str) -> bool:
        """Whether ``model`` takes a batch dimension (asked once; False when it cannot be
        asked, so the request itself reports what is wrong)."""
        if model not in self._batch_dims:
            try:
                config = await self.client.get_model_config(model, as_json=True)
            except Exception:
                return False
            self._batch_dims[model] = has_batch_dim(config)
        return self._batch_dims[model]

    async def is_model_ready(self, model: str) -> bool:
        if self.unavailable() is not None:
            return False
        try:
            return bool(await self.client.is_model_ready(model))
        except Exception:
            return False

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None


class GenerationStream:
    """Iterates one request's responses as dicts (``grpc_outputs``); ends after the final one.

    ``cancel()`` (or ``aclose()``, or cancelling the task that iterates) cancels the gRPC call,
    which cancels the request in Triton. Errors raise ``UpstreamError``.
    """

    def __init__(self, upstream: TritonGrpc, model: str, inputs: dict[str, Any], rid: str) -> None:
        self._upstream = upstream
        self._model = model
        self._inputs = inputs
        self.request_id = rid
        self._responses: Any = None
        self.done = False

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        import grpc

        if self.done:
            raise StopAsyncIteration
        if self._responses is None:
            down = self._upstream.unavailable()
            if down is not None:
                self.done = True
                raise down
            batched = await self._upstream.batch_dim(self._model)
            self._responses = self._upstream.client.stream_infer(
                self._requests(batched), stream_timeout=self._upstream.timeout_s
            )
        try:
            result, error = await self._responses.__anext__()
        except StopAsyncIteration:
            self.done = True
            raise UpstreamError("Triton closed the stream before the final response") from None
        except grpc.aio.AioRpcError as exc:
            self.done = True
            unavailable = exc.code() in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.CANCELLED,
            )
            message = f"Triton gRPC {exc.code().name} at {self._upstream.url}: {exc.details()}"
            state = state_for(self._upstream.url)  # it may know by now that the server died
            retry = None if state is None else state.retry_after()
            raise UpstreamError(message, unavailable=unavailable, retry_after=retry) from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self.done and not (task is not None and task.cancelling()):
                # cancel() ended the call under us: the request is over, this task is not
                raise UpstreamError("the request was cancelled", unavailable=True) from None
            self.cancel()  # the consumer gave up, so must Triton
            raise
        if error is not None:
            self.done = True
            raise UpstreamError(str(error.message()))
        params = result.get_response().parameters
        event = grpc_outputs(result)
        if "triton_final_response" in params:
            self.done = params["triton_final_response"].bool_param
        else:
            self.done = "finish_reason" in event
        return event

    def cancel(self) -> None:
        """Cancel the request in Triton (idempotent; a no-op once the final response came)."""
        if self._responses is not None and not self.done:
            self._responses.cancel()
        self.done = True

    async def aclose(self) -> None:
        self.cancel()

    async def _requests(self, batch_dim: bool) -> AsyncIterator[dict[str, Any]]:
        yield {
            "model_name": self._model,
            "inputs": grpc_inputs(self._inputs, batch_dim=batch_dim),
            "request_id": self.request_id,
        }
