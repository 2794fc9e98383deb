"""tree_accept_greedy / tree_accept_sample: the public functions (the C++ op on CPU, the Triton kernels on
CUDA) against the naive reference; greedy_verdict (from logits to the host's summary: one C++ op on the CPU)
against the composition it replaces there (argmax + tree_accept_greedy + verdict_summary).

Bytes moved = the tree, uniforms and outputs + the probability rows the algorithm has to read: every
node on the accepted path for deterministic drafts; with draft probabilities only the final node's target
row and, if its child was rejected, that child's draft row (accepted nodes read two scalars).
"""
import pytest
import torch

from eagle_kernels import argmax, greedy_verdict, tree_accept_greedy, tree_accept_sample, verdict_summary
from kernel_refs_tree import batch_trees, random_bfs_parents, ref_tree_accept_greedy, ref_tree_accept_sample

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# name: (B, N, V); 32000 is the Llama-2 vocabulary, 128256 Llama-3's.
SHAPES = {"B4-N16-V1k": (4, 16, 1000), "B16-N64-V32k": (16, 64, 32000)}
if DEVICE.type == "cuda":
    SHAPES["B64-N64-V128k"] = (64, 64, 128256)
REFERENCE_SHAPES = {"B4-N16-V1k"}
MODES = ["greedy", "sample", "sample-draft-probs"]

IMPLS = ["triton" if DEVICE.type == "cuda" else "native", "reference"]  # the one implementation per device


def make_case(B: int, N: int, V: int) -> dict:
    """Full random trees; the first child of a node is the target argmax at it, later siblings are drawn
    from the draft distribution, so walks go a few levels deep as with a trained draft head."""
    gen = torch.Generator().manual_seed(0)
    parents, sizes = batch_trees([random_bfs_parents(N, gen) for _ in range(B)], N)
    logits = torch.randn(B, N, V, generator=gen) * 4
    probs = torch.softmax(logits, -1)
    draft = torch.softmax(logits + torch.randn(B, N, V, generator=gen), -1)
    at_parent = parents.clamp(min=0).long()
    first = torch.cat([torch.zeros(B, 1, dtype=torch.bool), parents[:, 1:] != parents[:, :-1]], 1)
    argmax = probs.argmax(-1).gather(1, at_parent)
    sampled = torch.multinomial(draft.reshape(B * N, V), 1, generator=gen).reshape(B, N)
    return dict(parents=parents, tokens=torch.where(first, argmax, sampled), sizes=sizes, target_probs=probs,
                uniforms=torch.rand(B, N + 1, generator=gen), draft_probs=draft)


def moved_bytes(case: dict, mode: str, accept_len: torch.Tensor, accept_path: torch.Tensor) -> int:
    B, N, V = case["target_probs"].shape
    nbytes = B * N * (4 + 8) + B * 4 + B * N * 4 + B * (4 + 8)  # parents, tokens, sizes, outputs
    if mode == "greedy":
        return nbytes + B * N * 8
    nbytes += B * (N + 1) * 4
    if mode == "sample":
        return nbytes + int((accept_len + 1).sum()) * V * 4
    last = accept_path.gather(1, accept_len.long()[:, None])                    # [B, 1] final node
    rejected_child = (case["parents"] == last).any(1)
    return nbytes + (B + int(rejected_child.sum())) * V * 4


def call(impl: str, mode: str, case: dict):
    if impl == "reference":
        if mode == "greedy":
            return lambda: ref_tree_accept_greedy(case["parents"], case["tokens"], case["sizes"], case["argmax"])
        return lambda: ref_tree_accept_sample(**sample_args(case, mode))
    if mode == "greedy":
        return lambda: tree_accept_greedy(case["parents"], case["tokens"], case["sizes"], case["argmax"])
    return lambda: tree_accept_sample(**sample_args(case, mode))


def sample_args(case: dict, mode: str) -> dict:
    keys = ["parents", "tokens", "sizes", "target_probs", "uniforms"]
    return {k: case[k] for k in keys + (["draft_probs"] if mode == "sample-draft-probs" else [])}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_tree_accept(bandwidth, shape, mode, impl):
    if impl == "reference" and shape not in REFERENCE_SHAPES:
        pytest.skip("the reference is too slow for this shape")
    case = make_case(*SHAPES[shape])
    case["argmax"] = case["target_probs"].argmax(-1)
    device = torch.device("cpu") if impl == "reference" else DEVICE
    case = {k: v.to(device) for k, v in case.items()}
    fn = call(impl, mode, case)
    path, length, _ = fn()
    bandwidth(fn, moved_bytes({k: v.cpu() for k, v in case.items()}, mode, length.cpu(), path.cpu()), device)


@pytest.mark.parametrize("impl", ["native", "composed"])
@pytest.mark.parametrize("shape", ["B1-N3-V49k", "B4-N16-V32k"])
def test_greedy_verdict(bandwidth, shape, impl):
    """Bytes moved: the logits rows the descent reads (the visited nodes; the composition reads them all, the
    same count is used for both), the tree and the summary."""
    B, N, V = {"B1-N3-V49k": (1, 3, 49152), "B4-N16-V32k": (4, 16, 32000)}[shape]
    case = {k: v.to(DEVICE) for k, v in make_case(B, N, V).items()}
    tree = (case["parents"], case["tokens"], case["sizes"])
    logits = case["target_probs"].log()
    if impl == "native":
        fn = lambda: greedy_verdict(*tree, logits)
    else:
        fn = lambda: verdict_summary(case["tokens"], *tree_accept_greedy(*tree, argmax(logits)))
    out = fn()
    assert torch.equal(out.cpu(), greedy_verdict(*tree, logits).cpu())
    visited = int((out[:, 0] + 1).sum())
    bandwidth(fn, visited * V * 4 + B * N * (4 + 8) + B * 4 + B * (2 * N + 2) * 8, DEVICE)
