"""OpenAI's Files and Batches routes, as the official ``openai`` client calls them.

``/v1/files`` takes batch input files (``purpose=batch``), checked line by line on upload so a
bad file is a 400 naming its first bad line, and serves the output and error files batches
write. ``/v1/batches`` creates, lists, retrieves and cancels batches; ``BatchRunner`` runs them.

The store opens on first use, not at startup: a gateway that never sees a batch writes nothing
to disk. A state directory an earlier run left is opened at startup, and its unfinished
batches resume.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, File, Form, Query, UploadFile
from fastapi.responses import FileResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from quanta.frontends.openai.batch_input import ENDPOINTS, BatchFileError, parse_batch_file
from quanta.frontends.openai.batch_runner import Answer, BatchRunner
from quanta.frontends.openai.batch_store import ACTIVE, BatchStore, FileRecord
from quanta.frontends.openai.errors import OpenAIError, invalid

WINDOWS = {"24h": 24 * 3600}  # completion windows OpenAI offers, in seconds
MetaKey = Annotated[str, Field(max_length=64)]  # OpenAI's limits on metadata
MetaValue = Annotated[str, Field(max_length=512)]


class BatchCreate(BaseModel):
    """``POST /v1/batches``."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[MetaKey, MetaValue] | None = None

    @field_validator("metadata")
    @classmethod
    def _at_most_16(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and len(value) > 16:
            raise ValueError("metadata holds at most 16 pairs")
        return value


class BatchService:
    """The routes (``router``) and the runner behind them, for one state directory."""

    def __init__(self, state_dir: Path, answer: Answer, *, concurrency: int) -> None:
        self.state_dir = state_dir
        self._answer = answer
        self._concurrency = concurrency
        self._runner: BatchRunner | None = None
        self._opening = asyncio.Lock()
        self.router = APIRouter(prefix="/v1")
        self.router.post("/files")(self.upload)
        self.router.get("/files")(self.list_files)
        self.router.get("/files/{file_id}")(self.retrieve_file)
        self.router.get("/files/{file_id}/content", response_model=None)(self.file_content)
        self.router.delete("/files/{file_id}")(self.delete_file)
        self.router.post("/batches")(self.create)
        self.router.get("/batches")(self.list_batches)
        self.router.get("/batches/{batch_id}")(self.retrieve)
        self.router.post("/batches/{batch_id}/cancel")(self.cancel)

    async def start(self) -> None:
        """Resume the batches an earlier run left unfinished (the app's startup)."""
        if BatchStore.exists(self.state_dir):
            await (await self._open()).resume()

    async def stop(self) -> None:
        """Stop running batches (their lines in flight stay pending) and close the store."""
        if self._runner is not None:
            await self._runner.close()
            self._runner.store.close()
            self._runner = None

    # -- files ---------------------------------------------------------------------------------
    async def upload(
        self, file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()]
    ) -> dict[str, Any]:
        if purpose != "batch":
            raise invalid(f"purpose {purpose!r} is not supported (only 'batch')", "purpose")
        content = await file.read()
        try:
            await asyncio.to_thread(parse_batch_file, content)
        except BatchFileError as exc:
            name = file.filename or "the file"
            raise invalid(f"{name} is not a valid batch file: {exc}", "file") from None
        store = (await self._open()).store
        name = file.filename or "upload.jsonl"
        record = await asyncio.to_thread(store.add_file, name, purpose, content)
        return record.object()

    async def list_files(
        self,
        purpose: str | None = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
        after: str | None = None,
        order: Literal["asc", "desc"] = "desc",
    ) -> dict[str, Any]:
        runner = await self._opened()
        if runner is None:
            return _page([], False)
        records, more = await asyncio.to_thread(
            runner.store.files,
            purpose=purpose,
            limit=limit,
            after=after,
            descending=order == "desc",
        )
        return _page([r.object() for r in records], more)

    async def retrieve_file(self, file_id: str) -> dict[str, Any]:
        return (await self._file(file_id)).object()

    async def file_content(self, file_id: str) -> FileResponse:
        record = await self._file(file_id)
        runner = await self._open()
        path = runner.store.file_path(record.id)
        return FileResponse(path, media_type="application/octet-stream", filename=record.filename)

    async def delete_file(self, file_id: str) -> dict[str, Any]:
        runner = await self._opened()
        if runner is None or not await asyncio.to_thread(runner.store.delete_file, file_id):
            raise _no_such("File", file_id, "file_id")
        return {"id": file_id, "object": "file", "deleted": True}

    # -- batches -------------------------------------------------------------------------------
    async def create(self, body: BatchCreate) -> dict[str, Any]:
        if body.endpoint not in ENDPOINTS:
            raise invalid(
                f"endpoint {body.endpoint!r} is not supported (one of {', '.join(ENDPOINTS)})",
                "endpoint",
            )
        if body.completion_window not in WINDOWS:
            raise invalid(
                f"completion_window {body.completion_window!r} is not supported (only '24h')",
                "completion_window",
            )
        record = await self._file(body.input_file_id, param="input_file_id")
        if record.purpose != "batch":
            raise invalid(f"file {record.id} was not uploaded for a batch", "input_file_id")
        runner = await self._open()
        content = await asyncio.to_thread(runner.store.file_path(record.id).read_bytes)
        requests = await asyncio.to_thread(parse_batch_file, content)
        batch = await asyncio.to_thread(
            runner.store.create_batch,
            body.endpoint,
            record.id,
            body.completion_window,
            WINDOWS[body.completion_window],
            body.metadata,
            requests,
        )
        if batch["status"] in ACTIVE:
            runner.start(batch["id"])
        return batch

    async def list_batches(
        self, limit: Annotated[int, Query(ge=1, le=100)] = 20, after: str | None = None
    ) -> dict[str, Any]:
        runner = await self._opened()
        if runner is None:
            return _page([], False)
        batches, more = await asyncio.to_thread(runner.store.batches, limit=limit, after=after)
        return _page(batches, more)

    async def retrieve(self, batch_id: str) -> dict[str, Any]:
        runner = await self._opened()
        batch = None if runner is None else await asyncio.to_thread(runner.store.batch, batch_id)
        if batch is None:
            raise _no_such("Batch", batch_id, "batch_id")
        return batch

    async def cancel(self, batch_id: str) -> dict[str, Any]:
        batch = await self.retrieve(batch_id)
        if batch["status"] not in ("validating", "in_progress", "cancelling"):
            raise invalid(
                f"batch {batch_id} is {batch['status']}: only a batch in progress can be cancelled"
            )
        runner = await self._open()
        await runner.cancel(batch_id)
        return await self.retrieve(batch_id)

    # -- helpers -------------------------------------------------------------------------------
    async def _open(self) -> BatchRunner:
        """The runner and its store, opened (the state directory created) on first use."""
        async with self._opening:
            if self._runner is None:
                store = await asyncio.to_thread(BatchStore.open, self.state_dir)
                self._runner = BatchRunner(store, self._answer, concurrency=self._concurrency)
            return self._runner

    async def _opened(self) -> BatchRunner | None:
        """The runner if a store exists: reading routes create no state directory."""
        if self._runner is None and not BatchStore.exists(self.state_dir):
            return None
        return await self._open()

    async def _file(self, file_id: str, param: str = "file_id") -> FileRecord:
        runner = await self._opened()
        record = None if runner is None else await asyncio.to_thread(runner.store.file, file_id)
        if record is None:
            raise _no_such("File", file_id, param)
        return record


def _page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """A list in OpenAI's cursor-page shape (``after=last_id`` fetches the next page)."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def _no_such(kind: str, object_id: str, param: str) -> OpenAIError:
    return OpenAIError(404, f"No such {kind} object: {object_id}", param=param)
