"""RMSNorm as Gemma-4 computes it: weight used directly (not 1 + w); at least fp32."""
import math

import numpy as np


def rmsnorm(x, weight=None, eps=1e-6):
    """x (..., D) float32/64 (kept); weight (D,) or None for the no-scale norms (v_norm, router, embedder)."""
    x = np.asarray(x)
    x = x if x.dtype == np.float64 else x.astype(np.float32)
    y = x * np.power(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps), np.float32(-0.5))
    return y if weight is None else y * weight


# --- GPU ---
import ml_dtypes  # noqa: E402

import gpu  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)


def rmsnorm_gpu(g, x, w, out, eps, add=None, scale=None, ld_x=None, ld_out=None):
    """out = rmsnorm(x) [* w] in bf16; with add: out = add + that; with scale too: (add + that) * scale.
    x, out, add: bf16 (T, n) rows, or (T, G, n) for a per-head norm (G heads of width n per token); ld_x /
    ld_out: elements between tokens when x / out (and add) are column slices of wider rows (default G*n).
    w: bf16 (n,) or None (no-scale). out may alias x or add. The thread layout depends on n only."""
    shape = x.shape
    n, heads = shape[-1], (shape[-2] if len(shape) >= 3 else 1)
    rows = math.prod(shape[:-1])
    ld_x, ld_out = ld_x or heads * n, ld_out or heads * n
    assert x.dtype == out.dtype == BF16 and out.shape == shape, (x, out)
    assert w is None or (w.dtype == BF16 and w.shape == (n,)), w
    assert add is None or (add.dtype == BF16 and add.shape == shape), add
    assert scale is None or add is not None, "scale needs add"
    vec = 8 if n % 8 == 0 else 1                          # from n only, so the reduction order is fixed by n
    if vec == 8 and (ld_x % 8 or ld_out % 8 or any(a.ptr % 16 for a in (x, w, out, add) if a is not None)):
        raise ValueError("rmsnorm_gpu: n % 8 == 0 needs 16-byte aligned rows")
    tpr = min(1024, -(-(n // vec) // 32) * 32)            # threads per row: one vector each, up to 1024
    rpb = max(1, 256 // tpr)                              # rows per block
    f = g.module("elementwise").function("rmsnorm_bf16" if add is None else
                                         "rmsnorm_add_bf16" if scale is None else "rmsnorm_add_scale_bf16")
    args = [out, x, w] + ([] if add is None else [add]) + [rows, n, heads, gpu.i64(ld_x), gpu.i64(ld_out),
                                                           float(eps)] + ([] if scale is None else [float(scale)])
    g.launch(f, grid=(-(-rows // rpb), 1, 1), block=(tpr, rpb, 1), args=args + [vec])


def fused_tpr(x):
    """Threads per row of the fused norm chains: rmsnorm_gpu's layout for n (one 8-vector per thread), or None
    when that layout has several vectors per thread or the rows are not 16-byte aligned (then the chain runs as
    separate rmsnorm_gpu launches, the same bytes)."""
    T, n = x.shape
    tpr = -(-(n // 8) // 32) * 32
    if n % 8 or tpr > 1024 or x.ptr % 16:
        return None
    return tpr


# The fused norm chains for T <= NORMS_PRE_MAX_T run the `_pre` kernels (elementwise.cu: every weight fetched before
# griddepcontrol.wait, every activation right after it, the next launch let go only then) with PDL; above, the
# plain kernels (each vector loaded where it is used: a third of the registers) without it. The same bytes.
# H200, 2026-11-30, decode graphs at 1k context, rebuilt per setting: batch 1 2599.5 (plain) -> 2539.7 (_pre) ->
# 2508.9 us (_pre + PDL), batch 16 7437.4 -> 7419.4 -> 7399.5; batch 64 14630.1 -> 14612.0 -> 14785.5 (with PDL
# the early CTAs, 96 registers x 352 threads each, hold SMs the expert kernels need: kernels_ptx/pdl.cuh); the
# 2,048-token prefill's norms 2.13 ms (plain) -> 3.63 ms (_pre: one or two CTAs an SM instead of three).
NORMS_PRE_MAX_T = 16


def _norms_kernel(g, name, T, tpr):
    """(function, pre): the `_pre` form of chain `name` up to NORMS_PRE_MAX_T rows when its registers allow a CTA
    of tpr threads (71-96 a thread: not the 1,024 threads of n > 4096), else the plain form (a third of them)."""
    m = g.module("elementwise")
    if T <= NORMS_PRE_MAX_T:
        f = m.function(name + "_pre_bf16")
        if tpr <= f.max_threads:
            return f, True
    return m.function(name + "_bf16"), False


def post_attn_norms_gpu(g, a, x, w_pa, w_pf, w_pf2, h, xn, e_in, eps, router=None, xn_slots=False, e_perm=False):
    """After o_proj, in one launch: h = x + norm(a) * w_pa; xn = norm(h) * w_pf; e_in = norm(h) * w_pf2
    (all (T, n) bf16): the bytes of rmsnorm_gpu(a, w_pa, h, add=x), rmsnorm_gpu(h, w_pf, xn),
    rmsnorm_gpu(h, w_pf2, e_in). router = (r, scale, root): also the MoE router's input r (T, n) =
    bf16(bf16(bf16(norm(h)) * scale) * root), the bytes of router_input_gpu(h). xn_slots: xn's rows in
    x16_bf16's slot order if the fused launch runs (n % 64 == 0); e_perm: e_in's rows in the experts' permuted
    order (kernels_ptx/xperm.cuh; their wgmma path then skips moe_permute_x) if it runs and n % 128 == 0.
    Returns (xn_slots, e_perm): whether xn and e_in went out that way."""
    T, n = a.shape
    for v in (x, h, xn, e_in) + ((router[0],) if router else ()):
        assert v.dtype == BF16 and v.shape == (T, n), v
    tpr = fused_tpr(a)
    if tpr is None or any(v.ptr % 16 for v in (x, h, xn, e_in, w_pa, w_pf, w_pf2) + (router[:2] if router else ())):
        rmsnorm_gpu(g, a, w_pa, h, eps, add=x)
        rmsnorm_gpu(g, h, w_pf, xn, eps)
        rmsnorm_gpu(g, h, w_pf2, e_in, eps)
        if router:
            router_input_gpu(g, h, router[1], router[0], eps, router[2])
        return False, False
    r, scale, root = router if router else (None, None, 1.0)
    f, pre = _norms_kernel(g, "post_attn_norms", T, tpr)
    slots, perm = bool(xn_slots) and n % 64 == 0, bool(e_perm) and n % 128 == 0
    g.launch(f, grid=(T,), block=(tpr,), args=[h, xn, e_in, a, x, w_pa, w_pf, w_pf2, n, float(eps), r, scale,
                                               float(root), int(slots), int(perm)], pdl=pre)
    return slots, perm


def router_input_gpu(g, h, scale, r, eps, root):
    """The MoE router's input row r (T, n) = bf16(bf16(bf16(h * rms(h)^-1) * scale) * root) (root = n^-0.5),
    the bytes post_attn_norms_gpu(router=...) gives. Needs n % 8 == 0, n <= 8192, 16-byte aligned rows."""
    T, n = h.shape
    assert h.dtype == r.dtype == BF16 and r.shape == (T, n) and scale.shape == (n,), (h, r, scale)
    tpr = fused_tpr(h)
    if tpr is None or r.ptr % 16 or scale.ptr % 16:
        raise ValueError(f"router_input_gpu: needs n % 8 == 0, n <= 8192 and 16-byte aligned rows (n={n})")
    g.launch(g.module("elementwise").function("router_input_bf16"), grid=(T,), block=(tpr,),
             args=[r, h, scale, n, float(eps), float(root)])


def post_ffn_norms_gpu(g, m, e, h, w1, w2, w3, scale, x, eps, w_next=None, xn=None, xn_slots=False):
    """After the dense MLP (m) and the experts (e), in one launch: m1 = norm(m) * w1; s = m1 + norm(e) * w2;
    x = (h + norm(s) * w3) * scale; with w_next: xn = norm(x) * w_next (the next layer's input norm). The bytes
    of the rmsnorm_gpu chain it replaces; m1 and s stay in registers. x must not alias m, e or h.
    e may also be the experts' output before its combine (layers.moe.Pairs, from moe_gpu(combine=False)): then
    the combine runs inside this launch (post_ffn_norms_pairs_bf16), the bytes of Pairs.combine() then this.
    xn_slots: xn's rows in x16_bf16's slot order if the fused launch runs (n % 64 == 0); returns whether xn went
    out that way."""
    T, n = m.shape
    pairs = e if hasattr(e, "combine") else None
    for v in (h, x) + ((xn,) if w_next is not None else ()) + ((e,) if pairs is None else ()):
        assert v.dtype == BF16 and v.shape == (T, n), v
    tpr = fused_tpr(m)
    ws = (w1, w2, w3) + ((w_next,) if w_next is not None else ())
    src = pairs.o if pairs is not None else e
    if tpr is None or any(v.ptr % 16 for v in (src, h, x) + ws) or (xn is not None and xn.ptr % 16):
        if pairs is not None:
            e = pairs.combine(g)
        rmsnorm_gpu(g, m, w1, x, eps)                       # x holds m1, then s (out may alias add / x)
        rmsnorm_gpu(g, e, w2, x, eps, add=x)
        rmsnorm_gpu(g, x, w3, x, eps, add=h, scale=scale)
        if w_next is not None:
            rmsnorm_gpu(g, x, w_next, xn, eps)
        return False
    xn_arg = xn if w_next is not None else None
    slots = bool(xn_slots) and w_next is not None and n % 64 == 0
    if pairs is not None:
        f, pre = _norms_kernel(g, "post_ffn_norms_pairs", T, tpr)
        g.launch(f, grid=(T,), block=(tpr,),
                 args=[x, xn_arg, m, pairs.o, pairs.idx, pairs.k, pairs.E, h, w1, w2, w3, w_next, n, float(eps),
                       float(scale), int(slots)], pdl=pre)
        return slots
    f, pre = _norms_kernel(g, "post_ffn_norms", T, tpr)
    g.launch(f, grid=(T,), block=(tpr,),
             args=[x, xn_arg, m, e, h, w1, w2, w3, w_next, n, float(eps), float(scale), int(slots)], pdl=pre)
    return slots
