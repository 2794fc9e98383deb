"""topk_expand and sampling_probs: torch path (every device) and Triton kernels (CUDA) against plain torch.

Bytes moved = the logits read once (plus probabilities written for sampling_probs); the small [R, k]
outputs are ignored.
"""
import pytest
import torch

from eagle_kernels import expand, sampling

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# name: (B, R, V, k, d2t). 49152 is the SmolLM2 vocabulary; 32000 a reduced EAGLE-3 draft vocabulary.
SHAPES = {
    "R1-V49k-k10": (1, 1, 49152, 10, False),
    "R10-V49k-k10": (1, 10, 49152, 10, False),
    "B4-R10-V32k-k8-d2t": (4, 10, 32000, 8, True),
}
if DEVICE.type == "cuda":
    SHAPES["B8-R16-V128k-k16"] = (8, 16, 128256, 16, False)
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32


def reference_expand(logits, parent_scores, k, d2t):
    """The unfused formulation: full log-softmax, per-row top-k, flatten, global top-k, d2t gather."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    row_scores, row_ids = logp.topk(k, dim=-1)
    row_scores = row_scores + parent_scores[..., None]
    scores, flat = row_scores.flatten(-2).topk(k, dim=-1)
    ids = row_ids.flatten(-2).gather(-1, flat)
    return ids + d2t[ids] if d2t is not None else ids, scores, flat // k


IMPLS = {"torch": expand._topk_expand_torch, "reference": reference_expand}
if DEVICE.type == "cuda" and expand.triton is not None:
    IMPLS["triton"] = expand._topk_expand_triton


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_topk_expand(bandwidth, shape, impl):
    b, r, v, k, use_d2t = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(b, r, v, generator=gen).to(DTYPE).to(DEVICE)
    parent_scores = -torch.rand(b, r, generator=gen).to(DEVICE)
    d2t = torch.randint(0, 1000, (v,), generator=gen).to(DEVICE) if use_d2t else None
    bandwidth(lambda: IMPLS[impl](logits, parent_scores, k, d2t), logits.numel() * logits.element_size(), DEVICE)


def reference_sampling(logits, temperature, top_k, top_p):
    """Always the full sort-based formulation, whatever the parameters."""
    probs = torch.softmax(logits.float() / temperature[:, None], dim=-1)
    sorted_p, ids = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)
    sorted_p = torch.where(rank < top_k[:, None], sorted_p, 0.0)
    keep = sorted_p.cumsum(-1) - sorted_p < top_p[:, None] * sorted_p.sum(-1, keepdim=True)
    out = torch.zeros_like(probs).scatter_(1, ids, torch.where(keep, sorted_p, 0.0))
    return out / out.sum(-1, keepdim=True)


# name: (rows, V, top_k, top_p) -- rows = batch x tree nodes of target distributions.
SAMPLING = {"rows64-V49k-topk50-topp0.9": (64, 49152, 50, 0.9), "rows64-V49k-topk20": (64, 49152, 20, 1.0)}


@pytest.mark.parametrize("impl", ["torch", "reference"])
@pytest.mark.parametrize("shape", list(SAMPLING))
def test_sampling_probs(bandwidth, shape, impl):
    rows, v, top_k, top_p = SAMPLING[shape]
    logits = torch.randn(rows, v, generator=torch.Generator().manual_seed(0)).to(DTYPE).to(DEVICE)
    params = [torch.full((rows,), x, device=DEVICE) for x in (0.8, top_k, top_p)]
    fn = sampling.sampling_probs if impl == "torch" else reference_sampling
    nbytes = logits.numel() * (logits.element_size() + 4)
    bandwidth(lambda: fn(logits, *params), nbytes, DEVICE)
