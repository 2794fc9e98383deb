"""Tree construction (pools, dynamic and static policies, masks) and verification's KV bookkeeping, checked
against brute force on small inputs."""
import pytest
import torch

from engine.config import LlamaConfig
from engine.model import Llama
from engine.model_runner import ModelRunner
from engine.sampler import Sampler
from engine.scheduler import SamplingParams, Sequence
from engine.spec_eagle import History
from engine.speculative import verify
from engine.trees import EAGLE1_TREE, DynamicTree, Frontier, Pool, StaticTree, Tree, pack_bits
from tests.kernel_refs_attention import ancestor_mask_bits


def grow(policy, logits_per_depth, B):
    """Run a policy over given frontier logits; -> (pool, frontiers)."""
    pool = Pool()
    front = policy.expand(pool, logits_per_depth[0], torch.full((B, 1), -1), torch.zeros(B, 1), 1)
    fronts = [front]
    for d, logits in enumerate(logits_per_depth[1:], start=2):
        front = policy.expand(pool, logits[:, :front.ids.shape[1]], front.ids, front.scores, d)
        fronts.append(front)
    return pool, fronts


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
    tokens, scores = torch.cat(pool._tokens, 1), torch.cat(pool._scores, 1)
    parents = torch.cat(pool._parents, 1)
    for f in fronts:  # frontier ids point at their own pool entries; the frontier is the best K of its depth
        assert torch.equal(tokens.gather(1, f.ids), f.tokens) and torch.equal(scores.gather(1, f.ids), f.scores)
    tree = pool.select(torch.tensor([7, 8, 9]), M - 1, torch.full((B,), D))
    check_bfs(tree)
    assert tree.sizes.tolist() == [M] * B and tree.tokens[:, 0].tolist() == [7, 8, 9]
    for b in range(B):
        best = scores[b].sort(descending=True, stable=True).indices[:M - 1].sort().values
        assert torch.equal(tree.tokens[b, 1:], tokens[b, best])
        # a parent's score beats its children's, so siblings come out best-first
        for i in range(1, M):
            sib = [j for j in range(1, M) if tree.parents[b, j] == tree.parents[b, i]]
            assert sib == sorted(sib, key=lambda j: -scores[b, best[j - 1]].item())
        # renumbered parents agree with the pool's
        pool_parent = parents[b, best]
        for i in range(1, M):
            p = int(tree.parents[b, i])
            assert (p == 0 and pool_parent[i - 1] == -1) or best[p - 1] == pool_parent[i - 1]


def test_depth_caps_prune_per_request():
    torch.manual_seed(1)
    B, V, K, D = 3, 10, 2, 4
    pool, _ = grow(DynamicTree(D, K, 20), [torch.randn(B, 1, V)] + [torch.randn(B, K, V)] * (D - 1), B)
    tree = pool.select(torch.zeros(B, dtype=torch.long), 19, torch.tensor([0, 1, 3]))
    check_bfs(tree)
    assert tree.sizes.tolist() == [1, 1 + K, 1 + K + 2 * K + 2 * K]
    assert [int(tree.depths[b, :tree.sizes[b]].max()) for b in range(B)] == [0, 1, 3]


def test_static_tree_reproduces_the_rank_paths():
    torch.manual_seed(2)
    B, V = 2, 20
    policy = StaticTree()
    assert policy.verify_tokens == 26 and policy.depth == 5 and policy.max_draft_tokens == 10
    logits = [torch.randn(B, 1, V)] + [torch.randn(B, 4, V) for _ in range(4)]
    pool, _ = grow(policy, logits, B)
    tree = pool.select(torch.zeros(B, dtype=torch.long), policy.verify_tokens - 1, torch.full((B,), 5))
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


def test_pack_bits_matches_the_reference_bitmask():
    parents = [-1, 0, 0, 1, 2, 3] + [4] * 30 + [35]
    n = len(parents)
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = parents[j]
    assert torch.equal(pack_bits(anc), ancestor_mask_bits(parents))


def test_history_masks_follow_true_ancestors():
    B, K = 2, 3
    hist = History()
    h = torch.zeros(B, K, 4)
    front = lambda rows: Frontier(torch.zeros(B, K, dtype=torch.long), torch.zeros(B, K, dtype=torch.long),
                                  torch.zeros(B, K), torch.tensor(rows))
    hist.append(front([[0, 0, 0]] * B), h, 1)
    hist.append(front([[2, 0, 0], [1, 1, 2]]), h, 2)
    hist.append(front([[1, 1, 0], [0, 2, 2]]), h, 3)
    # node ids: depth 1 = 0..2, depth 2 = 3..5, depth 3 = 6..8
    expect = {0: {6: {6, 4, 0}, 7: {7, 4, 0}, 8: {8, 3, 2}},
              1: {6: {6, 3, 1}, 7: {7, 5, 2}, 8: {8, 5, 2}}}
    for b, rows in expect.items():
        for i, anc in rows.items():
            assert set(torch.nonzero(hist.anc[b, i]).flatten().tolist()) == anc
    assert hist.depths == [1] * 3 + [2] * 3 + [3] * 3 and hist.last == 6


@pytest.fixture
def tiny_runner():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=8, max_position=128)
    model = Llama(cfg).eval().requires_grad_(False)
    return ModelRunner(model, cfg, block_size=4, num_blocks=64)


def test_verify_keeps_exactly_the_accepted_paths_kv(tiny_runner):
    """After verifying trees whose accepted paths are not contiguous, each cache equals a fresh prefill of
    prompt + accepted tokens, and the next tokens are the target's greedy ones."""
    runner = tiny_runner
    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    seqs = [Sequence(p[:-1], SamplingParams(max_new_tokens=50)) for p in prompts]
    for s, p in zip(seqs, prompts):
        s.output_ids = [p[-1]]
        runner.forward([s.seq_id], [s.prompt_ids])
    # Greedy continuations, to plant on non-first branches.
    greedy = []
    for p in prompts:
        ref = ModelRunner(runner.model, runner.cfg, block_size=4, num_blocks=64)
        toks = list(p)
        for _ in range(3):
            f, _, _ = ref.forward([0], [toks if len(toks) == len(p) else toks[-1:]])
            toks.append(int(runner.model.logits(f[-1:]).argmax()))
        greedy.append(toks[len(p):])
    # root -> (wrong, g1 -> (wrong, g2 -> g3)): accepted nodes 0, 2, 4, 5.
    tokens = [[p[-1], (g[0] + 1) % 40, g[0], (g[1] + 1) % 40, g[1], g[2]] for p, g in zip(prompts, greedy)]
    tree = Tree(torch.tensor(tokens), torch.tensor([[-1, 0, 0, 2, 2, 4]] * 2, dtype=torch.int32),
                torch.tensor([[0, 1, 1, 2, 2, 3]] * 2, dtype=torch.int32), torch.tensor([6, 6], dtype=torch.int32))
    v = verify(runner, Sampler(0), seqs, tree)
    assert v.paths == [[0, 2, 4, 5]] * 2
    fresh = ModelRunner(runner.model, runner.cfg, block_size=4, num_blocks=64)
    for s, p, g, new in zip(seqs, prompts, greedy, v.new_tokens):
        assert new[:3] == g
        kept = p + g  # the cache holds everything but the bonus token
        assert runner.blocks.length(s.seq_id) == len(kept)
        fresh.forward([s.seq_id], [kept])
        slots = torch.tensor(runner.blocks.slots(s.seq_id, 0, len(kept)))
        fslots = torch.tensor(fresh.blocks.slots(s.seq_id, 0, len(kept)))
        for layer in range(runner.cfg.num_layers):
            for kv in range(2):
                ours = runner.kv[layer, kv].flatten(0, 1)[slots]
                ref = fresh.kv[layer, kv].flatten(0, 1)[fslots]
                torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
