"""The OpenAI Batch API of the gateway, through the official ``openai`` client and ``quanta batch``.

Most tests serve the real gateway (uvicorn on a thread, every route and the batch runner as in
production) over ``FakeTriton``, an upstream whose answers are a function of the prompt and
which can be made slow or unreachable on purpose: that is what makes restarts, outages and
cancellation deterministic. A gateway in front of the session's shared tritonserver (as
``quanta serve --openai-port`` runs its own) runs batches end to end through real Triton and
compares them with the online route.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from quanta.frontends.openai.app import GatewaySettings
from quanta.frontends.openai.batch_input import parse_batch_file
from quanta.frontends.openai.batch_runner import BatchRunner
from quanta.frontends.openai.batch_store import BatchStore
from quanta.frontends.openai.errors import OpenAIError
from quanta.frontends.openai.server import GatewayServer
from quanta.frontends.openai.upstream import UpstreamError
from quanta.frontends.triton.launcher import free_port
from serving import wait_for
from typer.testing import CliRunner

openai = pytest.importorskip("openai")

MODEL = "quanta"
DONE = ("completed", "failed", "expired", "cancelled")


# -- a Triton stand-in -------------------------------------------------------------------------
class FakeTriton:
    """Answers each request with its prompt reversed (up to ``max_tokens`` characters).

    ``unavailable`` requests fail first as an unreachable Triton does; ``delay`` seconds pass
    before each answer. Thread-safe: the test thread reads what the gateway's loop recorded.
    """

    def __init__(self, *, delay: float = 0.0, unavailable: int = 0) -> None:
        self.delay = delay
        self.unavailable = unavailable
        self.served: list[dict[str, Any]] = []  # inputs of the requests answered
        self.refused = 0
        self._lock = threading.Lock()

    def stream(self, model: str, inputs: dict[str, Any], **_: Any) -> FakeStream:
        return FakeStream(self, inputs)

    async def is_model_ready(self, model: str) -> bool:
        return True

    async def close(self) -> None:
        pass

    def prompts(self) -> list[str]:
        with self._lock:
            return [inputs["text_input"] for inputs in self.served]

    async def answer(self, inputs: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self.unavailable > 0:
                self.unavailable -= 1
                self.refused += 1
                raise UpstreamError("Triton gRPC UNAVAILABLE at fake: refused", unavailable=True)
        await asyncio.sleep(self.delay)
        text = inputs["text_input"][::-1][: inputs["max_tokens"]]
        with self._lock:
            self.served.append(inputs)
        return {
            "text_output": text,
            "finish_reason": "length",
            "num_prompt_tokens": len(inputs["text_input"]),
            "num_output_tokens": len(text),
        }


class FakeStream:
    def __init__(self, upstream: FakeTriton, inputs: dict[str, Any]) -> None:
        self._upstream = upstream
        self._inputs = inputs
        self.request_id = uuid.uuid4().hex
        self.done = False

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self.done:
            raise StopAsyncIteration
        try:
            return await self._upstream.answer(self._inputs)
        finally:
            self.done = True

    def cancel(self) -> None:
        self.done = True


# -- helpers -----------------------------------------------------------------------------------
def gateway(state_dir: Path, upstream: FakeTriton, concurrency: int = 4) -> GatewayServer:
    settings = GatewaySettings(
        triton_grpc_url="127.0.0.1:1",
        model_name=MODEL,
        state_dir=state_dir,
        batch_concurrency=concurrency,
    )
    return GatewayServer(settings, port=free_port(), upstream=upstream).start()  # type: ignore[arg-type]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Any, FakeTriton, GatewayServer]]:
    """An ``openai`` client of a gateway over a ``FakeTriton``."""
    upstream = FakeTriton()
    server = gateway(tmp_path / "state", upstream)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0, timeout=30)
    try:
        yield client, upstream, server
    finally:
        client.close()
        server.stop()


def line(custom_id: str, prompt: str = "hello", url: str = "/v1/completions", **body: Any) -> str:
    if url == "/v1/completions":
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, **body}
    else:
        body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def jsonl(lines: list[str]) -> bytes:
    return ("\n".join(lines) + "\n").encode()


def submit(client: Any, lines: list[str], endpoint: str = "/v1/completions", **kw: Any) -> Any:
    file = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    return client.batches.create(
        input_file_id=file.id, endpoint=endpoint, completion_window="24h", **kw
    )


def wait_done(client: Any, batch_id: str, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while (batch := client.batches.retrieve(batch_id)).status not in DONE:
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch}"
        time.sleep(0.05)
    return batch


def content(client: Any, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


# -- through the openai client ---------------------------------------------------------------
def test_a_batch_answers_every_line_in_input_order_as_offline_work(served):
    client, upstream, _ = served
    prompts = [f"prompt number {i}" for i in range(30)]
    lines = [line(f"req-{i}", p) for i, p in enumerate(prompts)]
    batch = submit(client, lines, metadata={"job": "nightly"})
    assert batch.id.startswith("batch_") and batch.object == "batch"
    assert batch.status == "in_progress" and batch.metadata == {"job": "nightly"}
    batch = wait_done(client, batch.id)
    assert batch.status == "completed"
    assert batch.request_counts.model_dump() == {"total": 30, "completed": 30, "failed": 0}
    assert batch.completed_at >= batch.in_progress_at >= batch.created_at
    assert batch.error_file_id is None
    out = content(client, batch.output_file_id)
    assert [o["custom_id"] for o in out] == [f"req-{i}" for i in range(30)]
    for o, prompt in zip(out, prompts, strict=True):
        assert o["id"].startswith("batch_req_") and o["error"] is None
        assert o["response"]["status_code"] == 200
        assert o["response"]["request_id"] == o["response"]["body"]["id"]
        assert o["response"]["body"]["object"] == "text_completion"
        assert o["response"]["body"]["choices"][0]["text"] == prompt[::-1][:4]
    assert all(inputs["priority_class"] == "offline" for inputs in upstream.served)
    assert sorted(upstream.prompts()) == sorted(prompts)  # each once
    output = client.files.retrieve(batch.output_file_id)
    assert output.purpose == "batch_output" and output.bytes > 0
    assert output.filename == f"{batch.id}_output.jsonl"


def test_a_line_asking_for_online_priority_still_runs_offline(served):
    client, upstream, _ = served
    batch = wait_done(client, submit(client, [line("a", priority_class="online")]).id)
    assert batch.status == "completed"
    assert [inputs["priority_class"] for inputs in upstream.served] == ["offline"]


def test_chat_batches(served):
    client, _, _ = served
    url = "/v1/chat/completions"
    lines = [line(f"c{i}", f"question {i}", url, max_tokens=3) for i in range(3)]
    batch = wait_done(client, submit(client, lines, endpoint=url).id)
    out = content(client, batch.output_file_id)
    assert [o["response"]["body"]["object"] for o in out] == ["chat.completion"] * 3
    assert all(o["response"]["body"]["choices"][0]["message"]["content"] for o in out)


def test_bad_lines_go_to_the_error_file_with_the_routes_errors(served):
    client, _, _ = served
    lines = [
        line("ok-0"),
        line("unknown-model", model="nope"),
        line("ok-1"),
        line("typo", max_tokenz=3),
        line("bias", logit_bias={"1": 250.0}),
        line("empty", prompt=""),
        line("ok-2"),
    ]
    batch = wait_done(client, submit(client, lines).id)
    assert batch.status == "completed"
    assert batch.request_counts.model_dump() == {"total": 7, "completed": 3, "failed": 4}
    out, errors = content(client, batch.output_file_id), content(client, batch.error_file_id)
    assert [o["custom_id"] for o in out] == ["ok-0", "ok-1", "ok-2"]
    assert [e["custom_id"] for e in errors] == ["unknown-model", "typo", "bias", "empty"]
    by_id = {e["custom_id"]: e for e in errors}
    assert by_id["unknown-model"]["response"]["status_code"] == 404
    assert by_id["unknown-model"]["response"]["body"]["error"]["code"] == "model_not_found"
    assert by_id["typo"]["response"]["body"]["error"]["param"] == "max_tokenz"
    assert by_id["bias"]["response"]["body"]["error"]["param"] == "logit_bias"
    assert "prompt is empty" in by_id["empty"]["response"]["body"]["error"]["message"]
    for e in errors:
        assert e["error"] is None and e["response"]["status_code"] in (400, 404)
        assert e["response"]["request_id"] and e["response"]["body"]["error"]["type"]


BAD_FILES = {
    "not json": ([line("a"), line("b"), "{not json"], "line 3: not valid JSON"),
    "duplicate custom_id": ([line("a"), line("b"), line("a")], "line 3: custom_id 'a'"),
    "wrong url": ([line("a"), line("b", url="/v1/embeddings")], "line 2: url must be one of"),
    "no body": (
        [json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions"})],
        "line 1: body",
    ),
    "GET": ([line("a").replace('"POST"', '"GET"')], 'line 1: method must be "POST"'),
    "not an object": (["[1, 2]"], "line 1: not a JSON object"),
    "empty": ([""], "holds no requests"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_bad_file_is_400_naming_its_line(served, case):
    client, _, _ = served
    lines, message = BAD_FILES[case]
    with pytest.raises(openai.BadRequestError) as info:
        client.files.create(file=("bad.jsonl", jsonl(lines)), purpose="batch")
    error = info.value.response.json()["error"]
    assert message in error["message"] and error["param"] == "file"
    assert error["type"] == "invalid_request_error"


def test_blank_lines_are_skipped_and_line_numbers_count_them(served):
    client, _, _ = served
    with pytest.raises(openai.BadRequestError, match="line 4: not valid JSON"):
        client.files.create(file=("x.jsonl", jsonl([line("a"), "", "  ", "nope"])), purpose="batch")


def test_only_batch_files_and_known_endpoints_are_taken(served):
    client, _, _ = served
    with pytest.raises(openai.BadRequestError, match="purpose 'fine-tune'"):
        client.files.create(file=("x.jsonl", jsonl([line("a")])), purpose="fine-tune")
    file = client.files.create(file=("in.jsonl", jsonl([line("a")])), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="endpoint '/v1/embeddings'"):
        client.batches.create(
            input_file_id=file.id, endpoint="/v1/embeddings", completion_window="24h"
        )
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(
            input_file_id=file.id, endpoint="/v1/completions", completion_window="1h"
        )
    with pytest.raises(openai.NotFoundError):
        client.batches.create(
            input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h"
        )
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")


def test_lines_for_another_endpoint_fail_the_batch_naming_them(served):
    client, upstream, _ = served
    lines = [line("a"), line("b", url="/v1/chat/completions"), line("c")]
    batch = wait_done(client, submit(client, lines).id)
    assert batch.status == "failed" and batch.failed_at is not None
    assert [(e.line, e.code) for e in batch.errors.data] == [(2, "invalid_url")]
    assert upstream.served == []


def test_files_are_listed_retrieved_and_deleted(served):
    client, _, _ = served
    ids = [
        client.files.create(file=(f"f{i}.jsonl", jsonl([line("a")])), purpose="batch").id
        for i in range(3)
    ]
    assert [f.id for f in client.files.list()] == ids[::-1]
    assert [f.id for f in client.files.list(order="asc", limit=2)] == ids  # every page
    assert client.files.retrieve(ids[0]).filename == "f0.jsonl"
    assert client.files.content(ids[1]).text == jsonl([line("a")]).decode()
    assert client.files.delete(ids[2]).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(ids[2])


def test_batches_list_pages_newest_first(served):
    client, _, _ = served
    ids = [submit(client, [line("a")]).id for _ in range(5)]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[::-1][:2] and first.has_more
    assert [b.id for b in client.batches.list(limit=2, after=ids[3]).data] == [ids[2], ids[1]]
    assert [b.id for b in client.batches.list(limit=2)] == ids[::-1]  # auto-paging: all
    last = client.batches.list(limit=10)
    assert not last.has_more and len(last.data) == 5


def test_cancel_stops_dispatching_and_keeps_what_finished(tmp_path):
    upstream = FakeTriton(delay=0.1)
    server = gateway(tmp_path / "state", upstream, concurrency=1)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)
    try:
        batch = submit(client, [line(f"r{i}", f"p{i}") for i in range(40)])
        wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 2, 20)
        cancelled = client.batches.cancel(batch.id)
        assert cancelled.status in ("cancelling", "cancelled")
        assert cancelled.cancelling_at is not None
        batch = wait_done(client, batch.id)
        assert batch.status == "cancelled" and batch.cancelled_at is not None
        done = batch.request_counts.completed
        assert 2 <= done < 40 and batch.request_counts.total == 40
        out = content(client, batch.output_file_id)
        assert [o["custom_id"] for o in out] == [f"r{i}" for i in range(done)]
        time.sleep(0.3)
        assert len(upstream.served) == done  # nothing dispatched after the cancel
        with pytest.raises(openai.BadRequestError, match="cancelled"):
            client.batches.cancel(batch.id)
    finally:
        client.close()
        server.stop()


def test_a_batch_survives_a_gateway_restart_and_a_triton_outage(tmp_path):
    state = tmp_path / "state"
    first = FakeTriton(delay=0.05)
    server = gateway(state, first, concurrency=2)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)
    prompts = [f"line {i}" for i in range(30)]
    batch = submit(client, [line(f"r{i}", p) for i, p in enumerate(prompts)])
    wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 5, 20)
    client.close()
    server.stop()  # the gateway goes away mid-batch
    committed = BatchStore.open(state).batch(batch.id)
    assert committed is not None and committed["status"] == "in_progress"
    done_before = committed["request_counts"]["completed"]
    assert 5 <= done_before < 30

    second = FakeTriton(unavailable=6)  # and Triton is not back yet
    server = gateway(state, second, concurrency=2)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)
    try:
        batch = wait_done(client, batch.id)  # resumed at startup: nobody asked
        assert batch.status == "completed"
        assert batch.request_counts.model_dump() == {"total": 30, "completed": 30, "failed": 0}
        out = content(client, batch.output_file_id)
        assert [o["custom_id"] for o in out] == [f"r{i}" for i in range(30)]  # each once
        assert [o["response"]["body"]["choices"][0]["text"] for o in out] == [
            p[::-1][:4] for p in prompts
        ]
        assert second.refused == 6  # the outage was waited out, no line failed
        again = set(first.prompts()) & set(second.prompts())
        assert len(again) <= 2  # at most the lines in flight at the stop ran twice
        assert set(second.prompts()) >= set(prompts[done_before + 2 :])
    finally:
        client.close()
        server.stop()


# -- the store and runner on their own -----------------------------------------------------
def test_the_store_commits_a_line_once_and_reopens_with_it(tmp_path):
    store = BatchStore.open(tmp_path)
    file = store.add_file("in.jsonl", "batch", jsonl([line("a"), line("b")]))
    requests = parse_batch_file(jsonl([line("a"), line("b")]))
    batch = store.create_batch("/v1/completions", file.id, "24h", 3600, None, requests)
    assert store.finish_line(batch["id"], 1, True, {"custom_id": "b"})
    assert not store.finish_line(batch["id"], 1, False, {"custom_id": "b"})  # already done
    store.close()
    store = BatchStore.open(tmp_path)
    assert [p.custom_id for p in store.pending_lines(batch["id"])] == ["a"]
    assert store.active_batches() == [batch["id"]]
    assert store.batch(batch["id"])["request_counts"] == {"total": 2, "completed": 1, "failed": 0}
    store.close()


def test_an_expired_batch_reports_its_unrun_lines(tmp_path):
    async def scenario() -> dict[str, Any]:
        store = BatchStore.open(tmp_path, clock=lambda: 1000.0)
        requests = parse_batch_file(jsonl([line(f"r{i}") for i in range(3)]))
        batch = store.create_batch("/v1/completions", "file-x", "24h", 60, None, requests)

        async def never(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
            raise OpenAIError(503, "Triton is down")

        runner = BatchRunner(store, never, concurrency=2, clock=lambda: 2000.0)  # past 1060
        runner.start(batch["id"])
        await asyncio.wait_for(asyncio.gather(*runner._tasks.values()), 10)
        result = store.batch(batch["id"])
        errors = store.file_path(result["error_file_id"]).read_text().splitlines()
        store.close()
        return result | {"lines": [json.loads(e) for e in errors]}

    batch = asyncio.run(scenario())
    assert batch["status"] == "expired" and batch["expired_at"] is not None
    assert batch["request_counts"] == {"total": 3, "completed": 0, "failed": 3}
    assert [e["error"]["code"] for e in batch["lines"]] == ["batch_expired"] * 3
    assert [e["custom_id"] for e in batch["lines"]] == ["r0", "r1", "r2"]


def test_no_state_directory_until_a_file_is_uploaded(served, tmp_path):
    client, _, _ = served
    assert client.batches.list().data == [] and client.files.list().data == []
    assert not (tmp_path / "state").exists()
    client.files.create(file=("in.jsonl", jsonl([line("a")])), purpose="batch")
    assert (tmp_path / "state" / "batches.sqlite3").is_file()


# -- quanta batch --------------------------------------------------------------------------
def test_quanta_batch_commands(served, tmp_path):
    from quanta.cli import app

    client, _, server = served
    requests = tmp_path / "requests.jsonl"
    requests.write_bytes(jsonl([line("a", "abc"), line("b", model="nope"), line("c", "xyz")]))
    cli = CliRunner()
    url = ["--url", server.url]
    result = cli.invoke(
        app,
        ["batch", "submit", str(requests), *url, "--wait", "--interval", "0.05",
         "--output", str(tmp_path / "out.jsonl"), "--errors", str(tmp_path / "err.jsonl"),
         "--metadata", "owner=me"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    batch_id = result.stdout.splitlines()[0]
    assert batch_id.startswith("batch_")
    assert f"{batch_id} completed: 2 completed, 1 failed, 3 total" in result.stdout
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in out] == ["a", "c"]
    errors = [json.loads(x) for x in (tmp_path / "err.jsonl").read_text().splitlines()]
    assert [e["custom_id"] for e in errors] == ["b"]
    assert client.batches.retrieve(batch_id).metadata == {"owner": "me"}

    result = cli.invoke(app, ["batch", "status", batch_id, *url, "--watch"])
    assert result.exit_code == 0 and "completed: 2 completed, 1 failed" in result.stdout
    result = cli.invoke(app, ["batch", "download", batch_id, *url])
    assert result.exit_code == 0
    assert [json.loads(x)["custom_id"] for x in result.stdout.splitlines()] == ["a", "c"]
    result = cli.invoke(app, ["batch", "list", *url])
    assert result.exit_code == 0 and batch_id in result.stdout
    result = cli.invoke(app, ["batch", "cancel", batch_id, *url])
    assert result.exit_code == 1 and "only a batch in progress" in result.stderr
    result = cli.invoke(app, ["batch", "status", "batch_nope", *url])
    assert result.exit_code == 1 and "No such Batch object" in result.stderr


def test_quanta_batch_reports_an_unreachable_gateway():
    from quanta.cli import app

    result = CliRunner().invoke(
        app, ["batch", "status", "batch_x", "--url", f"http://127.0.0.1:{free_port()}"]
    )
    assert result.exit_code == 1 and "cannot reach" in result.stderr


# -- end to end through Triton -------------------------------------------------------------
@pytest.mark.live
def test_a_batch_through_triton_equals_the_online_route(triton):
    url = triton.openai_url()
    client = openai.OpenAI(base_url=url, api_key="-", max_retries=0, timeout=60)
    bodies = [{"prompt": f"The number {i} is", "max_tokens": 6, "seed": i} for i in range(6)]
    lines = [line(f"n{i}", **body) for i, body in enumerate(bodies)]
    with client:
        batch = wait_done(client, submit(client, lines).id, timeout=120)
        assert batch.status == "completed", batch
        out = content(client, batch.output_file_id)
        assert [o["custom_id"] for o in out] == [f"n{i}" for i in range(6)]
        for o, body in zip(out, bodies, strict=True):
            online = client.completions.create(model=MODEL, **body)
            choice = o["response"]["body"]["choices"][0]
            assert choice["text"] == online.choices[0].text
            assert o["response"]["body"]["usage"] == online.usage.model_dump(exclude_none=True)
    assert (triton.state_dir() / "batches.sqlite3").is_file()


@pytest.mark.live
def test_a_killed_gateway_resumes_its_batch_through_triton(triton, tmp_path):
    """``quanta openai`` killed (SIGKILL: no shutdown at all) mid-batch, then started again
    on the same state directory: every line once in the output, in order."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "quanta.cli", "openai", "--triton-grpc-url", triton.grpc_url,
        "--port", str(port), "--state-dir", str(tmp_path / "state"), "--batch-concurrency", "1",
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}/v1"

    def start() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: _answers(f"{url}/models"), timeout=60)
        return proc

    proc = start()
    client = openai.OpenAI(base_url=url, api_key="-", max_retries=0, timeout=60)
    lines = [line(f"k{i}", f"Line {i} of the batch", max_tokens=24) for i in range(12)]
    try:
        batch = submit(client, lines)
        wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 3, 120)
        proc.kill()
        proc.wait()
        store = BatchStore.open(tmp_path / "state")
        left = store.batch(batch.id)
        store.close()
        assert left is not None and left["status"] == "in_progress", left
        assert 3 <= left["request_counts"]["completed"] < 12
        proc = start()
        batch = wait_done(client, batch.id, timeout=120)
        assert batch.status == "completed"
        assert batch.request_counts.model_dump() == {"total": 12, "completed": 12, "failed": 0}
        out = content(client, batch.output_file_id)
        assert [o["custom_id"] for o in out] == [f"k{i}" for i in range(12)]
        assert all(o["response"]["body"]["usage"]["completion_tokens"] > 0 for o in out)
    finally:
        client.close()
        proc.kill()
        proc.wait()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False
