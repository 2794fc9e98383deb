"""Paged KV-cache bookkeeping in plain Python: a pool of fixed-size blocks and a block table per sequence.

A sequence's token at logical position p lives in slot `table[p // block_size] * block_size + p % block_size`
of the cache tensors (owned by the model runner). Speculative rounds append the whole draft tree, then
`truncate` back to the accepted length: blocks past it return to the pool at once. The target and a draft's
own cache (same block geometry, other tensors) share a sequence's table.
"""
from __future__ import annotations


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

    @property
    def num_free(self) -> int:
        return len(self._free)

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
        if need > len(self._free):
            if not table:
                del self.tables[seq_id]
            raise OutOfBlocks(f"KV cache exhausted: sequence {seq_id} needs {need} more blocks, "
                              f"{len(self._free)} of {self.num_blocks} free (raise --kv-cache-gb)")
        table.extend(self._free.pop() for _ in range(need))
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
            self._free.append(table.pop())
        self.lengths[seq_id] = length

    def free(self, seq_id: int):
        for block in reversed(self.tables.pop(seq_id, [])):
            self._free.append(block)
        self.lengths.pop(seq_id, None)

    def block_table(self, seq_id: int) -> list[int]:
        return self.tables.get(seq_id, [])
