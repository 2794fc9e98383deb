"""The server's Prometheus metrics (GET /metrics). One registry per server, so tests can run several.

Speculation is counted per sequence-round: a round of a batch of B sequences is B sequence-rounds. A
round that drafted nothing (the adaptive policy turned speculation off, or vanilla) counts as plain. In
a speculative round a sequence gains its accepted drafts plus one token from the target, so its
acceptance length is the tokens it gained (1 = no draft accepted) and position p was reached when at
least p drafts were accepted.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()   # no *_created series: they double the page and nobody graphs them

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
LENGTH_BUCKETS = tuple(range(1, 17))


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("eagle_requests", "Finished requests by finish reason (stop, length, abort, "
                                "error)", ["method", "finish_reason"], registry=r)
        self.prompt_tokens = Counter("eagle_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("eagle_prompt_tokens_cached", "Of those, tokens the prefix cache held (not "
                                     "prefilled); the hit rate is this over eagle_prompt_tokens", registry=r)
        self.generation_tokens = Counter("eagle_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("eagle_time_to_first_token_seconds", "Arrival to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.itl = Histogram("eagle_inter_token_latency_seconds", "Gap between a request's emissions, "
                             "divided over the tokens emitted (one observation per token)", registry=r,
                             buckets=LATENCY_BUCKETS)
        self.latency = Histogram("eagle_request_latency_seconds", "Arrival to last token", registry=r,
                                 buckets=LATENCY_BUCKETS + (60.0, 120.0))
        self.waiting = Gauge("eagle_requests_waiting", "Requests queued for admission", registry=r)
        self.running = Gauge("eagle_requests_running", "Requests in the running batch", registry=r)
        self.kv_used = Gauge("eagle_kv_blocks_used", "KV-cache blocks in use", registry=r)
        self.kv_total = Gauge("eagle_kv_blocks_total", "KV-cache blocks in the pool", registry=r)
        self.round_seconds = Histogram("eagle_round_seconds", "Wall time of a decoding round", ["method"],
                                       registry=r, buckets=LATENCY_BUCKETS)
        self.depth = Histogram("eagle_spec_draft_depth", "Draft depth per decoding round (0: no drafts)",
                               ["method"], registry=r, buckets=tuple(range(0, 17)))
        self.spec_rounds = Counter("eagle_spec_rounds", "Sequence-rounds that verified drafts", ["method"],
                                   registry=r)
        self.plain_rounds = Counter("eagle_spec_plain_rounds", "Sequence-rounds that drafted nothing",
                                    ["method"], registry=r)
        self.accepted = Counter("eagle_spec_accepted_tokens", "Draft tokens accepted", ["method"], registry=r)
        self.lookups = Counter("eagle_spec_lookup_rounds", "Sequence-rounds whose drafts were read from the "
                               "context (prompt lookup) instead of drafted", ["method"], registry=r)
        self.accept_length = Histogram("eagle_spec_acceptance_length", "Tokens a sequence gained per "
                                       "speculative round (accepted drafts + 1)", ["method"], registry=r,
                                       buckets=LENGTH_BUCKETS)
        self.mean_length = Gauge("eagle_spec_mean_acceptance_length", "Mean tokens per speculative "
                                 "sequence-round", ["method"], registry=r)
        self.position_rate = Gauge("eagle_spec_acceptance_rate", "Fraction of speculative sequence-rounds "
                                   "that accepted at least `position` drafts", ["method", "position"], registry=r)
        self._reached: dict[str, list[int]] = {}   # method -> sequence-rounds reaching position p + 1
        self._rounds: dict[str, int] = {}
        self._accepted: dict[str, int] = {}

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def set_load(self, waiting: int, running: int, kv_used: int, kv_total: int):
        self.waiting.set(waiting)
        self.running.set(running)
        self.kv_used.set(kv_used)
        self.kv_total.set(kv_total)

    def tokens(self, arrived: float | None, last_emit: float | None, now: float, n: int):
        """A request emitted n tokens at `now`; `arrived` is given for its first emission."""
        if n <= 0:
            return
        self.generation_tokens.inc(n)
        if arrived is not None:
            self.ttft.observe(now - arrived)
            return
        for _ in range(n):
            self.itl.observe((now - last_emit) / n)

    def round(self, method: str, depth: int, gained: list[int], seconds: float, from_context: int = 0):
        """A decoding round that drafted `depth` deep; gained[b]: tokens sequence b kept; from_context of the
        sequences verified drafts read from the context."""
        self.round_seconds.labels(method).observe(seconds)
        self.depth.labels(method).observe(depth)
        if from_context:
            self.lookups.labels(method).inc(from_context)
        if depth == 0:
            self.plain_rounds.labels(method).inc(len(gained))
            return
        reached = self._reached.setdefault(method, [])
        for n in gained:
            self.accept_length.labels(method).observe(n)
            reached.extend([0] * (n - 1 - len(reached)))
            for p in range(n - 1):
                reached[p] += 1
        rounds = self._rounds[method] = self._rounds.get(method, 0) + len(gained)
        accepted = self._accepted[method] = self._accepted.get(method, 0) + sum(gained) - len(gained)
        self.spec_rounds.labels(method).inc(len(gained))
        self.accepted.labels(method).inc(sum(gained) - len(gained))
        self.mean_length.labels(method).set(1 + accepted / rounds)
        for p, count in enumerate(reached, 1):
            self.position_rate.labels(method, str(p)).set(count / rounds)

    def finished(self, method: str, req, reason: str):
        self.requests.labels(method, reason).inc()
        self.prompt_tokens.inc(req.prompt_tokens)
        self.cached_tokens.inc(req.seq.cached_tokens)
        if reason != "abort":
            self.latency.observe(time.perf_counter() - req.arrived)
