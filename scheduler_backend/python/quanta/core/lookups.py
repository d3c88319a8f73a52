"""Which waiting requests' prefix lookups still hold: a lookup is kept across steps until a
block name it read changes.

Why: the loop looks up every waiting request's cached prefix before every step, and walking
each request's chain of names again was, with 1,600 requests waiting on long shared
prefixes, many times the cost of the rest of the step. A lookup reads the names of the
blocks it found and the first name past them, where the walk stopped; its answer can change
only when one of those names comes into a tier's cache, leaves it, or is answered by another
block. The pools report each such name (``BlockPool.changed``), and only the requests that
read one are looked up again.
"""

from __future__ import annotations

from collections.abc import Iterable, KeysView, Sequence


class LookupMemo:
    """The requests whose latest lookup is current, and for each name the requests that read
    it. Holds ids and names only: the lookups' results stay with the block manager.

    A stale lookup keeps the names it read before the first one that changed (``resume_at``):
    their answers still hold, so the next lookup walks on from there, and only the names it
    reads past them are registered again. With long shared prefixes, a lookup goes stale
    mostly because a block came into the cache where its walk stopped, and walking and
    registering its whole chain again was most of what it cost."""

    def __init__(self) -> None:
        self._reads: dict[str, tuple[bytes, ...]] = {}  # current lookups: the names each read
        self._kept: dict[str, tuple[bytes, ...]] = {}  # stale ones: the names that still hold
        self._readers: dict[bytes, set[str]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._reads

    def current(self) -> KeysView[str]:
        """The requests whose latest lookup is current, as a live view: a membership test
        in C, for the loop that asks of every waiting request at every step."""
        return self._reads.keys()

    def resume_at(self, request_id: str) -> int:
        """How many of the names a stale lookup of ``request_id`` read still hold (0: none,
        or no lookup was made): a new walk may start there."""
        return len(self._kept.get(request_id, ()))

    def keep(self, request_id: str, reads: Sequence[bytes]) -> None:
        """``request_id`` was looked up, reading ``reads``: the names of the blocks found,
        then the one it stopped at (if it did not stop at its last name)."""
        reads = tuple(reads)
        kept = self._kept.pop(request_id, None)
        if kept is not None and reads[: len(kept)] == kept:
            new = reads[len(kept) :]  # NOTE: the names that held are registered still
        else:
            self._unregister(request_id, kept or ())
            self.drop(request_id)
            new = reads
        self._reads[request_id] = reads
        readers = self._readers
        for name in new:  # NOTE: no empty set made for a name that has readers already
            known = readers.get(name)
            if known is None:
                readers[name] = {request_id}
            else:
                known.add(request_id)

    def drop(self, request_id: str) -> None:
        """Forget the request's lookup (it holds blocks now, or left)."""
        reads = self._reads.pop(request_id, None)
        kept = self._kept.pop(request_id, None)
        self._unregister(request_id, reads if reads is not None else kept or ())

    def changed(self, names: Iterable[bytes]) -> None:
        """These names came into a cache, left it or moved: their readers are stale from the
        first of them they read."""
        first: dict[str, int] = {}
        for name in names:
            for request_id in self._readers.get(name, ()):
                reads = self._reads.get(request_id)
                if reads is None:
                    reads = self._kept[request_id]
                at = len(reads) - 1 if reads[-1] == name else reads.index(name)
                if at < first.get(request_id, len(reads)):
                    first[request_id] = at
        for request_id, at in first.items():
            reads = self._reads.pop(request_id, None)
            if reads is None:
                reads = self._kept[request_id]
            self._unregister(request_id, reads[at:])
            self._kept[request_id] = reads[:at]

    def clear(self) -> None:
        self._reads.clear()
        self._kept.clear()
        self._readers.clear()

    def __len__(self) -> int:
        return len(self._reads)

    def _unregister(self, request_id: str, names: Iterable[bytes]) -> None:
        for name in names:
            readers = self._readers[name]
            readers.discard(request_id)
            if not readers:
                del self._readers[name]
