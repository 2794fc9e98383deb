"""How deep to speculate, decided per round from measured costs and live acceptance (plain Python, no torch).

A round that drafts d levels (d = 0: none, a plain decode step) verifies N_d tokens per sequence and yields
E[tokens | d] = 1 + r_1 + ... + r_d per sequence, r_j being the fraction of rounds whose accepted path
reached depth j. The batch's throughput is B * E[tokens | d] / seconds(B, d), so the policy picks

    d* = argmax_d  E[tokens | d] / seconds(B, d)

Speculation pays where verifying B * N_d rows costs about what B rows cost (a GPU at small batches, a CPU at
batch 1), and stops paying once the batch alone fills the device: then d* = 0.

- Acceptance: r_j = c_1 * ... * c_j, c_j being the chance that a path which reached depth j - 1 goes on to
  depth j: a running mean over the sequence-rounds that drafted at least j deep (a window of about WINDOW
  of them), starting from an optimistic prior (every draft accepted) worth PRIOR_WEIGHT observations. A
  depth played rarely keeps its c_j while the shallower c_i follow the live acceptance, so its estimate
  moves with the prompts' predictability as the played depths see it. Evidence ages: a c_j unobserved for
  a while (speculation off) counts half every HALF_LIFE rounds against what comes next, so after a request
  the head could not draft for, the next one's re-probes move the estimate (one probe round against a full
  window's worth of old evidence barely did: speculation stayed off for the requests after). A new request
  is expected to draft like requests in general, not like the one before it: its first round blends the
  batch's c_j toward the long-run means m_j (every observation, a window of LONG_WINDOW) by its share of the
  batch, as evidence worth FRESH_WEIGHT sequence-rounds at most, so one hard request does not keep
  speculation off for the next ones until a re-probe happens to come. The long-run mean of c_1 starts from
  the optimistic prior worth LONG_PRIOR sequence-rounds: the first request's few drafting rounds are not
  requests in general (the peers' first chat prompt, which the head drafts poorly for from its opening,
  left m_1 at ~0.2 after its first probes, and the next two requests decoded plainly end to end; session 30
  in benchmarks/RESULTS.md). Deeper c_j keep the light prior: observed only in deep rounds, a heavy one
  would outweigh their evidence for long.
- Cost: round wall times, kept per (batch bucket, d); batches are bucketed by powers of two. Samples taken
  at exactly this batch size are preferred; others in the bucket are scaled per sequence. The estimate is
  the fastest of SAMPLES rounds spread evenly over those played within the last STALE rounds (below), the
  newest first (all of them where fewer): contention on a shared machine only ever adds time, and comes in
  bursts that must not leave a depth played rarely with only slow samples, nor make the depth played through
  a burst look slower than the others; and a depth played every round is judged on as many rounds as one
  played now and then (the fastest of 64 rounds sits lower than the fastest of 8 of them: the played depth
  would look better than it is). With only its last SAMPLES rounds counted, a burst of ~25 rounds at ~1.8x
  filled the chain of 2's window; a new request starting as it ended then played one level, its fresh rounds
  fast against the chain's slow ones, for 143 rounds before the chain was timed again (traced on the Zen 4
  EPYC, session 36 in benchmarks/RESULTS.md).
  A round that built a step on a GPU (graph capture, kernel compilation; first-use allocations on a CPU)
  reports no time.
- Unmeasured shapes are predicted by one line fitted over the other measured shapes, seconds ~ a + b * rows
  (rows = B * N_d verified tokens); with fewer than two distinct row counts measured there is no
  prediction and the shape is simply tried. A shape measured once counts as the lower of its sample and
  the prediction, so one slow first run (a noisy neighbour) does not lock a depth out.
- To start drafting, a depth must promise MARGIN more than plain decoding (its value is discounted by
  1 + MARGIN): the round times it is judged by leave out what drafting costs around them (the head's
  weights and caches warming again after a pause, the longer commit), and a close call is not worth a
  loss. Once the best depth drafts, only STAY_MARGIN: its steady rounds' times hold those costs, and a
  full margin both ways gave up drafting that paid 5-10% (measured: `auto` at 1.01-1.05x vanilla where a
  fixed chain made 1.08-1.11x).
- Among drafting depths, the deepest one within DEEPER of the best is played. c_j is observed only in
  rounds that draft j deep, so a shallower depth played on a close call keeps the deeper one's c_j as it
  was, and a few unlucky rounds could keep it out for whole requests (traced on the Zen 5 EPYC at batch 1,
  where the chain's full depth was the better one on every prompt: benchmarks/RESULTS.md, session 28). At
  most DEEPER is given up where the shallower depth is truly better. It is wide because the depths' round
  times are sampled at different moments, on a CPU whose speed drifts by more than a level's share of a round
  (~7% at batch 1 on the Zen 5 EPYC): at 0.03, `auto` still drafted one level in 1220 of 1607 rounds of a run
  where the chain of 2 beat the chain of 1 on every prompt (session 30).
- Exploring: a new bucket first plays depth 0 for SAMPLES rounds (the baseline every depth is weighed
  against, measured over a window: a single cold first round must not make drafting look better than it
  is). Then the best measured depth is played, except that a depth whose value is close to the best (or
  cannot be predicted yet) is played until it has MIN_SAMPLES timed rounds in this bucket, as is one within
  NOISE of the best: one round's time varies by +-20% on a shared CPU, and the best depth's estimate is the
  fastest of a full window, so a single slow early round of a depth (it came out 1.2x its steady time and
  kept speculation off for two requests, measured) must not rule it out. A depth's timed rounds go stale
  STALE rounds after they were played: its estimate then comes from its fresh rounds alone once it has any,
  and a stale depth within NOISE of the best is a close call (re-probed as below): a shared CPU's speed
  drifts by 30% within minutes, and a depth last timed while a neighbour was busy kept its slow estimate
  against the played depth's fresh, fast one (traced on the EPYC: a whole request decoded plainly that
  drafting made faster before and after it). Settled depths are
  re-probed (the stalest first) while re-probes have taken less than PROBE_SHARE of the
  bucket's time. A stale depth outside the close calls is re-probed too, when it is the stalest of all,
  waiting for the budget it needs: a burst of contention can leave its whole window slow (8 slow rounds of
  depth 2 kept it out for 167 rounds while depth 1 played, traced on the Zen 5 EPYC in session 30), and the
  cheaper close calls took every probe it could have had. A probe's cost includes catching the draft up on the rounds that drafted nothing (an EAGLE
  head feeds every token since it last ran: after a long stretch at depth 0, more than the probe itself): the
  pairs the batch's draft is behind by, which the caller counts (a new request's prompt is no catch-up),
  times the seconds a pair last took.
- A prompt the draft has not read yet (an EAGLE head feeds a request's prompt in its first drafting round:
  ~0.1 ms a token on the CPU, 0.3 s for a 3000-token prompt) is drafting's one-off cost for that request: a
  depth's round time is charged its share, the feed spread over the rounds the rest of the reply takes at that
  depth (at most HORIZON tokens of it), and a re-probe is due only if the budget also covers the feed. For a
  long prompt and a short reply the feed costs more than drafting can gain (measured: 0.83-0.92x vanilla on
  1300-2900-token prompts before), and the request decodes plainly without ever feeding it. The seconds a
  prompt pair takes are measured from the feeds that happened (a running mean; not from a round whose time
  is no sample: a first use, with the head's weights gathered, took 10x). Close means within SLACK, a margin that widens by SLACK every AGING rounds the depth goes
  unplayed, since its estimates age: a burst of contention that made a depth look slow, or prompts that
  got easier to draft, is re-checked sooner or later, and nothing the measurements predict to be clearly
  worse is ever tried early, nor more than the budget allows.
"""
from __future__ import annotations

from collections import deque

SAMPLES = 8         # timed rounds that make a depth's window full (those of the last STALE rounds are kept)
WINDOW = 64         # sequence-rounds the acceptance rates average over
PRIOR_WEIGHT = 1    # sequence-rounds the optimistic prior (every draft accepted) is worth
HALF_LIFE = 32      # rounds unobserved after which an acceptance rate's evidence counts half
LONG_WINDOW = 1024  # sequence-rounds the long-run acceptance means average over
LONG_PRIOR = 12     # sequence-rounds the long-run mean of c_1's optimistic prior is worth
FRESH_WEIGHT = 8    # sequence-rounds a new request's share of the long-run mean counts as
SLACK = 0.1         # a depth within 10% of the best is a close call, worth re-probing ...
AGING = 100         # ... and the margin grows by SLACK every AGING rounds its estimate goes unrefreshed
PROBE_SHARE = 0.01  # of a bucket's round time, the most its re-probes may take
REUSE = 8           # rounds a plain decision (the best depth, settled, no probe due) holds at the same batch size
MARGIN = 0.1        # drafting's value is discounted by this much against plain decoding to start drafting ...
STAY_MARGIN = 0.02  # ... and by this much to go on (the bucket's best depth was a drafting one)
DEEPER = 0.10       # a deeper drafting depth this close to the best drafting depth is played instead
MIN_SAMPLES = 3     # timed rounds a depth is played before its estimate alone may rule it out ...
NOISE = 0.3         # ... while it is within this share of the best (one round's time: +-20% on a shared CPU)
STALE = 64          # rounds after which a depth's timed rounds are stale (a close call if within NOISE)
HORIZON = 256       # reply tokens a prompt's feed is spread over at most (replies often end well before their cap)


def bucket(batch: int) -> int:
    return 1 << max(0, batch - 1).bit_length()


class SpeculationPolicy:
    """verify_tokens[d]: tokens verified per sequence when drafting d levels (verify_tokens[0] = 1, the root)."""

    def __init__(self, verify_tokens: list[int]):
        if not verify_tokens or verify_tokens[0] != 1:
            raise ValueError(f"verify_tokens must start with 1 (the root alone), got {verify_tokens}")
        self.tokens = list(verify_tokens)
        self.depth = len(verify_tokens) - 1
        self.accept = [1.0] * (self.depth + 1)            # c_j (c_0 unused)
        self.weight = [float(PRIOR_WEIGHT)] * (self.depth + 1)
        self.seen = [0] * (self.depth + 1)                # the round c_j was last observed
        self.mean = [1.0] * (self.depth + 1)              # m_j: c_j over every observation (long run)
        self.mean_weight = [float(PRIOR_WEIGHT)] * (self.depth + 1)
        self.mean_weight[1:2] = [float(LONG_PRIOR)] * (self.depth > 0)
        self.samples: dict[tuple[int, int], deque] = {}   # (bucket, d) -> (batch, seconds, round)
        self.tried: dict[tuple[int, int], int] = {}       # (bucket, d) -> the round it was last played
        self.spent: dict[int, float] = {}                 # bucket -> seconds of all its rounds
        self.probed: dict[int, float] = {}                # bucket -> seconds of its re-probes
        self.settled: dict[int, int] = {}                 # bucket -> the best depth of its last decision
        self.catch_up = 0.0                               # seconds of draft catch-up per pair behind
        self.feed_rate = 0.0                              # seconds per prompt pair fed (0: none measured yet)
        self.rounds = 0
        self.held: tuple[int, int, int] | None = None     # (batch, depth, round) of the last plain decision

    def expected_tokens(self, d: int) -> float:
        """1 + r_1 + ... + r_d with r_j = c_1 * ... * c_j."""
        total, r = 1.0, 1.0
        for c in self.accept[1:d + 1]:
            r *= c
            total += r
        return total

    def choose(self, batch: int, behind: int = 0, fresh: int = 0, unfed: int = 0, remaining: float = HORIZON) -> int:
        """The depth to draft this round for a batch of `batch` sequences, whose draft is `behind` pairs behind
        (what a drafting round would first catch up on), `fresh` of them in their first decoding round (new
        requests), with `unfed` prompt pairs the draft has not read yet and `remaining` reply tokens a sequence
        may still produce (their mean). Weighing every depth costs ~30 us of Python, ~1% of a CPU decode step:
        a plain decision (the best depth, its SAMPLES window full, no probe due) holds for REUSE rounds at the
        same batch size (a probe falling due waits at most that long)."""
        if fresh:
            self.welcome(min(fresh, batch) / batch)
        held = self.held
        if held is not None and held[0] == batch and self.rounds - held[2] < REUSE:
            return held[1]
        self.held = None
        k, depths = bucket(batch), range(self.depth + 1)
        if len(self.samples.get((k, 0), ())) < SAMPLES and not any((k, d) in self.samples for d in depths[1:]):
            return 0  # a new bucket starts with the cheapest round, the baseline every depth is compared with
        seconds = [self.seconds(batch, d) for d in depths]
        feed = unfed * self.feed_rate  # drafting's one-off cost: the prompts' pairs, spread over the reply's rounds
        horizon = max(1.0, min(float(remaining), HORIZON))
        charged = [t if t is None or not d else t + feed * self.expected_tokens(d) / horizon
                   for d, t in zip(depths, seconds)]
        margin = STAY_MARGIN if self.settled.get(k, 0) else MARGIN  # probes do not change it
        value = [float("inf") if t is None else batch * self.expected_tokens(d) / max(t, 1e-9) / (1 + margin * (d > 0))
                 for d, t in zip(depths, charged)]
        best = max((d for d in depths if (k, d) in self.samples), key=lambda d: value[d])
        if best:  # the deepest measured drafting depth within DEEPER of the best: its c_j stay observed
            best = max(d for d in depths[best:] if (k, d) in self.samples and value[d] >= (1 - DEEPER) * value[best])
        self.settled[k] = best
        rounds, tried, floor = self.rounds, self.tried, (1 - SLACK) * value[best]
        close = [d for d in depths if d != best and
                 (value[d] >= floor - SLACK * (rounds - tried.get((k, d), rounds)) / AGING * value[best]
                  or value[d] >= (1 - NOISE) * value[best] and not self.fresh(k, d))]  # stale: the speed drifts
        # and stale depths beyond them, each probed when it is the stalest (see the docstring)
        far = [d for d in depths if d != best and d not in close and (k, d) in self.samples and not self.fresh(k, d)]
        timed = {d: len(self.samples.get((k, d), ())) for d in depths}
        young = [d for d in depths if d != best and timed[d] < MIN_SAMPLES
                 and (value[d] >= (1 - NOISE) * value[best] or not timed[d] and d in close)]
        if young:  # judged on too few rounds (or none) to rule it out
            return min(young)
        settled = len(self.samples[k, best]) >= SAMPLES  # one volatile sample decides nothing for long
        if not close and not far:
            self.held = (batch, best, rounds) if settled else None
            return best
        budget = PROBE_SHARE * self.spent.get(k, 0.0) - self.probed.get(k, 0.0)
        staleness = lambda d: rounds - tried.get((k, d), rounds)  # noqa: E731
        stalest = max(close + far, key=staleness)
        due = [d for d in ([stalest] if stalest in far else close)
               if seconds[d] + self.catch_up * behind + feed <= budget]  # it catches up first
        if not due:
            self.held = (batch, best, rounds) if settled else None
            return best
        probe = max(due, key=staleness)
        self.probed[k] = self.probed.get(k, 0.0) + seconds[probe]
        return probe

    def welcome(self, share: float):
        """New requests make up `share` of the batch: its acceptance estimates move toward the long-run means
        by that share, and count as at most FRESH_WEIGHT observations (the new requests' own rounds soon
        outweigh them)."""
        for j in range(1, self.depth + 1):
            self.accept[j] += share * (self.mean[j] - self.accept[j])
            self.weight[j] = max(float(PRIOR_WEIGHT), min(self.weight[j], FRESH_WEIGHT / share))
        self.held = None

    def seconds(self, batch: int, d: int) -> float | None:
        """Estimated round time at this batch size and depth; None when there is nothing to go on."""
        k = bucket(batch)
        every = self.samples.get((k, d))
        if not every:
            return self.predict(batch * self.tokens[d], exclude=(k, d))
        seen = self.fresh(k, d) or every
        if len(seen) > SAMPLES:  # SAMPLES of them, spread over the window: the fastest of many is biased low
            step = -(-len(seen) // SAMPLES)
            seen = list(seen)[::-1][::step]
        exact = [t for b, t, _ in seen if b == batch]
        est = min(exact or [t * batch / b for b, t, _ in seen])
        if len(every) == 1:
            guess = self.predict(batch * self.tokens[d], exclude=(k, d))
            est = est if guess is None else min(est, guess)
        return est

    def fresh(self, k: int, d: int) -> list[tuple[int, float, int]]:
        """The timed rounds of depth d in bucket k played within the last STALE rounds."""
        return [s for s in self.samples.get((k, d), ()) if self.rounds - s[2] <= STALE]

    def predict(self, rows: int, exclude: tuple[int, int]) -> float | None:
        """seconds ~ a + b * rows, least squares over one point per measured shape (its fastest sample) but
        the one predicted for."""
        pts = []
        for (k, d), seen in self.samples.items():
            if (k, d) != exclude:
                b, t, _ = min(seen, key=lambda s: s[1])
                pts.append((b * self.tokens[d], t))
        if len({x for x, _ in pts}) < 2:
            return None
        n = len(pts)
        mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
        slope = max(0.0, sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts))
        return max(0.0, my + slope * (rows - mx))

    def observe(self, batch: int, d: int, seconds: float | None, accepted: list[int], backlog: float = 0.0,
                behind: int = 0, fed: tuple[float, int] = (0.0, 0)):
        """A finished round: its depth, wall time (None: not representative; without `backlog`), the accepted
        draft lengths of the sequences that could have reached depth d, the seconds it spent catching the
        draft up on the `behind` pairs rounds that drafted nothing left (charged to the re-probe budget), and
        `fed`: the seconds it spent feeding the draft prompt pairs, and how many."""
        k = bucket(batch)
        self.probed[k] = self.probed.get(k, 0.0) + backlog
        if d and backlog and behind:
            self.catch_up = backlog / behind
        if d and seconds is not None and fed[0] > 0 and fed[1] > 0:  # not from a first-use round: 10x slower
            rate = fed[0] / fed[1]
            self.feed_rate = rate if not self.feed_rate else 0.5 * (self.feed_rate + rate)
        self.tried[k, d], self.rounds = self.rounds, self.rounds + 1
        if seconds is not None:
            self.samples.setdefault((k, d), deque(maxlen=STALE)).append((batch, seconds, self.rounds))
            self.spent[k] = self.spent.get(k, 0.0) + seconds
        for j in range(1, d + 1):
            reached = [a for a in accepted if a >= j - 1]
            if reached:
                hits, n = sum(a >= j for a in reached), len(reached)
                age = self.rounds - 1 - self.seen[j]  # rounds since c_j was last observed (0: the last one)
                w = max(float(PRIOR_WEIGHT), self.weight[j] * 0.5 ** (age / HALF_LIFE))
                self.accept[j] = (self.accept[j] * w + hits) / (w + n)
                self.weight[j] = min(w + n, WINDOW)
                self.seen[j] = self.rounds
                m = self.mean_weight[j]
                self.mean[j] = (self.mean[j] * m + hits) / (m + n)
                self.mean_weight[j] = min(m + n, LONG_WINDOW)


class PrefillPacer:
    """How many prompt tokens a step prefills beside a decoding round (chunked prefill, engine/scheduler.py).

    While sequences decode, a step's prefill may take about `share` of its decoding round's time, at the
    prefill rate measured so far (tokens per second, an exponential average over chunks), so a burst of new
    prompts stretches each running stream's gap between tokens by about 1 + share instead of stalling it for
    the burst's whole prefill. The share grows with the backlog: times the sequences waiting for their prompt
    per decoding one, when more wait than decode. Under sustained load a prompt holds a batch slot for as long
    as it prefills, and a fixed share lets that backlog grow until few sequences decode (a decoding round then
    yields less than the prefill it paces would have let in). At least one block's worth (`floor`) goes per
    step, so prompts always advance; never more than `cap` (None: no cap). With nothing decoding, or before
    any prefill was timed, the cap. A round that drafts nothing carries the chunk in its own forward (a mixed
    step, LLM.step), paced by the last plain round's time and the prefill rate of the last chunks run apart
    (`mix`)."""
    REFRESH = 8  # one step in REFRESH with a chunk to mix runs the chunk and the round apart, measuring both

    def __init__(self, cap: int | None, share: float | None, floor: int = 16, decay: float = 0.7):
        self.cap, self.share, self.floor, self.decay = cap, share, floor, decay
        self.rate: float | None = None
        self.round_s: float | None = None  # the last plain decoding round's seconds
        self.mixed = 0                     # steps asked whether to mix

    def budget(self, decode_s: float | None, prefilling: int = 1, decoding: int = 1) -> int | None:
        """Prompt tokens this step may prefill beside a decoding round of decode_s seconds (0: none runs;
        None: not measured yet, so the floor) of `decoding` sequences, `prefilling` sequences waiting for the
        rest of their prompts."""
        if decode_s is None and self.share is not None:
            return self.floor if self.cap is None else min(self.cap, self.floor)
        if not decode_s or self.share is None or self.rate is None:
            return self.cap
        share = self.share * max(1.0, prefilling / max(1, decoding))
        paced = max(self.floor, int(self.rate * share * decode_s))
        return paced if self.cap is None else min(self.cap, paced)

    def mix(self) -> bool:
        """Whether this step's decoding round may carry its chunk (a mixed step). Every REFRESH-th step with a
        chunk keeps them apart instead, so that both are measured again: a mixed step's own time cannot be
        split into its round's and its chunk's (an estimate from it would feed each chunk's time into the next
        chunk's size)."""
        self.mixed += 1
        return self.round_s is not None and self.mixed % self.REFRESH != 0

    def observe_round(self, seconds: float, prefilled: int = 0) -> float:
        """A decoding round took `seconds`, `prefilled` prompt tokens of a chunk in its forward (a mixed step)
        -> the decoding part's seconds: a plain round's own, which paces the next chunks; a mixed step's, the
        last plain round's."""
        if not prefilled:
            self.round_s = seconds
            return seconds
        return min(self.round_s, 0.9 * seconds)

    def observe(self, tokens: int, seconds: float):
        if seconds > 0:
            rate = tokens / seconds
            self.rate = rate if self.rate is None else self.decay * self.rate + (1 - self.decay) * rate
