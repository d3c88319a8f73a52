"""The Batch API's state in SQLite: uploaded files, batches, and one row per request line.

Why SQLite (in WAL mode): a batch has to outlive the gateway process and Triton restarts. Each
answered line is committed in a transaction of its own before it counts, so a crash loses only
the lines in flight, never half a result; ``finish_line`` moves only a pending line, so no line
is answered twice. Status polls read while the runner writes.

File contents live on disk under ``<state_dir>/files/`` (written, then renamed into place
before their row is committed, so a file row always has its whole content); the rows hold
metadata. With API keys, each file and batch has an ``owner`` (the tenant of the key that
made it, or of the batch that wrote it), and a caller sees only its own: ``owner=ANY`` (no
keys) sees everything. Every method is synchronous and serialised by a lock: the async side
calls them through ``asyncio.to_thread`` so the gateway's event loop keeps serving online
requests while a large file is validated or an output file written.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from quanta.frontends.openai.batch_input import BatchLine

Status = Literal[
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
]
ACTIVE: tuple[Status, ...] = ("validating", "in_progress", "finalizing", "cancelling")
_STAMPED = (  # statuses with a ``<status>_at`` time
    "in_progress",
    "finalizing",
    "completed",
    "failed",
    "expired",
    "cancelling",
    "cancelled",
)
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    owner TEXT
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,
    output_file_id TEXT,
    error_file_id TEXT,
    errors TEXT,
    metadata TEXT,
    owner TEXT,
    created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    {", ".join(f"{name}_at INTEGER" for name in _STAMPED)}
);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    custom_id TEXT NOT NULL,
    body TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('pending', 'ok', 'failed')),
    result TEXT,
    PRIMARY KEY (batch_id, idx)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS lines_state ON lines (batch_id, state);
"""


ANY = "*any*"  # an owner filter that matches every owner (a gateway without keys)


@dataclass(frozen=True, slots=True)
class FileRecord:
    id: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    owner: str | None = None

    def object(self) -> dict[str, Any]:
        """The OpenAI ``file`` object."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
        }


@dataclass(frozen=True, slots=True)
class PendingLine:
    index: int  # 0-based position among the file's requests: the output's order
    custom_id: str
    body: dict[str, Any]


class BatchStore:
    """Files, batches and lines under one state directory; use ``BatchStore.open``."""

    def __init__(self, root: Path, db: sqlite3.Connection, clock: Callable[[], float]) -> None:
        self.root = root
        self._db = db
        self._clock = clock
        self._lock = threading.Lock()

    @classmethod
    def open(cls, state_dir: Path, clock: Callable[[], float] = time.time) -> BatchStore:
        """Open (creating if need be) the store in ``state_dir``."""
        (state_dir / "files").mkdir(parents=True, exist_ok=True)
        for partial in (state_dir / "files").glob("*.part"):  # a write a crash cut short
            partial.unlink()
        db = sqlite3.connect(
            state_dir / "batches.sqlite3", isolation_level=None, check_same_thread=False
        )
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")  # WAL keeps commits atomic; fsync at checkpoints
        db.executescript(_SCHEMA)
        for table in ("files", "batches"):  # a state directory from before owners
            columns = {row["name"] for row in db.execute(f"PRAGMA table_info({table})")}
            if "owner" not in columns:
                db.execute(f"ALTER TABLE {table} ADD COLUMN owner TEXT")
        return cls(state_dir, db, clock)

    @staticmethod
    def exists(state_dir: Path) -> bool:
        return (state_dir / "batches.sqlite3").is_file()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- files ---------------------------------------------------------------------------------
    def add_file(
        self, filename: str, purpose: str, content: bytes, owner: str | None = None
    ) -> FileRecord:
        record = FileRecord(_new_id("file-"), filename, purpose, len(content), self._now(), owner)
        self._write(record.id, content)
        with self._tx() as db:
            db.execute(
                "INSERT INTO files (id, filename, purpose, bytes, created_at, owner) "
                "VALUES (?,?,?,?,?,?)",
                (record.id, filename, purpose, record.bytes, record.created_at, owner),
            )
        return record

    def file(self, file_id: str, owner: str | None = ANY) -> FileRecord | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
        record = None if row is None else _file(row)
        return record if record is not None and _owns(owner, record.owner) else None

    def files(
        self,
        *,
        purpose: str | None,
        limit: int,
        after: str | None,
        descending: bool = True,
        owner: str | None = ANY,
    ) -> tuple[list[FileRecord], bool]:
        """One page of files, newest first unless ``descending`` is False; and whether more."""
        where = ["1"] if purpose is None else ["purpose = :purpose"]
        if owner != ANY:
            where.append("owner IS :owner")
        if after is not None:
            cmp = "<" if descending else ">"
            where.append(f"seq {cmp} (SELECT seq FROM files WHERE id = :after)")
        sql = (
            f"SELECT * FROM files WHERE {' AND '.join(where)} "
            f"ORDER BY seq {'DESC' if descending else 'ASC'} LIMIT :n"
        )
        with self._lock:
            rows = self._db.execute(
                sql, {"purpose": purpose, "after": after, "n": limit + 1, "owner": owner}
            )
            records = [_file(row) for row in rows]
        return records[:limit], len(records) > limit

    def file_path(self, file_id: str) -> Path:
        return self.root / "files" / file_id

    def delete_file(self, file_id: str) -> bool:
        with self._tx() as db:
            deleted = db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount > 0
        if deleted:
            self.file_path(file_id).unlink(missing_ok=True)
        return deleted

    # -- batches -------------------------------------------------------------------------------
    def create_batch(
        self,
        endpoint: str,
        input_file_id: str,
        completion_window: str,
        window_s: int,
        metadata: dict[str, str] | None,
        requests: list[BatchLine],
        owner: str | None = None,
    ) -> dict[str, Any]:
        """A new batch of ``requests``: ``failed`` (with errors naming the lines) if a line's
        url is not ``endpoint``, else ``in_progress``. Returns the batch object."""
        errors = [
            {
                "code": "invalid_url",
                "message": f"the url of line {r.line} is {r.url}, not the batch's {endpoint}",
                "param": "url",
                "line": r.line,
            }
            for r in requests
            if r.url != endpoint
        ]
        now, batch_id = self._now(), _new_id("batch_")
        status = "failed" if errors else "in_progress"
        with self._tx() as db:
            db.execute(
                "INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, "
                f"errors, metadata, owner, created_at, expires_at, {status}_at) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (
                    batch_id,
                    endpoint,
                    input_file_id,
                    completion_window,
                    status,
                    json.dumps({"object": "list", "data": errors}) if errors else None,
                    None if metadata is None else json.dumps(metadata),
                    owner,
                    now,
                    now + window_s,
                    now,
                ),
            )
            if not errors:
                db.executemany(
                    "INSERT INTO lines (batch_id, idx, custom_id, body, state) "
                    "VALUES (?,?,?,?,'pending')",
                    [
                        (batch_id, i, r.custom_id, json.dumps(r.body))
                        for i, r in enumerate(requests)
                    ],
                )
        batch = self.batch(batch_id)
        assert batch is not None
        return batch

    def batch(self, batch_id: str, owner: str | None = ANY) -> dict[str, Any] | None:
        """The OpenAI ``batch`` object, request counts included."""
        with self._lock:
            row = self._db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None or not _owns(owner, row["owner"]):
                return None
            return self._batch(row)

    def batch_owner(self, batch_id: str) -> str | None:
        """The tenant whose key created the batch (None: made without keys)."""
        with self._lock:
            row = self._db.execute(
                "SELECT owner FROM batches WHERE id = ?", (batch_id,)
            ).fetchone()
        return None if row is None else row["owner"]

    def batches(
        self, *, limit: int, after: str | None, owner: str | None = ANY
    ) -> tuple[list[dict[str, Any]], bool]:
        """One page of batches, newest first; and whether more follow."""
        where = "1" if after is None else "seq < (SELECT seq FROM batches WHERE id = :after)"
        if owner != ANY:
            where += " AND owner IS :owner"
        sql = f"SELECT * FROM batches WHERE {where} ORDER BY seq DESC LIMIT :n"
        with self._lock:
            rows = self._db.execute(
                sql, {"after": after, "n": limit + 1, "owner": owner}
            ).fetchall()
            objects = [self._batch(row) for row in rows[:limit]]
        return objects, len(rows) > limit

    def active_batches(self) -> list[str]:
        """Batches an earlier run left unfinished, oldest first."""
        marks = ",".join("?" * len(ACTIVE))
        with self._lock:
            rows = self._db.execute(
                f"SELECT id FROM batches WHERE status IN ({marks}) ORDER BY seq", ACTIVE
            )
            return [row["id"] for row in rows]

    def pending_lines(self, batch_id: str) -> list[PendingLine]:
        with self._lock:
            rows = self._db.execute(
                "SELECT idx, custom_id, body FROM lines "
                "WHERE batch_id = ? AND state = 'pending' ORDER BY idx",
                (batch_id,),
            ).fetchall()
        return [PendingLine(r["idx"], r["custom_id"], json.loads(r["body"])) for r in rows]

    def finish_line(self, batch_id: str, index: int, ok: bool, result: dict[str, Any]) -> bool:
        """Commit a line's result; False (and nothing changes) if it was not pending."""
        with self._tx() as db:
            cursor = db.execute(
                "UPDATE lines SET state = ?, result = ? "
                "WHERE batch_id = ? AND idx = ? AND state = 'pending'",
                ("ok" if ok else "failed", json.dumps(result), batch_id, index),
            )
            return cursor.rowcount == 1

    def set_status(self, batch_id: str, status: Status, *, only_from: tuple[Status, ...]) -> bool:
        """Move the batch to ``status`` (stamping ``<status>_at``) if it is in ``only_from``."""
        stamp = f", {status}_at = :now" if status in _STAMPED else ""
        marks = ",".join(f":s{i}" for i in range(len(only_from)))
        with self._tx() as db:
            cursor = db.execute(
                f"UPDATE batches SET status = :status{stamp} "
                f"WHERE id = :id AND status IN ({marks})",
                {"status": status, "now": self._now(), "id": batch_id}
                | {f"s{i}": s for i, s in enumerate(only_from)},
            )
            return cursor.rowcount == 1

    def finalize(
        self, batch_id: str, status: Status, unfinished: dict[str, Any] | None = None
    ) -> None:
        """End the batch as ``status``, writing its output and error files (input order).

        ``unfinished``: the ``error`` that lines still pending get in the error file (an
        expired batch's); None leaves them out (a cancelled batch's).
        """
        if unfinished is not None:
            for line in self.pending_lines(batch_id):
                self.finish_line(batch_id, line.index, False, unfinished_line(line, unfinished))
        written: dict[str, tuple[str, int] | None] = {}  # kind -> (file id, bytes)
        for state, kind in (("ok", "output"), ("failed", "error")):
            with self._lock:
                rows = self._db.execute(
                    "SELECT result FROM lines WHERE batch_id = ? AND state = ? ORDER BY idx",
                    (batch_id, state),
                ).fetchall()
            written[kind] = None
            if rows:
                content = "".join(f"{row['result']}\n" for row in rows).encode()
                file_id = _new_id("file-")
                self._write(file_id, content)
                written[kind] = (file_id, len(content))
        now = self._now()
        marks = ",".join("?" * len(ACTIVE))
        owner = self.batch_owner(batch_id)
        with self._tx() as db:
            for kind, file in written.items():
                if file is not None:
                    db.execute(
                        "INSERT INTO files (id, filename, purpose, bytes, created_at, owner) "
                        "VALUES (?,?,?,?,?,?)",
                        (file[0], f"{batch_id}_{kind}.jsonl", "batch_output", file[1], now, owner),
                    )
            db.execute(
                f"UPDATE batches SET status = ?, {status}_at = ?, output_file_id = ?, "
                f"error_file_id = ? WHERE id = ? AND status IN ({marks})",
                (
                    status,
                    now,
                    *(None if f is None else f[0] for f in written.values()),
                    batch_id,
                    *ACTIVE,
                ),
            )

    # -- helpers -------------------------------------------------------------------------------
    def _now(self) -> int:
        return int(self._clock())

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, committed on success and rolled back on an error."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _write(self, file_id: str, content: bytes) -> None:
        path = self.file_path(file_id)
        partial = path.with_suffix(".part")
        partial.write_bytes(content)
        partial.replace(path)

    def _batch(self, row: sqlite3.Row) -> dict[str, Any]:
        counts = dict.fromkeys(("pending", "ok", "failed"), 0)
        for state, n in self._db.execute(
            "SELECT state, COUNT(*) FROM lines WHERE batch_id = ? GROUP BY state", (row["id"],)
        ):
            counts[state] = n
        batch = {
            "id": row["id"],
            "object": "batch",
            "endpoint": row["endpoint"],
            "errors": None if row["errors"] is None else json.loads(row["errors"]),
            "input_file_id": row["input_file_id"],
            "completion_window": row["completion_window"],
            "status": row["status"],
            "output_file_id": row["output_file_id"],
            "error_file_id": row["error_file_id"],
            "created_at": row["created_at"],
            "expires_at": row["expires_at"],
        }
        batch |= {f"{name}_at": row[f"{name}_at"] for name in _STAMPED}
        batch["request_counts"] = {
            "total": sum(counts.values()),
            "completed": counts["ok"],
            "failed": counts["failed"],
        }
        batch["metadata"] = None if row["metadata"] is None else json.loads(row["metadata"])
        return batch


def unfinished_line(line: PendingLine, error: dict[str, Any]) -> dict[str, Any]:
    """The error-file line of a request that never ran (OpenAI's shape: no response)."""
    return {
        "id": _new_id("batch_req_"),
        "custom_id": line.custom_id,
        "response": None,
        "error": error,
    }


def _file(row: sqlite3.Row) -> FileRecord:
    return FileRecord(
        row["id"], row["filename"], row["purpose"], row["bytes"], row["created_at"], row["owner"]
    )


def _owns(caller: str | None, owner: str | None) -> bool:
    return caller in (ANY, owner)


def _new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"
