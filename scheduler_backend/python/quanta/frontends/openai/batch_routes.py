"""OpenAI's Files and Batches routes, as the official ``openai`` client calls them.

``/v1/files`` takes batch input files (``purpose=batch``), checked line by line on upload so a
bad file is a 400 naming its first bad line, and serves the output and error files batches
write. ``/v1/batches`` creates, lists, retrieves and cancels batches; ``BatchRunner`` runs them.

With API keys (``scoped``), files and batches belong to the tenant of the key that made them:
another tenant's are not found (404), listings show only the caller's own, and a batch's
lines run as its owner's tenant whatever their bodies say.

The store opens on first use, not at startup: a gateway that never sees a batch writes nothing
to disk. A state directory an earlier run left is opened at startup, and its unfinished
batches resume.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, File, Form, Query, Request, UploadFile
from fastapi.responses import FileResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from quanta.frontends.openai.auth import principal_of
from quanta.frontends.openai.batch_input import ENDPOINTS, BatchFileError, parse_batch_file
from quanta.frontends.openai.batch_runner import Answer, BatchRunner
from quanta.frontends.openai.batch_store import ACTIVE, ANY, BatchStore, FileRecord
from quanta.frontends.openai.errors import OpenAIError, invalid

WINDOWS = {"24h": 24 * 3600}  # completion windows OpenAI offers, in seconds
MetaKey = Annotated[str, Field(max_length=64)]  # OpenAI's limits on metadata
MetaValue = Annotated[str, Field(max_length=512)]


class BatchCreate(BaseModel):
    """``POST /v1/batches``."""

    model_config = ConfigDict(extra="forbid", strict=True)

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

    def __init__(
        self,
        state_dir: Path,
        answer: Answer,
        *,
        concurrency: int,
        scoped: bool = False,
    ) -> None:
        self.state_dir = state_dir
        self._answer = answer
        self._concurrency = concurrency
        self._scoped = scoped
        self._runner: BatchRunner | None = None
        self._opening = asyncio.Lock()
        self.router = APIRouter(prefix="/v1")
        self.router.post("/files")(self.upload)  # its own body limit: limits.BodyLimit
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
    def _owner(self, request: Request) -> str | None:
        """The tenant whose files and batches ``request`` may see: ``ANY`` without keys."""
        if not self._scoped:
            return ANY
        principal = principal_of(request.scope)
        return None if principal is None else principal.tenant

    async def upload(
        self,
        request: Request,
        file: Annotated[UploadFile, File()],
        purpose: Annotated[str, Form()],
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
        owner = self._owner(request)
        record = await asyncio.to_thread(
            store.add_file, name, purpose, content, None if owner == ANY else owner
        )
        return record.object()

    async def list_files(
        self,
        request: Request,
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
            owner=self._owner(request),
        )
        return _page([r.object() for r in records], more)

    async def retrieve_file(self, request: Request, file_id: str) -> dict[str, Any]:
        return (await self._file(file_id, self._owner(request))).object()

    async def file_content(self, request: Request, file_id: str) -> FileResponse:
        record = await self._file(file_id, self._owner(request))
        runner = await self._open()
        path = runner.store.file_path(record.id)
        return FileResponse(path, media_type="application/octet-stream", filename=record.filename)

    async def delete_file(self, request: Request, file_id: str) -> dict[str, Any]:
        await self._file(file_id, self._owner(request))  # another tenant's: not found
        runner = await self._open()
        if not await asyncio.to_thread(runner.store.delete_file, file_id):
            raise _no_such("File", file_id, "file_id")
        return {"id": file_id, "object": "file", "deleted": True}

    # -- batches -------------------------------------------------------------------------------
    async def create(self, request: Request, body: BatchCreate) -> dict[str, Any]:
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
        owner = self._owner(request)
        record = await self._file(body.input_file_id, owner, param="input_file_id")
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
            None if owner == ANY else owner,
        )
        if batch["status"] in ACTIVE:
            runner.start(batch["id"])
        return batch

    async def list_batches(
        self,
        request: Request,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
        after: str | None = None,
    ) -> dict[str, Any]:
        runner = await self._opened()
        if runner is None:
            return _page([], False)
        batches, more = await asyncio.to_thread(
            runner.store.batches, limit=limit, after=after, owner=self._owner(request)
        )
        return _page(batches, more)

    async def retrieve(self, request: Request, batch_id: str) -> dict[str, Any]:
        return await self._batch(batch_id, self._owner(request))

    async def _batch(self, batch_id: str, owner: str | None) -> dict[str, Any]:
        runner = await self._opened()
        batch = (
            None if runner is None else await asyncio.to_thread(runner.store.batch, batch_id, owner)
        )
        if batch is None:
            raise _no_such("Batch", batch_id, "batch_id")
        return batch

    async def cancel(self, request: Request, batch_id: str) -> dict[str, Any]:
        owner = self._owner(request)
        batch = await self._batch(batch_id, owner)
        if batch["status"] not in ("validating", "in_progress", "cancelling"):
            raise invalid(
                f"batch {batch_id} is {batch['status']}: only a batch in progress can be cancelled"
            )
        runner = await self._open()
        await runner.cancel(batch_id)
        return await self._batch(batch_id, owner)

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

    async def _file(
        self, file_id: str, owner: str | None = ANY, param: str = "file_id"
    ) -> FileRecord:
        runner = await self._opened()
        record = (
            None if runner is None else await asyncio.to_thread(runner.store.file, file_id, owner)
        )
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
