"""Tree construction (dynamic and static policies, selection, subtrees, masks) and verification's KV
bookkeeping, checked against direct computations."""
import pytest
import torch

from engine.config import LlamaConfig
from engine.decoding import Draft, SpeculativeDecoder
from engine.model import Llama
from engine.model_runner import ModelRunner, StepPlan
from engine.sampler import Sampler
from engine.scheduler import SamplingParams, Scheduler, Sequence
from engine.trees import EAGLE1_TREE, DynamicTree, StaticTree, Tree
from tests.kernel_refs_attention import ancestor_mask_bits


def grow(policy, logits_per_depth, B):
    """Run a policy over given frontier logits from roots 0; -> (tree of all candidates, frontiers)."""
    tree = Tree.roots(torch.zeros(B, dtype=torch.long))
    front = torch.zeros(B, 1, dtype=torch.long)
    fronts = []
    for d, logits in enumerate(logits_per_depth, start=1):
        tree, front = policy.expand(tree, logits[:, :front.shape[1]], front, d)
        fronts.append(front)
    return tree, fronts

def check_bfs(tree: Tree):
    for b in range(tree.tokens.shape[0]):
        n = int(tree.sizes[b])
        par = tree.parents[b].tolist()
        assert par[0] == -1 and all(0 <= par[i] < i for i in range(1, n)) and all(p == -1 for p in par[n:])
        for i in range(1, n):
            assert tree.depths[b, i] == tree.depths[b, par[i]] + 1


def test_dynamic_tree_keeps_the_best_candidates_in_bfs_order():
    torch.manual_seed(0)
    B, V, K, D, M = 3, 12, 3, 4, 9
    policy = DynamicTree(D, K, M)
    logits = [torch.randn(B, 1, V)] + [torch.randn(B, K, V) for _ in range(D - 1)]
    pool, fronts = grow(policy, logits, B)
    for f in fronts:  # each frontier is the best K candidates of its depth
        depth = pool.depths.gather(1, f)
        assert (depth == depth[:, :1]).all()
        d = int(depth[0, 0])
        at_d = torch.where(pool.depths == d, pool.scores, -torch.inf)
        assert torch.equal(pool.scores.gather(1, f), at_d.sort(dim=1, descending=True, stable=True).values[:, :K])
    check_bfs(pool)
    tree = pool.select(M - 1, torch.full((B,), D))
    check_bfs(tree)
    assert tree.sizes.tolist() == [M] * B
    for b in range(B):
        best = pool.scores[b, 1:].sort(descending=True, stable=True).indices[:M - 1].sort().values + 1
        assert torch.equal(tree.tokens[b, 1:], pool.tokens[b, best])
        assert torch.equal(tree.scores[b, 1:], pool.scores[b, best])
        # a parent's score beats its children's, so siblings come out best-first
        for i in range(1, M):
            sib = [j for j in range(1, M) if tree.parents[b, j] == tree.parents[b, i]]
            assert sib == sorted(sib, key=lambda j: -pool.scores[b, best[j - 1]].item())
        # renumbered parents agree with the pool's
        for i in range(1, M):
            p = int(tree.parents[b, i])
            assert (p == 0 and pool.parents[b, best[i - 1]] == 0) or best[p - 1] == pool.parents[b, best[i - 1]]


def test_depth_caps_prune_per_request():
    torch.manual_seed(1)
    B, V, K, D = 3, 10, 2, 4
    pool, _ = grow(DynamicTree(D, K, 20), [torch.randn(B, 1, V)] + [torch.randn(B, K, V)] * (D - 1), B)
    tree = pool.select(19, torch.tensor([0, 1, 3]))
    check_bfs(tree)
    assert tree.sizes.tolist() == [1, 1 + K, 1 + K + 2 * K + 2 * K]
    assert [int(tree.depths[b, :tree.sizes[b]].max()) for b in range(B)] == [0, 1, 3]


def test_static_tree_reproduces_the_rank_paths():
    torch.manual_seed(2)
    B, V = 2, 20
    policy = StaticTree()
    assert policy.verify_tokens == 26 and policy.depth == 5 and policy.frontier_sizes() == [1, 4, 4, 1, 1]
    logits = [torch.randn(B, 1, V)] + [torch.randn(B, 4, V) for _ in range(4)]
    pool, _ = grow(policy, logits, B)
    tree = pool.select(policy.verify_tokens - 1, torch.full((B,), 5))
    check_bfs(tree)
    paths = sorted(EAGLE1_TREE, key=lambda p: (len(p), p))
    # fronts_at[d]: the nodes at depth d - 1 the draft expands, in the order of their logits rows
    fronts_at = {1: [()]}
    for d in range(1, 5):
        fronts_at[d + 1] = [p for p in paths if len(p) == d and any(q[:-1] == p for q in paths)]
    for b in range(B):
        for i, p in enumerate(paths, start=1):
            row = fronts_at[len(p)].index(p[:-1])
            ranked = logits[len(p) - 1][b, row].argsort(descending=True)
            assert tree.tokens[b, i] == ranked[p[-1]]
            assert tree.parents[b, i] == (0 if len(p) == 1 else paths.index(p[:-1]) + 1)


def test_tree_mask_is_the_ancestor_bitmask():
    parents = [-1, 0, 0, 1, 2, 3] + [4] * 30 + [35]
    n = len(parents)
    tree = Tree.chains(torch.zeros(1, n, dtype=torch.long), torch.tensor([n], dtype=torch.int32))
    tree.parents = torch.tensor([parents], dtype=torch.int32)
    assert torch.equal(tree.mask(), ancestor_mask_bits(parents))


def test_subtree_of_the_drafted_history_keeps_true_ancestors():
    """The history a draft forward re-feeds (root + frontiers, frontier order) re-indexed as a tree."""
    torch.manual_seed(3)
    B, K, V = 2, 3, 16
    pool, fronts = grow(DynamicTree(3, K, 10), [torch.randn(B, 1, V)] + [torch.randn(B, K, V)] * 2, B)
    history = torch.cat([torch.zeros(B, 1, dtype=torch.long)] + fronts[:-1], 1)           # [B, 1 + 2K]
    sub = pool.subtree(history)
    check_bfs(sub)
    for b in range(B):
        for i in range(1, history.shape[1]):
            assert history[b, sub.parents[b, i]] == pool.parents[b, history[b, i]]
            assert sub.tokens[b, i] == pool.tokens[b, history[b, i]]


def test_chains_pad_past_their_sizes():
    tree = Tree.chains(torch.arange(10).view(2, 5), torch.tensor([5, 2], dtype=torch.int32))
    check_bfs(tree)
    assert tree.parents.tolist() == [[-1, 0, 1, 2, 3], [-1, 0, -1, -1, -1]]


def tiny_target():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=8, max_position=128)
    return Llama(cfg).eval().requires_grad_(False), cfg


def prefill(runner, blocks, seq_id, tokens):
    blocks.reserve(seq_id, len(tokens))
    meta, pos, ids = runner.meta(StepPlan([blocks.block_table(seq_id)], [0], [len(tokens)]), ids=tokens)
    return runner.model(ids, pos, runner.layers, meta)[0]


@torch.inference_mode()
def test_verify_keeps_exactly_the_accepted_paths_kv():
    """After verifying trees whose accepted paths are not contiguous, each cache equals a fresh prefill of
    prompt + accepted tokens, and the next tokens are the target's greedy ones."""
    model, cfg = tiny_target()
    sched = Scheduler(64, 4, 4, 128, eos_ids=(), lookahead=6)
    runner = ModelRunner(model, cfg, torch.float32, torch.device("cpu"), 64, 4, 128)
    decoder = SpeculativeDecoder(runner, Sampler(0, torch.device("cpu"), runner), sched.blocks)
    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    seqs = [Sequence(p[:-1], SamplingParams(max_new_tokens=50)) for p in prompts]
    for s, p in zip(seqs, prompts):
        s.output_ids = [p[-1]]
        prefill(runner, sched.blocks, s.seq_id, s.prompt_ids)
    # Greedy continuations, to plant on non-first branches.
    greedy = []
    for p in prompts:
        toks = list(p)
        for i in range(3):
            ref = Scheduler(64, 4, 4, 128, eos_ids=()).blocks
            fresh = ModelRunner(model, cfg, torch.float32, torch.device("cpu"), 64, 4, 128)
            toks.append(int(model.logits(prefill(fresh, ref, 0, toks)[-1:]).argmax()))
        greedy.append(toks[len(p):])
    # root -> (wrong, g1 -> (wrong, g2 -> g3)): accepted nodes 0, 2, 4, 5.
    tokens = [[p[-1], (g[0] + 1) % 40, g[0], (g[1] + 1) % 40, g[1], g[2]] for p, g in zip(prompts, greedy)]
    tree = Tree(torch.tensor(tokens), torch.tensor([[-1, 0, 0, 2, 2, 4]] * 2, dtype=torch.int32),
                torch.tensor([[0, 1, 1, 2, 2, 3]] * 2, dtype=torch.int32), torch.zeros(2, 6),
                torch.tensor([6, 6], dtype=torch.int32))
    sched.prepare(seqs)
    summary, logprobs = decoder.verify(seqs, tree)                          # [B, 2N + 2]
    assert summary[:, 2:6].tolist() == [[0, 2, 4, 5]] * 2 and logprobs is None  # the accepted path, root first
    v = decoder.read(seqs, summary, logprobs, Draft(tree, 3))
    assert v.lengths == [3, 3] and v.depth == 3
    for s, new in zip(seqs, v.new_tokens):
        sched.commit(s, new)
    ref_blocks = Scheduler(64, 4, 4, 128, eos_ids=()).blocks
    fresh = ModelRunner(model, cfg, torch.float32, torch.device("cpu"), 64, 4, 128)
    for s, p, g, new in zip(seqs, prompts, greedy, v.new_tokens):
        assert new[:3] == g
        kept = p + g  # the cache holds everything but the bonus token
        assert sched.blocks.length(s.seq_id) == len(kept)
        prefill(fresh, ref_blocks, s.seq_id, kept)
        slots = torch.tensor(sched.blocks.slots(s.seq_id, 0, len(kept)))
        fslots = torch.tensor(ref_blocks.slots(s.seq_id, 0, len(kept)))
        for layer in range(cfg.num_layers):
            for kv in range(2):
                ours = runner.kv[layer, kv].flatten(0, 1)[slots]
                ref = fresh.kv[layer, kv].flatten(0, 1)[fslots]
                torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
