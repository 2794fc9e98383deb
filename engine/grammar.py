"""Structured output: grammars that constrain what a request may generate (xgrammar).

A request's `SamplingParams.structured` is a (kind, spec) pair of plain strings, one of KINDS:

    json      a JSON schema (JSON text); "" for any JSON object (OpenAI's json_object)
    regex     a regular expression the whole output matches
    grammar   a context-free grammar: xgrammar's EBNF (GBNF-like, `root ::= ...`) or Lark (`start: ...`)
    choice    a JSON list of strings: the output is one of them

`Grammars` compiles them against the engine's tokenizer (compiled grammars are cached by their text), and
the scheduler gives each admitted request a `GrammarState` (Sequence.grammar) that follows its output
tokens. Before any token is decided, Sampler.adjust sets the logits of the tokens its grammar does not
allow next to -inf: the first token, a decode step's, and every node of a speculative tree (the state after
the node's drafted ancestors; a drafted token the grammar rejects is thereby never accepted). Masks are
computed on the host, for the requests with a grammar only; the others never touch this module.

xgrammar was chosen over llguidance by per-token mask cost with this tokenizer on the project's CPU
(benchmarks/grammar_mask_cost.py, benchmarks/RESULTS.md).
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator

import numpy as np
import torch

KINDS = ("json", "regex", "grammar", "choice")


class Grammars:
    """The engine's grammar compiler; xgrammar and the tokenizer's vocabulary index (a fraction of a second)
    are loaded by the first request with a grammar, never otherwise."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: tuple[int, ...]):
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, stop_ids
        self._compiler = None

    @property
    def compiler(self):
        if self._compiler is None:
            try:
                import xgrammar
            except ImportError:
                raise ValueError("structured output needs the xgrammar package (pip install xgrammar)") from None
            info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                           stop_token_ids=list(self.stop_ids))
            self._compiler = xgrammar.GrammarCompiler(info)
        return self._compiler

    def compile(self, structured: tuple[str, str]):
        """(kind, spec) -> xgrammar's CompiledGrammar; ValueError (one line) when the spec is malformed or
        something xgrammar does not support."""
        kind, spec = structured
        c = self.compiler
        try:
            if kind == "json":
                # Compact separators, no free whitespace: a small model left free to add whitespace can fill
                # its budget with it.
                return c.compile_json_schema(spec or '{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return c.compile_regex(spec)
            if kind == "grammar":
                return c.compile_grammar(spec) if "::=" in spec else c.compile_lark(spec)
            if kind == "choice":
                return c.compile_grammar(choice_ebnf(spec))
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"invalid {kind}: {clean_error(e)}") from None
        raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got {kind!r}")

    def check(self, structured: tuple[str, str]):
        self.compile(structured)

    def state(self, structured: tuple[str, str]) -> "GrammarState":
        """A fresh matcher at the grammar's start (the compile is a cache hit after `check`)."""
        import xgrammar
        return GrammarState(xgrammar.GrammarMatcher(self.compile(structured)), self.stop_ids, (self.vocab_size + 31) // 32)


def choice_ebnf(spec: str) -> str:
    """A JSON list of strings -> an EBNF grammar matching exactly one of them."""
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"not a JSON list of strings ({e.msg})") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("must be a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def clean_error(e: Exception) -> str:
    """xgrammar's message without its C++ log prefix ("[time] file.cc:123: Check failed: ... is false:")."""
    msg = str(e).strip()
    msg = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", msg)
    msg = re.sub(r"^Check failed: \(.*?\) is false:\s*", "", msg)
    return msg.splitlines()[0] if msg else type(e).__name__


class GrammarState:
    """One request's grammar, advanced by its output tokens (Scheduler.commit). The masks are int32 rows of
    ceil(V / 32) words, bit t of the row = token t allowed."""

    def __init__(self, matcher, stop_ids: tuple[int, ...], words: int):
        self.matcher, self.stop_ids, self.words = matcher, stop_ids, words

    def accept(self, token: int) -> bool:
        """Advance by a decided token; False (the state unchanged) if the grammar does not allow it."""
        return self.matcher.accept_token(token)

    @property
    def finished(self) -> bool:
        """The output is complete: the grammar took a stop token, or it allows nothing but one next."""
        m = self.matcher
        if m.is_terminated():
            return True
        if not m.is_completed():
            return False
        row = torch.zeros(1, self.words, dtype=torch.int32)
        m.fill_next_token_bitmask(row)
        allowed = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")
        allowed[list(self.stop_ids)] = 0
        return not allowed.any()

    def fill(self, out: torch.Tensor, index: int = 0):
        """The mask of the next token into out[index] (out: int32 [n, W] on the host)."""
        if not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(out, index)

    def walk(self, tokens: list[int], parents: list[int]) -> Iterator[int]:
        """The nodes of a draft tree (node 0: the last output token, already taken) the grammar can reach:
        each node's drafted ancestors and itself allowed in order, none past a stop token. Each is yielded while
        the state is the one after it (depth first); the state is left as it was."""
        children = [[] for _ in tokens]
        for i, p in enumerate(parents):
            if p >= 0:
                children[p].append(i)

        def visit(i: int):
            yield i
            if self.matcher.is_terminated():
                return
            for c in children[i]:
                if self.matcher.accept_token(tokens[c]):
                    yield from visit(c)
                    self.matcher.rollback(1)
        yield from visit(0)

    def fill_tree(self, tokens: list[int], parents: list[int], out: torch.Tensor):
        """Per node of a draft tree, the mask of the token after it. out: int32 [N, W] on the host, all ones on
        entry; a node the grammar cannot reach keeps them: it can never be accepted, so its row decides nothing."""
        for i in self.walk(tokens, parents):
            self.fill(out, i)
