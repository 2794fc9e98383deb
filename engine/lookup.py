"""Drafts read from the context (prompt lookup, n-gram speculation): where a sequence's last n tokens occurred
before, in its prompt or its own reply, the tokens that followed them then are proposed as its next ones. No
model runs: a round drafted this way costs its verification alone. Plain Python, no torch.

A small target repeats itself and quotes its prompt often enough that on chat prompts the last three tokens
recur in about one round of six, and there the tokens that followed them are accepted more often than the
EAGLE head's drafts (benchmarks/RESULTS.md, session 39). Verification keeps it lossless whatever is proposed.
"""
from __future__ import annotations


MOST = 8  # the longest chain a lookup proposes (a sequence copying a span: while its proposals are accepted whole)


class ContextIndex:
    """One sequence's n-grams: each -> the position after its latest occurrence, kept up to date as the
    sequence grows (only n-grams that something followed are indexed, so the last n tokens never find
    themselves)."""

    def __init__(self, n: int = 3):
        if n < 1:
            raise ValueError(f"lookup n-grams must be at least 1 token long, got {n}")
        self.n = n
        self.after: dict[tuple[int, ...], int] = {}
        self.indexed = n - 1  # n-grams ending before this position are in `after`
        self.last: tuple[int, list[int]] = (0, [])  # the last proposal: where it started, its tokens

    def propose(self, seq, k: int, most: int | None = None) -> list[int]:
        """Up to k tokens to follow `seq` (an engine Sequence: num_tokens, span): what followed the latest
        earlier occurrence of its last n tokens, [] where they never occurred. A match running into the end
        of the sequence (a repeating span) goes on periodically. Where the sequence went on exactly as the last
        proposal said (it is copying), up to twice as many, at most `most` (default k)."""
        n, L = self.n, seq.num_tokens
        at, said = self.last
        if said and seq.span(at, min(at + len(said), L)) == said:
            k = max(k, min(2 * len(said), k if most is None else most))
        if k <= 0 or L <= n:
            return []
        start = self.indexed - n + 1
        tail = seq.span(start, L)  # the tokens new since the last call, and the n - 1 before them
        for end in range(self.indexed, L - 1):  # the n-gram ending at `end`, followed by the token at end + 1
            self.after[tuple(tail[end - n + 1 - start:end + 1 - start])] = end + 1
        self.indexed = max(self.indexed, L - 1)
        p = self.after.get(tuple(tail[L - n - start:]))
        if p is None:
            self.last = (L, [])
            return []
        out = seq.span(p, min(p + k, L))
        while len(out) < k:  # past the end: the span p .. L - 1 repeats
            out.append(out[len(out) - (L - p)])
        self.last = (L, out)
        return out
