"""Content hashes of full KV blocks: the names under which the prefix cache shares them.

Block ``i`` of a request is named by a digest chained over block ``i - 1``'s name and the
block's token ids, so a name stands for the whole prefix up to the block's end, not only its
own tokens: two requests share block ``i`` exactly when their first ``(i + 1) * block_size``
tokens agree. The chain starts from a root that names what the blocks hold (K and V; a
different salt for anything else that changes them, such as an adapter), so caches of
different content never meet.

BLAKE2b with a 128-bit digest rather than Python's ``hash``: the cache is shared between
tenants, and a name one tenant could collide on purpose would hand it another tenant's KV.
"""

from __future__ import annotations

from array import array
from hashlib import blake2b

from quanta.core.request import Request

KV_ROOT = b"quanta-kv-v1"


def block_hashes(request: Request, block_size: int, num_blocks: int) -> list[bytes]:
    """The request's chain extended to at least ``num_blocks`` full blocks (memoized on the
    request: its tokens only ever grow, so a name once computed never changes)."""
    chain = request.block_hashes
    tokens = request.all_token_ids
    num_blocks = min(num_blocks, len(tokens) // block_size)
    while len(chain) < num_blocks:
        i = len(chain)
        parent = chain[-1] if chain else KV_ROOT
        ids = array("q", tokens[i * block_size : (i + 1) * block_size])
        chain.append(blake2b(parent + ids.tobytes(), digest_size=16).digest())
    return chain


def cacheable_blocks(request: Request, block_size: int) -> int:
    """Full blocks of the request's tokens a prefix hit may cover: the last token is always
    computed, so its logits exist to sample from."""
    return max(0, request.num_tokens - 1) // block_size
