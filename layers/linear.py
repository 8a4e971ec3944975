"""Weight-only linear layers on the GPU: y (T, N) = x (T, K) @ W (N, K)^T, x bf16, fp32 accumulation, y bf16
(f32 for the tied head). W stays in its checkpoint format: FP8 e4m3 with a per-tensor / per-channel /
128x128-block f32 scale, or bf16. Kernels: kernels_ptx/linear.cu, one family for every T, so a row's output
bytes do not depend on T or on the other rows of the batch (see the header there for the fixed K order).
The numpy reference is checkpoint.dequantize(raw) in float64 against bf16-rounded x (test_span02.py, the linear tests).
"""
import re
from dataclasses import dataclass

import numpy as np

import gpu
from checkpoint import BF16, fp8_granularity

F32 = np.dtype(np.float32)
ROWS, THREADS = 16, 256                 # decode family: N rows per CTA, threads per CTA (8 K-slice warps)
P_ROWS, P_TOK = 64, 32                  # prefill tile (`_p` kernels): N rows x tokens per CTA
P_SMEM = {'bf16': 55296, 'fp8': 34816}  # prefill dynamic smem bytes (4 stages, linear.cu PrefillSmem)
PREFILL_MIN_T = 65                      # T from which a prefill tile runs (same bits; None = decode family always)
# Prefill tiles: `_p` (64 rows x 32 tokens per CTA, every format and fusion) and, from G128_MIN_T tokens,
# `_g128` (128 x 128, slice-major: plain and multi launches of FP8 tensor / channel and bf16 weights; see linear.cu
# for the H200 times that set the threshold). Same bits either way. G128_MIN_T = None: `_p` only.
G128_MIN_T = 512
# The tied head's family (bf16 weights, f32 out: 262,144 rows) takes `_g128` from 65 tokens where `_wb` (below) does
# not run (GPUs other than sm_90, WB_MIN_T None): H200, 2026-12-01, graph-replayed, the same bytes, us (decode family /
# `_p` / `_g128`): T = 64 860 / 924 / 1,090, T = 96 1,771 / 1,384 / 1,090, T = 128 1,939 / 1,827 / 1,092 (`_p` and the
# decode family re-read each row of the table for every 32 / 64 tokens; `_g128` reads it once and runs at ~1.35 TB/s).
G128_F32_MIN_T = 65
# From WB_MIN_T tokens the head takes `_wb` instead (kernels_ptx/linear_sm90a.cu gemm_bf16_f32_ws / _ws64, sm_90 GPUs
# only): `_ws`'s persistent wgmma tile (128 rows x 64 or 128 tokens: WB_TOK below) with the bf16 table copied as it
# is, both operands from shared memory, f32 out; the same bits as the decode family. H200, 2026-12-02, graph-replayed,
# the same bytes, us (the pick above / `_wb`'s 128-token tile): T = 32 481 / 530, 33 775 / 530, 64 860 / 549, 96 1,082
# / 575, 128 1,084 / 591 (`_wb` reads the table once, at 2.5-2.8 TB/s); decode graphs at batch 64 / 96 / 128 13.23 /
# 16.72 / 19.27 -> 12.90 / 16.19 / 18.72 ms. None: off.
WB_MIN_T = 33
G_ROWS, G_STAGES, G_XSTRIDE = 128, 4, 144
# The wgmma tile `_ws` (kernels_ptx/linear_sm90a.cu, sm_90 GPUs only: 128 rows x 128 tokens a tile, persistent,
# the same bits as every other tile) for plain / multi / gelu launches of FP8 tensor / channel weights from W_MIN_T
# tokens, when the launch has at least W_MIN_CTAS tiles; W_MIN_T None: off. H200, 2026-11-30
# (test_gpu_linear_prefill_timing, us, `_p` / `_g128` / `_ws`): T = 2048 q+k+v 687 / 503 / 217, o_proj 346 / 269 /
# 118, down 184 / 150 / 67, gate_up_gelu (`_p` / `_ws`, 64 rows a tile) 352 / 139 (128.5 from the sixteenth
# session: linear_sm90a.cu ws_gelu_half); T = 512 q+k+v 178 / 128 / 57;
# T = 128 q+k+v (64 tiles) 47 / 64 / 29, but o_proj (22 tiles) 34 / 92 / 40 and down 19 / 51 / 24: hence a floor.
# At 40 rather than 64 (fifty-first session), o_proj and down take `_ws` from 129 tokens (44 tiles: `_p`'s time grows
# with T, a `_ws` tile's does not while the tiles fit the SMs; gelu's 33 tiles at T <= 128 stay on `_p`): decode graphs
# (H200, two alternating rounds, ms, W_MIN_CTAS 64 / 40, outputs byte-equal) 128 rows 19.26, 19.59 / 19.20, 19.51;
# 192 rows 24.79, 25.34 / 24.72, 25.39; 256 rows 30.60, 31.23 / 29.72, 30.21.
W_MIN_T, W_MIN_CTAS = 65, 40
W_GATE = 64 * 2 * 128                                               # gelu: + the gate / up halves exchanged
W_OUT = 128 * 128 * 2                                               # plain: + the tile's outputs on their way out
WS_THREADS = 384                                                    # 2 compute warpgroups + 1 loader
WS_SMEM = 8 * (128 * 64 + 4 * (128 * 32 + 32)) + 2 * 8 * 8          # 8 stages + their mbarriers
# `_wb`'s token tiles: gemm_bf16_f32_ws64 / _ws (64 / 128 tokens); a launch takes the narrowest that holds T (128
# above). H200, 2026-12-02, the head alone, us (64 / 128-token tile): T = 33 459 / 527, 64 477 / 549 (a 96-token tile
# was slower than 128's at T = 80 / 96: linear_sm90a.cu); the batch-64 decode graph 13.29 -> 13.21 ms. Dynamic smem:
# 8 / 6 stages of W (128 rows) and X (the tile's tokens) + their mbarriers.
WB_TOK = (64, 128)
WB_SMEM = {nt: s * 4 * ((128 * 32 + 32) + (nt * 32 + 32)) + 2 * s * 8 for nt, s in ((64, 8), (128, 6))}
# `_ss` (linear_sm90a.cu): the `_ws` tile from bf16 copies of its FP8 weights (w16_fp8) and of X (x16_bf16), each
# unit's columns put in the k16 steps' slot order once per launch, so that the loader copies whole 128-byte lines of
# both wgmma operands and the compute warps convert nothing; the same bits. The copies go to the GPU's 'w16' / 'x16'
# scratch buffers, which the model reserves (reserve_w16). Taken instead of `_ws` from W16_MIN_T tokens when the
# scratch holds the launch's copies (None: never). H200, 2026-12-01 (dev A/B, eager steps, medians of 5, the same
# bytes): the 2,048-token prefill step 49.56 -> 46.87 ms, 1,024 tokens 27.48 -> 26.57, but 508 tokens 15.88 -> 16.31
# (the copies cost the same at any T): hence the threshold.
W16_MIN_T = 1024
# A launch whose every weight has a bf16 copy kept on the device (cache_w16: every o_proj, some q+k+v) makes no
# w16_fp8 copy, so it takes `_ss` from this many tokens instead (None: from W16_MIN_T like the others). H200,
# 2026-12-02, the eager prefill step of one sequence (alternating, medians of 8, argmax equal): 508 tokens 14.94 ->
# 14.77 ms (its kernel sum 14.98 -> 14.62 ms: `_ws` 3.87 ms -> `_ss` 1.15 + `_ws` 2.27 + one x16 copy; the attention's
# `_slots` form +0.08), 1,000 tokens 24.57 -> 23.95; 300 tokens within its spread (15.66 / 15.72, 12.7 .. 21.2).
# But 2026-12-02 (forty-eighth session), the engine's 512-token readouts (6 alternating rounds of 5, medians) 15.93 ->
# 16.39 ms with it from 65 tokens, slower in every round though its kernel sum is 0.47 ms less; eager steps (medians
# of 8): 512 tokens 18.13 -> 18.46, 508 17.53 -> 18.45, 640 19.32 -> 18.89, 768 19.87 -> 19.82, 1,000 24.57 -> 24.17.
# Hence from 640 tokens: a one-sequence prompt chunk (at most 512 tokens) never takes it, larger steps do.
W16_KEPT_MIN_T = 640
SS_SMEM = 6 * 2 * 128 * 128 + 2 * 6 * 8                           # 6 stages of A + B, their mbarriers
W16_THREADS = 512                     # most threads a CTA of the copies (a row's 8 pieces a unit)
COPY_ROWS = 4                         # rows a CTA of w16_fp8 (linear_sm90a.cu COPY_ROWS)
DECODE_NT_MIN = 16                      # smallest decode-family token tile the launcher picks (8 or 16)
XS_MAX = 160 << 10                      # largest X staging (bytes) of the _t8 kernels: min(T, 8) * (K + 8) * 2

# Decode-family speed variants (linear.cu dec2_body: the same per-output arithmetic, so the same bits as the
# default `_t*` kernels; only the data movement differs). DECODE_VARIANT picks, per token bucket (T <= 8 / 16 /
# 32 / 64), a kernel suffix; 't16' is the `_t*` path below for every bucket. 'mix' (default) took the full-size
# decode step from 3.321 to 3.172 ms at batch 1 and from 18.40 to 17.26 ms at batch 64 (H200, 2026-11-30, same
# run, t16 and mix loaded one after the other; batch 16 unchanged, 9.00 vs 9.01 ms); the whole GPU suite passed
# with it as the default (226 passed, 2026-11-30). Variant kernels exist for gemm_fp8_bf16, gelu_fp8_bf16 and
# gemm_bf16_f32 only (other families, and buckets a variant leaves out, take the default).
# Suffix [s]n<NT>m<MT>r<R>b<MINB>[t]: s = weight ring in smem, 8*NT tokens x 16*MT rows per CTA, t = token tile
# fastest in the grid.
DECODE_VARIANT = 'mix'
_S8 = {8: 'sn1m1r8b3', 16: 'sn2m1r8b3', 32: 'sn4m1r6b2t', 64: 'sn8m1r4b2'}
DECODE_VARIANTS = {         # variant -> family -> {max T: suffix (None: the default kernel)}, smallest key >= T
    't16': {},
    'reg': {'gemm_fp8_bf16': {16: 'n2m1r8b2', 64: 'n4m1r4b2t'},
            'gelu_fp8_bf16': {16: None, 64: 'n4m1r4b2t'},
            'gemm_bf16_f32': {16: None, 64: 'n4m1r2b2t'}},
    's8': {'gemm_fp8_bf16': _S8, 'gelu_fp8_bf16': _S8,
           'gemm_bf16_f32': {8: 'sn1m1r4b3', 16: 'sn2m1r4b3', 32: 'sn4m1r4b2t', 64: 'sn8m1r3b1'}},
    's5': {'gemm_fp8_bf16': {16: 'sn2m1r5b4', 64: 'sn4m1r6b2t'},
           'gelu_fp8_bf16': {16: 'sn2m1r5b4', 64: 'sn4m1r6b2t'},
           'gemm_bf16_f32': {16: 'sn2m1r6b2', 64: 'sn4m1r4b2t'}},
    # per T bucket the fastest of the above in the 2026-11-30 H200 table (test_gpu_linear_decode_variants):
    # s8's kernels at T <= 8, the default at 9..16, m2's at 17..64; the head: default up to 16, reg's at 64.
    # Then the plain FP8 GEMV at T <= 8 on sn1m1r6b4 (a 6-item ring: 48 KB of shared memory, 4 CTAs an SM, so
    # the 512 CTAs of a sliding layer's q+k+v are resident at once; 3 an SM left 116 for a second wave): batch-1
    # decode graph 2507.3 -> 2456.2 us (H200, 2026-11-30, the same bits).
    'mix': {'gemm_fp8_bf16': {8: 'sn1m1r6b4', 16: None, 64: 'sn4m2r4b2t'},
            'gelu_fp8_bf16': {8: 'sn1m1r8b3', 16: None, 64: 'sn4m1r6b2t'},
            'gemm_bf16_f32': {16: None, 64: 'n4m1r2b2t'}},
    'm2': {'gemm_fp8_bf16': {16: 'sn2m1r8b3', 64: 'sn4m2r4b2t'},
           'gelu_fp8_bf16': {16: 'sn2m1r8b3', 64: 'sn4m1r6b2t'},
           'gemm_bf16_f32': {16: 'sn2m1r4b3', 64: 'sn4m1r4b2t'}},
}


# --- GPU ---

@dataclass(frozen=True, eq=False)
class GpuLinear:
    """One Linear on the device. format: 'fp8_channel' | 'fp8_tensor' | 'fp8_block' | 'bf16'."""
    format: str
    N: int
    K: int
    w: gpu.DeviceArray                  # fp8: (N, K) uint8 (e4m3 bytes); bf16: (N, K) bf16
    s: gpu.DeviceArray = None           # f32: (1,) tensor | (N,) channel | (ceil(N/128), ceil(K/128)) block | None


def upload_linear(g, raw):
    """checkpoint.LinearRaw -> GpuLinear. FP8 scales (bf16 or f32 in the checkpoint) become f32; f32/f16
    weights are rounded to bf16 (the kernels take bf16). NVFP4 modules belong to the MoE kernels."""
    n, k = raw.shape
    if k % 16:
        raise ValueError(f'linear {raw.shape}: K must be a multiple of 16')
    if raw.format in ('bf16', 'f32', 'f16'):
        return GpuLinear('bf16', n, k, g.upload(np.asarray(raw.weight).astype(BF16).reshape(n, k)))
    if raw.format.startswith('fp8'):
        fmt = fp8_granularity(np.shape(raw.scale), n, k)
        s = np.asarray(raw.scale).astype(F32)
        s = s.reshape({'fp8_tensor': (1,), 'fp8_channel': (n,), 'fp8_block': (-(-n // 128), -(-k // 128))}[fmt])
        w8 = np.ascontiguousarray(raw.weight).view(np.uint8).reshape(n, k)
        return GpuLinear(fmt, n, k, g.upload(w8), g.upload(s))
    raise ValueError(f'linear {raw.shape}: format {raw.format} has no dense GPU kernel')


def _kp(k):
    return -(-k // 64) * 64


def w16_bytes(ws):
    """Bytes of the bf16 copies that one `_ss` launch over the GpuLinears ws needs (rows of Kp = 64 ceil(K / 64))."""
    return sum(w.N * _kp(w.K) * 2 for w in ws)


def _ss_weights(ws):
    """Whether the GpuLinears of one launch have weights w16_fp8 copies (FP8 tensor / channel), and there are some."""
    return bool(ws) and all(w.format in ('fp8_tensor', 'fp8_channel') for w in ws)


def reserve_w16(g, launches, rows):
    """Give g the scratch buffers of the `_ss` launches: 'w16' for the weights' copies (launches = lists of
    GpuLinears that go in one launch: q + k + v, o_proj, gate + up, down; the largest of those with FP8 tensor /
    channel weights sets its size) and 'x16' for X's (rows x the largest Kp x 2 B). Kept while g lives; a larger
    request replaces a buffer. Only where `_ss` can run (sm_90)."""
    fp8 = [ws for ws in launches if _ss_weights(ws)]
    if g.capability != (9, 0) or not fp8 or rows <= 0:
        return
    for name, nbytes in (('w16', max(w16_bytes(ws) for ws in fp8)),
                         ('x16', rows * max(_kp(w.K) for ws in fp8 for w in ws) * 2)):
        old = g.scratch.get(name)
        if old is None or old.nbytes < nbytes:
            if old is not None:
                g.free(old)
            g.scratch[name] = g.empty((nbytes,), np.uint8)


def cache_w16(g, launches, budget):
    """Keep the bf16 copies of whole `_ss` launches' weights on the device (g.w16_cache, by the FP8 weights'
    address), made once here by w16_fp8 (the same bytes it writes for a launch): those launches then skip their
    w16_fp8 copy, 3 bytes moved a weight. (H200, 2026-12-01, the full-size model with 0.967 GiB kept, every o_proj
    and 5 layers' q+k+v: w16_fp8 1,600 -> 1,112 us over a 2,048-token prefill's kernels, the eager step 42.32 ->
    41.96 ms wall, medians of 9 alternating steps; BENCHMARKS.md thirtieth session.) launches: lists of GpuLinears
    of one launch (FP8 tensor / channel), each kept, in order, if its copies still fit in `budget` bytes (they
    count as weight memory). Used only where `_ss` runs (sm_90, reserve_w16's scratch). Returns the bytes taken."""
    if g.capability != (9, 0):
        return 0
    used = 0
    for ws in launches:
        need = w16_bytes(ws)
        if not _ss_weights(ws) or used + need > budget:
            continue
        copies = [g.empty((w.N, _kp(w.K)), BF16) for w in ws]
        _w16_launch(g, ws[0].K, [(w.w, y, w.N) for w, y in zip(ws, copies)])
        for w, y in zip(ws, copies):
            g.w16_cache[w.w.ptr] = y
        used += need
    g.sync()
    return used


def _copy_block(kp):
    """Block and grid x of the copy kernels (x16_bf16, w16_fp8) for rows of kp columns: a row's 8 pieces a 64-column
    unit, in whole warps up to W16_THREADS."""
    pieces = 8 * (kp // 64)
    block = min(W16_THREADS, -(-pieces // 32) * 32)
    return block, -(-pieces // block)


def _w16_launch(g, k, copies):
    """w16_fp8 over [(FP8 weights, bf16 copy (N, Kp), N)], at most 4."""
    kp = _kp(k)
    block, gx = _copy_block(kp)
    args = [k] + [a for c in copies for a in c] + [None, None, 0] * (4 - len(copies))
    g.launch(g.module('linear_sm90a').function('w16_fp8'),
             grid=(gx, -(-max(n for *_, n in copies) // COPY_ROWS), len(copies)), block=(block, 1, 1), args=args,
             nbytes=sum(3 * n * kp for *_, n in copies), pdl=True)


def _cached(g, w_ptr):
    """The kept bf16 copy of these FP8 weights (cache_w16), or None."""
    cache = getattr(g, 'w16_cache', None)
    return cache.get(w_ptr.ptr) if cache and w_ptr is not None else None


def _ss_ok(g, t, k, projs, x_slots=False):
    """Whether g's scratch holds a `_ss` launch's copies: 'w16' the weights' (those not kept by cache_w16), 'x16'
    X's (not needed when X comes in the slot order already: x_slots); grid y (rows) at most 65535. Otherwise `_ws`
    runs."""
    kp = _kp(k)
    scratch = getattr(g, 'scratch', {})
    wbuf, xbuf = scratch.get('w16'), scratch.get('x16')
    if wbuf is None or wbuf.nbytes < sum(n * kp * 2 for w_ptr, *_, n in projs if _cached(g, w_ptr) is None):
        return False
    if not x_slots and (xbuf is None or xbuf.nbytes < t * kp * 2):
        return False
    return max(t, *(n for *_, n in projs)) <= 65535


def _ss_copies(g, x, projs, x_slots=False):
    """x16_bf16 (unless x_slots: x is the slot-ordered copy already) and w16_fp8 (of the projections without a copy
    kept by cache_w16) of a launch into g's scratch -> (X's copy, projs with W = their copies). One pair of buffers
    a GPU: `_ss` launches must not run on two streams at once (the model's: the main stream's, and the dense MLP's
    on the branch while the main stream runs only the router and the experts)."""
    t, k = x.shape
    kp = _kp(k)
    wbuf, xbuf = g.scratch['w16'], g.scratch.get('x16')
    if x_slots:
        x16 = x
    else:
        x16 = g.view(xbuf, 0, (t, kp), BF16)
        block, gx = _copy_block(kp)
        g.launch(g.module('linear_sm90a').function('x16_bf16'), grid=(gx, t, 1), block=(block, 1, 1),
                 args=[x, x16, t, k], nbytes=2 * t * (k + kp), pdl=True)
    copies, out, off = [], [], 0
    for w_ptr, s, s_arg, o, n in projs:
        y = _cached(g, w_ptr)
        if y is None:                                        # copied into the scratch by this launch's w16_fp8
            y = g.view(wbuf, off, (n, kp), BF16)
            copies.append((w_ptr, y, n))
            off += n * kp * 2
        out.append((y, s, s_arg, o, n))
    if copies:
        _w16_launch(g, k, copies)
    return x16, out


def _nt_suffix(t):
    """Decode family: tokens per CTA (8, 16, 32 or 64) for T rows: fewer idle mma columns and registers at small T. Only
    the grouping of outputs into CTAs changes with it, never any output's arithmetic."""
    # T <= 16 runs _t16: on the H200 (2026-11-30) it beat _t8 at every decode shape measured (_t8's 45 KB of X
    # staging in shared memory halves its occupancy): q_proj 6.4 vs 7.7 us, o_proj 7.9 vs 8.6, the bf16 head 374
    # vs 406 us (T=16 on _t16 against T=1 on _t8). _t8 stays selectable through DECODE_NT_MIN for measurements.
    return next(c for c in (8, 16, 32) if t <= c and c >= DECODE_NT_MIN) if t <= 32 else 64


def _variant_of(kernel, t):
    """(suffix, tokens per CTA, rows per CTA, token tile fastest, dynamic smem bytes) of DECODE_VARIANT's kernel
    for `kernel` at T = t, or None (default path)."""
    table = DECODE_VARIANTS[DECODE_VARIANT].get(kernel)
    if not table:
        return None
    bucket = next((c for c in sorted(table) if t <= c), None)
    suf = None if bucket is None else table[bucket]
    if suf is None:
        return None
    nt, mt, r = (int(v) for v in re.fullmatch(r's?n(\d+)m(\d+)r(\d+)b\d+t?', suf).groups())
    wv = 2 if kernel.split('_')[1] == 'bf16' else 1                      # 16-byte pieces per W row per unit
    smem = r * 8 * mt * 2 * wv * 512 if suf.startswith('s') else 0      # linear.cu dec2_body SR ring
    return suf, 8 * nt, ROWS * mt, suf.endswith('t'), smem


def _kernel_of(w, f32=False):
    """Kernel family of a GpuLinear ('gemm_fp8_bf16', ...) and its s_arg (linear.cu: tensor 0 / channel 1 /
    block ceil(K/128) / bf16 0)."""
    if w.format == 'bf16':
        return ('gemm_bf16_f32' if f32 else 'gemm_bf16_bf16'), 0
    if w.format == 'fp8_block':
        return 'gemm_fp8blk_bf16', -(-w.K // 128)
    return 'gemm_fp8_bf16', int(w.format == 'fp8_channel')


def _gemm_smem(kernel):
    """Dynamic smem bytes of `{kernel}_g128` (linear.cu GemmSmem): 4 stages of one 64-K unit (W 128 rows, X 128
    tokens) and the fp32 slice totals (64 per thread)."""
    wstride = G_XSTRIDE if kernel.split('_')[1] == 'bf16' else 64
    return G_STAGES * (G_ROWS * wstride + 128 * G_XSTRIDE) + 64 * 4 * THREADS


def _w_tiles(t, projs, gelu, tok=128):
    """Tiles of a wgmma launch: 128 rows x `tok` tokens (gelu: 64 gate and 64 up rows)."""
    rows = [n for *_, n in projs]
    return (-(-rows[0] // 64) if gelu else sum(-(-n // 128) for n in rows)) * -(-t // tok)


def _wgmma_tile(g, kernel, t, k, projs, gelu=False, x_slots=False):
    """The wgmma tile a launch takes: 'ss', 'ws' or None (another tile); see _launch."""
    if not (W_MIN_T is not None and t >= max(W_MIN_T, PREFILL_MIN_T or 0) and _w_tiles(t, projs, gelu) >= W_MIN_CTAS
            and kernel in ('gemm_fp8_bf16', 'gelu_fp8_bf16') and g.capability == (9, 0)):
        return None
    kept = W16_KEPT_MIN_T is not None and t >= W16_KEPT_MIN_T and all(_cached(g, p[0]) is not None for p in projs)
    ok = (kept or W16_MIN_T is not None and t >= W16_MIN_T) and _ss_ok(g, t, k, projs, x_slots)
    return 'ss' if ok else 'ws'


def _launch(g, kernel, x, projs, gelu=False, slots=False, x_slots=False):
    """One launch of `kernel` (linear.cu signature) over up to 4 projections [(w_ptr, s, s_arg, out, n)] of
    x (T, K); gelu: projs = [gate, up] and projs[0]'s out is act. Picks a prefill tile (`_ws` from W_MIN_T,
    `_g128` from G128_MIN_T (bf16 -> f32: G128_F32_MIN_T, and the head's `_wb` from WB_MIN_T before it), else `_p`)
    or the decode family (DECODE_VARIANT) by T (same bits either way).
    slots (gelu) / x_slots: act goes out / x comes in x16_bf16's slot order; both only on `_ss` (mlp_gpu)."""
    t, k = x.shape
    rows = [n for *_, n in projs]
    args = [x, t, k]
    for w_ptr, s, s_arg, out, n in list(projs) + [(None, None, 0, None, 0)] * (4 - len(projs)):
        args += [w_ptr, s, s_arg, out, n]
    wbytes = sum(p[0].nbytes for p in projs if p[0] is not None)
    flops = 2 * t * k * sum(rows)                            # gelu: gate and up rows both
    tile = _wgmma_tile(g, kernel, t, k, projs, gelu, x_slots)
    if (slots or x_slots) and tile != 'ss':
        raise AssertionError(f'{kernel}: slot-ordered act needs the `_ss` tile (T={t}, K={k})')
    if tile is not None:
        if tile == 'ss':
            x16, copies = _ss_copies(g, x, projs, x_slots)
            args = [x16, t, k]
            for p in copies + [(None, None, 0, None, 0)] * (4 - len(copies)):
                args += list(p)
        f = g.module('linear_sm90a').function(f'{kernel}_{tile}' + ('_slots' if slots else ''))
        g.launch(f, grid=(min(_w_tiles(t, projs, gelu), g.sm_count), 1, 1), block=(WS_THREADS, 1, 1), args=args,
                 shared=(SS_SMEM if tile == 'ss' else WS_SMEM) + (W_GATE if gelu else W_OUT),
                 nbytes=2 * _kp(k) * sum(rows) if tile == 'ss' else wbytes, flops=flops, pdl=True)
        return
    if kernel == 'gemm_bf16_f32' and WB_MIN_T is not None and t >= WB_MIN_T and len(projs) == 1 \
            and g.capability == (9, 0):
        nt = next((n for n in WB_TOK if t <= n), 128)
        f = g.module('linear_sm90a').function('gemm_bf16_f32_ws' + ('' if nt == 128 else str(nt)))
        g.launch(f, grid=(min(_w_tiles(t, projs, False, nt), g.sm_count), 1, 1), block=(WS_THREADS, 1, 1), args=args,
                 shared=WB_SMEM[nt], nbytes=wbytes, flops=flops, pdl=True)
        return
    g128 = G128_F32_MIN_T if kernel == 'gemm_bf16_f32' else G128_MIN_T
    if g128 is not None and t >= max(g128, PREFILL_MIN_T or 0) and not gelu and 'fp8blk' not in kernel:
        f = g.module('linear').function(f'{kernel}_g128')
        g.launch(f, grid=(sum(-(-n // G_ROWS) for n in rows), -(-t // 128), 1), block=(THREADS, 1, 1), args=args,
                 shared=_gemm_smem(kernel), nbytes=wbytes, flops=flops, pdl=True)
        return
    if PREFILL_MIN_T is not None and t >= PREFILL_MIN_T:
        f = g.module('linear').function(f'{kernel}_p')
        tiles = -(-rows[0] // P_ROWS) if gelu else sum(-(-n // P_ROWS) for n in rows)
        g.launch(f, grid=(tiles, -(-t // P_TOK), 1), block=(THREADS, 1, 1), args=args,
                 shared=P_SMEM['bf16' if kernel.split('_')[1] == 'bf16' else 'fp8'], nbytes=wbytes, flops=flops,
                 pdl=True)
        return
    v = _variant_of(kernel, t)
    if v is not None:                                        # DECODE_VARIANT (same bits, other data movement)
        suf, tok, rt, tf, shared = v
        f = g.module('linear').function(f'{kernel}_{suf}')
        tiles = -(-rows[0] // rt) if gelu else sum(-(-n // rt) for n in rows)
        grid = (-(-t // tok), tiles, 1) if tf else (tiles, -(-t // tok), 1)
        g.launch(f, grid=grid, block=(THREADS, 1, 1), args=args, shared=shared, nbytes=wbytes, flops=flops, pdl=True)
        return
    nt = _nt_suffix(t)
    shared = min(t, 8) * (k + 8) * 2 if nt == 8 else 0      # _t8 stages X in smem
    if shared > XS_MAX:                                      # very large K: the _t16 kernel (X in registers)
        nt, shared = 16, 0
    f = g.module('linear').function(f'{kernel}_t{nt}')
    tiles = -(-rows[0] // ROWS) if gelu else sum(-(-n // ROWS) for n in rows)
    g.launch(f, grid=(tiles, -(-t // nt), 1), block=(THREADS, 1, 1), args=args, shared=shared, nbytes=wbytes,
             flops=flops, pdl=True)                          # every linear.cu kernel waits (griddepcontrol)


def _check_x(x, k):
    if x.dtype != BF16 or len(x.shape) != 2 or x.shape[1] != k or x.ptr % 16:
        raise ValueError(f'x {x.shape} {x.dtype} at {x.ptr:#x}: expected (T, {k}) bf16, 16-byte aligned')


def _check_out(out, t, w):
    f32 = out.dtype == F32
    if out.shape != (t, w.N) or out.dtype not in (BF16, F32) or (f32 and w.format != 'bf16'):
        raise ValueError(f'out {out.shape} {out.dtype}: expected ({t}, {w.N}) bf16 (f32 only for bf16 weights)')
    return f32


def linear_gpu(g, x, w, out, x_slots=False):
    """x (T, K) bf16, w GpuLinear, out (T, N) bf16 (or f32 for bf16 weights) -> out. x_slots: x holds its rows in
    x16_bf16's slot order (mlp_gpu's act; only where the launch runs `_ss`)."""
    _check_x(x, w.K)
    f32 = _check_out(out, x.shape[0], w)
    if x.shape[0]:
        kernel, s_arg = _kernel_of(w, f32)
        _launch(g, kernel, x, [(w.w, w.s, s_arg, out, w.N)], x_slots=x_slots)
    return out


def _multi_launches(x_rows, ws, outs):
    """linear_multi_gpu's launches: [(kernel, projs)], projections of one kernel family four per launch."""
    groups = {}
    for w, out in zip(ws, outs):
        kernel, s_arg = _kernel_of(w, _check_out(out, x_rows, w) if out is not None else False)
        groups.setdefault(kernel, []).append((w.w, w.s, s_arg, out, w.N))
    return [(kernel, projs[i:i + 4]) for kernel, projs in groups.items() for i in range(0, len(projs), 4)]


def linear_multi_gpu(g, x, ws, outs, x_slots=False):
    """Several projections of the same x in one launch (q, k, v): outs[i] = linear_gpu(g, x, ws[i], outs[i]),
    byte for byte. All ws share K; projections of the same kernel family (fp8 tensor / channel mix freely) go
    four per launch, in the order given; outputs bf16 (or f32 for bf16 weights). x_slots: x's rows in x16_bf16's
    slot order (only where every launch runs `_ss`: x_slots_ok). Returns outs."""
    if len(ws) != len(outs):
        raise ValueError(f'{len(ws)} weights for {len(outs)} outputs')
    for w in ws:
        _check_x(x, w.K)
    if x.shape[0]:
        for kernel, projs in _multi_launches(x.shape[0], ws, outs):
            _launch(g, kernel, x, projs, x_slots=x_slots)
    return outs


def _gelu_tile(g, t, w_gate, x_slots=False):
    """The wgmma tile (see _wgmma_tile) of gate_up_gelu_gpu's launch over t rows with these gate (and like up)
    weights."""
    kg = _kernel_of(w_gate)[0].replace('gemm_', 'gelu_')
    return _wgmma_tile(g, kg, t, w_gate.K, [(None, None, 0, None, w_gate.N)] * 2, gelu=True, x_slots=x_slots)


def x_slots_ok(g, t, ws, gelu=False):
    """Whether x (t rows) may come in x16_bf16's slot order to linear_multi_gpu(ws) (gelu=False) or to mlp_gpu's
    gate_up_gelu launch (ws = (gate, up)): every launch runs `_ss`, and K % 64 == 0 (a slot-ordered row is K
    long). The producers (layers.norm's chains, the gelu tile, layers.attention's wgmma kernels) write that order only
    when this holds."""
    k = ws[0].K
    if t <= 0 or k % 64:
        return False
    if gelu:
        return _gelu_tile(g, t, ws[0], x_slots=True) == 'ss'
    return all(_wgmma_tile(g, kernel, t, k, projs, x_slots=True) == 'ss'
               for kernel, projs in _multi_launches(t, ws, [None] * len(ws)))


def gate_up_gelu_gpu(g, x, w_gate, w_up, act, slots=False, x_slots=False):
    """The dense MLP's act = gelu_mul(bf16(x @ gate^T), bf16(x @ up^T)) in one launch, byte for byte what
    linear_gpu(gate) -> linear_gpu(up) -> layers.mlp.gelu_mul_gpu gives. x (T, K) bf16, gate / up GpuLinear
    of the same format family and shape (I, K), act (T, I) bf16. slots / x_slots: act's / x's rows in x16_bf16's
    slot order (mlp_gpu; only where the launch runs `_ss`). Returns act."""
    _check_x(x, w_gate.K)
    kg, sg = _kernel_of(w_gate)
    ku, su = _kernel_of(w_up)
    if kg != ku or (w_gate.N, w_gate.K) != (w_up.N, w_up.K):
        raise ValueError(f'gate {w_gate.format} {w_gate.N}x{w_gate.K} / up {w_up.format} {w_up.N}x{w_up.K}: '
                         'expected one format family and one shape')
    if act.shape != (x.shape[0], w_gate.N) or act.dtype != BF16:
        raise ValueError(f'act {act.shape} {act.dtype}: expected ({x.shape[0]}, {w_gate.N}) bf16')
    if x.shape[0]:
        _launch(g, kg.replace('gemm_', 'gelu_'), x,
                [(w_gate.w, w_gate.s, sg, act, w_gate.N), (w_up.w, w_up.s, su, None, w_up.N)], gelu=True,
                slots=slots, x_slots=x_slots)
    return act


def mlp_gpu(g, x, w_gate, w_up, w_down, act, out, x_slots=False):
    """The dense MLP: gate_up_gelu_gpu(x) -> act, then linear_gpu(act, down) -> out, byte for byte those two calls.
    When both launches run `_ss`, act goes out in x16_bf16's slot order (gelu_fp8_bf16_ss_slots) and the down
    projection takes it as its X with no x16_bf16 launch (act's buffer then holds the slot order). x_slots: x
    comes in the slot order (x_slots_ok(gelu=True) held for it). Returns out."""
    t, i = x.shape[0], w_gate.N
    slots = (t > 0 and i % 64 == 0 and w_down.K == i and act.shape == (t, i)
             and _gelu_tile(g, t, w_gate, x_slots) == 'ss'
             and _wgmma_tile(g, _kernel_of(w_down)[0], t, i, [(None, None, 0, None, w_down.N)], x_slots=True) == 'ss')
    gate_up_gelu_gpu(g, x, w_gate, w_up, act, slots=slots, x_slots=x_slots)
    return linear_gpu(g, act, w_down, out, x_slots=slots)


def head_gpu(g, x, table, out_f32):
    """Tied head logits: x (T, H) bf16 @ table (V, H) bf16 ^T -> out_f32 (T, V) f32 (no norm, no soft-cap)."""
    v, h = table.shape
    _check_x(x, h)
    if table.dtype != BF16 or h % 16:
        raise ValueError(f'table {table.shape} {table.dtype}: expected (V, H) bf16, H % 16 == 0')
    if out_f32.shape != (x.shape[0], v) or out_f32.dtype != F32:
        raise ValueError(f'out {out_f32.shape} {out_f32.dtype}: expected ({x.shape[0]}, {v}) f32')
    if x.shape[0]:
        _launch(g, 'gemm_bf16_f32', x, [(table, None, 0, out_f32, v)])
    return out_f32
