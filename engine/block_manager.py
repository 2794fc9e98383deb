"""Paged KV-cache bookkeeping in plain Python: a pool of fixed-size blocks and a block table per sequence.

A sequence's token at logical position p lives in slot `table[p // block_size] * block_size + p % block_size`
of the cache tensors (owned by the model runner). Speculative rounds append the whole draft tree, then
`truncate` back to the accepted length: blocks past it return to the pool at once. The target and a draft's
own cache (same block geometry, other tensors) share a sequence's table.

Prefix caching: a full block whose KV is final can be registered under a key (the scheduler's hash of every
token up to it and the one after it: prefix_keys). Blocks are reference counted; a registered block nobody
holds stays cached, LRU-evicted only when a fresh block is needed, and a new sequence whose prompt starts with
the same tokens takes it into its table (`share`) instead of recomputing it. Shared blocks are never written:
a sequence writes only past its shared prefix. A decoder that keeps its own state per slot (an EAGLE head's
KV) marks the blocks where it is final (`mark_side`), so a sharing sequence can skip recomputing it there.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict


class OutOfBlocks(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: recently freed blocks are reused first
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self.refs = [0] * num_blocks                     # tables holding each block
        self.key_of: dict[int, bytes] = {}               # registered block -> its prefix key
        self.by_key: dict[bytes, int] = {}
        self.cached: OrderedDict[int, None] = OrderedDict()  # registered blocks nobody holds, least recent first
        self.side: set[int] = set()  # blocks whose decoder-side state (a draft's KV) is final too (mark_side)

    @property
    def num_free(self) -> int:
        """Blocks a sequence can get: never used, or cached ones nobody holds (evicted on demand)."""
        return len(self._free) + len(self.cached)

    def _take(self) -> int:
        if self._free:
            block = self._free.pop()
        else:  # the least recently released cached block
            block, _ = self.cached.popitem(last=False)
            del self.by_key[self.key_of.pop(block)]
        self.refs[block] = 1
        self.side.discard(block)
        return block

    def _release(self, block: int):
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self.key_of:
                self.cached[block] = None
            else:
                self._free.append(block)

    def share(self, seq_id: int, keys: list[bytes]) -> int:
        """Start an empty sequence with the registered blocks of its prefix keys, as far as they are cached.
        -> the tokens shared."""
        if self.tables.get(seq_id):
            raise ValueError(f"sequence {seq_id} already has blocks")
        table = []
        for key in keys:
            block = self.by_key.get(key)
            if block is None:
                break
            if self.refs[block] == 0:
                del self.cached[block]
            self.refs[block] += 1
            table.append(block)
        if table:
            self.tables[seq_id], self.lengths[seq_id] = table, len(table) * self.block_size
        return len(table) * self.block_size

    def drop_cache(self):
        """Forget every registration; blocks nobody holds become plainly free."""
        self._free += list(self.cached)
        self.cached.clear()
        self.key_of.clear()
        self.by_key.clear()
        self.side.clear()

    def mark_side(self, seq_id: int, start: int, end: int):
        """A decoder wrote its own per-slot state (a draft head's KV) for positions [start, end) of the
        sequence, those before start being final already: the blocks wholly below `end` are complete for a
        later sequence that shares them (side_prefix)."""
        table, bs = self.tables[seq_id], self.block_size
        self.side.update(table[start // bs:end // bs])

    def side_prefix(self, seq_id: int, tokens: int) -> int:
        """Of the sequence's first `tokens` positions (a shared prefix), how many lead blocks whose
        decoder-side state is final cover. -> tokens."""
        n = 0
        for block in self.tables.get(seq_id, [])[:tokens // self.block_size]:
            if block not in self.side:
                break
            n += 1
        return n * self.block_size

    def register(self, seq_id: int, first: int, keys: list[bytes]):
        """Register the sequence's blocks first, first + 1, ... under `keys` (full, final blocks). A key
        already cached elsewhere keeps its block."""
        table = self.tables[seq_id]
        for block, key in zip(table[first:], keys):
            if key not in self.by_key and block not in self.key_of:
                self.by_key[key], self.key_of[block] = block, key

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def length(self, seq_id: int) -> int:
        return self.lengths.get(seq_id, 0)

    def allocate(self, seq_id: int, n: int):
        """Append room for n tokens. All or nothing: on OutOfBlocks nothing changes."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} tokens")
        table = self.tables.setdefault(seq_id, [])
        start = self.lengths.get(seq_id, 0)
        need = self.blocks_for(start + n) - len(table)
        if need > self.num_free:
            if not table:
                del self.tables[seq_id]
            raise OutOfBlocks(f"KV cache exhausted: sequence {seq_id} needs {need} more blocks, "
                              f"{self.num_free} of {self.num_blocks} free (raise --kv-cache-gb)")
        table.extend(self._take() for _ in range(need))
        self.lengths[seq_id] = start + n

    def reserve(self, seq_id: int, length: int):
        """Make the table cover `length` positions (a no-op if it already does)."""
        if length > self.length(seq_id):
            self.allocate(seq_id, length - self.length(seq_id))

    def slots(self, seq_id: int, start: int, end: int) -> list[int]:
        table, bs = self.tables[seq_id], self.block_size
        if not 0 <= start <= end <= self.lengths[seq_id]:
            raise IndexError(f"positions [{start}, {end}) outside sequence {seq_id} of length "
                             f"{self.lengths[seq_id]}")
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def truncate(self, seq_id: int, length: int):
        """Roll back to `length` tokens (rejected drafts); whole blocks past it go back to the pool."""
        if not 0 <= length <= self.lengths[seq_id]:
            raise ValueError(f"cannot truncate sequence {seq_id} of length {self.lengths[seq_id]} to {length}")
        table = self.tables[seq_id]
        keep = self.blocks_for(length)
        while len(table) > keep:
            self._release(table.pop())
        self.lengths[seq_id] = length

    def free(self, seq_id: int):
        for block in reversed(self.tables.pop(seq_id, [])):
            self._release(block)
        self.lengths.pop(seq_id, None)

    def block_table(self, seq_id: int) -> list[int]:
        return self.tables.get(seq_id, [])


def prefix_keys(tokens: list[int], block_size: int, start_key: bytes = b"", first: int = 0,
                blocks: int | None = None) -> list[bytes]:
    """Keys of the blocks first, first + 1, ... of a token sequence (`blocks` of them, or every block whose
    tokens and the token after it are known): a hash of all tokens up to the block's end and the next one,
    chained from the previous block's key (`start_key`). The next token is in because a draft head's KV at a
    block's last position depends on it (EAGLE pairs a position with the token after it)."""
    n = (len(tokens) - 1) // block_size - first if blocks is None else blocks
    keys, key = [], start_key
    for k in range(first, first + n):
        chunk = array("q", tokens[k * block_size:(k + 1) * block_size + 1])
        key = hashlib.blake2b(key + chunk.tobytes(), digest_size=16).digest()
        keys.append(key)
    return keys
