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
    it. Holds ids and names only: the lookups' results stay with the block manager."""

    def __init__(self) -> None:
        self._reads: dict[str, tuple[bytes, ...]] = {}  # current lookups: the names each read
        self._readers: dict[bytes, set[str]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._reads

    def current(self) -> KeysView[str]:
        """The requests whose latest lookup is current, as a live view: a membership test
        in C, for the loop that asks of every waiting request at every step."""
        return self._reads.keys()

    def keep(self, request_id: str, reads: Sequence[bytes]) -> None:
        """``request_id`` was looked up, reading ``reads``: the names of the blocks found,
        then the one it stopped at (if it did not stop at its last name)."""
        self.drop(request_id)
        reads = tuple(reads)
        self._reads[request_id] = reads
        for name in reads:
            self._readers.setdefault(name, set()).add(request_id)

    def drop(self, request_id: str) -> None:
        """Forget the request's lookup (it holds blocks now, or left)."""
        for name in self._reads.pop(request_id, ()):
            readers = self._readers[name]
            readers.discard(request_id)
            if not readers:
                del self._readers[name]

    def changed(self, names: Iterable[bytes]) -> None:
        """These names came into a cache, left it or moved: their readers are stale."""
        for name in names:
            for request_id in self._readers.get(name, set()).copy():
                self.drop(request_id)

    def clear(self) -> None:
        self._reads.clear()
        self._readers.clear()

    def __len__(self) -> int:
        return len(self._reads)
