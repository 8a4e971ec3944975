"""Attention of one decoder layer over the paged KV cache: q/k/v norms, RoPE (default and proportional),
GQA, the exact sliding-window mask and, on sliding layers, bidirectional attention inside image blocks.

KV layout (the GPU uses the same): per layer K and V pools of shape (blocks, 16, Hkv, D); position p of a
sequence lives in block `table[p // 16]`, slot `p % 16`.
"""
import dataclasses

import ml_dtypes
import numpy as np

from config import KV_DTYPES
from layers.norm import rmsnorm

BLOCK = 16  # positions per KV block
_BF16 = np.dtype(ml_dtypes.bfloat16)
_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
# What the KV pools hold: "bf16" (the default; the GPU's pools, the reference keeps float32) or "fp8", an opt-in mode
# that halves the cache's bytes: each K / V value is the bf16 value rounded to float8 e4m3 (nearest even, saturated
# at +-448), the rounding the GPU's KV writes make (attention.cu). Everything else is the same arithmetic. (KV_DTYPES:
# config.py.)
E4M3_MAX = 448.0


def kv_round(x, kv_dtype):
    """x as the KV pools keep it: unchanged ("bf16": the reference's float32 pools) or e4m3(bf16(x)) ("fp8"),
    as float32."""
    if kv_dtype == "bf16":
        return x
    if kv_dtype != "fp8":
        raise ValueError(f"kv dtype {kv_dtype!r}: one of {', '.join(KV_DTYPES)}")
    b = np.asarray(x, np.float32).astype(_BF16).astype(np.float32)
    return np.clip(b, -E4M3_MAX, E4M3_MAX).astype(_E4M3).astype(np.float32)


def rope_inv_freq(rope, head_dim):
    """(D/2,) float32 per-pair frequencies. "proportional" rotates only the first partial*D/2 pairs, with
    the full head_dim as denominator; the rest get frequency 0 (cos 1, sin 0: they pass through)."""
    n_rot = int(rope.partial * head_dim // 2) if rope.kind == "proportional" else head_dim // 2
    f = 1.0 / (rope.theta ** (np.arange(0, 2 * n_rot, 2, dtype=np.float64).astype(np.float32) / head_dim))
    return np.concatenate([f.astype(np.float32), np.zeros(head_dim // 2 - n_rot, np.float32)])


def rope_apply(x, positions, inv_freq):
    """x (T, heads, D) float32 rotated NeoX-style (pairs i, i + D/2) by angle position * f_i (angle in fp32)."""
    ang = positions.astype(np.float32)[:, None] * inv_freq[None, :]          # (T, D/2) fp32, as transformers
    cos = np.cos(ang.astype(np.float64)).astype(np.float32)[:, None, :]
    sin = np.sin(ang.astype(np.float64)).astype(np.float32)[:, None, :]
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def mask(q_pos, k_pos, sliding, window, image_spans=()):
    """(Tq, Tk) bool, True where query q may see key k. Full: k <= q. Sliding: q - W < k <= q, and inside one
    image block (start, n) every row sees every row (bidirectional), still within the window."""
    q, k = q_pos[:, None], k_pos[None, :]
    allowed = k <= q
    if sliding:
        for s, n in image_spans:
            allowed |= (q >= s) & (q < s + n) & (k >= s) & (k < s + n)
        allowed &= k > q - window
    return allowed


def project_qkv(x, w, geo, eps):
    """x (T, H) normed input -> q (T, Hq, D), k (T, Hkv, D), v (T, Hkv, D), before RoPE."""
    T, D = x.shape[0], geo.head_dim
    q = rmsnorm((x @ w["self_attn.q_proj"].T).reshape(T, -1, D), w["self_attn.q_norm"], eps)
    kraw = (x @ w["self_attn.k_proj"].T).reshape(T, -1, D)
    vraw = kraw if geo.k_eq_v else (x @ w["self_attn.v_proj"].T).reshape(T, -1, D)
    return q, rmsnorm(kraw, w["self_attn.k_norm"], eps), rmsnorm(vraw, None, eps)


def attend(q, keys, values, allowed):
    """q (Tq, Hq, D); keys/values (Tk, Hkv, D); allowed (Tq, Tk) -> (Tq, Hq*D). Scaling 1.0, softmax fp32."""
    Tq, Hq, D = q.shape
    group = Hq // keys.shape[1]
    kk = np.repeat(keys, group, axis=1)                                      # (Tk, Hq, D)
    vv = np.repeat(values, group, axis=1)
    s = np.einsum("qhd,khd->hqk", q, kk)                                     # (Hq, Tq, Tk)
    s = np.where(allowed[None], s, -np.inf)
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, vv).reshape(Tq, Hq * D)


def gather(pool, table, start, stop):
    """Rows of positions start..stop-1 of one sequence from a paged pool (blocks, 16, Hkv, D)."""
    pos = np.arange(start, stop)
    return pool[np.asarray(table)[pos // BLOCK], pos % BLOCK]


def scatter(pool, table, positions, rows):
    pool[np.asarray(table)[positions // BLOCK], positions % BLOCK] = rows


# --- GPU ---
# Launchers for kernels_ptx/attention.cu (its header states the arithmetic and why a query's output bytes do
# not depend on the launch: fixed 64-key chunks at absolute positions, each chunk's partial computed by the
# same tensor-core code, folded in increasing order by one formula, in scratch (split) or in registers (fused)). Thin:
# check shapes and dtypes, size the grid, launch. `g` is a gpu.GPU; arrays are gpu.DeviceArray.
ATTN_CHUNK = 64                    # keys per attention partial (CHUNK in attention.cu)
ATTN_WORK_BYTES = 256 << 20        # scratch one attention_gpu call allocates when the caller gives none
ATTN_HEAD_DIMS = (64, 128, 256, 512)   # D with attn_split_bf16_d{D} / attn_fused_bf16_d{D} (one template in attention.cu)
ATTN_SPLIT_ROWS = 64               # T <= this: split kernels + combine; above: fused (the decode graphs: split always)
ATTN_FUSED_MT = {64: 2, 128: 2, 256: 4, 512: 2}   # m16 row tiles per fused CTA by D (FMT in attention.cu)
# The fused tile on wgmma with a loader warpgroup (attention_sm90a.cu, sm_90 GPUs), by head_dim: D = 256 (the sliding
# layers) and 512 (the full ones), the same bytes as attn_fused_bf16_d{D}; None: the mma.sync tile everywhere. H200,
# 2,048-token sliding prefill (graph-replayed): 255.4 -> 207.7 us (2026-11-30); 193.3 us since K and V are handed
# over apart (nineteenth session); 148.6 us with the loader's block numbers read once a chunk (twenty-third); 131.9 us
# with next_pass warp-collective (twenty-seventh). The d512
# tile runs as 2 CTAs a tile (D / ATTN_WG_COLS), each for half the output columns.
ATTN_FUSED_WG = {256: "attn_fused_wg_bf16_d256", 512: "attn_fused_wg_bf16_d512"}
ATTN_WG_K_STAGES = {256: 2, 512: 1}   # K stages of that tile by D (WgCfg::WKS in attention_sm90a.cu)
ATTN_WG_V_STAGES = 2               # V stages (WVS)
ATTN_WG_THREADS = 384              # 2 compute warpgroups + 1 loader (WNT + WLT)
ATTN_WG_ROWS = 64                  # query rows a CTA (WROWS): 64 / G positions
ATTN_WG_COLS = 256                 # output columns a CTA (WDV)
ATTN_SPLIT8_STAGES = 2             # chunk stages of the e4m3 split tile (attention_tile.cuh SPLIT8_STAGES): the K
                                   # and V of chunks c and c + Z in shared memory
ATTN_SPLIT_Z = 17                  # most chunk-slot columns of the split grid (CTA z takes slots z, z + Z, ...):
                                   # 17 = a full 1024-key window at any alignment; never more CTAs than slots
ATTN_SPLIT_WAVE = 512              # split grids aim at ~this many CTAs per CTA an SM holds (~4 waves on 132 SMs):
                                   # split_z
SM_SMEM = 228 * 1024               # shared memory of an sm_90 SM; each resident CTA also takes 1 KiB (reserved)


def split_fit(D, G, e4m3=False):
    """CTAs of attn_split_bf16_d{D} (e4m3: attn_split_e4m3_d{D}) an SM holds for G query heads a kv head: its shared
    memory binds (D = 256, G = 2: 72,176 B, 3 (e4m3 74,224 B, 3); D = 512, G = 8: 146,000 B, 1 (148,048 B, 1))."""
    return max(1, SM_SMEM // (attention_smem(D, 1, G=G, e4m3=e4m3) + 1024))


def split_z(n, Hkv, slots, D, G, e4m3=False):
    """Chunk-slot columns Z of a split launch over n rows (grid (n, Hkv, Z)) for head_dim D, G query heads a kv
    head. Each CTA walks its slots with the next chunk's K / V in flight, so when n * Hkv alone fills the GPU
    fewer, longer CTAs stream better than one chunk each (H200, 1k context, graph-replayed: sliding B = 64 205.6 us
    at Z = 17 -> 179.1 at Z = 2; B = 16 57.9 -> 52.1 at Z = 4; full B = 64 129.2 -> 117.9 at Z = 4; BENCHMARKS.md,
    7th session), while a single row keeps Z = 17 (136 CTAs on a sliding layer). The grid aims at ATTN_SPLIT_WAVE
    CTAs for every CTA an SM holds (split_fit): 1536 at D = 256, G = 2 (3 an SM), where the target was measured
    (decode graphs at 1k context, b64 step 14,596 us (16 Q rows, 512 CTAs) -> 14,099 (G + 1 rows, 1536); eighteenth
    session), and 512 at D = 512, G = 8 (1 an SM: Z = 4 at batch 64, not 12; b64 step 14,060.6 -> 14,017.1 us,
    nineteenth session). Speed only: the partials and their fold are the same."""
    want = -(-ATTN_SPLIT_WAVE * split_fit(D, G, e4m3) // max(1, n * Hkv))
    return max(1, min(slots, ATTN_SPLIT_Z, max(2, want)))


def _need(a, shape, dtype, name):
    dt = _BF16 if isinstance(dtype, str) and dtype == "bf16" else np.dtype(dtype)
    if a.dtype != dt:
        raise ValueError(f"{name}: dtype {a.dtype}, expected {dt}")
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(a.shape)}, expected {tuple(shape)}")


def _pool_kind(k_pool, v_pool, shape):
    """The kernels' name for what the pools hold: "bf16" or "e4m3" (KV_DTYPES "fp8"); both pools alike, of `shape`."""
    kind = {_BF16: "bf16", _E4M3: "e4m3"}.get(k_pool.dtype)
    if kind is None:
        raise ValueError(f"k_pool: dtype {k_pool.dtype}, expected bfloat16 or float8_e4m3fn")
    _need(k_pool, shape, k_pool.dtype, "k_pool")
    _need(v_pool, shape, k_pool.dtype, "v_pool")
    return kind


def _row_src(g, a, T, heads, D, name):
    """(pointer, row stride in elements) of a (T, heads*D) bf16 input: a dense DeviceArray (T, heads, D) or
    (T, heads*D), or a (DeviceArray-or-gpu.ptr, row_stride) pair for a slice of a wider (fused) buffer."""
    if isinstance(a, tuple):
        return a[0], int(a[1])
    if a.size != T * heads * D or a.shape[0] != T:
        raise ValueError(f"{name}: shape {a.shape}, expected ({T}, {heads}, {D})")
    _need(a, a.shape, "bf16", name)
    return a, heads * D


def _rows_aligned(pointers, strides):
    """qk_norm_rope_rows_bf16 moves heads as 16-byte pieces: every pointer (DeviceArray, gpu.ptr or None) 16-byte
    aligned, every row stride (elements) a multiple of 8."""
    return (all(p is None or int(getattr(p, "ptr", p)) % 16 == 0 for p in pointers)
            and all(s % 8 == 0 for s in strides))


# qkv_prep_gpu's kernel: a CTA per (row, head) up to this many rows, then a row per CTA (H200, twelfth session, us
# a launch, head / row kernel, d256 and d512: T = 16 2.7 / 3.7 and 2.9 / 4.4; T = 64 4.1 / 4.6 and 4.8 / 4.6;
# T = 507 20.7 / 11.0 and 23.8 / 11.6).
QK_HEAD_MAX_T = 64


def qkv_prep_gpu(g, q_in, k_in, v_in, q_norm_w, k_norm_w, inv_freq, positions, eps, q_out, k_out, v_out,
                 kv=None):
    """q = rope(q_norm(q_in)), k = rope(k_norm(k_in)), v = v_norm(v_in) (no weight, no rope) in one launch.
    q_out (T, Hq, D) bf16; k_out / v_out (T, Hkv, D) bf16 or None (then kv is needed); inputs see `_row_src`
    (v_in None: k=v layer, V = v_norm(raw k)); q_norm_w / k_norm_w (D,) bf16; inv_freq (D/2,) float32
    (rope_inv_freq); positions (T,) int32. kv = (k_pool, v_pool, rows_seq, block_tables) also writes k and v
    into the paged pools (the fused kv_write_gpu; e4m3 pools get kv_round's values: the `_e4m3` kernels). Two
    kernels, the same bytes (attention.cu): T <= QK_HEAD_MAX_T
    (or D > 512, or rows not 16-byte aligned: _rows_aligned) qk_norm_rope_bf16, grid (T, Hq + 2 Hkv), block D/2;
    else qk_norm_rope_rows_bf16, grid (T, ny), block 256, D/16 lanes a head, ny CTAs a row (1 for long
    prompts)."""
    T, Hq, D = q_out.shape
    Hkv = k_out.shape[1] if k_out is not None else kv[0].shape[2]
    if D % 64 or not 64 <= D <= 2048:                   # block D/2 threads: whole warps (D = 64: one warp)
        raise ValueError(f"head_dim {D}: a multiple of 64 up to 2048")
    if k_out is None and kv is None:
        raise ValueError("k_out / v_out None needs kv (the pools to write)")
    _need(q_out, (T, Hq, D), "bf16", "q_out")
    if k_out is not None:
        _need(k_out, (T, Hkv, D), "bf16", "k_out")
    if v_out is not None:
        _need(v_out, (T, Hkv, D), "bf16", "v_out")
    _need(q_norm_w, (D,), "bf16", "q_norm_w")
    _need(k_norm_w, (D,), "bf16", "k_norm_w")
    _need(inv_freq, (D // 2,), np.float32, "inv_freq")
    _need(positions, (T,), np.int32, "positions")
    k_pool = v_pool = rows_seq = tables = None
    mb, kind = 0, "bf16"
    if kv is not None:
        k_pool, v_pool, rows_seq, tables = kv
        kind = _pool_kind(k_pool, v_pool, (k_pool.shape[0], BLOCK, Hkv, D))
        _need(rows_seq, (T,), np.int32, "rows_seq")
        if len(tables.shape) != 2 or tables.dtype != np.int32:
            raise ValueError(f"block_tables: int32 (S, max_blocks), got {tables.shape} {tables.dtype}")
        mb = tables.shape[1]
    qp, qs = _row_src(g, q_in, T, Hq, D, "q_in")
    kp, ks = _row_src(g, k_in, T, Hkv, D, "k_in")
    vp, vs = _row_src(g, k_in if v_in is None else v_in, T, Hkv, D, "v_in")
    if T == 0:
        return
    heads = Hq + 2 * Hkv
    rows = T > QK_HEAD_MAX_T and D <= 512 and _rows_aligned((qp, kp, vp, q_out, k_out, v_out, k_pool, v_pool),
                                                            (qs, ks, vs))
    if not rows:
        f, grid, block = g.module("attention").function(f"qk_norm_rope_{kind}"), (T, heads, 1), (D // 2, 1, 1)
    else:                           # ny CTAs a row: about 2 CTAs an SM in all; a warp takes 32 // (D // 16) heads
        ny = max(1, min(-(-heads // (8 * (32 // (D // 16)))), -(-2 * g.sm_count // T)))
        f, grid, block = g.module("attention").function(f"qk_norm_rope_rows_{kind}"), (T, ny, 1), (256, 1, 1)
    g.launch(f, grid=grid, block=block,
             args=[qp, qs, kp, ks, vp, vs, q_norm_w, k_norm_w, inv_freq, positions, Hq, Hkv, D, float(eps),
                   q_out, k_out, v_out, k_pool, v_pool, rows_seq, tables, mb])


def kv_write_gpu(g, k, v, k_pool, v_pool, rows_seq, rows_pos, block_tables):
    """Scatter k, v (T, Hkv, D) bf16 into the pools (blocks, 16, Hkv, D), bf16 or e4m3 (kv_round's values): row t
    goes to position rows_pos[t] of sequence rows_seq[t], i.e. pool row block_tables[seq, pos // 16] * 16 + pos % 16.
    Kernel kv_write_bf16 / kv_write_e4m3."""
    T, Hkv, D = k.shape
    _need(k, (T, Hkv, D), "bf16", "k")
    _need(v, (T, Hkv, D), "bf16", "v")
    kind = _pool_kind(k_pool, v_pool, (k_pool.shape[0], BLOCK, Hkv, D))
    _need(rows_seq, (T,), np.int32, "rows_seq")
    _need(rows_pos, (T,), np.int32, "rows_pos")
    if len(block_tables.shape) != 2 or block_tables.dtype != np.int32:
        raise ValueError(f"block_tables: int32 (S, max_blocks), got {block_tables.shape} {block_tables.dtype}")
    if (Hkv * D) % 8:
        raise ValueError("Hkv * D must be a multiple of 8")
    if T == 0:
        return
    f = g.module("attention").function(f"kv_write_{kind}")
    g.launch(f, grid=(T, 1, 1), block=(128, 1, 1),
             args=[k, v, k_pool, v_pool, rows_seq, rows_pos, block_tables, block_tables.shape[1], Hkv * D])


def kv_widen_gpu(g, k_pool, v_pool, src, k16, v16):
    """k16[i], v16[i] = the e4m3 pools' blocks src[i] (i < len(src)) as bf16, exactly (kernel kv_widen_e4m3): copies
    that the wgmma prompt tile, which reads bf16 pools only, attends as it would the pools (attention_plan). src (n,)
    int32 (a DeviceArray, or a (gpu.ptr, n) pair for a slice of a wider buffer); k16 / v16 bf16 of at least n blocks
    of the pools' shape."""
    NB, _, Hkv, D = k_pool.shape
    if _pool_kind(k_pool, v_pool, (NB, BLOCK, Hkv, D)) != "e4m3":
        raise ValueError("kv_widen_gpu: e4m3 pools")
    if isinstance(src, tuple):
        src, n = src[0], int(src[1])
    else:
        n = src.size
        _need(src, (n,), np.int32, "src")
    for name, a in (("k16", k16), ("v16", v16)):
        if a.dtype != _BF16 or tuple(a.shape[1:]) != (BLOCK, Hkv, D) or a.shape[0] < n:
            raise ValueError(f"{name}: bf16 of at least {n} blocks ({BLOCK}, {Hkv}, {D}), got {a.shape} {a.dtype}")
    if n == 0:
        return
    bpb = BLOCK * Hkv * D                               # bytes of an e4m3 block: 16 | bpb (the kernel's 16-byte steps)
    g.launch(g.module("attention").function("kv_widen_e4m3"), grid=(n, 2, 1), block=(256, 1, 1),
             args=[k_pool, v_pool, src, k16, v16, bpb], nbytes=6 * n * bpb)


# An eager step's attention (attention_plan): a sequence with at most ATTN_SPLIT_SEQ_ROWS rows in the step (a decode
# row of a step that also holds prompt chunks) takes the split path, the others the fused tiles, each path over runs
# of consecutive sequences. (The fused tile spends a whole tile's arithmetic a chunk on such a row, and over e4m3 pools
# it is the mma.sync tile, ~1.9x the wgmma one; the split path reads each of the row's chunks once.)
ATTN_SPLIT_SEQ_ROWS = 1


@dataclasses.dataclass(frozen=True)
class AttnRun:
    """Rows r0 .. r1 - 1 of a step (whole sequences), attended in one call: split or fused. A fused run over e4m3
    pools whose wgmma tile reads bf16 copies has `wide`: per table (0 full layers, 1 sliding), (offset, count) of its
    blocks in the plan's src lists; its sequences' rows of the plan's tab number the copies from 0."""
    r0: int
    r1: int
    split: bool
    wide: tuple | None = None


def attention_plan(n_rows, starts, tables, window, wide_cap=0):
    """The attention calls of an eager step: returns (runs, tab, src). Sequence j has n_rows[j] rows (after those of
    j - 1; 0: none), the first at position starts[j], and the KV blocks tables[j]. A step of <= ATTN_SPLIT_ROWS rows
    is one split run; else runs of consecutive sequences, split where a sequence has <= ATTN_SPLIT_SEQ_ROWS rows, fused
    elsewhere. wide_cap > 0 (e4m3 pools, the wgmma tile): each fused run (cut where its sequences' blocks would exceed
    wide_cap) gets bf16 copies of its sequences' blocks (kv_widen_gpu): for full layers every block of the table, for
    sliding ones from the block of position starts[j] - window + 1 (no row of the step sees a key before it). tab
    (2, S, max len) int32 then maps (table, sequence, block) to its copy (0 where none: never read), src[t] (n,) int32
    lists the pool block of each copy; without wide_cap tab and src are None."""
    T, S = int(sum(n_rows)), len(n_rows)
    if T <= ATTN_SPLIT_ROWS:
        return [AttnRun(0, T, True)], None, None
    groups, r, held = [], 0, 0                  # [r0, r1, split, fused sequences (with copies)]; blocks they hold
    for j, n in enumerate(n_rows):
        if n == 0:
            continue
        split, nb = n <= ATTN_SPLIT_SEQ_ROWS, len(tables[j])
        if wide_cap and not split and nb > wide_cap:
            raise ValueError(f"a sequence of {nb} blocks: the bf16 copies hold {wide_cap}")
        if not groups or groups[-1][2] != split or (wide_cap and not split and held + nb > wide_cap):
            groups.append([r, r, split, []])
            held = 0
        r += n
        groups[-1][1] = r
        if wide_cap and not split:
            groups[-1][3].append(j)
            held += nb
    if not wide_cap:
        return [AttnRun(r0, r1, split) for r0, r1, split, _ in groups], None, None
    tab = np.zeros((2, S, max(1, max(len(b) for b in tables))), np.int32)
    src, runs = [[], []], []
    for r0, r1, split, seqs in groups:
        wide = None
        if not split:
            wide = []
            for t in (0, 1):
                off = len(src[t])
                for j in seqs:
                    first = 0 if t == 0 else max(0, int(starts[j]) - int(window) + 1) // BLOCK
                    nb = len(tables[j])
                    tab[t, j, first:nb] = np.arange(len(src[t]) - off, len(src[t]) - off + nb - first)
                    src[t].extend(tables[j][first:])
                wide.append((off, len(src[t]) - off))
            wide = tuple(wide)
        runs.append(AttnRun(r0, r1, split, wide))
    return runs, tab, [np.asarray(x, np.int32) for x in src]


def attention_slots(max_keys):
    """Chunk partials a row can need when its key range [lo, hi] holds at most max_keys keys."""
    return (max_keys + ATTN_CHUNK - 1) // ATTN_CHUNK + 1


def split_row_floats(Hq, max_keys, D):
    """float32 scratch of one row on the split path: per query head and chunk slot, its m, l and D accumulators
    (attention_gpu's `work` holds a group of such rows + 4)."""
    return Hq * attention_slots(max_keys) * (D + 2)


def attention_work(g, rows, Hq, D, max_keys):
    """Scratch (float32) for attention_gpu over `rows` rows: per (row, head, chunk slot) m, l and acc[D]
    (only the split path, T <= ATTN_SPLIT_ROWS, uses it)."""
    return g.empty((rows * split_row_floats(Hq, max_keys, D) + 4,), np.float32)


def attention_smem(D, MT, wg=False, G=None, e4m3=False):
    """Dynamic shared memory of attn_split (MT 1) / attn_fused (MT = ATTN_FUSED_MT[D]) for head_dim D (attn_tile in
    attention_tile.cuh): K and V chunks + the Q tile (rows of 2D + 16 bytes), P (16 MT rows x 144 B), per-warp row
    max / sum, per-position lo / hi / seq. wg (attention_sm90a.cu WgCfg<D>; MT unused): Q and ATTN_WG_K_STAGES[D]
    stages of K (64 rows of 2D bytes, swizzled), ATTN_WG_V_STAGES of V (64 rows of the CTA's ATTN_WG_COLS columns),
    P, row maxima of 2 warpgroups and sums of D / 64 key groups, lo / hi / seq, and the stages' full / empty
    mbarriers. G (the split tile, MT 1): its query heads a kv head; the tile then keeps G + 1 Q rows (at most 16;
    attention_tile.cuh QR), not 16. e4m3 (the split tile over e4m3 pools, attn_split8; G given):
    ATTN_SPLIT8_STAGES stages each of K and V chunks in rows of D + 16 bytes, not one each of 2D + 16."""
    if wg:
        ks, vs, rows = ATTN_WG_K_STAGES[D], ATTN_WG_V_STAGES, ATTN_WG_ROWS
        return ((1 + ks) * rows * 2 * D + vs * rows * 2 * ATTN_WG_COLS + rows * (2 * ATTN_CHUNK + 16)
                + (2 + D // 64) * rows * 4 + 3 * rows * 4 + 2 * (ks + vs) * 8)
    qrows = 16 * MT if G is None else min(G + 1, 16)     # split (G given): the G rows and a zero row
    if e4m3 and G is not None:
        kv = 2 * ATTN_SPLIT8_STAGES * ATTN_CHUNK * (D + 16)
    else:
        kv = 2 * ATTN_CHUNK * (2 * D + 16)
    return (kv + qrows * (2 * D + 16) + 16 * MT * (2 * ATTN_CHUNK + 16)
            + 2 * MT * (D // 64) * 16 * 4 + 3 * 16 * MT * 4)


def attention_gpu(g, q, k_pool, v_pool, rows_seq, rows_pos, block_tables, spans, window, sliding, out,
                  max_keys=None, work=None, out_slots=False, split=None, rows=None):
    """out (T, Hq*D) bf16 = softmax(q . K^T) V per row over the paged pools, scaling 1.0, fp32 softmax with
    p rounded to bf16 for the P.V tensor-core product (attention.cu header).
    q (T, Hq, D) bf16 (normed, roped); pools (blocks, 16, Hkv, D) bf16 or e4m3 (KV_DTYPES "fp8": the `_e4m3`
    kernels, which widen the values to bf16 exactly and give the bytes bf16 pools of the same values give; their
    prompt tile is the mma.sync one: the model's prompt steps give the wgmma tile bf16 copies instead, attention_plan),
    D in {64, 128, 256, 512}; rows_seq, rows_pos
    (T,) int32: the row's sequence (index into block_tables / spans) and position; block_tables int32
    (S, max_blocks); spans None or int32 (S, n_spans, 2) of (start, n) image blocks (n = 0: unused), used on
    sliding layers only. Row (seq, p) sees keys [lo, hi]: lo = max(0, p - window + 1) if sliding else 0, hi = p,
    or the end of p's image block (sliding). The keys must already be in the pools (kv_write_gpu first).
    max_keys bounds hi - lo + 1 over the rows (default: window on sliding layers without spans, else the
    table's capacity max_blocks * 16); a row that needs more chunks than that gets NaN.
    Two launch shapes with the same per-(row, chunk) arithmetic, picked by T unless `split` says which (every grid
    depends on T, max_keys and split only, never on the data: CUDA-graph safe):
      T <= ATTN_SPLIT_ROWS (decode): attn_split_bf16_d{D} grid (n, Hkv, split_z(n, Hkv, slots, D, G)), block D/2,
        one CTA per (row, kv head, chunk slot column) writing partials to `work`, then attn_combine_bf16
        grid (n, Hq), block D/4. work: float32 scratch (attention_work); None allocates (and frees) one of at
        most ATTN_WORK_BYTES, so graph capture must pass one sized for every row; rows run in groups that fit.
      T > ATTN_SPLIT_ROWS (prefill): attn_fused_bf16_d{D} grid (ceil(T / (16 mt // G)), Hkv), block mt D / 2
        (mt = ATTN_FUSED_MT[D]): a CTA per (16 mt // G positions, kv head) folds the chunks in registers; no
        scratch (work unused). On sm_90 at D = 256 and 512 its wgmma form ATTN_FUSED_WG[D] (the same bytes): grid
        (ceil(T / (64 // G)), Hkv, D // ATTN_WG_COLS), block ATTN_WG_THREADS (two compute warpgroups and a
        loader), a CTA per (64 // G positions, kv head, ATTN_WG_COLS output columns).
    out_slots: the wgmma kernels' `_slots` form writes out's rows in x16_bf16's slot order (layers.linear: o_proj's
    `_ss` X, no copy); returns whether out went out that way (not from the split path, whose combine writes it
    plainly, nor from the mma.sync tile, which is at its register cap).
    split: None picks by T as above; True takes the split path at any T (rows of one position each: the decode
    graphs' buckets above ATTN_SPLIT_ROWS, where a fused tile would walk one sequence a pass), False the fused one.
    rows: (r0, r1): attend rows r0 .. r1 - 1 only (a run of attention_plan; the rest of out is left as it is); None:
    all T."""
    T, Hq, D = q.shape
    NB, _, Hkv, _ = k_pool.shape
    S, MB = block_tables.shape
    if D not in ATTN_HEAD_DIMS:
        raise ValueError(f"head_dim {D}: attention kernels exist for {', '.join(map(str, ATTN_HEAD_DIMS))}")
    if Hq % Hkv or Hq // Hkv > 16:
        raise ValueError(f"Hq={Hq} Hkv={Hkv}: need Hkv | Hq and Hq / Hkv <= 16")
    _need(q, (T, Hq, D), "bf16", "q")
    kind = _pool_kind(k_pool, v_pool, (NB, BLOCK, Hkv, D))
    _need(rows_seq, (T,), np.int32, "rows_seq")
    _need(rows_pos, (T,), np.int32, "rows_pos")
    _need(block_tables, (S, MB), np.int32, "block_tables")
    _need(out, (T, Hq * D), "bf16", "out")
    n_spans = 0
    if spans is not None:
        _need(spans, (S, spans.shape[1], 2), np.int32, "spans")
        n_spans = spans.shape[1]
    use_spans = spans if (sliding and n_spans) else None
    if max_keys is None:
        max_keys = min(MB * BLOCK, window) if (sliding and use_spans is None) else MB * BLOCK
    slots = attention_slots(int(max_keys))
    per_row = split_row_floats(Hq, int(max_keys), D)    # float32 scratch per row (split path)
    r0, r1 = (0, T) if rows is None else (int(rows[0]), int(rows[1]))
    if not 0 <= r0 <= r1 <= T:
        raise ValueError(f"rows [{r0}, {r1}) outside the {T} rows")
    if r0 == r1:
        return False
    G = Hq // Hkv
    mod = g.module("attention")
    common = [q, k_pool, v_pool, rows_seq, rows_pos, block_tables, MB, use_spans, n_spans, int(window),
              int(bool(sliding))]
    if not (T <= ATTN_SPLIT_ROWS if split is None else split):
        wg = ATTN_FUSED_WG is not None and D in ATTN_FUSED_WG and g.capability == (9, 0) and kind == "bf16"
        if wg:
            rp, nz, block = ATTN_WG_ROWS // G, D // ATTN_WG_COLS, ATTN_WG_THREADS
            f = g.module("attention_sm90a").function(ATTN_FUSED_WG[D] + ("_slots" if out_slots else ""))
        else:
            mt = ATTN_FUSED_MT[D]
            rp, nz, block = 16 * mt // G, 1, mt * D // 2   # positions per fused tile (mt m16 tiles of rows)
            f = mod.function(f"attn_fused_{kind}_d{D}")
        g.launch(f, grid=((r1 - r0 + rp - 1) // rp, Hkv, nz), block=(block, 1, 1),
                 args=common + [r0, r1 - r0, Hq, Hkv, slots, None, None, out],
                 shared=attention_smem(D, ATTN_FUSED_MT[D], wg))
        return wg and bool(out_slots)
    own = work is None
    if own:
        work = g.empty((max(1, min(r1 - r0, ATTN_WORK_BYTES // (4 * per_row))) * per_row + 4,), np.float32)
    if work.dtype != np.float32 or work.size < per_row + 4:
        raise ValueError(f"work: float32 of at least {per_row} + 4 elements (attention_work)")
    group = min(r1 - r0, (work.size - 4) // per_row)
    fs = mod.function(f"attn_split_{kind}_d{D}")
    e4 = kind == "e4m3"
    fc = mod.function("attn_combine_bf16")
    import gpu
    ml = gpu.ptr(work.ptr)                               # (group, Hq, slots, 2) m, l
    acc = gpu.ptr(work.ptr + 16 * ((group * Hq * slots * 2 + 3) // 4))  # (group, Hq, slots, D), 16 B aligned
    try:
        for row0 in range(r0, r1, group):
            n = min(group, r1 - row0)
            g.launch(fs, grid=(n, Hkv, split_z(n, Hkv, slots, D, G, e4)), block=(D // 2, 1, 1),
                     args=common + [row0, n, Hq, Hkv, slots, ml, acc, None], shared=attention_smem(D, 1, G=G, e4m3=e4))
            g.launch(fc, grid=(n, Hq, 1), block=(D // 4, 1, 1),
                     args=[ml, acc, rows_seq, rows_pos, use_spans, n_spans, int(window), int(bool(sliding)),
                           row0, Hq, D, slots, out])
    finally:
        if own:
            g.sync()                                     # the kernels must be done with it before the free
            g.free(work)
    return False
