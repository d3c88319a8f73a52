"""The bad-input battery: every malformed, out-of-range or hostile input a real client might
send, against a running ``quanta serve``, over each of its interfaces.

Why a battery and not unit tests: each frontend validates its own way (pydantic on the gateway,
Triton's parsers before Quanta sees a tensor, the backend's checks after), and what matters to
an operator is what a client gets back at the edge: a 4xx that names the field, or a 500, a
hang, a dead server. Each case runs with a timeout; its answer is classified as 2xx (noted
when the input was bad: accepted silently), 4xx, 5xx, hang (no answer in time), crash (the
server stopped answering a health probe right after; the battery waits for it to come back
and counts the recovery) or error (the connection failed without a status). After every case
one small valid request through the same interface checks that the server still answers;
a failed check is a lost request.

    python bench/trust/battery.py --gateway-url http://127.0.0.1:9000 \\
        --triton-url http://127.0.0.1:8000 --grpc-url 127.0.0.1:8001 --out battery.json

Only the standard library, aiohttp, numpy and tritonclient are used, so it runs against any
``quanta serve`` (or any OpenAI/Triton server on the loopback) without importing Quanta.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import queue
import re
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import numpy as np

INTERFACES = ("gateway", "triton-http", "triton-grpc")
CLASSES = ("2xx", "4xx", "5xx", "hang", "crash", "error")
MAX_BODY_MB = 25.0  # the largest body the battery will ever send

# gRPC status -> HTTP status (grpc-gateway's mapping), so every interface shares one table.
GRPC_STATUS = {
    "OK": 200,
    "CANCELLED": 499,
    "UNKNOWN": 500,
    "INVALID_ARGUMENT": 400,
    "DEADLINE_EXCEEDED": 504,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "PERMISSION_DENIED": 403,
    "UNAUTHENTICATED": 401,
    "RESOURCE_EXHAUSTED": 429,
    "FAILED_PRECONDITION": 400,
    "ABORTED": 409,
    "OUT_OF_RANGE": 400,
    "UNIMPLEMENTED": 501,
    "INTERNAL": 500,
    "UNAVAILABLE": 503,
    "DATA_LOSS": 500,
}
# An error delivered inside a stream has no status: Quanta's backend tags its messages
# ("[invalid_argument] ..."); these tags are server-side failures, every other tag a refusal.
SERVER_TAGS = {"internal", "cancelled", "shutting_down", "unknown", "data_loss"}
# Phrases of Triton's own untagged messages that refuse the client's input.
CLIENT_PHRASES = (
    "unknown model",
    "not found",
    "unable to parse",
    "unexpected shape",
    "unexpected datatype",
    "unexpected inference input",
    "unexpected inference output",
    "expected",
    "expects",
    "invalid",
    "must be",
    "not supported",
    "not allowed",
    "failed to parse",
)


# -- outcomes ------------------------------------------------------------------------------------
@dataclass
class Outcome:
    """What one request got back."""

    klass: str  # one of CLASSES
    status: int | None = None  # HTTP status (gRPC: mapped); None without one
    detail: str = ""  # the start of the body or the error message
    in_stream: bool = False  # an error reported inside a 200 stream
    body: str = ""  # the whole body, for the checks


@dataclass
class Result:
    """One case, run: its outcome and what the checks after it found."""

    name: str
    interface: str
    field: str
    expect: str  # refuse | accept | any
    klass: str = "not run"
    status: int | None = None
    detail: str = ""
    in_stream: bool = False
    seconds: float = 0.0
    crash: bool = False
    recovery_s: float | None = None
    check_ok: bool | None = None
    check_detail: str = ""

    @property
    def accepted_silently(self) -> bool:
        return self.expect == "refuse" and self.klass == "2xx"

    @property
    def refused_valid(self) -> bool:
        return self.expect == "accept" and self.klass == "4xx"

    @property
    def problem(self) -> bool:
        return self.klass in ("5xx", "hang", "crash", "error") or self.accepted_silently


def http_class(status: int | None) -> str:
    if status is None:
        return "error"
    if 200 <= status < 300:
        return "2xx"
    if 400 <= status < 500:
        return "4xx"
    if status >= 500:
        return "5xx"
    return "error"  # 1xx/3xx: no answer a client can use


def message_class(message: str) -> str:
    """4xx or 5xx for an error message that came without a status (inside a stream)."""
    tag = re.match(r"\s*\[([a-z_]+)\]", message)
    if tag:
        return "5xx" if tag.group(1) in SERVER_TAGS else "4xx"
    low = message.lower()
    return "4xx" if any(phrase in low for phrase in CLIENT_PHRASES) else "5xx"


def stream_error(body: str) -> str | None:
    """The first error event of an SSE body (OpenAI's ``{"error": {...}}`` or Triton's
    ``{"error": "..."}``), as text; None when there is none."""
    for line in body.splitlines():
        if not line.startswith("data:"):
            continue
        try:
            event = json.loads(line[5:])
        except ValueError:
            continue
        if isinstance(event, dict) and "error" in event:
            return json.dumps(event["error"])[:300]
    return None


def stream_error_class(error: str) -> str:
    try:
        parsed = json.loads(error)
    except ValueError:
        parsed = error
    if isinstance(parsed, dict):  # OpenAI's error object
        if parsed.get("type") == "server_error" or str(parsed.get("code", "")).startswith("5"):
            return "5xx"
        return message_class(str(parsed.get("message", "")))
    return message_class(str(parsed))


# -- the server under test -----------------------------------------------------------------------
@dataclass
class Target:
    """Where the server is and what it serves; filled in by ``discover``."""

    gateway: str | None  # base URL without /v1
    triton: str | None  # Triton HTTP base URL
    grpc: str | None  # host:port
    api_key: str | None
    model: str = "quanta"  # the gateway's model name
    triton_model: str = "quanta"
    batch_dim: bool = False  # the tensorrt_llm layout: every tensor has a batch dimension
    valid_file_id: str | None = None  # an uploaded batch input file, for the batch cases
    timeout: float = 30.0
    max_body: int = 5 << 20
    session: aiohttp.ClientSession | None = None

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def _base(url: str | None, strip: str = "") -> str | None:
    if not url:
        return None
    url = url.rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    return url.removesuffix(strip) if strip else url


def _grpc_target(url: str | None) -> str | None:
    if not url:
        return None
    return url.split("://", 1)[1].rstrip("/") if "://" in url else url.rstrip("/")


# -- HTTP requests ------------------------------------------------------------------------------
async def http(
    t: Target,
    method: str,
    url: str,
    *,
    body: Any = None,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
    content_type: str | None = "application/json",
    auth: bool = True,
    cancel_after_first: bool = False,
    form: aiohttp.FormData | None = None,
    skip_headers: tuple[str, ...] = (),
) -> Outcome:
    """One HTTP request; a 2xx stream is read to its end (or its first chunk, when
    ``cancel_after_first``) and an error event inside it counts as a refusal."""
    assert t.session is not None
    sent = dict(t.auth()) if auth else {}
    data: Any = form
    if form is None:
        if raw is not None:
            data = raw
        elif body is not None:
            data = json.dumps(body).encode()
        if data is not None and content_type is not None:
            sent["Content-Type"] = content_type
    sent.update(headers or {})
    skip = set(skip_headers)
    if form is None and content_type is None:
        skip.add("Content-Type")
    async with t.session.request(
        method, url, data=data, headers=sent, skip_auto_headers=skip or None
    ) as resp:
        if cancel_after_first and resp.status < 300:
            first = await resp.content.readany()
            resp.close()  # the client goes away mid-stream
            return Outcome("2xx", resp.status, first[:200].decode(errors="replace"))
        text = (await resp.read()).decode(errors="replace")
    outcome = Outcome(http_class(resp.status), resp.status, text[:300], body=text)
    if outcome.klass == "2xx" and (error := stream_error(text)):
        outcome = Outcome(stream_error_class(error), resp.status, error, in_stream=True)
    return outcome


async def raw_http(t: Target, url: str, request: bytes) -> Outcome:
    """Bytes written straight to the socket: the requests an HTTP client will not make."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 80)
    answer = b""
    try:
        writer.write(request)
        await writer.drain()
        while len(answer) < 4096 and (chunk := await reader.read(4096)):
            answer += chunk  # NOTE: the request says Connection: close, so this ends
    except ConnectionError:
        pass  # a server may reset the connection after its answer
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    match = re.match(rb"HTTP/\d\.\d (\d{3})", head)
    status = int(match.group(1)) if match else None
    text = (body or head)[:300].decode(errors="replace")
    return Outcome(http_class(status), status, text or "connection closed without an answer")


# -- gRPC requests ------------------------------------------------------------------------------
def run_in_thread(fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
    """``fn(*args)`` on a daemon thread: a gRPC call stuck past its deadline must not keep
    the battery from exiting (an executor's threads are joined at exit)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def target() -> None:
        try:
            value = fn(*args)
        except BaseException as exc:  # handed to the awaiting task, whatever it is
            loop.call_soon_threadsafe(_settle, future, None, exc)
        else:
            loop.call_soon_threadsafe(_settle, future, value, None)

    threading.Thread(target=target, daemon=True).start()
    return future


def _settle(future: asyncio.Future[Any], value: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(value)


Tensor = tuple[str, Any, str]  # (name, values, Triton datatype)


def grpc_tensors(t: Target, tensors: list[Tensor]) -> list[Any]:
    import tritonclient.grpc as grpcclient

    made = []
    for name, values, dtype in tensors:
        if dtype == "BYTES":
            items = [v if isinstance(v, bytes) else str(v).encode() for v in values]
            array = np.array(items, dtype=np.object_)
        else:
            numpy_type = {
                "INT32": np.int32,
                "INT64": np.int64,
                "UINT64": np.uint64,
                "FP32": np.float32,
                "FP64": np.float64,
                "BOOL": np.bool_,
            }[dtype]
            array = np.array(values, dtype=numpy_type)
        if t.batch_dim:
            array = array[None, ...]
        tensor = grpcclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        made.append(tensor)
    return made


def prompt_tensors(text: str | bytes = "Hi", max_tokens: int = 4) -> list[Tensor]:
    return [("text_input", [text], "BYTES"), ("max_tokens", [max_tokens], "INT32")]


def grpc_outcome(exc: Any) -> Outcome:
    status = exc.status() if hasattr(exc, "status") else None
    message = exc.message() if hasattr(exc, "message") else str(exc)
    message = str(message)[:300]
    if status:
        code = str(status).rsplit(".", 1)[-1]
        mapped = GRPC_STATUS.get(code, 500)
        if code == "UNAVAILABLE" and "restricted" in message:
            mapped = 403  # NOTE: Triton's code for a restricted protocol called without its key
        if code == "DEADLINE_EXCEEDED":
            return Outcome("hang", mapped, f"{code}: {message}")
        return Outcome(http_class(mapped), mapped, f"{code}: {message}")
    return Outcome(message_class(message), None, message, in_stream=True)


def grpc_stream(
    t: Target,
    tensors: list[Tensor] | Callable[[], list[Any]],
    *,
    model: str | None = None,
    cancel_after_first: bool = False,
    outputs: list[str] | None = None,
    request_id: str | None = None,
) -> Outcome:
    """One request on a bidirectional stream (the only gRPC way to a decoupled model)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(t.grpc)
    final = False
    try:
        inputs = tensors() if callable(tensors) else grpc_tensors(t, tensors)
        wanted = [grpcclient.InferRequestedOutput(name) for name in outputs or []] or None
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        client.async_stream_infer(
            model or t.triton_model,
            inputs,
            outputs=wanted,
            request_id=request_id or uuid.uuid4().hex,
            enable_empty_final_response=True,
        )
        deadline = time.monotonic() + t.timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return Outcome("hang", None, f"no final response in {t.timeout:.0f}s")
            try:
                result, error = answers.get(timeout=left)
            except queue.Empty:
                continue
            if error is not None:
                final = True
                return grpc_outcome(error)
            if cancel_after_first:
                return Outcome("2xx", 200, "first response, then the stream was cancelled")
            params = result.get_response().parameters
            if "triton_final_response" not in params or params["triton_final_response"].bool_param:
                final = True
                return Outcome("2xx", 200, "final response")
    except InferenceServerException as exc:
        return grpc_outcome(exc)
    finally:
        try:
            client.stop_stream(cancel_requests=not final)
            client.close()
        except Exception:
            pass  # NOTE: a server that died mid-call cannot be closed cleanly


def grpc_call(t: Target, call: Callable[[Any], Any]) -> Outcome:
    """A unary call on a fresh client; ``call(client)`` makes it."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(t.grpc)
    try:
        call(client)
        return Outcome("2xx", 200, "OK")
    except InferenceServerException as exc:
        return grpc_outcome(exc)
    finally:
        with contextlib.suppress(Exception):  # NOTE: a server that died mid-call
            client.close()


# -- the cases ---------------------------------------------------------------------------------
Run = Callable[[Target], Awaitable[Outcome]]


@dataclass
class Case:
    name: str
    interface: str
    field: str  # what the request gets wrong
    run: Run
    expect: str = "refuse"  # refuse: a bad input | accept: a valid one | any: either is fine
    smoke: bool = False  # in the `--cases smoke` subset
    needs_key: bool = False  # only when --api-key is given
    last: bool = False  # may leave the server broken: run after every other case


def completion(t: Target, **fields: Any) -> dict[str, Any]:
    body = {"model": t.model, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    body.update(fields)
    return {k: v for k, v in body.items() if v is not DROP}


def chat(t: Target, **fields: Any) -> dict[str, Any]:
    body = {"model": t.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    body.update(fields)
    return {k: v for k, v in body.items() if v is not DROP}


DROP = object()  # a field value that leaves the field out


def generate_body(**fields: Any) -> dict[str, Any]:
    body = {"text_input": "Hello", "max_tokens": 4}
    body.update(fields)
    return {k: v for k, v in body.items() if v is not DROP}


def gw_json(path: str, make: Callable[[Target], Any], method: str = "POST", **kw: Any) -> Run:
    async def run(t: Target) -> Outcome:
        return await http(t, method, f"{t.gateway}{path}", body=make(t), **kw)

    return run


def gw_raw(path: str, make: Callable[[Target], bytes], **kw: Any) -> Run:
    async def run(t: Target) -> Outcome:
        return await http(t, "POST", f"{t.gateway}{path}", raw=make(t), **kw)

    return run


def gw_get(path: str, method: str = "GET", **kw: Any) -> Run:
    async def run(t: Target) -> Outcome:
        return await http(t, method, f"{t.gateway}{path}", **kw)

    return run


def th_json(endpoint: str, body: Any, model: str | None = None, **kw: Any) -> Run:
    async def run(t: Target) -> Outcome:
        url = f"{t.triton}/v2/models/{model or t.triton_model}/{endpoint}"
        return await http(t, "POST", url, body=body, auth=False, **kw)

    return run


def th_raw(endpoint: str, make: Callable[[Target], bytes], **kw: Any) -> Run:
    async def run(t: Target) -> Outcome:
        url = f"{t.triton}/v2/models/{t.triton_model}/{endpoint}"
        return await http(t, "POST", url, raw=make(t), auth=False, **kw)

    return run


def th_path(method: str, path: str, body: Any = None, **kw: Any) -> Run:
    async def run(t: Target) -> Outcome:
        return await http(t, method, f"{t.triton}{path}", body=body, auth=False, **kw)

    return run


def grpc_run(fn: Callable[[Target], Outcome]) -> Run:
    async def run(t: Target) -> Outcome:
        return await run_in_thread(fn, t)

    return run


def infer_body(*tensors: dict[str, Any]) -> dict[str, Any]:
    return {"inputs": list(tensors)}


def kserve(name: str, datatype: str, shape: list[int], data: list[Any]) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": shape, "data": data}


def big_text(t: Target) -> str:
    return "hello " * (t.max_body // 6)


def gateway_cases() -> list[Case]:
    C = Case  # a short name keeps the table of cases readable
    g = "gateway"
    cmp, cht = "/v1/completions", "/v1/chat/completions"

    def c(name: str, fld: str, **fields: Any) -> Case:
        return C(f"completions.{name}", g, fld, gw_json(cmp, lambda t: completion(t, **fields)))

    def h(name: str, fld: str, **fields: Any) -> Case:
        return C(f"chat.{name}", g, fld, gw_json(cht, lambda t: chat(t, **fields)))

    def user(content: Any, role: str = "user") -> list[dict[str, Any]]:
        return [{"role": role, "content": content}]

    cases = [
        # -- the body itself
        C("completions.malformed_json", g, "body", gw_raw(cmp, lambda t: b'{"model": "x", "pr'),
          smoke=True),
        C("completions.empty_body", g, "body", gw_raw(cmp, lambda t: b"")),
        C("completions.non_utf8_bytes", g, "prompt", gw_raw(
            cmp, lambda t: b'{"model": "%s", "prompt": "\xff\xfe\xfa", "max_tokens": 4}'
            % t.model.encode())),
        C("completions.lone_surrogate", g, "prompt", gw_raw(
            cmp, lambda t: b'{"model": "%s", "prompt": "a\\ud800b", "max_tokens": 4}'
            % t.model.encode()), smoke=True),
        C("completions.nan_temperature", g, "temperature", gw_raw(
            cmp, lambda t: b'{"model": "%s", "prompt": "hi", "max_tokens": 4, '
            b'"temperature": NaN}' % t.model.encode())),
        C("completions.deeply_nested", g, "body", gw_raw(
            cmp, lambda t: b'{"model": "%s", "prompt": ' % t.model.encode()
            + b"[" * 100_000 + b"]" * 100_000 + b"}")),
        C("completions.content_type_text_plain", g, "Content-Type",
          gw_json(cmp, lambda t: completion(t), content_type="text/plain")),
        C("completions.invalid_host", g, "Host",
          gw_json(cmp, lambda t: completion(t), headers={"Host": "evil.example.com"})),
        C("completions.huge_body", g, "prompt",
          gw_json(cmp, lambda t: completion(t, prompt=big_text(t)))),
        C("completions.unknown_route", g, "path", gw_get("/v1/nothing-here", method="POST")),
        # -- fields
        c("missing_model", "model", model=DROP),
        c("unknown_model", "model", model="no-such-model"),
        c("missing_prompt", "prompt", prompt=DROP),
        c("null_prompt", "prompt", prompt=None),
        c("empty_prompt", "prompt", prompt=""),
        c("prompt_is_number", "prompt", prompt=42),
        c("token_ids_out_of_vocab", "prompt", prompt=[1, 2, 10**9]),
        c("token_ids_negative", "prompt", prompt=[1, -5, 2]),
        c("two_prompts", "prompt", prompt=["one", "two"]),
        c("prompt_beyond_context", "prompt", prompt="hello " * 20_000),
        c("max_tokens_negative", "max_tokens", max_tokens=-1),
        c("max_tokens_huge", "max_tokens", max_tokens=2**40),
        c("max_tokens_beyond_context", "max_tokens", max_tokens=10**7),
        c("temperature_huge", "temperature", temperature=1e9),
        c("top_p_two", "top_p", top_p=2),
        c("top_k_negative", "top_k", top_k=-5),
        c("n_zero", "n", n=0),
        c("n_huge", "n", n=1000),
        c("logprobs_100", "logprobs", logprobs=100),
        c("echo_yes", "echo", echo="yes"),
        c("stream_yes", "stream", stream="yes"),
        c("stream_options_without_stream", "stream_options",
          stream_options={"include_usage": True}),
        c("stop_list_too_long", "stop", stop=[f"s{i}" for i in range(1000)]),
        c("stop_string_huge", "stop", stop=["x" * 100_000]),
        c("seed_beyond_uint64", "seed", seed=2**70),
        c("unknown_field", "foo", foo=1),
        c("logit_bias", "logit_bias", logit_bias={"50256": -100}),
        c("min_tokens_above_max", "min_tokens", min_tokens=100, max_tokens=4),
        c("response_format_bad_schema", "response_format",
          response_format={"type": "json_schema",
                           "json_schema": {"name": "x", "schema": {"type": "bogus"}}}),
        c("response_format_unknown_type", "response_format", response_format={"type": "xml"}),
        c("response_format_no_schema", "response_format", response_format={"type": "json_schema"}),
        c("guided_regex_invalid", "guided_regex", guided_regex="(unclosed"),
        c("tenant_huge", "user", user="u" * 100_000),
        C("completions.stream_cancelled", g, "stream",
          gw_json(cmp, lambda t: completion(t, stream=True, max_tokens=200, ignore_eos=True),
                  cancel_after_first=True), expect="accept", smoke=True),
        # -- chat
        h("missing_messages", "messages", messages=DROP),
        h("empty_messages", "messages", messages=[]),
        h("messages_is_string", "messages", messages="hello"),
        h("null_content", "content", messages=user(None)),
        h("unknown_role", "role", messages=user("hi", role="robot")),
        h("tool_role_without_call", "role", messages=user("result", role="tool")),
        h("image_part", "content", messages=user(
            [{"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}])),
        h("lone_surrogate_content", "content", messages=user("a\ud800b")),
        C("chat.roles_out_of_order", g, "role", gw_json(cht, lambda t: chat(t, messages=[
            {"role": "assistant", "content": "hi"}, {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"}, {"role": "user", "content": "again"}])),
          expect="any"),
        h("top_logprobs_100", "top_logprobs", logprobs=True, top_logprobs=100),
        h("stream_yes", "stream", stream="yes"),
        C("chat.stream_cancelled", g, "stream",
          gw_json(cht, lambda t: chat(t, stream=True, max_tokens=200, ignore_eos=True),
                  cancel_after_first=True), expect="accept"),
        # -- models and admin
        C("models.unknown", g, "model", gw_get("/v1/models/no-such-model")),
        # -- raw HTTP
        C("http.no_host_header", g, "Host", _raw_gateway(
            b"POST /v1/completions HTTP/1.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")),
        C("http.bad_chunked_encoding", g, "Transfer-Encoding", _raw_gateway(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
            b"Connection: close\r\n\r\nzz\r\n{}\r\n0\r\n\r\n")),
    ]
    return cases + batch_cases() + auth_cases() + [engine_killer()]


def _raw_gateway(request: bytes) -> Run:
    async def run(t: Target) -> Outcome:
        assert t.gateway is not None
        auth = f"Authorization: Bearer {t.api_key}\r\n".encode() if t.api_key else b""
        head, rest = request.split(b"\r\n", 1)
        return await raw_http(t, t.gateway, head + b"\r\n" + auth + rest)

    return run


def batch_line(t: Target, custom_id: str = "a", **fields: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/completions",
        "body": completion(t, **fields),
    }


def upload(content: Callable[[Target], bytes], purpose: str = "batch") -> Run:
    async def run(t: Target) -> Outcome:
        form = aiohttp.FormData()
        form.add_field("purpose", purpose)
        form.add_field("file", content(t), filename="in.jsonl",
                       content_type="application/jsonl")
        return await http(t, "POST", f"{t.gateway}/v1/files", form=form)

    return run


def batches(**fields: Any) -> Run:
    async def run(t: Target) -> Outcome:
        body = {
            "input_file_id": t.valid_file_id or "file-missing",
            "endpoint": "/v1/completions",
            "completion_window": "24h",
        }
        body.update(fields)
        return await http(t, "POST", f"{t.gateway}/v1/batches", body=body)

    return run


def jsonl(*lines: Any) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def batch_cases() -> list[Case]:
    g = "gateway"
    return [
        Case("files.no_file", g, "file", _form_only()),
        Case("files.not_jsonl", g, "file", upload(lambda t: b"this is not json\n"), smoke=True),
        Case("files.line_bad_body", g, "file",  # OpenAI checks bodies when the batch runs
             upload(lambda t: jsonl(batch_line(t, max_tokens=-1))), expect="any"),
        Case("files.duplicate_custom_id", g, "custom_id",
             upload(lambda t: jsonl(batch_line(t), batch_line(t)))),
        Case("batches.unknown_file", g, "input_file_id", batches(input_file_id="file-nope")),
        Case("batches.endpoint_embeddings", g, "endpoint", batches(endpoint="/v1/embeddings")),
        Case("batches.window_1h", g, "completion_window", batches(completion_window="1h")),
        Case("files.content_unknown", g, "file_id", gw_get("/v1/files/file-nope/content")),
        Case("files.path_traversal", g, "file_id",
             gw_get("/v1/files/..%2F..%2F..%2Fetc%2Fpasswd/content")),
    ]


def _form_only() -> Run:
    async def run(t: Target) -> Outcome:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        return await http(t, "POST", f"{t.gateway}/v1/files", form=form)

    return run


def auth_cases() -> list[Case]:
    """With keys configured: a request without the right key is a 401 on every route that
    is not a health probe."""
    g = "gateway"

    def with_headers(path: str, headers: dict[str, str], method: str = "POST",
                     chat_body: bool = False) -> Run:
        async def run(t: Target) -> Outcome:
            body = (chat(t) if chat_body else completion(t)) if method == "POST" else None
            return await http(t, method, f"{t.gateway}{path}", body=body, headers=headers,
                              auth=False)

        return run

    wrong = {"Authorization": "Bearer not-the-key"}
    return [
        Case("auth.completions_no_key", g, "Authorization",
             with_headers("/v1/completions", {}), needs_key=True, smoke=True),
        Case("auth.completions_wrong_key", g, "Authorization",
             with_headers("/v1/completions", wrong), needs_key=True),
        Case("auth.chat_empty_bearer", g, "Authorization",
             with_headers("/v1/chat/completions", {"Authorization": "Bearer "},
                          chat_body=True), needs_key=True),
        Case("auth.completions_basic_scheme", g, "Authorization",
             with_headers("/v1/completions", {"Authorization": "Basic dXNlcjpwYXNz"}),
             needs_key=True),
        Case("auth.models_no_key", g, "Authorization",
             with_headers("/v1/models", {}, method="GET"), needs_key=True),
        Case("auth.files_no_key", g, "Authorization",
             with_headers("/v1/files", {}, method="GET"), needs_key=True),
        Case("auth.batches_wrong_key", g, "Authorization",
             with_headers("/v1/batches", wrong, method="GET"), needs_key=True),
        Case("auth.reset_prefix_cache_no_key", g, "Authorization",
             with_headers("/reset_prefix_cache", {}, method="POST"), needs_key=True),
        Case("auth.health_no_key", g, "Authorization",
             with_headers("/health", {}, method="GET"), expect="any", needs_key=True),
    ]


def engine_killer() -> Case:
    """lm-evaluation-harness's loglikelihood pattern: echo with logprobs, two prompts sharing
    more than one 16-token block of the prefix cache. Valid; run last, since a server with
    the bug it finds stops answering for good."""

    async def run(t: Target) -> Outcome:
        shared = " ".join(f"word{i}" for i in range(24))
        outcome = Outcome("2xx")
        for ending in (" alpha beta", " gamma delta"):
            body = completion(t, prompt=shared + ending, max_tokens=1, echo=True, logprobs=1)
            outcome = await http(t, "POST", f"{t.gateway}/v1/completions", body=body)
            if outcome.klass != "2xx":
                break
        return outcome

    return Case("completions.echo_logprobs_shared_prefix", "gateway", "echo+logprobs", run,
                expect="accept", last=True)


def triton_http_cases() -> list[Case]:
    C = Case
    i = "triton-http"

    def gen(name: str, fld: str, smoke: bool = False, **fields: Any) -> Case:
        return C(f"generate.{name}", i, fld, th_json("generate", generate_body(**fields)),
                 smoke=smoke)

    return [
        C("generate.malformed_json", i, "body", th_raw("generate", lambda t: b'{"text_input": '),
          smoke=True),
        C("generate.lone_surrogate", i, "text_input",
          th_raw("generate", lambda t: b'{"text_input": "a\\ud800b", "max_tokens": 4}')),
        C("generate.non_utf8_bytes", i, "text_input",
          th_raw("generate", lambda t: b'{"text_input": "\xff\xfe", "max_tokens": 4}')),
        C("generate.content_type_text_plain", i, "Content-Type",
          th_json("generate", generate_body(), content_type="text/plain")),
        C("generate.invalid_host", i, "Host",
          th_json("generate", generate_body(), headers={"Host": "evil.example.com"})),
        C("generate.huge_body", i, "text_input",
          _th_big("generate")),
        gen("no_prompt", "text_input", text_input=DROP),
        gen("text_input_number", "text_input", text_input=5),
        gen("text_input_empty", "text_input", text_input=""),
        gen("input_ids_out_of_vocab", "input_ids", text_input=DROP, input_ids=[1, 10**9]),
        gen("text_input_two_items", "text_input", text_input=["a", "b"]),
        gen("max_tokens_negative", "max_tokens", smoke=True, max_tokens=-1),
        gen("seed_negative", "seed", seed=-1),
        gen("temperature_huge", "temperature", temperature=1e9),
        gen("stream_yes", "stream", stream="yes"),
        gen("unknown_parameter", "foo", foo=1),
        gen("stop_words_too_many", "stop_words", stop_words=[f"w{n}" for n in range(1000)]),
        gen("num_return_sequences_100", "num_return_sequences", num_return_sequences=100),
        gen("top_log_probs_100", "top_log_probs", return_log_probs=True, top_log_probs=100),
        gen("guide_schema_invalid", "guided_decoding_guide",
            guided_decoding_guide_type="json_schema", guided_decoding_guide="{"),
        gen("reset_with_prompt", "reset_prefix_cache", reset_prefix_cache=True),
        C("generate.unknown_model", i, "model",
          th_json("generate", generate_body(), model="no-such-model")),
        C("generate_stream.lone_surrogate", i, "text_input",
          th_raw("generate_stream", lambda t: b'{"text_input": "\\udfff", "max_tokens": 4}')),
        C("generate_stream.max_tokens_negative", i, "max_tokens",
          th_json("generate_stream", generate_body(max_tokens=-1))),
        C("generate_stream.cancelled", i, "stream",
          th_json("generate_stream", generate_body(max_tokens=200, ignore_eos=True, stream=True),
                  cancel_after_first=True), expect="accept"),
        C("infer.decoupled_model", i, "endpoint", th_json("infer", infer_body(
            kserve("text_input", "BYTES", [1], ["hi"]))), expect="any"),
        C("models.unknown", i, "model", th_path("GET", "/v2/models/no-such-model")),
        C("admin.logging_post", i, "admin", th_path("POST", "/v2/logging", {"log_info": True})),
        C("admin.repository_index", i, "admin", th_path("POST", "/v2/repository/index", {})),
        C("admin.load_unknown_model", i, "admin",
          th_path("POST", "/v2/repository/models/no-such-model/load", {})),
        C("admin.shm_register_bogus", i, "admin", th_path(
            "POST", "/v2/systemsharedmemory/region/bogus/register",
            {"key": "/no-such-region", "offset": 0, "byte_size": 64})),
    ]


def _th_big(endpoint: str) -> Run:
    async def run(t: Target) -> Outcome:
        url = f"{t.triton}/v2/models/{t.triton_model}/{endpoint}"
        return await http(t, "POST", url, body=generate_body(text_input=big_text(t)), auth=False)

    return run


def triton_grpc_cases() -> list[Case]:
    i = "triton-grpc"

    def stream(name: str, fld: str, tensors: Callable[[Target], list[Tensor]],
               smoke: bool = False, expect: str = "refuse", **kw: Any) -> Case:
        return Case(f"stream.{name}", i, fld,
                    grpc_run(lambda t: grpc_stream(t, tensors(t), **kw)),
                    smoke=smoke, expect=expect)

    def with_(*extra: Tensor, text: str | bytes = "Hi", max_tokens: int = 4) -> Callable[
            [Target], list[Tensor]]:
        def make(t: Target) -> list[Tensor]:
            base = {n: (n, v, d) for n, v, d in prompt_tensors(text, max_tokens)}
            for tensor in extra:
                if tensor[1] is DROP:
                    base.pop(tensor[0], None)
                else:
                    base[tensor[0]] = tensor
            return list(base.values())

        return make

    def mismatched(t: Target) -> list[Any]:
        tensors = grpc_tensors(t, [("text_input", [b"hi"], "BYTES"),
                                   ("max_tokens", [4, 5], "INT32")])
        tensors[1].set_shape([1, 1] if t.batch_dim else [1])  # 8 bytes of data for a [1]
        return tensors

    def unary(call: Callable[[Any, Target], Any]) -> Run:
        return grpc_run(lambda t: grpc_call(t, lambda client: call(client, t)))

    return [
        stream("unknown_model", "model", with_(), model="no-such-model"),
        stream("unknown_input", "inputs", with_(("foo", [1], "INT32")), smoke=True),
        stream("text_input_as_int32", "text_input", with_(("text_input", [1], "INT32"))),
        stream("max_tokens_as_fp32", "max_tokens", with_(("max_tokens", [4.0], "FP32"))),
        Case("stream.data_size_mismatch", i, "max_tokens",
             grpc_run(lambda t: grpc_stream(t, lambda: mismatched(t)))),
        stream("no_inputs", "inputs", with_(("text_input", DROP, ""), ("max_tokens", DROP, ""))),
        stream("non_utf8_text", "text_input", with_(text=b"\xff\xfe\xfa")),
        stream("input_ids_out_of_vocab", "input_ids",
               with_(("text_input", DROP, ""), ("input_ids", [1, 10**9], "INT32"))),
        stream("max_tokens_negative", "max_tokens", with_(max_tokens=-1)),
        stream("temperature_nan", "temperature", with_(("temperature", [float("nan")], "FP32"))),
        stream("top_k_negative", "top_k", with_(("top_k", [-5], "INT32"))),
        stream("unknown_output", "outputs", with_(), outputs=["foo"]),
        stream("request_id_huge", "id", with_(), request_id="r" * 100_000, expect="any"),
        stream("reset_with_prompt", "reset_prefix_cache",
               with_(("reset_prefix_cache", [True], "BOOL"))),
        Case("stream.huge_text", i, "text_input",
             grpc_run(lambda t: grpc_stream(t, prompt_tensors(big_text(t))))),
        stream("cancelled", "stream", with_(("ignore_eos", [True], "BOOL"),
                                            ("stream", [True], "BOOL"), max_tokens=200),
               expect="accept", cancel_after_first=True),
        Case("infer.decoupled_model", i, "rpc", unary(
            lambda c, t: c.infer(t.triton_model, grpc_tensors(t, prompt_tensors()),
                                 client_timeout=t.timeout)), expect="any"),
        Case("infer.unknown_model", i, "model", unary(
            lambda c, t: c.infer("no-such-model", grpc_tensors(t, prompt_tensors()),
                                 client_timeout=t.timeout))),
        Case("admin.update_log_settings", i, "admin", unary(
            lambda c, t: c.update_log_settings({"log_info": True}, client_timeout=t.timeout))),
        Case("admin.repository_index", i, "admin", unary(
            lambda c, t: c.get_model_repository_index(client_timeout=t.timeout))),
    ]


def all_cases() -> list[Case]:
    return gateway_cases() + triton_http_cases() + triton_grpc_cases()


# -- checks between cases ----------------------------------------------------------------------
async def probe(t: Target) -> str | None:
    """None when every endpoint's health probe answers 200, else what failed."""
    assert t.session is not None
    urls = []
    if t.gateway:
        urls.append(f"{t.gateway}/health")
    if t.triton:
        urls.append(f"{t.triton}/v2/health/live")
    for url in urls:
        try:
            timeout = aiohttp.ClientTimeout(total=5)
            async with t.session.get(url, headers=t.auth(), timeout=timeout) as resp:
                if resp.status != 200:
                    return f"{url}: {resp.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            return f"{url}: {type(exc).__name__}"
    if t.grpc and not t.triton:
        ok = await run_in_thread(_grpc_live, t)
        if not ok:
            return f"{t.grpc}: not live"
    return None


def _grpc_live(t: Target) -> bool:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(t.grpc)
    try:
        return bool(client.is_server_live(client_timeout=5))
    except Exception:
        return False
    finally:
        client.close()


async def valid_request(t: Target, interface: str) -> Outcome:
    """One small valid request through ``interface``."""
    if interface == "gateway":
        body = completion(t, prompt="Hi", max_tokens=2)
        outcome = await http(t, "POST", f"{t.gateway}/v1/completions", body=body)
        if outcome.klass == "2xx" and '"choices"' not in outcome.body:
            return Outcome("5xx", outcome.status, "no choices: " + outcome.detail)
        return outcome
    if interface == "triton-http":
        url = f"{t.triton}/v2/models/{t.triton_model}/generate"
        outcome = await http(t, "POST", url, body=generate_body(text_input="Hi", max_tokens=2),
                             auth=False)
        if outcome.klass == "2xx" and "text_output" not in outcome.body:
            return Outcome("5xx", outcome.status, "no text_output: " + outcome.detail)
        return outcome
    return await run_in_thread(grpc_stream, t, prompt_tensors("Hi", 2))


async def timed(t: Target, run: Run) -> tuple[Outcome, float]:
    started = time.monotonic()
    try:
        outcome = await asyncio.wait_for(run(t), timeout=t.timeout)
    except TimeoutError:
        outcome = Outcome("hang", None, f"no answer in {t.timeout:.0f}s")
    except Exception as exc:  # NOTE: whatever a client library raises, the battery goes on
        outcome = Outcome("error", None, f"{type(exc).__name__}: {exc}"[:300])
    return outcome, time.monotonic() - started


async def run_case(t: Target, case: Case, recover_timeout: float) -> Result:
    result = Result(case.name, case.interface, case.field, case.expect)
    outcome, result.seconds = await timed(t, case.run)
    result.klass, result.status = outcome.klass, outcome.status
    result.detail, result.in_stream = outcome.detail, outcome.in_stream
    await asyncio.sleep(0.2)  # NOTE: an abort a response raced past shows by now
    failed = await probe(t)
    if failed is not None:
        result.crash = True
        result.detail = f"[{outcome.klass} {outcome.status}] {outcome.detail}"[:300]
        result.klass = "crash"
        down = time.monotonic()
        while failed is not None and time.monotonic() - down < recover_timeout:
            await asyncio.sleep(1.0)
            failed = await probe(t)
        result.recovery_s = round(time.monotonic() - down, 1) if failed is None else None
    check, _ = await timed(t, lambda target: valid_request(target, case.interface))
    result.check_ok = check.klass == "2xx"
    if not result.check_ok:
        result.check_detail = f"{check.klass} {check.status}: {check.detail}"[:300]
    return result


# -- the report -------------------------------------------------------------------------------
def summarize(results: list[Result]) -> dict[str, dict[str, int]]:
    table: dict[str, dict[str, int]] = {}
    for interface in INTERFACES:
        mine = [r for r in results if r.interface == interface]
        if not mine:
            continue
        counts = Counter(r.klass for r in mine)
        row = {"cases": len(mine)}
        row.update({k: counts.get(k, 0) for k in CLASSES})
        row["not run"] = counts.get("not run", 0)
        row["accepted silently"] = sum(r.accepted_silently for r in mine)
        row["lost"] = sum(r.check_ok is False for r in mine)
        table[interface] = row
    if table:
        total = {key: sum(row[key] for row in table.values()) for key in next(iter(table.values()))}
        table["total"] = total
    return table


def print_report(results: list[Result], table: dict[str, dict[str, int]]) -> None:
    if not table:
        print("no cases ran")
        return
    keys = list(next(iter(table.values())))
    width = max(len(k) for k in table) + 2
    print("interface".ljust(width) + "".join(k.rjust(max(len(k), 4) + 2) for k in keys))
    for interface, row in table.items():
        cells = "".join(str(row[k]).rjust(max(len(k), 4) + 2) for k in keys)
        print(interface.ljust(width) + cells)
    flagged = [r for r in results if r.problem or r.check_ok is False or r.refused_valid]
    if flagged:
        print("\ncases to look at (5xx, hang, crash, error, accepted silently, lost, refused):")
    for r in flagged:
        what = "accepted silently" if r.accepted_silently else r.klass
        if r.refused_valid:
            what = "refused a valid request"
        status = "-" if r.status is None else str(r.status)
        line = f"  {r.interface:<12} {r.name:<44} {r.field:<22} {status:>4} {what}"
        if r.crash:
            back = "never" if r.recovery_s is None else f"{r.recovery_s}s"
            line += f" (back after {back})"
        if r.check_ok is False:
            line += " [lost: the valid request after it failed]"
        print(line)
        if r.detail and r.klass != "2xx":
            print(f"      {r.detail[:160]!r}")


# -- main --------------------------------------------------------------------------------------
async def discover(t: Target, model: str | None, triton_model: str | None) -> None:
    """The served names; uploads one valid batch file for the Batch API cases."""
    assert t.session is not None
    timeout = aiohttp.ClientTimeout(total=t.timeout)
    if t.gateway:
        if model:
            t.model = model
        else:
            async with t.session.get(f"{t.gateway}/v1/models", headers=t.auth(),
                                     timeout=timeout) as resp:
                if resp.status != 200:
                    raise SystemExit(f"GET {t.gateway}/v1/models: {resp.status} (--api-key?)")
                t.model = (await resp.json())["data"][0]["id"]
    if t.triton or t.grpc:
        names = [triton_model] if triton_model else [t.model, "quanta", "ensemble"]
        t.triton_model = names[0] or "quanta"
        if t.triton and not triton_model:
            for name in names:
                async with t.session.get(f"{t.triton}/v2/models/{name}/ready",
                                         timeout=timeout) as resp:
                    if resp.status == 200:
                        t.triton_model = name
                        break
    if t.grpc:
        t.batch_dim = await run_in_thread(_has_batch_dim, t)
    if t.gateway:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", jsonl(batch_line(t)), filename="valid.jsonl")
        async with t.session.post(f"{t.gateway}/v1/files", data=form, headers=t.auth(),
                                  timeout=timeout) as resp:
            if resp.status == 200:
                t.valid_file_id = (await resp.json()).get("id")


def _has_batch_dim(t: Target) -> bool:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(t.grpc)
    try:
        config = client.get_model_config(t.triton_model, as_json=True, client_timeout=10)
        return int(config.get("config", config).get("max_batch_size", 0) or 0) > 0
    except Exception:
        return False
    finally:
        client.close()


def select(cases: list[Case], args: argparse.Namespace, keyed: bool) -> list[Case]:
    interfaces = set(args.interfaces.split(","))
    chosen = [c for c in cases if c.interface in interfaces and (keyed or not c.needs_key)]
    if args.cases == "smoke":
        chosen = [c for c in chosen if c.smoke]
    if args.only:
        chosen = [c for c in chosen if re.search(args.only, c.name)]
    if args.skip:
        chosen = [c for c in chosen if not re.search(args.skip, c.name)]
    return [c for c in chosen if not c.last] + [c for c in chosen if c.last]


async def main_async(args: argparse.Namespace) -> int:
    t = Target(
        gateway=_base(args.gateway_url, "/v1"),
        triton=_base(args.triton_url),
        grpc=_grpc_target(args.grpc_url),
        api_key=args.api_key,
        timeout=args.timeout,
        max_body=int(min(args.max_body_mb, MAX_BODY_MB) * (1 << 20)),
    )
    available = {
        "gateway": t.gateway,
        "triton-http": t.triton,
        "triton-grpc": t.grpc,
    }
    missing = [name for name in args.interfaces.split(",") if not available.get(name)]
    args.interfaces = ",".join(n for n in args.interfaces.split(",") if available.get(n))
    cases = select(all_cases(), args, keyed=t.api_key is not None)
    if args.list:
        for case in cases:
            print(f"{case.interface:<12} {case.name:<44} {case.field:<22} {case.expect}")
        return 0
    connector = aiohttp.TCPConnector(limit=8, force_close=True)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t.session = session
        if (failed := await probe(t)) is not None:
            print(f"error: the server is not healthy before the battery: {failed}",
                  file=sys.stderr)
            return 2
        await discover(t, args.model, args.triton_model)
        print(f"{len(cases)} cases; gateway model {t.model!r}, Triton model "
              f"{t.triton_model!r}; skipping {', '.join(missing) or 'nothing'}", flush=True)
        results: list[Result] = []
        lost_in_a_row = 0
        started = time.time()
        for n, case in enumerate(cases, 1):
            if lost_in_a_row >= args.give_up_after:
                results.append(Result(case.name, case.interface, case.field, case.expect))
                continue
            result = await run_case(t, case, args.recover_timeout)
            results.append(result)
            lost_in_a_row = lost_in_a_row + 1 if result.check_ok is False else 0
            if args.verbose or result.problem or result.check_ok is False:
                print(f"[{n}/{len(cases)}] {case.interface} {case.name}: {result.klass} "
                      f"{result.status or ''} ({result.seconds:.1f}s)", flush=True)
        if lost_in_a_row >= args.give_up_after:
            print(f"\nthe server failed {lost_in_a_row} valid requests in a row: the "
                  "remaining cases were not run", flush=True)
    table = summarize(results)
    print()
    print_report(results, table)
    if args.out:
        report = {
            "started": started,
            "seconds": round(time.time() - started, 1),
            "target": {
                "gateway": t.gateway,
                "triton": t.triton,
                "grpc": t.grpc,
                "model": t.model,
                "triton_model": t.triton_model,
                "api_key": t.api_key is not None,
            },
            "options": {"cases": args.cases, "timeout": t.timeout, "max_body": t.max_body},
            "summary": table,
            "cases": [asdict(r) | {"accepted_silently": r.accepted_silently} for r in results],
        }
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"\nwrote {args.out}")
    if args.strict and any(r.klass in ("5xx", "hang", "crash", "error") or r.check_ok is False
                           for r in results):
        return 1
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Send bad inputs to a running quanta serve over the OpenAI gateway, "
        "Triton HTTP and Triton gRPC; classify every answer.",
    )
    p.add_argument("--gateway-url", help="the OpenAI gateway, e.g. http://127.0.0.1:9000")
    p.add_argument("--triton-url", help="Triton HTTP, e.g. http://127.0.0.1:8000")
    p.add_argument("--grpc-url", help="Triton gRPC, e.g. 127.0.0.1:8001")
    p.add_argument("--api-key", help="sent as Authorization: Bearer; adds the auth cases")
    p.add_argument("--model", help="the gateway's model name (default: the first of /v1/models)")
    p.add_argument("--triton-model", help="Triton's model name (default: found by /ready)")
    p.add_argument("--cases", choices=("all", "smoke"), default="all")
    p.add_argument("--only", help="run only the cases whose name matches this regex")
    p.add_argument("--skip", help="leave out the cases whose name matches this regex")
    p.add_argument("--interfaces", default=",".join(INTERFACES),
                   help="comma-separated subset of " + ",".join(INTERFACES))
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds a case may take before it counts as a hang")
    p.add_argument("--recover-timeout", type=float, default=180.0,
                   help="seconds to wait for a crashed server to answer its health probe")
    p.add_argument("--give-up-after", type=int, default=3,
                   help="stop after this many lost valid requests in a row")
    p.add_argument("--max-body-mb", type=float, default=5.0,
                   help=f"the huge-body cases' size in MB (at most {MAX_BODY_MB:g})")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 on any 5xx, hang, crash, error or lost request")
    p.add_argument("-v", "--verbose", action="store_true", help="print every case as it runs")
    args = p.parse_args(argv)
    if not (args.gateway_url or args.triton_url or args.grpc_url or args.list):
        p.error("give at least one of --gateway-url, --triton-url, --grpc-url")
    if args.list:
        args.gateway_url = args.gateway_url or "http://-"
        args.triton_url = args.triton_url or "http://-"
        args.grpc_url = args.grpc_url or "-"
    return args


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
