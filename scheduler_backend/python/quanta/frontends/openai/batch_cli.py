"""``quanta batch``: the gateway's Batch API from the shell, for people without the SDK.

``submit`` uploads a JSONL file and creates a batch (``--wait``: a progress bar until it ends,
then the results written where ``--output``/``--errors`` say); ``status`` prints where a batch
stands (``--watch``: the bar); ``download`` writes its output and error files; ``list`` and
``cancel`` do what they say. It speaks plain HTTP (the standard library's urllib), so it needs
nothing the gateway does not.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Annotated, Any

import typer

batch_app = typer.Typer(help="OpenAI Batch API jobs on a Quanta gateway.", no_args_is_help=True)
DONE = ("completed", "failed", "expired", "cancelled")

UrlOpt = Annotated[
    str, typer.Option(help="the OpenAI gateway (quanta openai, or quanta serve --openai-port)")
]
DEFAULT_URL = "http://127.0.0.1:9000"


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    """Add ``batch`` to the main app."""
    app.add_typer(batch_app, name="batch")


class GatewayClient:
    """The few Files and Batches calls the commands make; errors end the command."""

    def __init__(self, url: str, timeout: float = 60.0) -> None:
        base = url.rstrip("/")
        self.base = base if base.endswith("/v1") else f"{base}/v1"
        self.timeout = timeout

    def upload(self, path: Path) -> dict[str, Any]:
        boundary = uuid.uuid4().hex
        parts = [
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n',
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
            f'filename="{path.name}"\r\nContent-Type: application/jsonl\r\n\r\n',
        ]
        data = "".join(parts).encode() + path.read_bytes() + f"\r\n--{boundary}--\r\n".encode()
        return self._json("POST", "/files", data, f"multipart/form-data; boundary={boundary}")

    def create(self, file_id: str, endpoint: str, metadata: dict[str, str]) -> dict[str, Any]:
        body = {"input_file_id": file_id, "endpoint": endpoint, "completion_window": "24h"}
        if metadata:
            body["metadata"] = metadata  # type: ignore[assignment]
        return self._json("POST", "/batches", json.dumps(body).encode(), "application/json")

    def batch(self, batch_id: str) -> dict[str, Any]:
        return self._json("GET", f"/batches/{batch_id}")

    def batches(self, limit: int) -> dict[str, Any]:
        return self._json("GET", f"/batches?limit={limit}")

    def cancel(self, batch_id: str) -> dict[str, Any]:
        return self._json("POST", f"/batches/{batch_id}/cancel", b"", "application/json")

    def content(self, file_id: str) -> bytes:
        return self._call("GET", f"/files/{file_id}/content")

    def _json(
        self, method: str, path: str, data: bytes | None = None, kind: str | None = None
    ) -> dict[str, Any]:
        return json.loads(self._call(method, path, data, kind))  # type: ignore[no-any-return]

    def _call(
        self, method: str, path: str, data: bytes | None = None, kind: str | None = None
    ) -> bytes:
        headers = {} if kind is None else {"Content-Type": kind}
        request = urllib.request.Request(
            self.base + path, data=data, method=method, headers=headers
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return response.read()  # type: ignore[no-any-return]
        except urllib.error.HTTPError as exc:
            fail(f"{exc.code} from {self.base}{path}: {_message(exc.read())}")
        except urllib.error.URLError as exc:
            fail(f"cannot reach {self.base}: {exc.reason}")


def fail(message: str) -> Any:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


@batch_app.command()
def submit(
    file: Annotated[Path, typer.Argument(help="JSONL: one request per line", exists=True)],
    url: UrlOpt = DEFAULT_URL,
    endpoint: Annotated[
        str | None,
        typer.Option(help="/v1/completions or /v1/chat/completions (default: the lines' url)"),
    ] = None,
    metadata: Annotated[
        list[str] | None, typer.Option(help="key=value kept with the batch (repeatable)")
    ] = None,
    wait: Annotated[bool, typer.Option(help="show progress until the batch ends")] = False,
    output: Annotated[Path | None, typer.Option(help="with --wait: write the results here")] = None,
    errors: Annotated[
        Path | None, typer.Option(help="with --wait: write the failed lines here")
    ] = None,
    interval: Annotated[float, typer.Option(min=0.05, help="seconds between polls")] = 1.0,
) -> None:
    """Upload FILE and start a batch of its requests; prints the batch id."""
    pairs = dict(_pair(item) for item in metadata or ())
    client = GatewayClient(url)
    endpoint = endpoint or _endpoint_of(file)
    uploaded = client.upload(file)
    batch = client.create(uploaded["id"], endpoint, pairs)
    typer.echo(batch["id"])
    if wait:
        batch = _watch(client, batch, interval)
        _report(batch)
        _download(client, batch, output, errors)
        if batch["status"] != "completed":
            raise typer.Exit(1)


@batch_app.command()
def status(
    batch_id: Annotated[str, typer.Argument(help="batch_...")],
    url: UrlOpt = DEFAULT_URL,
    watch: Annotated[bool, typer.Option(help="show progress until the batch ends")] = False,
    interval: Annotated[float, typer.Option(min=0.05, help="seconds between polls")] = 1.0,
) -> None:
    """Print a batch's status and request counts."""
    client = GatewayClient(url)
    batch = client.batch(batch_id)
    if watch:
        batch = _watch(client, batch, interval)
    _report(batch)


@batch_app.command()
def download(
    batch_id: Annotated[str, typer.Argument(help="batch_...")],
    url: UrlOpt = DEFAULT_URL,
    output: Annotated[
        Path | None, typer.Option(help="write the results here (default: standard output)")
    ] = None,
    errors: Annotated[Path | None, typer.Option(help="write the failed lines here")] = None,
) -> None:
    """Write a finished batch's output file (and error file), lines in input order."""
    client = GatewayClient(url)
    batch = client.batch(batch_id)
    if batch["status"] not in DONE:
        fail(f"batch {batch_id} is {batch['status']}: its files are written when it ends")
    if output is None and batch["output_file_id"] is not None:
        sys.stdout.buffer.write(client.content(batch["output_file_id"]))
        sys.stdout.flush()
    _download(client, batch, output, errors)


@batch_app.command("list")
def list_batches(
    url: UrlOpt = DEFAULT_URL,
    limit: Annotated[int, typer.Option(min=1, max=100, help="how many, newest first")] = 20,
) -> None:
    """The latest batches: id, status, counts."""
    for batch in GatewayClient(url).batches(limit)["data"]:
        _report(batch)


@batch_app.command()
def cancel(
    batch_id: Annotated[str, typer.Argument(help="batch_...")], url: UrlOpt = DEFAULT_URL
) -> None:
    """Cancel a batch: what finished stays in its output and error files."""
    _report(GatewayClient(url).cancel(batch_id))


# -- helpers -----------------------------------------------------------------------------------
def _watch(client: GatewayClient, batch: dict[str, Any], interval: float) -> dict[str, Any]:
    """Poll until the batch ends, with a progress bar of its answered requests."""
    from rich.progress import MofNCompleteColumn, Progress, TimeElapsedColumn

    columns = (*Progress.get_default_columns()[:-1], MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=False) as bars:
        bar = bars.add_task(batch["id"], total=None)
        while True:
            counts = batch["request_counts"]
            bars.update(
                bar,
                total=counts["total"] or None,
                completed=counts["completed"] + counts["failed"],
                description=f"{batch['id']} {batch['status']}",
            )
            if batch["status"] in DONE:
                return batch
            time.sleep(interval)
            batch = client.batch(batch["id"])


def _report(batch: dict[str, Any]) -> None:
    counts = batch["request_counts"]
    typer.echo(
        f"{batch['id']} {batch['status']}: {counts['completed']} completed, "
        f"{counts['failed']} failed, {counts['total']} total"
    )
    for error in (batch.get("errors") or {}).get("data") or ():
        typer.echo(f"  line {error.get('line')}: {error.get('message')}")


def _download(
    client: GatewayClient, batch: dict[str, Any], output: Path | None, errors: Path | None
) -> None:
    for path, file_id, what in (
        (output, batch["output_file_id"], "results"),
        (errors, batch["error_file_id"], "failed lines"),
    ):
        if path is None:
            continue
        content = b"" if file_id is None else client.content(file_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        lines = content.count(b"\n")
        typer.echo(f"wrote {lines} {what} to {path}", err=True)


def _endpoint_of(file: Path) -> str:
    """The url of the file's first request (the gateway checks that every line agrees)."""
    with file.open("rb") as lines:
        for raw in lines:
            if raw.strip():
                try:
                    url = json.loads(raw).get("url")
                except (ValueError, AttributeError):
                    break
                if isinstance(url, str):
                    return url
                break
    return fail(f"{file}: cannot tell the endpoint from its first line; give --endpoint")


def _pair(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise typer.BadParameter(f"{item!r} is not key=value", param_hint="--metadata")
    return key, value


def _message(raw: bytes) -> str:
    """The message of an OpenAI-shaped error body (else the body itself)."""
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw.decode(errors="replace")
