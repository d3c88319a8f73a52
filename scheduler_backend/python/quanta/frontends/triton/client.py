"""Client side of the Triton frontend: HTTP generate endpoints and gRPC streaming.

HTTP goes through Triton's ``/generate`` and ``/generate_stream`` (SSE) endpoints with the
standard library, since ``tritonclient.http`` has no generate API; gRPC uses ``tritonclient``'s
bidirectional stream, the only gRPC way to talk to a decoupled model. Errors raise
``GenerateError`` carrying the server's message.
"""

from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np

from quanta.core.request import SamplingParams
from quanta.frontends.triton.inputs import BY_NAME, TYPES, request_inputs
from quanta.frontends.triton.tensors import OUTPUTS

_LIST_OUTPUTS = frozenset(name for name, _, dims in OUTPUTS if dims == [-1])


class GenerateError(RuntimeError):
    """The server refused or failed a request; the message is the server's."""


def http_events(
    url: str, model: str, inputs: dict[str, Any], *, stream: bool, timeout: float = 300.0
) -> Iterator[dict[str, Any]]:
    """POST to ``generate_stream`` (SSE) or ``generate``; yields each response's JSON."""
    endpoint = "generate_stream" if stream else "generate"
    req = urllib.request.Request(
        f"{_http_base(url)}/v2/models/{model}/{endpoint}",
        data=json.dumps(inputs).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            if not stream:
                yield _checked(json.loads(resp.read()))
                return
            final = False
            for raw in resp:
                line = raw.decode("utf-8").strip()
                if line.startswith("data:"):
                    event = _checked(json.loads(line[len("data:") :]))
                    final = "finish_reason" in event  # only the final response has one
                    yield event
            if not final:
                raise GenerateError("the stream ended before its final response")
    except urllib.error.HTTPError as exc:
        raise GenerateError(f"HTTP {exc.code}: {_error_text(exc.read())}") from None
    except urllib.error.URLError as exc:
        raise GenerateError(f"cannot reach {url}: {exc.reason}") from None


def grpc_events(
    url: str, model: str, inputs: dict[str, Any], *, timeout: float = 300.0
) -> Iterator[dict[str, Any]]:
    """One request over a gRPC bidirectional stream; yields each response as a dict.

    Closing the iterator early cancels the request on the server.
    """
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    responses: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(_grpc_target(url))
    finished = False
    try:
        batched = has_batch_dim(client.get_model_config(model, as_json=True))
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer(
            model,
            grpc_inputs(inputs, batch_dim=batched),
            request_id=uuid.uuid4().hex,
            enable_empty_final_response=True,
        )
        while not finished:
            try:
                result, error = responses.get(timeout=timeout)
            except queue.Empty:
                raise GenerateError(f"no response from {url} in {timeout:.0f}s") from None
            if error is not None:
                finished = True
                raise GenerateError(_grpc_error_text(error))
            params = result.get_response().parameters
            finished = params["triton_final_response"].bool_param
            event = grpc_outputs(result)
            if event or not finished:
                yield event
    except InferenceServerException as exc:
        raise GenerateError(_grpc_error_text(exc)) from None
    finally:
        client.stop_stream(cancel_requests=not finished)
        client.close()


def has_batch_dim(model_config: dict[str, Any]) -> bool:
    """Whether a model takes a batch dimension (the TensorRT-LLM layout): its config, as
    ``get_model_config(..., as_json=True)`` returns it, has a max_batch_size."""
    config = model_config.get("config", model_config)
    return int(config.get("max_batch_size", 0) or 0) > 0


def grpc_inputs(inputs: dict[str, Any], *, batch_dim: bool = False) -> list[Any]:
    """``InferInput`` tensors for ``inputs``, typed from the model's input spec; with
    ``batch_dim`` shaped ``[1, ...]`` for a model in the TensorRT-LLM layout."""
    import tritonclient.grpc as grpcclient

    tensors = []
    for name, value in inputs.items():
        spec = BY_NAME[name]
        dtype = TYPES[spec.dtype]
        values = value if spec.many else [value]
        if dtype.numpy is np.object_:
            array = np.array([str(v).encode() for v in values], dtype=np.object_)
        else:
            array = np.array(values, dtype=dtype.numpy)
        if batch_dim:
            array = array[None, ...]
        tensor = grpcclient.InferInput(name, list(array.shape), dtype.wire)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def grpc_outputs(result: Any) -> dict[str, Any]:
    """The output tensors of one gRPC response, shaped like the HTTP JSON (lists, str)."""
    event: dict[str, Any] = {}
    for out in result.get_response().outputs:
        array = result.as_numpy(out.name)
        if array is None:
            continue
        values = [v.decode("utf-8") if isinstance(v, bytes) else v.item() for v in array.ravel()]
        event[out.name] = values if out.name in _LIST_OUTPUTS else values[0]
    return event


def generate(
    url: str,
    prompt: str,
    params: SamplingParams,
    *,
    model: str = "quanta",
    use_grpc: bool = False,
    stream: bool = True,
) -> Iterator[str]:
    """Text pieces of one generation (one piece when not streaming)."""
    inputs = request_inputs(prompt, params, stream=stream)
    events = (
        grpc_events(url, model, inputs)
        if use_grpc
        else http_events(url, model, inputs, stream=stream)
    )
    for event in events:
        text = event.get("text_output", "")
        if text:
            yield text


def reset_prefix_cache(
    url: str, model: str = "quanta", *, use_grpc: bool = False, timeout: float = 60.0
) -> None:
    """Make ``model`` forget every cached prefix: one request with the control input
    ``reset_prefix_cache``, answered once the engine will take the reset before anything
    sent later. Raises ``GenerateError`` with the server's message."""
    inputs = {"reset_prefix_cache": True}
    events = (
        grpc_events(url, model, inputs, timeout=timeout)
        if use_grpc
        else http_events(url, model, inputs, stream=False, timeout=timeout)
    )
    for _ in events:
        pass


def output_ids(event: dict[str, Any]) -> list[int]:
    """``output_ids`` of one response as a list (HTTP JSON unwraps a single element)."""
    return output_list(event, "output_ids")


def output_list(event: dict[str, Any], name: str) -> list[Any]:
    """A list-shaped output of one response (HTTP JSON unwraps a single element)."""
    values = event.get(name, [])
    return list(values) if isinstance(values, list) else [values]


def _checked(event: dict[str, Any]) -> dict[str, Any]:
    if "error" in event:
        raise GenerateError(str(event["error"]))
    return event


def _error_text(body: bytes) -> str:
    try:
        return str(json.loads(body).get("error", body.decode(errors="replace")))
    except (ValueError, AttributeError):
        return body.decode(errors="replace")


def _grpc_error_text(error: Any) -> str:
    message = error.message() if hasattr(error, "message") else str(error)
    status = error.status() if hasattr(error, "status") else None
    return f"{status}: {message}" if status else str(message)


def _http_base(url: str) -> str:
    return url.rstrip("/") if "://" in url else f"http://{url.rstrip('/')}"


def _grpc_target(url: str) -> str:
    return url.split("://", 1)[1] if "://" in url else url
