"""Block hashes for prefix caching: a full block's identity is its tokens and everything before it."""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence

BlockHash = bytes


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], salt: str | None = None
) -> BlockHash:
    """sha256 of (parent hash, block tokens, salt).

    Chaining the parent makes a hash stand for the whole prefix up to the block's end. The salt
    goes into the first block only and so reaches every later block through the chain: requests
    with different salts (tenants) never share a block. A cryptographic hash, not Python's
    ``hash``, because one tenant must not be able to craft a prompt that collides with another's.
    """
    encoded = pickle.dumps((parent, tuple(token_ids), salt), protocol=pickle.HIGHEST_PROTOCOL)
    return hashlib.sha256(encoded).digest()


def extend_block_hashes(
    block_hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, salt: str | None
) -> None:
    """Append the hashes of the full blocks of ``token_ids`` that ``block_hashes`` lacks."""
    num_full = len(token_ids) // block_size
    for index in range(len(block_hashes), num_full):
        parent = block_hashes[-1] if block_hashes else None
        block_tokens = token_ids[index * block_size : (index + 1) * block_size]
        block_hashes.append(hash_block(parent, block_tokens, salt if index == 0 else None))
