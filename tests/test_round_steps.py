"""A speculative round as a few fixed-shape steps (issue 24 item 2): the whole tree draft as one step
(EagleDecoder._draft_tree) and greedy verification with acceptance and the KV move as another
(SpeculativeDecoder._verify_direct), each a CUDA graph replay on a GPU and run eagerly here. Every round of
these tests runs both the fused steps and the step-by-step references (fused off) on the same state and
compares them bit for bit: the trees drafted (for EAGLE-1 and EAGLE-3 heads, dynamic trees of several shapes
and the static tree, batch sizes padded to graph buckets or not, sequences with different depth caps) and
the verdicts; outputs equal vanilla's, and the round bodies make no host reads. A round of the tree path
runs exactly two steps, so a regression to per-level draft steps fails."""
import pytest
import torch

from engine.decoding import SpeculativeDecoder
from engine.model_runner import ModelRunner, StepGraph, StepPlan
from engine.sampler import Sampler
from engine.scheduler import SamplingParams, Scheduler, Sequence
from engine.trees import Tree
from tests.host_reads import no_host_reads
from tests.test_engine_paths import PROMPTS, forbid_host_reads, llm, reference  # noqa: F401 (fixtures)
from tests.test_speculative_trees import prefill, tiny_target

NEW = 6
TREES = {
    "eagle-3x3": ("eagle", {"depth": 3, "topk": 3, "tree_tokens": 7}),
    "eagle-static": ("eagle", {"tree": "static"}),
    "eagle3-4x4": ("eagle3", {"depth": 4, "topk": 4, "tree_tokens": 12}),
    "eagle3-2x5": ("eagle3", {"depth": 2, "topk": 5, "tree_tokens": 16}),
}


def same_tree(a, b):
    for field in ("tokens", "parents", "depths", "scores", "sizes"):
        x, y = getattr(a, field), getattr(b, field)
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), field


def twin_rounds(decoder, log: list):
    """Each draft and verify runs the reference first, then the fused step on the same state (drafting again
    rewrites the head's cache with the same values; verifying again rewrites the tree's KV before moving the
    path), asserts the two agree and returns the fused result."""
    draft, verify = decoder.draft, decoder.verify

    def twice(fn, *args):
        decoder.fused = False
        ref = fn(*args)
        decoder.fused = True
        return ref, fn(*args)

    def draft_both(seqs, depth, caps):
        ref, got = twice(draft, seqs, depth, caps)
        same_tree(ref.tree, got.tree)
        assert ref.depth == got.depth
        log.append(("draft", len(seqs), list(caps)))
        return got

    def verify_both(seqs, tree, probs=None):
        (ref, ref_lp), (got, got_lp) = twice(verify, seqs, tree, probs)
        assert torch.equal(ref, got) and ref_lp is None and got_lp is None
        log.append(("verify", len(seqs)))
        return got, got_lp
    decoder.draft, decoder.verify = draft_both, verify_both


@pytest.mark.parametrize("bucketed", [False, True], ids=["exact", "buckets"])
@pytest.mark.parametrize("name", list(TREES))
def test_fused_steps_match_the_step_by_step_round(llm, reference, name, bucketed):
    kind, args = TREES[name]
    llm.set_method(kind, {"head": "random", **args})
    llm.runner.bucketed = bucketed
    try:
        log = []
        twin_rounds(llm.decoder, log)
        forbid_host_reads(llm.decoder)
        # Three sequences (a bucket of 4 pads one row) ending at different lengths: their caps differ.
        lengths = [NEW, 2, 4]
        seqs, _ = llm.generate(PROMPTS[:3], [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths])
        assert [s.output_ids for s in seqs] == [r[:n] for r, n in zip(reference, lengths)]
        alone, _ = llm.generate(PROMPTS[:1], SamplingParams(max_new_tokens=NEW, ignore_eos=True))
        assert alone[0].output_ids == reference[0]
    finally:
        llm.runner.bucketed = False
    assert any(e[0] == "draft" and len(set(e[2])) > 1 for e in log)  # rounds with different caps
    assert any(e[0] == "draft" and e[1] == 1 for e in log) and any(e[0] == "verify" and e[1] == 3 for e in log)
    keys = {k[0] for k in llm.decoder.graphs}
    assert {"draft_tree", "verify_direct", "draft", "verify"} <= keys


def count_steps(decoder, monkeypatch) -> list:
    """Per round: the StepGraphs run (draft and verify steps: graph replays on a GPU)."""
    runs, per_round = [], []
    step_run = StepGraph.run

    def counted(self, *args, **kwargs):
        runs.append(self.fn)
        return step_run(self, *args, **kwargs)
    monkeypatch.setattr(StepGraph, "run", counted)
    step = decoder.step

    def counted_step(seqs, depth=0, chunk=None):
        runs.clear()
        verdict = step(seqs, depth, chunk)
        per_round.append((verdict.depth, len(runs)))
        return verdict
    decoder.step = counted_step
    return per_round


@pytest.mark.parametrize("name", ["eagle-3x3", "eagle3-4x4", "eagle-static"])
def test_a_tree_round_is_two_steps(llm, reference, name, monkeypatch):
    """One draft step and one verify step a round, whatever the depth: the head's per-level forwards and the
    bookkeeping between them are inside the draft step, acceptance and the KV move inside the verify step."""
    kind, args = TREES[name]
    llm.set_method(kind, {"head": "random", **args})
    per_round = count_steps(llm.decoder, monkeypatch)
    seqs, _ = llm.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert [s.output_ids for s in seqs] == reference
    drafted = [n for depth, n in per_round if depth]
    assert drafted and all(n == 2 for n in drafted), per_round
    assert any(depth >= 3 for depth, _ in per_round)
    # Sampled rows verify eagerly after the target's step, still one draft step and one verify step.
    per_round.clear()
    llm.generate(PROMPTS[:2], SamplingParams(max_new_tokens=4, ignore_eos=True, temperature=0.8, top_k=20))
    assert all(n == 2 for depth, n in per_round if depth), per_round


def test_fused_step_functions_make_no_host_reads(llm):
    """The step functions themselves (not only the round bodies that call them), guarded directly."""
    llm.set_method("eagle3", {"head": "random", **TREES["eagle3-4x4"][1]})
    guarded = []
    for name in ("_draft_tree_fn", "_verify_direct_fn"):
        fn = getattr(llm.decoder, name)

        def wrapped(*args, _fn=fn, _name=name, **kwargs):
            guarded.append(_name)
            with no_host_reads():
                return _fn(*args, **kwargs)
        setattr(llm.decoder, name, wrapped)
    llm.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert set(guarded) == {"_draft_tree_fn", "_verify_direct_fn"}


@torch.inference_mode()
@pytest.mark.parametrize("bucketed", [False, True], ids=["exact", "buckets"])
def test_fused_verify_moves_accepted_paths_like_the_reference(bucketed):
    """Planted trees whose accepted paths have different lengths and skip first branches (random heads are
    never accepted): the fused greedy verify step returns the reference's summary and leaves the caches
    bit-identical to it, batch 3 exact or padded to a bucket of 4."""
    model, cfg = tiny_target()
    prompts = [[1, 2, 3, 4, 5], [6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 10]]
    rigs = []
    for fused in (False, True):
        sched = Scheduler(64, 4, 4, 128, eos_ids=(), lookahead=6)
        runner = ModelRunner(model, cfg, torch.float32, torch.device("cpu"), 64, 4, 128)
        runner.bucketed = bucketed
        decoder = SpeculativeDecoder(runner, Sampler(0, torch.device("cpu"), runner), sched.blocks)
        decoder.fused = fused
        seqs = [Sequence(p[:-1], SamplingParams(max_new_tokens=50)) for p in prompts]
        for s, p in zip(seqs, prompts):
            s.output_ids = [p[-1]]
            prefill(runner, sched.blocks, s.seq_id, s.prompt_ids)
        sched.prepare(seqs)
        rigs.append((runner, decoder, seqs))
    runner = rigs[0][0]
    greedy = []
    for p in prompts:  # the target's greedy continuations, planted on later branches
        toks = list(p)
        for _ in range(3):
            ref = Scheduler(64, 4, 4, 128, eos_ids=()).blocks
            fresh = ModelRunner(model, cfg, torch.float32, torch.device("cpu"), 64, 4, 128)
            toks.append(int(model.logits(prefill(fresh, ref, 0, toks)[-1:]).argmax()))
        greedy.append(toks[len(p):])
    wrong = lambda t: (t + 1) % 40  # noqa: E731
    # root -> (wrong, g1 -> (wrong, g2 -> g3)) accepts 3; root -> (g1 -> wrong, wrong) accepts 1; nothing right: 0
    tokens = [[prompts[0][-1], wrong(greedy[0][0]), greedy[0][0], wrong(greedy[0][1]), greedy[0][1], greedy[0][2]],
              [prompts[1][-1], greedy[1][0], wrong(greedy[1][0]), wrong(greedy[1][1]), 0, 0],
              [prompts[2][-1], wrong(greedy[2][0]), wrong(wrong(greedy[2][0])), 0, 0, 0]]
    parents = [[-1, 0, 0, 2, 2, 4], [-1, 0, 0, 1, -1, -1], [-1, 0, 0, -1, -1, -1]]
    depths = [[0, 1, 1, 2, 2, 3], [0, 1, 1, 2, 0, 0], [0, 1, 1, 0, 0, 0]]
    tree = Tree(torch.tensor(tokens), torch.tensor(parents, dtype=torch.int32),
                torch.tensor(depths, dtype=torch.int32), torch.zeros(3, 6), torch.tensor([6, 4, 3], dtype=torch.int32))
    summaries = []
    for _, decoder, seqs in rigs:
        with no_host_reads():
            summary, logprobs = decoder.verify(seqs, tree)
        assert logprobs is None
        summaries.append(summary)
    assert torch.equal(*summaries)
    assert summaries[0][:, 0].tolist() == [3, 1, 0]
    keys = [set(k[0] for k in decoder.graphs) for _, decoder, _ in rigs]
    assert keys == [{"verify"}, {"verify_direct"}]
    pool = slice(0, runner.num_blocks)  # the scratch block holds garbage by design
    assert torch.equal(rigs[0][0].kv[:, :, pool], rigs[1][0].kv[:, :, pool])


@pytest.mark.parametrize("bucketed", [False, True], ids=["exact", "buckets"])
def test_step_inputs_are_read_in_place_only_where_nothing_is_padded(bucketed):
    """An eager step without padding reads a contiguous input where the caller has it; a padded one (or a
    non-contiguous input) is copied into the step's static buffer, whose padded rows keep their fill, and a
    caller's tensor read in place earlier is never written."""
    model, cfg = tiny_target()
    runner = ModelRunner(model, cfg, torch.float32, torch.device("cpu"), 64, 4, 128)
    runner.bucketed = bucketed
    B = 3
    Bp = runner.batch_rows(B)
    plan = StepPlan([[0], [1], [2]], [0, 0, 0], [1, 1, 1]).padded(Bp)
    seen = []
    g = runner.graph({}, ("inputs", Bp), plan, lambda g: seen.append(g.inputs["x"]) or g.inputs["x"].sum(),
                     {"x": ((Bp, 2), torch.int64, -1)})
    a = torch.arange(2 * B).view(B, 2)
    g.run(plan, x=a)
    if Bp == B:
        assert seen[-1] is a
    else:
        assert seen[-1] is g.static["x"] and torch.equal(seen[-1][:B], a) and (seen[-1][B:] == -1).all()
    kept = a.clone()
    b = torch.arange(100, 100 + 4 * B).view(B, 4)[:, ::2]  # [B, 2], not contiguous
    g.run(plan, x=b)
    assert seen[-1] is g.static["x"] and torch.equal(seen[-1][:B], b) and torch.equal(a, kept)
    assert Bp == B or (seen[-1][B:] == -1).all()
