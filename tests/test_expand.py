"""topk_expand (torch path and Triton kernels) against a plain fp64 reference with the documented tie rule.

Without CUDA the Triton kernels run under TRITON_INTERPRET=1, set before anything imports triton (see
test_attention_kernel.py); the interpreter is slow, so vocabularies stay small.
"""
import os
import warnings

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import eagle_kernels.expand as expand  # noqa: E402

# Triton decides "interpret or compile" when it decorates a kernel, its own jit'd library (tl.max, ...) included,
# at its first import: if that happened before TRITON_INTERPRET was set, kernels cannot be interpreted here.
TRITON_USABLE = expand.triton is not None and (
    torch.cuda.is_available() or "Interpret" in type(expand.triton.language.max).__name__)
if expand.triton is not None and not TRITON_USABLE:
    warnings.warn("Triton was imported before TRITON_INTERPRET=1 was set: Triton tests skipped "
                  "(set it in tests/conftest.py or run this file on its own)")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CPP = expand._CPU_OP
IMPLS = ["torch", "cpp"] + (["triton"] if TRITON_USABLE else [])


def ref_topk_expand(logits, parent_scores, k, d2t=None):
    """One [R, V] problem, in fp64 python: rows ranked by (logit desc, id asc), candidates by
    (score desc, row asc, rank asc)."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    row_tokens, row_scores, cands = [], [], []
    for r in range(logits.shape[0]):
        ids = sorted(range(logits.shape[1]), key=lambda i: (-float(logits[r, i]), i))[:k]
        scores = [float(parent_scores[r]) + float(logp[r, i]) for i in ids]
        row_tokens.append(ids)
        row_scores.append(scores)
        cands += [(-s, r, rank, i) for rank, (i, s) in enumerate(zip(ids, scores))]
    best = sorted(cands)[:k]

    def mapped(i):
        return i + int(d2t[i]) if d2t is not None else i

    return (torch.tensor([mapped(c[3]) for c in best]), torch.tensor([-c[0] for c in best], dtype=torch.float64),
            torch.tensor([c[1] for c in best]), torch.tensor([[mapped(i) for i in row] for row in row_tokens]),
            torch.tensor(row_scores, dtype=torch.float64))


def run(impl, logits, parent_scores, k, d2t=None):
    """Calls the chosen implementation through the public batched/unbatched wrapper."""
    if impl in ("torch", "cpp"):  # the public function (the C++ kernel on CPU tensors) or the torch path alone
        if impl == "torch":
            fn = lambda *a: expand.Expansion(*expand._topk_expand_torch(*a))
            out = _batched(fn, logits, parent_scores, k, d2t)
        else:
            assert CPP, "the extension has no topk_expand kernel: rebuild it (make setup)"
            out = expand.topk_expand(logits, parent_scores, k, d2t)
        return [*out, out.row_tokens, out.row_scores]
    batched = logits.dim() == 3
    args = [t.to(DEV) if t is not None else None for t in (logits, parent_scores, d2t)]
    if not batched:
        args[0], args[1] = args[0][None], args[1][None]
    out = expand._topk_expand_triton(args[0], args[1], k, args[2])
    return [t.cpu() if batched else t[0].cpu() for t in out]


def _batched(fn, logits, parent_scores, k, d2t):
    if logits.dim() == 3:
        return fn(logits, parent_scores, k, d2t)
    out = fn(logits[None], parent_scores[None], k, d2t)
    return expand.Expansion(*(t[0] for t in (*out, out.row_tokens, out.row_scores)))


def check(out, ref, dtype):
    tokens, scores, parents, row_tokens, row_scores = ref
    tol = 1e-5 if dtype == torch.float32 else 1e-4
    assert torch.equal(out[0], tokens) and out[0].dtype == torch.int64
    assert torch.equal(out[2], parents) and out[2].dtype == torch.int64
    torch.testing.assert_close(out[1].double(), scores, atol=tol, rtol=0)
    assert torch.equal(out[3], row_tokens)
    torch.testing.assert_close(out[4].double(), row_scores, atol=tol, rtol=0)
    assert out[1].dtype == out[4].dtype == torch.float32


CASES = [  # (R, V, k, d2t, dtype): R = 1 and R = k, with and without d2t, V not a multiple of chunks
    (1, 100, 4, False, torch.float32),
    (4, 300, 4, True, torch.float16),
    (8, 1000, 8, False, torch.float32),
    (3, 40, 16, True, torch.float32),
    (2, 500, 5, False, torch.bfloat16),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"R{c[0]}-V{c[1]}-k{c[2]}-d2t{int(c[3])}-{str(c[4])[6:]}")
def test_matches_reference(impl, case):
    r, v, k, use_d2t, dtype = case
    gen = torch.Generator().manual_seed(r * 1000 + v)
    logits = (torch.randn(r, v, generator=gen) * 3).to(dtype)
    parent_scores = -torch.rand(r, generator=gen) * 4
    d2t = torch.randint(0, 5000, (v,), generator=gen) if use_d2t else None
    out = run(impl, logits, parent_scores, k, d2t)
    check(out, ref_topk_expand(logits, parent_scores, k, d2t), dtype)
    assert out[0].shape == (k,) and out[3].shape == (r, k)


@pytest.mark.parametrize("impl", IMPLS)
def test_batched_form(impl):
    gen = torch.Generator().manual_seed(7)
    b, r, v, k = 3, 4, 200, 4
    logits = torch.randn(b, r, v, generator=gen)
    parent_scores = -torch.rand(b, r, generator=gen)
    d2t = torch.randint(0, 100, (v,), dtype=torch.int32, generator=gen)
    out = run(impl, logits, parent_scores, k, d2t)
    assert out[0].shape == (b, k) and out[4].shape == (b, r, k)
    for i in range(b):
        check([t[i] for t in out], ref_topk_expand(logits[i], parent_scores[i], k, d2t), torch.float32)


@pytest.mark.parametrize("impl", IMPLS)
def test_ties_resolve_to_lowest_id_then_lowest_row(impl):
    # Integer logits tie within rows (and across the top-k cut); identical rows with equal parent scores tie
    # across rows.
    gen = torch.Generator().manual_seed(3)
    row = torch.randint(-3, 4, (1, 64), generator=gen).float()
    logits = torch.cat([row, row, torch.randint(-3, 4, (1, 64), generator=gen).float()])
    parent_scores = torch.tensor([-0.5, -0.5, -0.5])
    out = run(impl, logits, parent_scores, 6)
    check(out, ref_topk_expand(logits, parent_scores, 6), torch.float32)


def test_result_unpacks_as_three_and_carries_rows():
    logits, parent_scores = torch.randn(2, 50), torch.zeros(2)
    out = expand.topk_expand(logits, parent_scores, 3)
    tokens, scores, parents = out
    assert out.tokens is tokens and out.row_tokens.shape == (2, 3) and out.row_scores.shape == (2, 3)


@pytest.mark.parametrize("message,kwargs", [
    ("logits must be", dict(logits=torch.randn(5))),
    ("dtype must be", dict(logits=torch.randn(2, 10).double())),
    ("parent_scores must be", dict(parent_scores=torch.zeros(3))),
    ("parent_scores must be", dict(parent_scores=torch.zeros(2, dtype=torch.float64))),
    ("k must be", dict(k=11)),
    ("k must be", dict(k=0)),
    ("d2t must be", dict(d2t=torch.zeros(9, dtype=torch.int64))),
    ("d2t must be", dict(d2t=torch.zeros(10))),
])
def test_bad_inputs_raise(message, kwargs):
    args = dict(logits=torch.randn(2, 10), parent_scores=torch.zeros(2), k=3, d2t=None) | kwargs
    with pytest.raises(ValueError, match=message):
        expand.topk_expand(**args)


@pytest.mark.skipif(not TRITON_USABLE, reason="Triton not installed or not interpretable")
def test_triton_rejects_large_k():
    with pytest.raises(ValueError, match="k <= 16"):
        expand._topk_expand_triton(torch.randn(1, 1, 100, device=DEV), torch.zeros(1, 1, device=DEV), 17, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_topk_low_index_first_matches_stable_sort(dtype):
    # Integer values (ties everywhere, also across the cut), signed zeros and infinities, every k.
    gen = torch.Generator().manual_seed(11)
    x = torch.randint(-3, 4, (3, 2, 40), generator=gen).to(dtype)
    x[0, :, ::5], x[0, :, 1::7], x[1, :, ::9], x[1, :, 2::11] = 0.0, -0.0, float("inf"), float("-inf")
    ref = torch.sort(x.float(), dim=-1, descending=True, stable=True)
    for k in range(1, 41):
        vals, ids = expand.topk_low_index_first(x, k)
        assert torch.equal(ids, ref.indices[..., :k]) and vals.dtype == dtype
        assert torch.equal(vals, x.gather(-1, ids))
