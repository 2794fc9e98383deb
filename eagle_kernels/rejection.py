"""Batched tree acceptance: greedy and rejection sampling over draft trees (DESIGN.md).

One implementation per device: the Triton kernels below for CUDA tensors (and for CPU tensors inside
`eagle_kernels.triton_on_cpu()`, under TRITON_INTERPRET=1), the C++ op `eagle::tree_accept_*` for CPU
tensors. Both follow the canonical fp32 order of csrc/cdf_order.h, so the same inputs and uniforms give
identical outputs. Randomness enters only through `uniforms`.
"""
from typing import NamedTuple

import torch

from ._ops import check_tensor, check_tree, check_tree_values, gpu_path, has_kernel, ops
from .sampling import argmax

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

CDF_SEGMENT = 256  # csrc/cdf_order.h: kCdfSegment
_MIN_LANES = 16  # segment lanes per Triton program: at least a few per warp, even for tiny vocabularies


class AcceptResult(NamedTuple):
    accept_path: torch.Tensor  # int32 [B, N]: accepted node indices from the root (0), -1 padded
    accept_len: torch.Tensor   # int32 [B]: accepted draft tokens, root excluded
    next_token: torch.Tensor   # int64 [B]: bonus token (all accepted) or corrected token


def tree_accept_greedy(parents, tokens, sizes, target_argmax) -> AcceptResult:
    """Greedy verification: descend to the first child whose token is the target argmax at its parent.

    parents: int32 [B, N], tokens: int64 [B, N], sizes: int32 [B], target_argmax: int64 [B, N].
    """
    B, N = _check_accept(parents, tokens, sizes)
    check_tensor(target_argmax, "target_argmax", torch.int64, (B, N), parents.device)
    if _on_triton(parents):
        return _greedy_triton(parents, tokens, sizes, target_argmax)
    check_tree_values(parents, sizes)
    return AcceptResult(*ops().tree_accept_greedy(parents, tokens, sizes, target_argmax))


def verdict_summary(tokens, path, length, next_token) -> torch.Tensor:
    """What a verify round's host reads, int64 [B, 2N + 2]: accepted length, next token, the accepted path
    (node ids from the root, -1 padded) and the tokens on it (a padded entry repeats the root's). tokens int64
    [B, N]; path int32 / int64 [B, N]; length int32 [B]; next_token int64 [B]."""
    on_path = tokens.gather(1, path.clamp(min=0).long())
    return torch.cat([length[:, None].long(), next_token[:, None], path.long(), on_path], 1)


_GREEDY_VERDICT_CPU = has_kernel("greedy_verdict", torch.device("cpu"))


def greedy_verdict(parents, tokens, sizes, logits) -> torch.Tensor:
    """Greedy verification straight from the target's logits fp32 [B, N, V] (its distribution at each node),
    or from their argmax int64 [B, N], in the form the host reads (verdict_summary's). CPU tensors take one C++ op, which also checks the
    arguments and takes the argmax of the nodes the descent visits only: after a forward that streamed the
    weights the host's caches are cold, and each torch op of argmax + tree_accept_greedy + verdict_summary
    (the reference, and the path everywhere else: the same values) cost ~30-50 us there."""
    if _GREEDY_VERDICT_CPU and parents.device.type == "cpu" and not gpu_path(parents):
        return ops().greedy_verdict(parents, tokens, sizes, logits)
    B, N = _check_accept(parents, tokens, sizes)
    if logits.dtype == torch.int64:
        return verdict_summary(tokens, *tree_accept_greedy(parents, tokens, sizes, logits))
    check_tensor(logits, "logits", torch.float32, (B, N, None), parents.device)
    if logits.shape[2] < 1:
        raise ValueError("logits must have a non-empty vocabulary (V >= 1)")
    return verdict_summary(tokens, *tree_accept_greedy(parents, tokens, sizes, argmax(logits)))


def tree_accept_sample(parents, tokens, sizes, target_probs, uniforms, draft_probs=None) -> AcceptResult:
    """Lossless rejection sampling of a draft tree against the target distributions.

    target_probs: fp32 [B, N, V], the target's next-token distribution at each node; uniforms: fp32
    [B, N + 1] in [0, 1) (uniforms[:, i] tests node i, uniforms[:, 0] draws the final token).
    draft_probs None (deterministic drafts): siblings are tried in index order, child token x accepted
    iff u < p(x) / sum(p), a rejected x is removed from p. draft_probs fp32 [B, N, V] (chains sampled from
    q, draft_probs[b, c] = q at c's parent): only the first child of a node is tried, accepted iff
    u < p(x) / q(x), else the final token comes from norm(max(0, p - q)).
    CPU tensors are validated in full (ValueError on a malformed tree or a token outside the vocabulary);
    the Triton kernels stay memory-safe on such values instead (an out-of-vocabulary draft is rejected).
    """
    B, N = _check_accept(parents, tokens, sizes)
    check_tensor(target_probs, "target_probs", torch.float32, (B, N, None), parents.device)
    V = target_probs.shape[2]
    if V < 1:
        raise ValueError("target_probs must have a non-empty vocabulary (V >= 1)")
    check_tensor(uniforms, "uniforms", torch.float32, (B, N + 1), parents.device)
    if draft_probs is not None:
        check_tensor(draft_probs, "draft_probs", torch.float32, (B, N, V), parents.device)
    if _on_triton(parents):
        return _sample_triton(parents, tokens, sizes, target_probs, uniforms, draft_probs)
    check_tree_values(parents, sizes, tokens, V)
    return AcceptResult(*ops().tree_accept_sample(parents, tokens, sizes, target_probs, uniforms, draft_probs))


def _check_accept(parents, tokens, sizes) -> tuple[int, int]:
    B, N = check_tree(parents, sizes)
    check_tensor(tokens, "tokens", torch.int64, (B, N), parents.device)
    return B, N


def _on_triton(parents) -> bool:
    """True for the Triton kernels (gpu_path), False for the C++ op (CPU tensors); ValueError if the
    chosen implementation cannot run."""
    if not gpu_path(parents):
        if parents.device.type != "cpu":
            raise ValueError(f"tree acceptance supports CPU and CUDA tensors, got {parents.device}")
        return False
    if triton is None:
        raise ValueError(f"tree acceptance on {parents.device.type} tensors needs Triton installed")
    if not parents.is_cuda and not _interpreting():
        raise ValueError("triton_on_cpu() needs TRITON_INTERPRET=1 set before Triton is imported")
    return True


def _interpreting() -> bool:
    return "Interpret" in type(_tree_accept_sample_kernel).__name__


def _next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def _greedy_triton(parents, tokens, sizes, target_argmax) -> AcceptResult:
    B, N = parents.shape
    out = _alloc_result(B, N, parents.device)
    if B == 0:
        return out
    _tree_accept_greedy_kernel[(B,)](
        parents.contiguous(), tokens.contiguous(), sizes.contiguous(), target_argmax.contiguous(),
        *out, N, BLOCK_N=_next_pow2(N), num_warps=1)
    return out


def _sample_triton(parents, tokens, sizes, target_probs, uniforms, draft_probs) -> AcceptResult:
    B, N = parents.shape
    V = target_probs.shape[2]
    lanes = max(_MIN_LANES, _next_pow2(-(-V // CDF_SEGMENT)))
    probs = target_probs.contiguous()
    work = torch.empty(B, V, dtype=torch.float32, device=parents.device)      # current distribution
    seg = torch.empty(B, lanes, dtype=torch.float32, device=parents.device)   # its segment sums
    out = _alloc_result(B, N, parents.device)
    if B == 0:
        return out
    _tree_accept_sample_kernel[(B,)](
        parents.contiguous(), tokens.contiguous(), sizes.contiguous(), probs,
        probs if draft_probs is None else draft_probs.contiguous(), uniforms.contiguous(), work, seg,
        *out, N, V, HAS_DRAFT=draft_probs is not None, SEG=CDF_SEGMENT, LANES=lanes,
        BLOCK_N=_next_pow2(N), BLOCK_V=1024, num_warps=4, enable_fp_fusion=False)
    return out


def _alloc_result(B: int, N: int, device) -> AcceptResult:
    return AcceptResult(torch.empty(B, N, dtype=torch.int32, device=device),
                        torch.empty(B, dtype=torch.int32, device=device),
                        torch.empty(B, dtype=torch.int64, device=device))


# One program per request. The walk is scalar; the distribution of the current node lives in a global
# scratch row (`work`, [V]) with its segment sums (`seg`, [LANES]), lane s summing segment s sequentially.
# Threads of a program exchange them through memory, so every pass is fenced by barriers.
if triton is not None:
    @triton.jit
    def _segment_pass(src, q, work, seg, V, RESIDUAL: tl.constexpr, COPY: tl.constexpr,
                      SEG: tl.constexpr, LANES: tl.constexpr):
        """seg[s] = sequential sum of segment s of src (max(0, src - q) with RESIDUAL); COPY writes the
        summed values to work."""
        tl.debug_barrier()
        start = tl.arange(0, LANES).to(tl.int64) * SEG
        acc = tl.zeros([LANES], dtype=tl.float32)
        for k in range(0, tl.minimum(V, SEG)):
            idx = start + k
            valid = idx < V
            v = tl.load(src + idx, mask=valid, other=0.0)
            if RESIDUAL:
                v = tl.maximum(v - tl.load(q + idx, mask=valid, other=0.0), 0.0)
            if COPY:
                tl.store(work + idx, v, mask=valid)
            acc += v
        tl.store(seg + tl.arange(0, LANES), acc)
        tl.debug_barrier()

    @triton.jit
    def _total(seg, nseg):
        acc = tl.zeros([], dtype=tl.float32)
        for s in range(0, nseg):
            acc += tl.load(seg + s)
        return acc

    @triton.jit
    def _last_positive(work, V, BLOCK_V: tl.constexpr):
        offs = tl.arange(0, BLOCK_V)
        best = tl.full([], -1, tl.int64)
        for start in range(0, V, BLOCK_V):
            idx = start + offs
            v = tl.load(work + idx, mask=idx < V, other=0.0)
            best = tl.maximum(best, tl.max(tl.where(v > 0.0, idx, -1)).to(tl.int64))
        return best

    @triton.jit
    def _draw(work, seg, V, u, SEG: tl.constexpr, BLOCK_V: tl.constexpr):
        """Inverse CDF of the work row at u (cdf_order.h): skip whole segments, then scan one."""
        nseg = (V + SEG - 1) // SEG
        threshold = u * _total(seg, nseg)
        found = tl.full([], -1, tl.int64)
        before = tl.zeros([], dtype=tl.float32)
        s = tl.zeros([], dtype=tl.int32)
        while (s < nseg) & (found < 0):
            after = before + tl.load(seg + s)
            if after > threshold:
                inner = tl.zeros([], dtype=tl.float32)
                i = s.to(tl.int64) * SEG
                end = tl.minimum(i + SEG, V)
                while (i < end) & (found < 0):
                    inner += tl.load(work + i)
                    if before + inner > threshold:
                        found = i
                    i += 1
            before = after
            s += 1
        if found < 0:
            found = _last_positive(work, V, BLOCK_V)
        return found

    @triton.jit
    def _try_siblings(par, tok, unif, row, work, seg, cur, n, V, SEG: tl.constexpr, LANES: tl.constexpr):
        """Deterministic drafts: the first child of cur accepted in index order, or -1 with work =
        the remaining distribution (rejected tokens zeroed)."""
        _segment_pass(row, row, work, seg, V, False, True, SEG, LANES)
        nseg = (V + SEG - 1) // SEG
        child = tl.full([], -1, tl.int32)
        c = cur + 1
        while (c < n) & (child < 0):
            if tl.load(par + c) == cur:
                x = tl.load(tok + c)
                in_vocab = (x >= 0) & (x < V)  # out-of-vocabulary drafts read as p(x) = 0: rejected
                px = tl.load(work + x, mask=in_vocab, other=0.0)
                if tl.load(unif + c) < tl.math.div_rn(px, _total(seg, nseg)):
                    child = c
                else:
                    tl.store(work + x, 0.0, mask=in_vocab)
                    _segment_pass(work, work, work, seg, V, False, False, SEG, LANES)
            c += 1
        return child

    @triton.jit
    def _try_chain(par, tok, unif, row, draft, work, seg, cur, n, V, SEG: tl.constexpr, LANES: tl.constexpr):
        """Chain drafts with probabilities: the first child of cur, accepted iff u < p(x) / q(x); else -1
        with work = max(0, p - q) (p if that has no mass)."""
        c = cur + 1
        while (c < n) & (tl.load(par + c, mask=c < n, other=-2) != cur):
            c += 1
        child = tl.full([], -1, tl.int32)
        use_p = c >= n
        if c < n:
            x = tl.load(tok + c)
            in_vocab = (x >= 0) & (x < V)  # out-of-vocabulary drafts read as 0 / 0: rejected
            q = draft + c.to(tl.int64) * V
            px = tl.load(row + x, mask=in_vocab, other=0.0)
            if tl.load(unif + c) < tl.math.div_rn(px, tl.load(q + x, mask=in_vocab, other=0.0)):
                child = c
            else:
                _segment_pass(row, q, work, seg, V, True, True, SEG, LANES)
                use_p = _total(seg, (V + SEG - 1) // SEG) == 0.0
        if use_p:
            _segment_pass(row, row, work, seg, V, False, True, SEG, LANES)
        return child

    @triton.jit
    def _tree_accept_sample_kernel(parents, tokens, sizes, probs, draft, uniforms, work, seg,
                                   path_out, len_out, next_out, N, V, HAS_DRAFT: tl.constexpr,
                                   SEG: tl.constexpr, LANES: tl.constexpr, BLOCK_N: tl.constexpr,
                                   BLOCK_V: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        n = tl.minimum(tl.maximum(tl.load(sizes + b), 1), N)
        par = parents + b * N
        tok = tokens + b * N
        unif = uniforms + b * (N + 1)
        work = work + b * V
        seg = seg + b * LANES
        offs = tl.arange(0, BLOCK_N)
        path = tl.where(offs == 0, 0, -1)
        cur = tl.zeros([], dtype=tl.int32)
        depth = tl.zeros([], dtype=tl.int32)
        child = tl.zeros([], dtype=tl.int32)
        while child >= 0:
            row = probs + (b * N + cur) * V
            if HAS_DRAFT:
                child = _try_chain(par, tok, unif, row, draft + b * N * V, work, seg, cur, n, V, SEG, LANES)
            else:
                child = _try_siblings(par, tok, unif, row, work, seg, cur, n, V, SEG, LANES)
            if child >= 0:
                cur = child
                depth += 1
                path = tl.where(offs == depth, cur, path)
        tl.store(path_out + b * N + offs, path, mask=offs < N)
        tl.store(len_out + b, depth)
        tl.store(next_out + b, _draw(work, seg, V, tl.load(unif), SEG, BLOCK_V))

    @triton.jit
    def _tree_accept_greedy_kernel(parents, tokens, sizes, argmax, path_out, len_out, next_out, N,
                                   BLOCK_N: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        n = tl.minimum(tl.maximum(tl.load(sizes + b), 1), N)
        offs = tl.arange(0, BLOCK_N)
        path = tl.where(offs == 0, 0, -1)
        cur = tl.zeros([], dtype=tl.int32)
        depth = tl.zeros([], dtype=tl.int32)
        want = tl.load(argmax + b * N)
        # BFS order: a child follows its parent, so one forward scan sees every child of each new node.
        for c in range(1, n):
            if (tl.load(parents + b * N + c) == cur) & (tl.load(tokens + b * N + c) == want):
                cur = c
                depth += 1
                path = tl.where(offs == depth, cur, path)
                want = tl.load(argmax + b * N + cur)
        tl.store(path_out + b * N + offs, path, mask=offs < N)
        tl.store(len_out + b, depth)
        tl.store(next_out + b, want)
