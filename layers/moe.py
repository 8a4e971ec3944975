"""The MoE block of a Gemma-4 layer: router (no-scale norm, scale, softmax over all experts, top-k,
renormalise, per-expert scale) and gated-GELU experts combined by their weights."""
from dataclasses import dataclass

import numpy as np

from layers.mlp import gelu_tanh
from layers.norm import rmsnorm


def route(h, w, top_k, eps):
    """h (T, H) raw residual -> weights (T, k) float32, experts (T, k) int (descending probability)."""
    r = rmsnorm(h, None, eps) * w["router.scale"] * np.float32(h.shape[-1] ** -0.5)
    logits = r @ w["router.proj"].T                                          # (T, E)
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    idx = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]                  # ties: lower expert first
    top = np.take_along_axis(p, idx, axis=-1)
    top = top / top.sum(axis=-1, keepdims=True)
    return top * w["router.per_expert_scale"][idx], idx


def experts(y, weights, idx, gate_up, down):
    """y (T, H) normed input; gate_up (E, 2I, H) rows [gate; up]; down (E, H, I) -> (T, H).
    Experts are visited in index order and each token's contributions added in that order."""
    out = np.zeros_like(y)
    inter = down.shape[-1]
    for e in np.unique(idx):
        tok, slot = np.nonzero(idx == e)
        gu = y[tok] @ gate_up[e].T                                           # (n, 2I)
        o = (gelu_tanh(gu[:, :inter]) * gu[:, inter:]) @ down[e].T
        np.add.at(out, tok, o * weights[tok, slot, None])
    return out


# --- GPU ---
# Device MoE: linear.cu's router_bf16_* -> (weights (T, k) f32, idx (T, k) i32); kernels_ptx/moe.cu:
# experts on tensor cores, two launch paths with identical arithmetic (see _experts_direct / _experts_grouped):
# direct (small T): moe_gate_up_direct -> moe_down_combine_direct; grouped: moe_group_place (stable counting sort
# of the T*k (token, slot) pairs by expert) -> moe_gate_up_mma_n* -> moe_down_mma_n* -> moe_combine_bf16.
# Arithmetic:
#   router: r = bf16(bf16(bf16(norm(h)) * scale) * H^-0.5) as transformers' bf16 model; logits fp32 (not
#     rounded; the dense layers' mma.sync K-slice arithmetic, linear.cu gemm_bf16_f32), softmax fp32, top-k
#     ties -> lower index, weights = p / sum(top p) * per_expert_scale[idx].
#   experts: q*s exact (bf16 mma operand), mma.sync bf16; each 128-column K block is a fresh mma chain (the
#     tensor core truncates its accumulator at every step: one chain over all of K drifted towards zero), the
#     blocks added in fp32 in increasing order, the same for every T and path; the global scale on the fp32 sum as
#     (acc * mult) / div with (mult, div) = (1, g) for CT (the reference's q*s/g, one division) and (wsf2, 1) for
#     ModelOpt; u = bf16(gelu_tanh(gate) * up) (fp32 math); o = bf16(down_acc * weight) (fp32 product, one
#     rounding); out[t] = bf16(fp32 sum of the token's o rows in increasing expert index: the reference's order).
import ml_dtypes  # noqa: E402

from layers.norm import fused_tpr, router_input_gpu  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)


def _bf16():
    return BF16


def _check(a, shape, dtype, name):
    if tuple(a.shape) != tuple(shape) or np.dtype(a.dtype) != np.dtype(dtype):
        raise ValueError(f"{name}: expected {tuple(shape)} {np.dtype(dtype)}, got {tuple(a.shape)} {np.dtype(a.dtype)}")


def _global_pair(raw):
    """LinearRaw nvfp4 -> (mult, div) f32 applied as (acc * mult) / div."""
    g = np.float32(np.asarray(raw.global_scale, np.float32).reshape(()))
    if raw.format == "nvfp4_ct":
        return np.float32(1.0), g
    if raw.format == "nvfp4_modelopt":
        return g, np.float32(1.0)
    raise ValueError(f"expert weight format {raw.format!r} is not NVFP4")


def upload_experts(g, ck, layer_prefix, E, H, I, router=True):
    """Stack the per-expert NVFP4 Linears `{prefix}experts.{e}.{gate,up,down}_proj` (or moe.experts.) of one layer
    on the device. -> dict: gw, uw (E, I, H/2) u8; gs, us (E, I/16, ceil(H/128), 16, 8) u8 (e4m3 bytes in the
    device scale layout, fp4_scale_blocks); dw (E, H, I/2) u8; ds (E, H/16, ceil(I/128), 16, 8) u8; gsc (E, 3, 2)
    f32 (mult, div) per gate/up/down; E, H, I; and, if router and present,
    router_proj (E, H) bf16, router_scale (H,) bf16, router_pes (E,) f32."""
    if H % 16 or I % 16:
        raise ValueError(f"NVFP4 experts need H, I divisible by 16 (H={H}, I={I})")
    p = layer_prefix if layer_prefix.endswith(".") else layer_prefix + "."
    base = next((b for b in (p + "experts.", p + "moe.experts.") if ck.has(b + "0.gate_proj.weight_scale")), None)
    if base is None:
        raise ValueError(f"no per-expert NVFP4 experts under {p}experts. / {p}moe.experts.")
    gw = np.empty((E, I, H // 2), np.uint8); uw = np.empty_like(gw)
    gs = np.empty((E, I, H // 16), np.uint8); us = np.empty_like(gs)
    dw = np.empty((E, H, I // 2), np.uint8); ds = np.empty((E, H, I // 16), np.uint8)
    gsc = np.empty((E, 3, 2), np.float32)
    for e in range(E):
        for j, (name, shape, w, s) in enumerate((("gate_proj", (I, H), gw, gs), ("up_proj", (I, H), uw, us),
                                                 ("down_proj", (H, I), dw, ds))):
            raw = ck.linear_raw(f"{base}{e}.{name}", shape)
            gsc[e, j] = _global_pair(raw)
            w[e] = np.asarray(raw.weight).view(np.uint8)
            s[e] = np.asarray(raw.scale).view(np.uint8)
    out = dict(E=E, H=H, I=I, gw=g.upload(gw), uw=g.upload(uw), gs=fp4_scale_blocks_gpu(g, gs),
               us=fp4_scale_blocks_gpu(g, us), dw=g.upload(dw), ds=fp4_scale_blocks_gpu(g, ds), gsc=g.upload(gsc))
    for name in ("gw", "uw", "dw"):
        fp4_repack_gpu(g, out[name])
    if router and ck.has(p + "router.proj.weight"):
        out.update(upload_router(g, ck.tensor(p + "router.proj.weight", (E, H)), ck.tensor(p + "router.scale", (H,)),
                                 ck.tensor(p + "router.per_expert_scale", (E,))))
    return out


# The expert kernels read the packed NVFP4 bytes in a device word layout (kernels_ptx/moe_common.cuh): every 32-bit
# word (8 columns) has its nibbles' bits moved so that each bf16 pair is a mask, a shift and a mask, or (pair 3) a
# multiply, a funnel shift and a mask away.
# Bits per column pair p of a word (even column in the low 16 bits, odd column at the same places of the high 16):
# (sign, e1, e0, m) of the e2m1 code at these places.
FP4_PLACES = ((15, 8, 7, 6), (12, 5, 4, 3), (9, 2, 1, 0), (11, 10, 14, 13))


def fp4_device_words(packed):
    """numpy twin of moe.cu's moe_fp4_repack: packed NVFP4 bytes (..., K/2) u8 (nibble i of each 4-byte word =
    column i, low nibble first) -> the same shape in the device word layout. For tests; uploads run the kernel."""
    v = np.ascontiguousarray(packed).view(np.uint32)
    r = np.zeros_like(v)
    for i in range(8):
        c = (v >> np.uint32(4 * i)) & np.uint32(15)
        for b, place in enumerate(FP4_PLACES[i >> 1]):
            r |= ((c >> np.uint32(3 - b)) & np.uint32(1)) << np.uint32(place + (16 if i & 1 else 0))
    return r.view(np.uint8).reshape(np.shape(packed))


def fp4_scale_blocks(s):
    """NVFP4 block scales (..., rows, K/16) u8 (rows % 16 == 0) -> the device scale layout of moe_common.cuh
    scale_row: (..., rows/16, ceil(K/128), 16, 8), each 16-row block's 8 bytes a row of one 128-column super unit
    side by side, zeros past K/16."""
    *lead, n, kb = s.shape
    nsu = -(-kb // 8)
    p = np.zeros((*lead, n, nsu * 8), np.uint8)
    p[..., :kb] = s
    return np.ascontiguousarray(p.reshape(*lead, n // 16, 16, nsu, 8).swapaxes(-3, -2))


def fp4_scale_blocks_gpu(g, s):
    """fp4_scale_blocks on the device (moe.cu moe_scale_blocks), what upload_experts runs: host (..., rows, K/16) u8
    -> a new device array in the device scale layout. (The numpy pass at upload took the full-size model load from
    9.2 to 12.5 s; H200 host, bench calls 7 and 1 of 2026-12-01.)"""
    *lead, n, kb = s.shape
    rows, nsu = int(np.prod(lead, dtype=np.int64)) * n, -(-kb // 8)
    if n % 16 or rows * kb >= 2 ** 31:
        raise ValueError(f"fp4_scale_blocks_gpu: need rows % 16 == 0 and rows * K/16 < 2^31 (shape {s.shape})")
    src = g.upload(np.ascontiguousarray(s, np.uint8))
    dst = g.empty((*lead, n // 16, nsu, 16, 8), np.uint8)
    words = rows // 16 * nsu * 16
    g.launch(g.module("moe").function("moe_scale_blocks"), grid=(max(1, min(-(-words // 256), 8192)),),
             block=(256,), args=[src, dst, rows, kb], nbytes=rows * kb + 8 * words)
    g.free(src)
    return dst


def fp4_repack_gpu(g, arr):
    """Rewrite a device array of packed NVFP4 bytes (a multiple of 4 bytes) into the device word layout, in place."""
    n = arr.nbytes // 4
    if arr.nbytes % 4 or n >= 2 ** 31:
        raise ValueError(f"fp4_repack_gpu: {arr.nbytes} bytes is not a whole number of 32-bit words below 2^31")
    g.launch(g.module("moe").function("moe_fp4_repack"), grid=(max(1, min(-(-n // 256), 8192)),), block=(256,),
             args=[arr, n], nbytes=2 * arr.nbytes)


def upload_router(g, proj, scale, per_expert_scale):
    """Router weights -> dict router_proj (E, H) bf16, router_scale (H,) bf16, router_pes (E,) f32."""
    bf = _bf16()
    return dict(router_proj=g.upload(np.asarray(proj, np.float32).astype(bf)),
                router_scale=g.upload(np.asarray(scale, np.float32).astype(bf)),
                router_pes=g.upload(np.asarray(per_expert_scale, np.float32)))


def _max_tiles(E, P, ts):
    """Upper bound on the grouped tiles of ts positions: sum_e ceil(c_e / ts) <= min(E, P) + ceil(P / ts)."""
    return min(E, P) + (P + ts - 1) // ts


def moe_workspace(g, T, E, k, H, I):
    """Scratch for one MoE call of up to T tokens (reuse across layers / graph replays)."""
    P = T * k
    return dict(T=T, k=k, logits=g.empty((T, E), np.float32), r=g.empty((T, H), _bf16()),
                counters=g.upload(np.zeros((T + 3) // 4, np.int32)),    # the router's arrivals, kept at 0
                offsets=g.empty((E + 1,), np.int32),
                perm=g.empty((P,), np.int32), active=g.empty((E,), np.int32), n_active=g.empty((1,), np.int32),
                u=g.empty((P, I), _bf16()), o=g.empty((P, H), _bf16()),
                xp=g.empty((T, _pad128(H)), _bf16()), up=g.empty((P, _pad128(I)), _bf16()),    # the wgmma path's
                tiles=g.empty((_max_tiles(E, P, 8), 4), np.int32), n_tiles=g.empty((1,), np.int32),
                wg_sync=g.upload(np.zeros(1 + _max_tiles(E, P, 8), np.int32)))   # WG_CHAIN's counters, kept at 0


def _router_fits(H, E, top_k):
    """Whether linear.cu's router kernels take these sizes (H the linear family's K, E experts a lane's top-k
    slots hold, k <= 16)."""
    return H % 16 == 0 and E <= 256 and 1 <= top_k <= min(16, E)


def _router_workspace(workspace, T, E):
    """The router's logits (>= T, E) f32 and arrival counters (>= one a 4 rows) in moe_workspace's dict."""
    logits, counters = workspace["logits"], workspace["counters"]
    if logits.shape[0] < T or logits.shape[1] != E or counters.shape[0] < (T + 3) // 4:
        raise ValueError(f"workspace logits {logits.shape} / counters too small for T={T}, E={E}")
    return logits, counters


def router_gpu(g, h, router, weights, idx, workspace, top_k, eps, r=None):
    """h (T, H) bf16 raw residual -> weights (T, k) f32, idx (T, k) i32 (descending probability): one launch of
    linear.cu's router kernels over r, the router's input row (layers.norm: post_attn_norms_gpu(router=...) makes
    it with the layer's norms); without r it is made here first (router_input_gpu, the same bytes)."""
    T, H = h.shape
    E = router["router_proj"].shape[0]
    bf = _bf16()
    _check(h, (T, H), bf, "h"); _check(router["router_proj"], (E, H), bf, "router_proj")
    _check(weights, (T, top_k), np.float32, "weights"); _check(idx, (T, top_k), np.int32, "idx")
    if not _router_fits(H, E, top_k):
        raise ValueError(f"router: need H % 16 == 0, E <= 256, 1 <= k <= min(16, E) (H={H}, E={E}, k={top_k})")
    if router["router_proj"].ptr % 16:
        raise ValueError("router_gpu: router_proj needs 16-byte alignment")
    logits, counters = _router_workspace(workspace, T, E)
    if r is None:
        r = g.view(workspace["r"], 0, (T, H), bf)
        router_input_gpu(g, h, router["router_scale"], r, eps, H ** -0.5)
    _check(r, (T, H), bf, "r")
    if r.ptr % 16:
        raise ValueError("router_gpu: r needs 16-byte alignment")
    router_launch(g, router_kernel(T), r, router, logits, counters, weights, idx, top_k)


# linear.cu's router kernels (logits with gemm_bf16_f32's arithmetic, then the top-k in the same launch):
# suffix -> (tokens per CTA, experts per CTA, dynamic smem bytes as a function of (T, H)). Every one gives the
# same bytes (test_gpu_router_bits runs each); router_kernel picks by speed only.
ROUTER_KERNELS = {
    "t8": (8, 16, lambda T, H: min(T, 8) * (H + 8) * 2),     # X staged in shared memory (cp.async)
    "t16": (16, 16, lambda T, H: 0),                          # X in the register ring (ld.global.cg)
    "s": (32, 64, lambda T, H: 221184),                      # the prefill tile, K slices on the warps (RS_SMEM)
}


def router_kernel(T):
    """The router kernel for T tokens (speed only). H200, E 128, H 2816, graph-replayed, us per launch at T = 1 / 16 /
    64 / 128 / 256 / 508 / 1024 / 1536 / 2048 (test_gpu_router_timing, BENCHMARKS.md twenty-fourth session, call 8):
    t8 6.21 / 7.04 / 7.72 / 8.21 / 10.63 / 18.07 / 30.37 / 42.28 / 53.24; t16 5.73 / 8.36 / 9.11 / 9.12 / 9.75 /
    12.36 / 20.90 / 28.75 / 35.45; s 13.87 / 16.48 / 20.80 / 20.77 / 21.32 / 21.28 / 21.35 / 23.14 / 24.43 (one CTA's
    K loop and top-k take ~14 us: a floor at small T). `_s` replaced the prefill tile router_bf16_p (27.50 us at
    2,048 in call 7). Before that: the fmaf-chain router.cu (eleventh and seventeenth sessions' tables: 8.2 / 10.6 /
    14.0 / 17.2 / - / 23.2 (507 tokens) / - / - / 77.8); never the fastest and removed: the 32- and 64-token decode
    tiles, three dec2_body shared-ring forms, t16 through ld.global.nc."""
    return "t16" if T <= 8 else "t8" if T <= 128 else "t16" if T <= 1024 else "s"


# The post-attention norms and the router in one launch (linear.cu router_pa_bf16_t8) up to PA_ROUTER_MAX_T rows
# (decode; None: never): the bytes of post_attn_norms_gpu then router_gpu, with the router's input rows made in its
# CTAs (no r round trip, one dependency fewer). The model (model_gpu._layer) then runs the norm chain a second time on
# the MLP's branch, so that the branch still starts right after o_proj: forked after the router instead, it cost more
# than the fusion saves. A CTA norms its token group's rows one after the other, so the launch grows with the rows.
# H200, decode graphs of the full-size model in one process, 6 alternating rounds, medians, ms a step (thirty-fifth
# session): two launches / one up to 1 row / one up to 2 rows: batch 1 2.4547 / 2.4286 / 2.4323, batch 2 2.9537 /
# 2.9546 / 2.9380, batch 4 4.0116 / 4.0182 / 4.0161 (none fused). With the branch forked after the router: batch 1
# 2.558 (two launches) / 2.527 (one), batch 8 5.368 / 5.742.
PA_ROUTER_MAX_T = 2
PA_MAX_THREADS = 384                    # linear.cu PA_MAX_WARPS * 32: the norms' threads a row (n <= 3072)


def post_attn_router_ok(a, arrays, router, top_k):
    """Whether post_attn_router_gpu takes these rows a (T, H) (arrays: the other rows and weights it reads or
    writes, for their alignment)."""
    T, H = a.shape
    E = router["router_proj"].shape[0]
    tpr = fused_tpr(a)
    return (PA_ROUTER_MAX_T is not None and 1 <= T <= PA_ROUTER_MAX_T and tpr is not None and tpr <= PA_MAX_THREADS
            and _router_fits(H, E, top_k)
            and not any(v.ptr % 16 for v in (a, router["router_scale"], router["router_proj"]) + tuple(arrays)))


def post_attn_router_gpu(g, a, x, w_pa, w_pf, w_pf2, h, xn, e_in, eps, router, weights, idx, workspace, top_k,
                         xn_slots=False, e_perm=False):
    """layers.norm.post_attn_norms_gpu(a, x, .., router=(r, router_scale, H^-0.5)) and router_gpu(h, .., r=r) in
    one launch, without r leaving the GPU's CTAs: h, xn, e_in, weights and idx get the same bytes. Returns
    (xn_slots, e_perm) as post_attn_norms_gpu does, or None (nothing launched) where post_attn_router_ok says no."""
    T, H = a.shape
    E = router["router_proj"].shape[0]
    bf = _bf16()
    if not post_attn_router_ok(a, (x, h, xn, e_in, w_pa, w_pf, w_pf2), router, top_k):
        return None
    for v in (x, h, xn, e_in):
        _check(v, (T, H), bf, "post_attn_router rows")
    _check(weights, (T, top_k), np.float32, "weights"); _check(idx, (T, top_k), np.int32, "idx")
    logits, counters = _router_workspace(workspace, T, E)
    slots, perm = bool(xn_slots) and H % 64 == 0, bool(e_perm) and H % 128 == 0
    g.launch(g.module("linear").function("router_pa_bf16_t8"), grid=(-(-E // 16), -(-T // 8)),
             block=(max(256, fused_tpr(a)),), shared=min(T, 8) * (H + 8) * 2, nbytes=E * H * 2, flops=2 * T * E * H,
             pdl=True, args=[h, xn, e_in, a, x, w_pa, w_pf, w_pf2, router["router_scale"], float(H ** -0.5),
                               float(eps), int(slots), int(perm), T, H, router["router_proj"], router["router_pes"],
                               logits, counters, weights, idx, E, top_k])
    return slots, perm


def router_launch(g, name, r, router, logits, counters, weights, idx, top_k):
    """One launch of linear.cu's router_bf16_<name> over r (T, H) bf16 -> logits, weights, idx; with PDL up to 16
    tokens."""
    T, H = r.shape
    E = router["router_proj"].shape[0]
    tok, rows, smem = ROUTER_KERNELS[name]
    g.launch(g.module("linear").function("router_bf16_" + name), grid=(-(-E // rows), -(-T // tok)), block=(256,),
             args=[r, T, H, router["router_proj"], router["router_pes"], logits, counters, weights, idx, E, top_k],
             shared=smem(T, H), nbytes=E * H * 2, flops=2 * T * E * H, pdl=T <= 16)


@dataclass(frozen=True)
class Pairs:
    """The experts' output before its combine (moe_gpu(combine=False) on the grouped / wgmma paths): o the pair rows
    (token t's slot s at row t * k + s, H bf16 each), idx (T, k) int32, E experts. post_ffn_norms_gpu runs the
    combine inside its launch; combine() runs moe_combine_bf16 into out (T, H) (the same bytes) and returns it."""
    o: object
    idx: object
    k: int
    E: int
    out: object

    def combine(self, g):
        T, H = self.out.shape
        _combine(g, self.o, self.idx, self.out, T, H, self.k, self.E)
        return self.out


def moe_gpu(g, x_normed, h, weights, idx, experts, out, workspace, top_k=None, eps=1e-6, path=None, nt=None,
            combine=True, x_perm=False):
    """x_normed (T, H) bf16 = pre_feedforward_layernorm_2(h); weights (T, k) f32, idx (T, k) i32 from router_gpu
    (if weights is None they are computed here from h with experts' router arrays: pass top_k, eps, and
    weights/idx land in workspace); out (T, H) bf16 <- sum_k weight * expert(x). h is only read by the router.
    path: None (auto: "direct" for T <= DIRECT_MAX_T, "wgmma" from WG_MIN_T on sm_90, else "grouped"), "direct",
    "grouped" or "wgmma"; nt: grouped tile width 8*nt tokens (1, 2, 4, 8), or the wgmma path's (4, 8; None =
    auto). Neither changes the result bits (tests force each). combine=False: on the grouped / wgmma paths the
    last launch (the combine) is left to the caller, and a Pairs is returned instead of out (post_ffn_norms_gpu
    takes it); the direct path combines in its down kernel and returns out either way. x_perm: x_normed's rows are
    in the wgmma path's permuted column order already (layers.norm.post_attn_norms_gpu(e_perm=True), when
    x_perm_ok), so its moe_permute_x copy is skipped; only on that path."""
    E, H, I = experts["E"], experts["H"], experts["I"]
    T = x_normed.shape[0]
    bf = _bf16()
    if T == 0:
        return out
    if weights is None:
        k = top_k
        weights = workspace.setdefault("weights", g.empty((workspace["T"], k), np.float32))
        idx = workspace.setdefault("idx", g.empty((workspace["T"], k), np.int32))
        if weights.shape[0] != T:
            weights = g.view(weights, 0, (T, k), np.float32)
            idx = g.view(idx, 0, (T, k), np.int32)
        router_gpu(g, h, experts, weights, idx, workspace, k, eps)
    k = weights.shape[1]
    P = T * k
    _check(x_normed, (T, H), bf, "x_normed"); _check(out, (T, H), bf, "out")
    _check(weights, (T, k), np.float32, "weights"); _check(idx, (T, k), np.int32, "idx")
    if E > 256 or k > 16 or H % 16 or I % 16:
        raise ValueError(f"moe: need E <= 256, k <= 16, H and I divisible by 16 (E={E}, k={k}, H={H}, I={I})")
    if workspace["perm"].shape[0] < P or workspace["u"].shape[1] != I or workspace["o"].shape[1] != H:
        raise ValueError(f"workspace too small for T={T}, k={k}, H={H}, I={I}")
    if any(a.ptr % 16 for a in (x_normed, out)):
        raise ValueError("moe_gpu: x_normed and out need 16-byte aligned rows")
    if H < 16 or I < 16 or P * max(H, I) >= 2 ** 31:
        raise ValueError(f"moe: need H, I >= 16 and T*k*max(H, I) < 2^31 (T={T}, k={k}, H={H}, I={I})")
    plan = _plan(g, x_normed, weights, idx, experts, out, workspace, T, k, path, nt, x_perm)
    deferred = not combine and plan[-1][0] == "combine"
    for _, launch in plan[:-1] if deferred else plan:
        launch()
    return Pairs(workspace["o"], idx, k, E, out) if deferred else out


def _auto_path(g, T, H, I, k):
    """moe_gpu's path for T tokens when none is asked for."""
    return ("direct" if T <= DIRECT_MAX_T and max(_direct_shared(H, I, k)) <= _DIRECT_SMEM else
            "wgmma" if T >= WG_MIN_T and g.capability == (9, 0) and wg_fits(H, I) else "grouped")


def x_perm_ok(g, T, experts, k):
    """Whether moe_gpu's input for T tokens may come in the wgmma path's permuted column order (x_perm=True): the
    auto path is wgmma and H % 128 == 0 (the permuted rows are H long, no padding). post_attn_norms_gpu writes e_in
    so (e_perm) only when this holds."""
    H, I = experts["H"], experts["I"]
    return T > 0 and H % 128 == 0 and _auto_path(g, T, H, I, k) == "wgmma"


def _plan(g, x, weights, idx, ex, out, ws, T, k, path=None, nt=None, x_perm=False):
    """The expert launches of one call as [(name, thunk)] (moe_gpu runs them in order; the timing test captures
    them one by one)."""
    H, I = ex["H"], ex["I"]
    if path is None:
        path = _auto_path(g, T, H, I, k)
    if x_perm and (path != "wgmma" or H % 128):
        raise AssertionError(f"moe: a permuted x needs the wgmma path and H % 128 == 0 (path {path}, H={H})")
    if path == "direct":
        if max(_direct_shared(H, I, k)) > _DIRECT_SMEM:      # a forced path: the auto one only picks it if it fits
            raise ValueError(f"moe_gpu: the direct path's kernels would need {_direct_shared(H, I, k)} bytes of "
                             f"shared memory, more than {_DIRECT_SMEM} (H={H}, k={k}, I={I})")
        return _experts_direct(g, x, weights, idx, ex, out, ws, T, k)
    if path == "grouped":
        return _experts_grouped(g, x, weights, idx, ex, out, ws, T, k, nt)
    if path == "wgmma":
        return _experts_wgmma(g, x, weights, idx, ex, out, ws, T, k, nt, x_perm)
    raise ValueError(f"moe_gpu: path must be 'direct', 'grouped' or 'wgmma', got {path!r}")


# Tensor-core expert paths (kernels_ptx/moe.cu). Both run the same per-element arithmetic (per 128-column K block
# a fresh mma.sync m16n8k16 bf16 chain, the blocks added in fp32 in increasing order; the same epilogue roundings),
# so a token's output bytes do not depend on T, on the path, on NT or on the other tokens (test_span02.py's MoE
# tests compare the paths byte for byte).
#   direct  (T <= DIRECT_MAX_T, 2 launches): moe_gate_up_direct, one CTA per (16 rows of I, pair), u in pair
#           order; moe_down_combine_direct, one CTA per (16 rows of H, token), the token's k slots in its warps,
#           combined in increasing expert index in shared memory. In both, the K blocks of one output tile are
#           spread over several warps (_direct_split) and added afterwards by one thread per output, in order.
#           No grouping: at tiny T tokens rarely share an expert (a shared one is read twice, mostly from L2).
#   grouped (4 launches): moe_group_place (stable counting sort by expert + tiles of 8*NT positions) ->
#           moe_gate_up_mma_n{NT} -> moe_down_mma_n{NT} -> moe_combine_bf16. Each tile reads its expert's
#           weights once for up to 8*NT tokens; x / u rows stream through a cp.async pipeline.
DIRECT_MAX_T = 4
_DIRECT_SMEM = 96 * 1024          # most dynamic shared a direct kernel takes (gpu.launch opts in above 48 KiB)
_DIRECT_DS = (3, 3)               # moe.cu GU_DIRECT_DS, DN_DIRECT_DS: units in flight a warp (1-KiB shared slots)
_NT_CHOICES = (1, 2, 4, 8)


def _pick_nt(P, E):
    """Tokens per grouped tile = 8*NT from the mean group size (speed only: results do not depend on it)."""
    avg = P / max(1, min(E, P))
    return 1 if avg <= 10 else 2 if avg <= 20 else 4 if avg <= 40 else 8


def _direct_shared(H, I, k):
    """Dynamic shared bytes of (moe_gate_up_direct, moe_down_combine_direct): the staged activation rows, the fp32
    per-super-unit partials (2 projections x ceil(H/128) x 16 rows; k slots x ceil(I/128) x 16 rows), then every
    warp's ring of weights (_DIRECT_DS slots of 1 KiB; 2 S_gu warps, k S_dn warps)."""
    s_gu, s_dn = _direct_split(H, I, k)
    return (2 * H + 128 * ((H + 127) // 128) + 2048 * s_gu * _DIRECT_DS[0],
            2 * k * I + 64 * k * ((I + 127) // 128) + 1024 * k * s_dn * _DIRECT_DS[1])


def _direct_split(H, I, k):
    """Warps per projection (gate/up) and per slot (down) of the direct kernels: the K super units are spread over
    them (each unit's partial kept apart, summed in order afterwards: the bits do not depend on it). gate/up: 4
    (block 256: 8 warps, <= 6 of the 22 units each at H = 2816); down: 512 // (32k) (2 at k = 8: 3 of 6 units)."""
    su_h, su_i = (H + 127) // 128, (I + 127) // 128
    return max(1, min(4, su_h)), max(1, min(16 // k, su_i))


def _experts_direct(g, x, weights, idx, ex, out, ws, T, k):
    E, H, I = ex["E"], ex["H"], ex["I"]
    P = T * k
    m = g.module("moe")
    sh_gu, sh_dn = _direct_shared(H, I, k)
    s_gu, s_dn = _direct_split(H, I, k)
    return [("gate_up_direct", lambda: g.launch(
                m.function("moe_gate_up_direct"), grid=(I // 16, P), block=(64 * s_gu,),
                args=[x, idx, ex["gw"], ex["gs"], ex["uw"], ex["us"], ex["gsc"], ws["u"], H, I, k, E], shared=sh_gu,
                flops=4 * P * I * H)),
            ("down_combine_direct", lambda: g.launch(
                m.function("moe_down_combine_direct"), grid=(H // 16, T), block=(32 * k * s_dn,),
                args=[ws["u"], idx, weights, ex["dw"], ex["ds"], ex["gsc"], out, H, I, k, E], shared=sh_dn,
                pdl=True, flops=2 * P * I * H))]    # reads idx before its wait: gate_up_direct must stay without PDL


_GSTAGES = 3        # cp.async stages of the grouped kernels (GSTAGES in moe.cu)


def _experts_grouped(g, x, weights, idx, ex, out, ws, T, k, nt=None):
    E, H, I = ex["E"], ex["H"], ex["I"]
    P = T * k
    nt = _pick_nt(P, E) if nt is None else nt
    if nt not in _NT_CHOICES:
        raise ValueError(f"moe_gpu: nt must be one of {_NT_CHOICES}, got {nt}")
    ts = 8 * nt
    maxt = _max_tiles(E, P, ts)
    tiles = ws.get("tiles")
    if tiles is None or tiles.shape[0] < maxt:
        raise ValueError(f"workspace tiles too small for T={T} (need {maxt} rows; build it with moe_workspace)")
    m = g.module("moe")
    shared = 256 + _GSTAGES * ts * 256           # row offsets + stages (> 48 KiB at nt=8: gpu.launch opts in)
    return [("group_tiles", lambda: _group_tiles(g, idx, P, E, ws, ts, tiles)),
            (f"gate_up_mma_n{nt}", lambda: g.launch(
                m.function(f"moe_gate_up_mma_n{nt}"), grid=((I + 63) // 64, maxt), block=(128,),
                args=[x, ws["perm"], tiles, ws["n_tiles"], ex["gw"], ex["gs"], ex["uw"], ex["us"], ex["gsc"],
                      ws["u"], H, I, k], shared=shared, flops=4 * P * I * H)),
            (f"down_mma_n{nt}", lambda: g.launch(
                m.function(f"moe_down_mma_n{nt}"), grid=((H + 127) // 128, maxt), block=(128,),
                args=[ws["u"], ws["perm"], tiles, ws["n_tiles"], ex["dw"], ex["ds"], ex["gsc"], weights, ws["o"],
                      H, I], shared=shared, flops=2 * P * I * H)),
            ("combine", lambda: _combine(g, ws["o"], idx, out, T, H, k, E))]


def _group_threads(P):
    """Threads a CTA of the grouping kernels: ~16 pairs a thread, whole warps, at most 1024."""
    return min(1024, max(32, -(-P // (16 * 32)) * 32))


def _group_tiles(g, idx, P, E, ws, ts, tiles):
    """moe.cu's grouping, one launch of a CTA an expert (moe_group_place; each CTA counts every expert's pairs in
    shared memory): the pairs sorted by expert (ws perm / offsets / active) and cut into tiles of ts positions. (One
    CTA with a warp-level match before: ~36 us at T = 2048 on the H200; then a separate count launch.)"""
    g.launch(g.module("moe").function("moe_group_place"), grid=(E,), block=(_group_threads(P),),
             args=[idx, P, E, ws["offsets"], ws["perm"], ws["active"], ws["n_active"], ts, tiles, ws["n_tiles"]])


_COMB_THREADS = 128  # COMB_THREADS in moe.cu: 8 columns a thread


def _combine(g, o, idx, out, T, H, k, E):
    """moe_combine_bf16: out[t] = the token's slots of the pair rows o summed in increasing expert index."""
    g.launch(g.module("moe").function("moe_combine_bf16"), grid=(T, (H + 8 * _COMB_THREADS - 1) // (8 * _COMB_THREADS)),
             block=(_COMB_THREADS,), args=[o, idx, out, T, H, k, E])


# wgmma path (kernels_ptx/moe_sm90a.cu, sm_90 only, H and I divisible by 64; 5 launches): moe_group_place (tiles of
#   8*nt positions) -> moe_permute_x (x in the permuted column order whose k16 steps are contiguous; skipped when x
#   comes in that order, x_perm: post_attn_norms writes it so in the model) -> moe_gate_up_wg{8nt} (u in that order)
#   -> moe_down_wg{8nt} (chained to it: WG_CHAIN) -> moe_combine_bf16. The grouped path's arithmetic on warpgroup MMAs
#   (m64nNk16, N the tile's tokens rounded up): each tile decodes its expert's weights once for up to 8*nt tokens.
#   Expert time per layer against the grouped path on the H200 (us, random routing over 128 experts; BENCHMARKS.md):
#   tenth session T = 256: 233 / 321, 512: 325 / 429, 2048: 812 / 1,318; since the MMAs are as wide as a tile's tokens
#   (thirteenth session, every launch of a call) T = 8: 101.4 / 112.6, 16: 129.6 / 131.7, 64: 186.7 / 190.6, 96: 192.8
#   / 214.0, hence WG_MIN_T = 8 (5 .. 7 not measured: grouped).
WG_MIN_T = 8
_WG_NT = (4, 8)
# kernel -> (tokens per tile, stages): moe_sm90a.cu's GU_WG / DN_WG table; tile width 8*nt runs f"wg{8*nt}"
_WG_KERNELS = {"wg32": (32, 5), "wg64": (64, 4)}


# The wgmma path's down launch chained to its gate/up launch (moe_sm90a.cu, before its kernels): PDL, each down CTA
# waiting for its own tile's gate/up CTAs (a counter a tile, ws "wg_sync") instead of the whole grid; the same
# bits. False: two plain launches (the tests compare both).
WG_CHAIN = True


def _pad128(n):
    return (n + 127) // 128 * 128


# 128-row blocks of the down projection one CTA runs through one stage ring (moe_down_wg*'s nbk). H200, T = 2048,
# us at 1 / 2 / 3: 293.4 / 283.5 / 285.9 (2 output blocks a gate/up CTA was slower: 433 -> 447; BENCHMARKS.md, tenth
# session)
WG_DOWN_BLOCKS = 2


def _wg_shared(ntok, stages):
    """Dynamic shared bytes of the wgmma kernels (moe_sm90a.cu WG_SMEM): 1 KiB to align the stages, the stages (x
    rows: 256 B a token; the weights: 8 KiB packed + 1 KiB scales), the tile's row offsets, pair positions and
    weights (4 B each a token), the expert's global scales (32 B)."""
    return 1024 + stages * (256 * ntok + 9216) + 12 * ntok + 32


def wg_fits(H, I):
    """The wgmma kernels copy weights in 16-byte packed / 4-byte scale pieces: rows of K % 64 == 0 columns."""
    return H % 64 == 0 and I % 64 == 0


def _pick_wg_nt(P, E):
    """Tokens per wgmma tile = 8*nt from the mean group size (speed only: results do not depend on it; at T = 512,
    a mean of 32, 64 tokens per tile measured 447 us against 462 for 32)."""
    avg = P / max(1, min(E, P))
    return 4 if avg <= 24 else 8


def _experts_wgmma(g, x, weights, idx, ex, out, ws, T, k, nt=None, x_perm=False):
    E, H, I = ex["E"], ex["H"], ex["I"]
    P = T * k
    if g.capability != (9, 0):
        cc = "".join(map(str, g.capability))
        raise ValueError(f"moe_gpu: the wgmma path needs an sm_90 GPU (this one is sm_{cc})")
    if not wg_fits(H, I):
        raise ValueError(f"moe_gpu: the wgmma path needs H and I divisible by 64 (H={H}, I={I})")
    nt = _pick_wg_nt(P, E) if nt is None else nt
    if nt not in _WG_NT:
        raise ValueError(f"moe_gpu: the wgmma path's nt must be one of {_WG_NT}, got {nt}")
    kern = f"wg{8 * nt}"
    ntok, stages = _WG_KERNELS[kern]
    Hp, Ip = _pad128(H), _pad128(I)
    maxt = _max_tiles(E, P, ntok)
    tiles, xp, up = ws.get("tiles"), ws.get("xp"), ws.get("up")
    if tiles is None or tiles.shape[0] < maxt or xp is None or xp.shape[0] < T or up is None or up.shape[0] < P:
        raise ValueError(f"workspace too small for the wgmma path at T={T} (build it with moe_workspace)")
    if max(T * Hp, P * Ip) >= 2 ** 31 or E * I * H // 2 >= 2 ** 32:
        # the kernels address x / u and each weight array by 32-bit byte offsets
        raise ValueError(f"moe: the wgmma path needs T*Hp, P*Ip < 2^31 and E*I*H/2 < 2^32 "
                         f"(T={T}, k={k}, E={E}, H={H}, I={I})")
    mw = g.module("moe_sm90a")
    shared = _wg_shared(ntok, stages)
    nbd = WG_DOWN_BLOCKS
    chain = ws.get("wg_sync") if WG_CHAIN else None
    if WG_CHAIN and (chain is None or chain.shape[0] < 1 + maxt):
        raise ValueError(f"workspace too small for the wgmma path at T={T} (build it with moe_workspace)")
    if x_perm:                                       # x is in the permuted order already (Hp == H): no copy
        xp = x
    permute = [] if x_perm else [
        ("permute_x", lambda: g.launch(                  # a 16-byte chunk of xp a thread
            mw.function("moe_permute_x"), grid=(-(-(Hp // 8) // min(Hp // 8, 512)), T),
            block=(min(Hp // 8, 512),), args=[x, xp, H, Hp], nbytes=2 * T * (H + Hp)))]
    return [("group_tiles", lambda: _group_tiles(g, idx, P, E, ws, ntok, tiles))] + permute + [
            (f"gate_up_{kern}", lambda: g.launch(
                mw.function(f"moe_gate_up_{kern}"), grid=(I // 64, maxt), block=(256,),
                args=[xp, ws["perm"], tiles, ws["n_tiles"], ex["gw"], ex["gs"], ex["uw"], ex["us"], ex["gsc"], up,
                      H, I, k, chain], shared=shared, flops=4 * P * I * H)),
            (f"down_{kern}", lambda: g.launch(
                mw.function(f"moe_down_{kern}"), grid=(-(-((H + 127) // 128) // nbd), maxt), block=(256,),
                args=[up, ws["perm"], tiles, ws["n_tiles"], ex["dw"], ex["ds"], ex["gsc"], weights, ws["o"], H, I,
                      nbd, chain], shared=shared, flops=2 * P * I * H, pdl=chain is not None)),
            ("combine", lambda: _combine(g, ws["o"], idx, out, T, H, k, E))]


def moe_bytes(E_active, H, I, router_E=None):
    """Weight bytes one call reads: per active expert gate+up packed/scales + down packed/scales (+ router)."""
    per = 2 * I * H // 2 + 2 * I * H // 16 + H * I // 2 + H * I // 16 + 3 * 8
    return E_active * per + (router_E * H * 2 if router_E else 0)
