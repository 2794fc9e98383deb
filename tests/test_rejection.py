"""tree_accept_greedy / tree_accept_sample: every implementation against the naive reference (bit-exact),
chi-square checks that sampling is lossless, and argument errors.

The Triton kernels (the CUDA implementation) run on CPU tensors inside `eagle_kernels.triton_on_cpu()`, under
the interpreter. TRITON_INTERPRET must be set before Triton decorates them, so that comparison runs this file
as a script in a child process: `python tests/test_rejection.py triton` (TRITON_INTERPRET=1).
"""
import os
import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch
from scipy import stats

import eagle_kernels.rejection as rejection
from eagle_kernels import argmax, greedy_verdict, tree_accept_greedy, tree_accept_sample, triton_on_cpu, verdict_summary
from kernel_refs_tree import batch_trees, random_bfs_parents, ref_tree_accept_greedy, ref_tree_accept_sample

CUDA = torch.cuda.is_available()
# V = 300 spans two CDF segments; V = 2500 has more than the 8 full segments the C++ op sums side by side.
GRID = [(B, N, V) for B in (1, 4) for N in (1, 64) for V in (8, 300)] + [(4, 64, 2500)]
TRITON_GRID = [(1, 1, 8), (4, 16, 8), (4, 16, 300), (2, 64, 8)]


# ----------------------------------------------------------------------------------------- random cases
def make_case(B: int, N: int, V: int, seed: int, truncate: bool = False) -> dict:
    """Random BFS trees (ragged sizes incl. 1 and N), target/draft distributions and uniforms.

    Draft tokens are the target argmax at the parent (always for a first child, else 1/2), a sample of
    the draft distribution (3/10) or noise, so acceptances, rejections and duplicate siblings all occur.
    truncate keeps the top 3 target tokens.
    """
    gen = torch.Generator().manual_seed(seed)
    sizes = [N] if B == 1 else [N, 1] + torch.randint(1, N + 1, (B - 2,), generator=gen).tolist()
    parents, sizes = batch_trees([random_bfs_parents(n, gen) for n in sizes], N)
    logits = torch.randn(B, N, V, generator=gen) * (1 + 5 * torch.rand(B, N, 1, generator=gen))  # flat..peaked
    if truncate:
        logits = logits.masked_fill(logits < logits.topk(min(3, V), -1).values[..., -1:], float("-inf"))
    probs = torch.softmax(logits, -1)
    draft = torch.softmax(logits.clamp(min=-30) + torch.randn(B, N, V, generator=gen), -1)  # q at the parent
    return dict(parents=parents, tokens=draft_tokens(parents, probs, draft, gen), sizes=sizes,
                target_probs=probs, uniforms=torch.rand(B, N + 1, generator=gen), draft_probs=draft)


def draft_tokens(parents, probs, draft, gen) -> torch.Tensor:
    B, N, V = probs.shape
    at_parent = probs.gather(1, parents.clamp(min=0).long()[..., None].expand(B, N, V))  # [B, N, V]
    sampled = torch.multinomial(draft.reshape(B * N, V), 1, generator=gen).reshape(B, N)
    noise = torch.randint(0, V, (B, N), generator=gen)
    choice = torch.rand(B, N, generator=gen)
    # BFS parents are non-decreasing: a node whose parent differs from its predecessor's is a first child.
    first_child = torch.cat([torch.zeros(B, 1, dtype=torch.bool), parents[:, 1:] != parents[:, :-1]], 1)
    choice = choice.masked_fill(first_child, 0.0)
    return torch.where(choice < 0.5, at_parent.argmax(-1), torch.where(choice < 0.8, sampled, noise))


def repeat_tree(parents: list[int], B: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same tree for B requests -> parents int32 [B, N], sizes int32 [B]."""
    tree = torch.tensor(parents, dtype=torch.int32)
    return tree.expand(B, -1).contiguous(), torch.full((B,), len(parents), dtype=torch.int32)


def sample_args(case: dict, with_draft: bool) -> dict:
    return {k: v for k, v in case.items() if with_draft or k != "draft_probs"}


def greedy_args(case: dict) -> dict:
    return dict(parents=case["parents"], tokens=case["tokens"], sizes=case["sizes"],
                target_argmax=case["target_probs"].argmax(-1))


def mismatch(got, want) -> str | None:
    for name, g, w in zip(("accept_path", "accept_len", "next_token"), got, want):
        if g.dtype != w.dtype or not torch.equal(g.cpu(), w):
            return f"{name}: got {g.tolist()}, want {w.tolist()}"
    return None


# --------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("B,N,V", GRID)
def test_greedy_cpu_matches_reference(B, N, V):
    args = greedy_args(make_case(B, N, V, seed=B + 10 * N + V))
    assert mismatch(tree_accept_greedy(**args), ref_tree_accept_greedy(**args)) is None


@pytest.mark.parametrize("B,N,V", GRID)
def test_greedy_verdict_matches_accept_then_summary(B, N, V):
    """greedy_verdict (the CPU's one op: argmax of the visited nodes only, the descent, the summary) against
    argmax + the reference acceptance + verdict_summary, on logits (ties and NaN rows too: the first index of
    a row's maximum, or its first NaN, as argmax gives it)."""
    case = make_case(B, N, V, seed=7 + B + 10 * N + V)
    logits = case["target_probs"].log()
    gen = torch.Generator().manual_seed(V)
    logits[torch.rand(B, N, generator=gen) < 0.2] = 0.0                  # whole-row ties
    logits[..., 0][torch.rand(B, N, generator=gen) < 0.1] = float("nan")  # NaN rows
    tree = dict(parents=case["parents"], tokens=case["tokens"], sizes=case["sizes"])
    want = verdict_summary(case["tokens"], *ref_tree_accept_greedy(**tree, target_argmax=argmax(logits)))
    got = greedy_verdict(**tree, logits=logits)
    assert got.dtype == torch.int64 and torch.equal(got, want), (got.tolist(), want.tolist())
    assert rejection._GREEDY_VERDICT_CPU  # the C++ op ran, not the reference composition
    assert torch.equal(greedy_verdict(**tree, logits=argmax(logits)), want)  # the argmax given (Llama.tokens')
    if N > 1 and B > 1:
        assert want[:, 0].max() > 0  # some drafts accepted


def test_greedy_verdict_bad_arguments_raise_value_error():
    case = make_case(2, 4, 8, seed=0)
    tree = dict(parents=case["parents"], tokens=case["tokens"], sizes=case["sizes"])
    logits = case["target_probs"]
    bad = {
        "logits must be (torch.float32|Float)": dict(logits=logits.double()),
        r"logits must be \[B, N, V\] with V >= 1": dict(logits=logits[..., :0]),
        r"logits must have shape \[2, 4, 8\]": dict(logits=logits[:, :3]),
        r"tokens must have shape \[2, 4\]": dict(tokens=case["tokens"][:1]),
        r"target_argmax must have shape \[2, 4\]": dict(logits=argmax(logits)[:, :3]),
        "breaks BFS order": dict(parents=torch.tensor([[-1, 0, 3, 1]] * 2, dtype=torch.int32)),
    }
    for message, change in bad.items():
        with pytest.raises(ValueError, match=message):
            greedy_verdict(**{**tree, "logits": logits, **change})


@pytest.mark.parametrize("mode", ["tree", "tree-truncated", "chain-q"])
@pytest.mark.parametrize("B,N,V", GRID)
def test_sample_cpu_matches_reference(B, N, V, mode):
    case = make_case(B, N, V, seed=B + 10 * N + V, truncate=mode == "tree-truncated")
    args = sample_args(case, with_draft=mode == "chain-q")
    assert mismatch(tree_accept_sample(**args), ref_tree_accept_sample(**args)) is None


@pytest.mark.parametrize("with_draft", [False, True])
def test_grid_cases_accept_and_reject(with_draft):
    lengths = torch.cat([tree_accept_sample(**sample_args(make_case(B, N, V, seed=B + 10 * N + V), with_draft))
                         .accept_len for B, N, V in GRID if N > 1])
    assert lengths.min() == 0 and lengths.max() >= 3, lengths.tolist()


def edge_uniform_cases() -> list[dict]:
    """u0 = 0 draws the first token with mass; u0 = 1 (outside the contract) makes u0 * total unreachable,
    which exercises the last-positive-token fallback; truncation puts zeros at both ends of the CDF."""
    base = make_case(4, 16, 300, seed=3, truncate=True)
    return [{**base, "uniforms": base["uniforms"].index_fill(1, torch.tensor([0]), u0)} for u0 in (0.0, 1.0)]


@pytest.mark.parametrize("with_draft", [False, True])
def test_edge_uniforms_match_reference(with_draft):
    for case in edge_uniform_cases():
        args = sample_args(case, with_draft)
        assert mismatch(tree_accept_sample(**args), ref_tree_accept_sample(**args)) is None


def test_sampling_with_one_hot_targets_is_greedy():
    case = make_case(4, 64, 50, seed=7)
    one_hot = torch.nn.functional.one_hot(case["target_probs"].argmax(-1), 50).float()
    got = tree_accept_sample(**{**sample_args(case, False), "target_probs": one_hot})
    assert mismatch(got, tree_accept_greedy(**greedy_args(case))) is None


def test_triton_interpreter_matches_reference():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's eagle_kernels
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run([sys.executable, __file__, "triton"], env=env, capture_output=True, text=True,
                           timeout=600)
    assert child.returncode == 0, child.stdout + child.stderr


def _triton_interpreter_check():
    """Child process (TRITON_INTERPRET=1): Triton kernels vs the reference; exit status 1 on a mismatch."""
    failures = []
    with triton_on_cpu():
        for B, N, V in TRITON_GRID:
            case = make_case(B, N, V, seed=B + 10 * N + V)
            args = greedy_args(case)
            failures.append(("greedy", B, N, V, mismatch(tree_accept_greedy(**args), ref_tree_accept_greedy(**args))))
            for with_draft in (False, True):
                args = sample_args(case, with_draft)
                failures.append(("sample", with_draft, B, N, V, mismatch(tree_accept_sample(**args),
                                                                         ref_tree_accept_sample(**args))))
        for case in edge_uniform_cases():
            for with_draft in (False, True):
                args = sample_args(case, with_draft)
                failures.append(("edge-uniforms", with_draft, mismatch(tree_accept_sample(**args),
                                                                        ref_tree_accept_sample(**args))))
        # Triton reads out-of-vocabulary drafts as rejections where the C++ op raises: this ran Triton.
        args = sample_args(make_case(2, 4, 8, seed=0), with_draft=False)
        out = tree_accept_sample(**{**args, "tokens": args["tokens"].clone().fill_(8)})
        failures.append(("triton_on_cpu runs Triton", None if out.accept_len.tolist() == [0, 0] else out))
    failures = [f for f in failures if f[-1] is not None]
    print("\n".join(map(str, failures)) or f"Triton matches the reference on {TRITON_GRID} and edge uniforms")
    sys.exit(1 if failures else 0)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("B,N,V", [(1, 1, 8), (4, 64, 300), (8, 64, 32000)])
def test_cuda_matches_cpu(B, N, V):
    """CUDA tensors take the Triton kernels, CPU tensors the C++ op: identical outputs."""
    case = make_case(B, N, V, seed=B + N + V)
    on_gpu = {k: v.cuda() for k, v in case.items()}
    assert mismatch(tree_accept_greedy(**greedy_args(on_gpu)), tree_accept_greedy(**greedy_args(case))) is None
    for with_draft in (False, True):
        got = tree_accept_sample(**sample_args(on_gpu, with_draft))
        assert got.next_token.is_cuda
        assert mismatch(got, tree_accept_sample(**sample_args(case, with_draft))) is None


# ------------------------------------------------------------------------------------------ losslessness
V_STAT = 8
DRAWS = 200_000
STAT_GEN = torch.Generator().manual_seed(1234)
TARGET_LOGITS = torch.randn(V_STAT + 1, V_STAT, generator=STAT_GEN, dtype=torch.float64) * 1.5
DRAFT_LOGITS = TARGET_LOGITS + torch.randn(V_STAT + 1, V_STAT, generator=STAT_GEN, dtype=torch.float64)

# (temperature, top_k, top_p) of the target (or draft) distributions.
VARIANTS = {"T1": (1.0, 0, 1.0), "T0.6": (0.6, 0, 1.0), "T1.6": (1.6, 0, 1.0), "k3": (1.0, 3, 1.0),
            "p0.8": (1.0, 0, 0.8), "mix": (0.8, 5, 0.9)}
# Deterministic trees: BFS parents, and each node's token as a rank in its parent's target distribution
# (ranks beyond a top-k / top-p cut are tokens the target rules out).
TREES = {
    "chain": ([-1, 0, 1, 2], [0, 0, 0, 1]),
    "wide": ([-1, 0, 0, 0, 0, 0], [0, 0, 1, 2, 5, 7]),
    "deep": ([-1, 0, 0, 1, 1, 2, 2], [0, 0, 1, 0, 2, 1, 0]),
    "dup": ([-1, 0, 0, 0, 1, 1], [0, 1, 1, 0, 0, 0]),
}


def distributions(logits: torch.Tensor, variant: str) -> torch.Tensor:
    """softmax(logits / T), cut to the top-k and to the smallest top-p prefix, renormalised (fp64).

    Row V_STAT is the distribution after the root; row t < V_STAT the one after token t."""
    temperature, top_k, top_p = VARIANTS[variant]
    p = torch.softmax(logits / temperature, -1)
    order = p.argsort(-1, descending=True)
    sorted_p = p.gather(-1, order)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if top_k:
        keep[:, top_k:] = False
    keep &= sorted_p.cumsum(-1) - sorted_p < top_p
    p = torch.zeros_like(p).scatter(-1, order, sorted_p * keep)
    return p / p.sum(-1, keepdim=True)


def emitted_pair(tokens, out, cond, gen) -> tuple[np.ndarray, np.ndarray]:
    """The first two tokens the verifier emits; if only one is emitted this step, the next step's token
    is simulated by drawing from the target after it."""
    path, length, nxt = (t.numpy() for t in out)
    tok = tokens.numpy()
    rows = np.arange(len(length))
    x1 = np.where(length >= 1, tok[rows, np.maximum(path[:, 1], 0)], nxt)
    cdf = cond.numpy().cumsum(-1)[x1]                                   # [B, V]
    u = torch.rand(len(x1), generator=gen, dtype=torch.float64).numpy()
    next_step = np.minimum((u[:, None] >= cdf).sum(-1), V_STAT - 1)
    x2 = np.where(length >= 2, tok[rows, np.maximum(path[:, min(2, path.shape[1] - 1)], 0)],
                  np.where(length == 1, nxt, next_step))
    return x1, x2


def assert_distributed_as(samples: np.ndarray, expected: np.ndarray, what: str):
    counts = np.bincount(samples, minlength=len(expected))
    ruled_out = expected == 0
    assert counts[ruled_out].sum() == 0, f"{what}: emitted tokens the target rules out"
    f_exp = expected[~ruled_out] / expected[~ruled_out].sum() * counts.sum()
    pvalue = stats.chisquare(counts[~ruled_out], f_exp).pvalue
    assert pvalue > 1e-3, f"{what}: chi-square p = {pvalue:.2e}, counts {counts}, expected {f_exp.round()}"


def assert_lossless(tokens, out, p, gen):
    """Position 1 ~ p(x1) at the root, and (x1, x2) ~ p(x1) p(x2 | x1)."""
    x1, x2 = emitted_pair(tokens, out, p[:V_STAT], gen)
    assert_distributed_as(x1, p[V_STAT].numpy(), "position 1")
    assert_distributed_as(x1 * V_STAT + x2, (p[V_STAT, :, None] * p[:V_STAT]).flatten().numpy(), "pair")


@pytest.mark.parametrize("tree,variant", [("chain", "T1"), ("chain", "p0.8"), ("wide", "k3"), ("wide", "T1.6"),
                                          ("deep", "T0.6"), ("deep", "mix"), ("dup", "T1"), ("dup", "k3")])
def test_deterministic_tree_sampling_is_lossless(tree, variant):
    parents_list, ranks = TREES[tree]
    p = distributions(TARGET_LOGITS, variant)                            # [V + 1, V] fp64
    order = p.argsort(dim=-1, descending=True, stable=True)
    node_tokens, after = [0], [V_STAT]                                   # root token unused: row V_STAT
    for i in range(1, len(parents_list)):
        node_tokens.append(int(order[after[parents_list[i]], ranks[i]]))
        after.append(node_tokens[-1])
    N = len(parents_list)
    parents, sizes = repeat_tree(parents_list, DRAWS)
    tokens = torch.tensor(node_tokens).expand(DRAWS, N).contiguous()
    target = p[after].float().expand(DRAWS, N, V_STAT).contiguous()    # [B, N, V]
    gen = torch.Generator().manual_seed(zlib.crc32(f"{tree}-{variant}".encode()))
    out = tree_accept_sample(parents, tokens, sizes, target, torch.rand(DRAWS, N + 1, generator=gen))
    assert_lossless(tokens, out, p, gen)


@pytest.mark.parametrize("target_variant,draft_variant", [("T1", "T1"), ("k3", "T1"), ("T1", "k3"),
                                                          ("p0.8", "T0.6")])
def test_chain_sampling_with_draft_probs_is_lossless(target_variant, draft_variant):
    p = distributions(TARGET_LOGITS, target_variant)
    q = distributions(DRAFT_LOGITS, draft_variant)
    gen = torch.Generator().manual_seed(zlib.crc32(f"{target_variant}-{draft_variant}".encode()))
    x1 = torch.multinomial(q[V_STAT], DRAWS, replacement=True, generator=gen)
    x2 = torch.multinomial(q[x1], 1, generator=gen)[:, 0]
    tokens = torch.stack([torch.zeros_like(x1), x1, x2], 1)               # chain root -> x1 -> x2
    after = torch.stack([torch.full_like(x1, V_STAT), x1, x2], 1)
    before = torch.stack([torch.full_like(x1, V_STAT), torch.full_like(x1, V_STAT), x1], 1)
    parents, sizes = repeat_tree([-1, 0, 1], DRAWS)
    out = tree_accept_sample(parents, tokens, sizes, p.float()[after], torch.rand(DRAWS, 4, generator=gen),
                             draft_probs=q.float()[before])
    assert_lossless(tokens, out, p, gen)


# ------------------------------------------------------------------------------------------------ errors
def test_bad_arguments_raise_value_error():
    args = sample_args(make_case(2, 4, 8, seed=0), with_draft=False)
    bad = {
        "target_probs must be torch.float32": dict(target_probs=args["target_probs"].half()),
        r"uniforms must have shape \[2, 5\]": dict(uniforms=args["uniforms"][:, :4]),
        r"tokens must have shape \[2, 4\]": dict(tokens=args["tokens"][:1]),
        "target_probs is on meta": dict(target_probs=args["target_probs"].to("meta")),
        r"draft_probs must have shape \[2, 4, 8\]": dict(draft_probs=args["target_probs"][..., :7]),
        "outside the vocabulary": dict(tokens=args["tokens"].clone().fill_(8)),
        "breaks BFS order": dict(parents=torch.tensor([[-1, 0, 3, 1]] * 2, dtype=torch.int32)),
        r"sizes\[1\] = 0 is outside": dict(sizes=torch.tensor([4, 0], dtype=torch.int32)),
    }
    for message, change in bad.items():
        with pytest.raises(ValueError, match=message):
            tree_accept_sample(**{**args, **change})
    with pytest.raises(ValueError, match="target_argmax must be torch.int64"):
        tree_accept_greedy(args["parents"], args["tokens"], args["sizes"], args["tokens"].int())
    with pytest.raises(TypeError):
        tree_accept_sample(**args, backend="triton")  # one implementation per device: no backend choice
    if not rejection._interpreting():
        with triton_on_cpu(), pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            tree_accept_sample(**args)


if __name__ == "__main__" and sys.argv[1:] == ["triton"]:
    _triton_interpreter_check()
