// Attention of one decoder layer on the GPU: q/k/v RMSNorm + NeoX RoPE, the paged KV scatter, and the
// attention itself on the tensor cores (mma.sync m16n8k16 bf16, fp32 accumulation).
//
// Shapes (letters as in Python): T rows of this step, Hq query heads, Hkv kv heads, D head_dim,
// G = Hq / Hkv query heads per kv head (<= 16); D in {64, 128, 256, 512} (one template per D).
// KV pools (blocks, 16, Hkv, D) bf16, or e4m3 (the `_e4m3` kernels: the pools' values are the bf16 ones rounded to
// e4m3 by the KV writes, widened back exactly by the attention: attention_tile.cuh): position p of a sequence lives
// in pool row  block_table[seq][p / 16] * 16 + p % 16.
//
// DETERMINISM. A query row (position p, head h) sees the contiguous key range [lo, hi]:
//   lo = max(0, p - W + 1) on sliding layers, 0 on full layers; hi = p, or, on sliding layers when p is inside
//   an image block (start, n), hi = start + n - 1 (the mask of layers.attention.mask is exactly this range).
// The range is cut at ABSOLUTE 64-key boundaries (chunk c = keys 64c .. 64c+63). For every (row, head, chunk)
// the same device code (attn_chunk below) computes the chunk's partial softmax
//     m = max_j s_j,  p_j = bf16(exp(s_j - m)),  l = sum_j p_j,  acc[d] = sum_j p_j v_j[d]
// (s_j = q . k_j, scaling 1.0; j over the chunk's keys inside [lo, hi]); the partials of a row are then folded
// in increasing c by one fixed formula (fold_chunk). Two launch shapes use that code:
//   - split (decode, T <= 64): attn_split_bf16_d{D}, one CTA per (row, kv head, chunk slot) writes the partial
//     to scratch; attn_combine_bf16 folds a row's slots in increasing order;
//   - fused (prefill): attn_fused_bf16_d{D}, one CTA per (tile of rows, kv head) walks the chunks in increasing
//     order and folds each partial into registers with the same formula, no scratch.
// The partial of a (row, head, chunk) depends only on that row's q and the chunk's keys, never on the launch
// shape or on the row's place in the tile: every mma output element is its own dot product (the tensor core
// does not mix rows of A or columns of B), the k-order of every mma chain is fixed (d ascending for S, key
// ascending for P.V), and the cross-warp reductions (row max, row sum of p) run in a fixed warp order. Keys a
// row may not see get score -inf (select, not arithmetic) and p = 0; keys no row of the tile may see are not
// read at all (zero-filled in smem), so pool rows past a sequence's end (possibly NaN) never enter a sum.
// So a query's output bytes are identical whatever else is in the launch (decode == prefill == chunked prefill).
// Float arithmetic whose rounding matters is written with explicit _rn intrinsics / inline PTX so that the
// compiler cannot contract it differently in different kernels.
#include <cuda_bf16.h>
#include <stdint.h>

#include "pdl.cuh"          // pdl_entry: programmatic dependent launch

#include "attention_tile.cuh"   // attn_tile, key_range, exp_fixed, fold: the tile of every kernel below

__device__ __forceinline__ float warp_sum(float v) {
    // xor butterfly: every lane ends with the same bits (each stage adds the same two values on both lanes)
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// ---------------------------------------------------------------------------------------------------------
// q / k / v norm + rope, two launch shapes with one arithmetic (layers/attention.py qkv_prep_gpu picks by T):
// per (row t, head) RMSNorm over D (q: q_norm weight, k: k_norm weight, v: no weight), then NeoX RoPE on q and
// k: pair (i, i + D/2) rotated by angle float(pos[t]) * inv_freq[i] (fp32 angle, full-precision sincosf).
// Head hy of a row: hy < Hq a q head, then Hkv k heads, then Hkv v heads. The sum of squares is fixed by D alone:
// per pair i fmaf(xb, xb, xa * xa); the 32 pairs i = 32 j + l (l = 0..31) added by the xor butterfly of
// warp_sum; the D/64 partials then added in increasing j from 0.f. So a row's bytes do not depend on the kernel.
// Inputs are read with row strides (elements) so a fused QKV projection output can be read in place; for k=v
// layers pass v_in = the raw k (V = v_norm(raw k)).
// Outputs are dense: q_out (T, Hq, D), k_out (T, Hkv, D), v_out (T, Hkv, D) (k_out / v_out may be null).
// Fused KV write (k_pool non-null): the k and v rows also go straight into the paged pools (blocks, 16, Hkv, D)
// at pool row block_tables[rows_seq[t] * max_blocks + pos / 16] * 16 + pos % 16 (pos = positions[t]), the
// same bytes kv_write_bf16 would store.
//   qk_norm_rope_bf16 (decode, small T): grid (T, Hq + 2 Hkv), block D/2 (D % 64 == 0: whole warps); thread i
//     owns pair i; the warps' partials meet in shared memory.
//   qk_norm_rope_rows_bf16 (prefill): grid (T, ny), block 256; a CTA computes its row's D/2 cos / sin once into
//     shared memory, then each warp takes 32 / L heads at a time (L = D/16 lanes a head: lane a of a head holds its
//     16-byte pieces a and a + L, i.e. the 8 pairs i = 8a .. 8a + 7 whole, in registers, loaded one round ahead).
//     The sum of squares is the same tree as warp_sum's, evaluated where the values lie: of pair i = 32j + l, bits
//     4 and 3 of l are bits 1 and 0 of the lane's place in its 4-lane group j, bits 2..0 its element; so the xor-16
//     and xor-8 stages pair lanes 2 and 1 apart and the xor-4, 2, 1 stages pair elements, and every stage halves
//     the values a lane holds by sending the half its partner keeps (9 shuffles a group instead of warp_sum's 5 for
//     each j). D <= 512. (Twelfth session: at 2,048 tokens 1,464 us against the per-head shape's 2,525; sixteenth:
//     a head through a warp's shared-memory row, one head a warp, 31.7 us sliding, 37.1 full; twenty-fifth, this
//     form: 28.4 / 37.1 us; twenty-eighth, its shared weights and angles in qk_lane_pos order: 26.3 / 33.4;
//     forty-seventh, 5 CTAs an SM (48 registers, no spill; 4 had 64): 26.1 -> 24.0 / 32.6 -> 30.2, but 512 tokens
//     7.3 -> 7.4 / 9.1 -> 9.4; BENCHMARKS.md.)
//     Needs 16-byte aligned head rows (row strides and pointers: the launcher checks, else the per-head kernel).
// ---------------------------------------------------------------------------------------------------------
#define QK_PARAMS                                                                                             \
    const __nv_bfloat16 *__restrict__ q_in, int q_stride, const __nv_bfloat16 *__restrict__ k_in, int k_stride, \
        const __nv_bfloat16 *__restrict__ v_in, int v_stride, const __nv_bfloat16 *__restrict__ q_w,           \
        const __nv_bfloat16 *__restrict__ k_w, const float *__restrict__ inv_freq,                              \
        const int *__restrict__ positions, int Hq, int Hkv, int D, float eps, __nv_bfloat16 *__restrict__ q_out, \
        __nv_bfloat16 *__restrict__ k_out, __nv_bfloat16 *__restrict__ v_out, __nv_bfloat16 *__restrict__ k_pool, \
        __nv_bfloat16 *__restrict__ v_pool, const int *__restrict__ rows_seq, const int *__restrict__ block_tables, \
        int max_blocks
#define QK_PASS /* QK_PARAMS' names, passed on (qk_head) */                                                 \
    q_in, q_stride, k_in, k_stride, v_in, v_stride, q_w, k_w, inv_freq, positions, Hq, Hkv, D, eps, q_out, k_out, \
        v_out, k_pool, v_pool, rows_seq, block_tables, max_blocks

struct QkHead {
    const __nv_bfloat16* src;
    __nv_bfloat16* dst;                              // null: no dense output
    uint8_t* pool;                                   // the head's row in the k or v pool; null: no fused write
    int w;                                           // 0: q_w, 1: k_w (both then rope), -1: no weight, no rope
};

// Head hy of row t; slot = the row's pool row (used when k_pool is non-null); ES = bytes a pool value (2 bf16, 1 e4m3).
template <int ES>
__device__ __forceinline__ QkHead qk_head(int t, int hy, size_t slot, QK_PARAMS) {
    if (hy < Hq)
        return {q_in + (size_t)t * q_stride + (size_t)hy * D, q_out + ((size_t)t * Hq + hy) * D, nullptr, 0};
    const bool k = hy < Hq + Hkv;
    const int h = k ? hy - Hq : hy - Hq - Hkv;
    __nv_bfloat16* pool = k ? k_pool : v_pool;
    uint8_t* row = k_pool ? reinterpret_cast<uint8_t*>(pool) + (slot * Hkv + h) * D * ES : nullptr;
    if (k)
        return {k_in + (size_t)t * k_stride + (size_t)h * D, k_out ? k_out + ((size_t)t * Hkv + h) * D : nullptr,
                row, 1};
    return {v_in + (size_t)t * v_stride + (size_t)h * D, v_out ? v_out + ((size_t)t * Hkv + h) * D : nullptr, row, -1};
}

__device__ __forceinline__ size_t qk_slot(int t, int p, const int* __restrict__ rows_seq,
                                          const int* __restrict__ block_tables, int max_blocks) {
    return (size_t)block_tables[(size_t)rows_seq[t] * max_blocks + p / KV_BLOCK] * KV_BLOCK + p % KV_BLOCK;
}

// Pair (i, i + D/2) of a head: normed by r, weighted (w >= 0: wv = its weights, then rotated by c, s), rounded.
__device__ __forceinline__ void qk_pair(int w, float xa, float xb, float r, float wa, float wb, float c, float s,
                                        __nv_bfloat16& ba, __nv_bfloat16& bb) {
    float ya = __fmul_rn(xa, r), yb = __fmul_rn(xb, r);
    if (w >= 0) {
        ya = __fmul_rn(ya, wa);
        yb = __fmul_rn(yb, wb);
        const float oa = __fsub_rn(__fmul_rn(ya, c), __fmul_rn(yb, s));
        const float ob = __fadd_rn(__fmul_rn(yb, c), __fmul_rn(ya, s));
        ya = oa; yb = ob;
    }
    ba = __float2bfloat16_rn(ya);
    bb = __float2bfloat16_rn(yb);
}

// The same, stored into the head's outputs (an e4m3 pool: each value rounded by bf16x2_e4m3x2).
template <int ES>
__device__ __forceinline__ void qk_store(const QkHead& hd, int i, int half, float xa, float xb, float r, float wa,
                                         float wb, float c, float s) {
    __nv_bfloat16 ba, bb;
    qk_pair(hd.w, xa, xb, r, wa, wb, c, s, ba, bb);
    if (hd.dst) {
        hd.dst[i] = ba;
        hd.dst[i + half] = bb;
    }
    if (hd.pool) {
        if constexpr (ES == 2) {
            reinterpret_cast<__nv_bfloat16*>(hd.pool)[i] = ba;
            reinterpret_cast<__nv_bfloat16*>(hd.pool)[i + half] = bb;
        } else {
            const uint16_t e = bf16x2_e4m3x2((uint32_t)__bfloat16_as_ushort(ba) |
                                             ((uint32_t)__bfloat16_as_ushort(bb) << 16));
            hd.pool[i] = (uint8_t)e;
            hd.pool[i + half] = (uint8_t)(e >> 8);
        }
    }
}

template <int ES>
__device__ __forceinline__ void qk_norm_rope_head(QK_PARAMS) {
    pdl_entry();
    __shared__ float red[32];
    const int t = blockIdx.x, i = threadIdx.x, half = D >> 1, p = positions[t];
    const size_t slot = k_pool ? qk_slot(t, p, rows_seq, block_tables, max_blocks) : 0;
    const QkHead hd = qk_head<ES>(t, blockIdx.y, slot, QK_PASS);
    const float xa = __bfloat162float(hd.src[i]), xb = __bfloat162float(hd.src[i + half]);
    const float ss = warp_sum(__fmaf_rn(xb, xb, __fmul_rn(xa, xa)));
    if ((i & 31) == 0) red[i >> 5] = ss;
    __syncthreads();
    float tot = 0.f;
    for (int j = 0; j < (half >> 5); j++) tot = __fadd_rn(tot, red[j]);      // same order in every thread
    const float r = __frsqrt_rn(__fadd_rn(__fdiv_rn(tot, (float)D), eps));
    float wa = 0.f, wb = 0.f, s = 0.f, c = 0.f;
    if (hd.w >= 0) {
        const __nv_bfloat16* w = hd.w ? k_w : q_w;
        wa = __bfloat162float(w[i]);
        wb = __bfloat162float(w[i + half]);
        sincosf(__fmul_rn((float)p, inv_freq[i]), &s, &c);
    }
    qk_store<ES>(hd, i, half, xa, xb, r, wa, wb, c, s);
}
extern "C" __global__ void qk_norm_rope_bf16(QK_PARAMS) { qk_norm_rope_head<2>(QK_PASS); }
extern "C" __global__ void qk_norm_rope_e4m3(QK_PARAMS) { qk_norm_rope_head<1>(QK_PASS); }

#define QK_WARPS 8

// The 4-lane group's total of warp_sum's tree over its 32 pairs (see above): v[e] = the lane's pair 8b + e's square
// sum, b = lane & 3 (the group's lanes are consecutive). Every lane of the group returns the same bits.
__device__ __forceinline__ float group_sum32(const float (&v)[8], int lane) {
    const bool b1 = lane & 2, b0 = lane & 1;
    float p1[4], p2[2];
#pragma unroll
    for (int t = 0; t < 4; t++) {               // xor 16: lanes 2 apart; this lane keeps elements 4 b1 + t
        const float give = b1 ? v[t] : v[t + 4];
        p1[t] = __fadd_rn(b1 ? v[t + 4] : v[t], __shfl_xor_sync(0xffffffffu, give, 2));
    }
#pragma unroll
    for (int u = 0; u < 2; u++) {               // xor 8: lanes 1 apart; keeps elements 4 b1 + 2 b0 + u
        const float give = b0 ? p1[u] : p1[u + 2];
        p2[u] = __fadd_rn(b0 ? p1[u + 2] : p1[u], __shfl_xor_sync(0xffffffffu, give, 1));
    }
    // xor 4 (element bit 2 = b1's side): keeps element 2 b0 + b1 of the 4 sums
    const float p3 = __fadd_rn(b1 ? p2[1] : p2[0], __shfl_xor_sync(0xffffffffu, b1 ? p2[0] : p2[1], 2));
    const float p4 = __fadd_rn(p3, __shfl_xor_sync(0xffffffffu, p3, 1));   // xor 2 (element bit 1 = b0's side)
    return __fadd_rn(p4, __shfl_xor_sync(0xffffffffu, p4, 2));            // xor 1 (element bit 0 = b1's side)
}

// 8 bf16 (16 bytes) -> 8 e4m3 (8 bytes), in order (bf16x2_e4m3x2).
__device__ __forceinline__ uint2 e4m3x8(const uint4& u) {
    return make_uint2((uint32_t)bf16x2_e4m3x2(u.x) | ((uint32_t)bf16x2_e4m3x2(u.y) << 16),
                      (uint32_t)bf16x2_e4m3x2(u.z) | ((uint32_t)bf16x2_e4m3x2(u.w) << 16));
}

__device__ __forceinline__ void unpack8(const uint4& u, float (&f)[8]) {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
        f[2 * k] = __uint_as_float(w[k] << 16);
        f[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
    }
}

// Where column j (< D/2) of a half (q_w's, k_w's, cos, sin) lies in shared memory: lane a reads columns 8a .. 8a + 7
// as 4 float2 (pairs k = 0..3), so float2 k of lane a sits at k L + a (L = D/16 lanes a head): the lanes of one load
// read consecutive float2, no bank conflict (at 8a + 2k, 32 bytes apart, ncu counted 76% of the shared wavefronts
// excess; 2,048 tokens, H200, same bytes: sliding 28.65 -> 26.26 us, full 38.03 -> 33.41).
__device__ __forceinline__ int qk_lane_pos(int j, int L) { return 2 * (((j & 7) >> 1) * L + (j >> 3)) + (j & 1); }

template <int ES>
__device__ __forceinline__ void qk_norm_rope_rows(QK_PARAMS) {
    __shared__ __align__(16) float cs[512];          // cos of the D/2 angles, then their sin (qk_lane_pos order)
    __shared__ __align__(16) float wqk[1024];        // q_w, then k_w (fp32; each half in qk_lane_pos order)
    const int t = blockIdx.x, half = D >> 1, L = D >> 4, nj = D >> 6, hpw = 32 / L;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, hl = lane / L, a = lane - hl * L;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {     // weights: nothing earlier kernels write
        const int at = (i >= half ? half : 0) + qk_lane_pos(i >= half ? i - half : i, L);
        wqk[at] = __bfloat162float(q_w[i]);
        wqk[D + at] = __bfloat162float(k_w[i]);
    }
    const int H = Hq + 2 * Hkv, step = QK_WARPS * gridDim.y;
    int ws = blockIdx.y * QK_WARPS + warp;           // the warp's slot: heads hpw ws .. hpw ws + hpw - 1
    pdl_entry();
    const int p = __ldcg(positions + t);             // not ld.global.nc, which ptxas hoisted above the wait (pdl.cuh)
    const size_t slot = k_pool ? qk_slot(t, p, rows_seq, block_tables, max_blocks) : 0;
    auto head = [&](int w) { return qk_head<ES>(t, hl < hpw && w * hpw + hl < H ? w * hpw + hl : 0, slot, QK_PASS); };
    auto mine = [&](int w) { return hl < hpw && w * hpw + hl < H; };
    uint4 v[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};   // the next round's pieces a, a + L
    auto load = [&](const QkHead& hd, bool on) {
        if (on) {
            v[0] = *reinterpret_cast<const uint4*>(hd.src + 8 * a);
            v[1] = *reinterpret_cast<const uint4*>(hd.src + 8 * (a + L));
        }
    };
    QkHead hd = head(ws);
    load(hd, ws * hpw < H && mine(ws));              // the first loads fly while cos / sin are computed
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float s, c;
        sincosf(__fmul_rn((float)p, inv_freq[i]), &s, &c);
        cs[qk_lane_pos(i, L)] = c;
        cs[half + qk_lane_pos(i, L)] = s;
    }
    __syncthreads();
    while (ws * hpw < H) {                           // warp-uniform: the shuffles below need every lane
        float xa[8], xb[8], sq[8];
        unpack8(v[0], xa);
        unpack8(v[1], xb);
        const QkHead cur = hd;
        const bool on = mine(ws);
        ws += step;
        if (ws * hpw < H) {                          // the next round's loads fly while this one is computed
            hd = head(ws);
            load(hd, mine(ws));
        }
#pragma unroll
        for (int e = 0; e < 8; e++) sq[e] = __fmaf_rn(xb[e], xb[e], __fmul_rn(xa[e], xa[e]));
        const float sj = group_sum32(sq, lane);      // group a / 4 = j's sum, on its 4 lanes
        float tot = 0.f;
        for (int j = 0; j < nj; j++) tot = __fadd_rn(tot, __shfl_sync(0xffffffffu, sj, hl * L + 4 * j));
        if (!on) continue;
        const float r = __frsqrt_rn(__fadd_rn(__fdiv_rn(tot, (float)D), eps));
        const float2* w = reinterpret_cast<const float2*>(wqk + (cur.w > 0 ? D : 0)) + a;   // (unread for v heads)
        const float2* c = reinterpret_cast<const float2*>(cs) + a;
        const int hp = half >> 1;                    // float2s a half
        uint32_t oa[4], ob[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {                // pairs 8a + 2k, + 1 (qk_lane_pos: float2 k L + a of a half)
            float2 wa = make_float2(0.f, 0.f), wb = wa, ck = wa, sk = wa;
            if (cur.w >= 0) {
                wa = w[k * L];
                wb = w[hp + k * L];
                ck = c[k * L];
                sk = c[hp + k * L];
            }
            __nv_bfloat16 a0, b0, a1, b1;
            qk_pair(cur.w, xa[2 * k], xb[2 * k], r, wa.x, wb.x, ck.x, sk.x, a0, b0);
            qk_pair(cur.w, xa[2 * k + 1], xb[2 * k + 1], r, wa.y, wb.y, ck.y, sk.y, a1, b1);
            oa[k] = (uint32_t)__bfloat16_as_ushort(a0) | ((uint32_t)__bfloat16_as_ushort(a1) << 16);
            ob[k] = (uint32_t)__bfloat16_as_ushort(b0) | ((uint32_t)__bfloat16_as_ushort(b1) << 16);
        }
        const uint4 A4 = make_uint4(oa[0], oa[1], oa[2], oa[3]), B4 = make_uint4(ob[0], ob[1], ob[2], ob[3]);
        if (cur.dst) {
            reinterpret_cast<uint4*>(cur.dst)[a] = A4;
            reinterpret_cast<uint4*>(cur.dst)[a + L] = B4;
        }
        if (cur.pool) {
            if constexpr (ES == 2) {
                reinterpret_cast<uint4*>(cur.pool)[a] = A4;
                reinterpret_cast<uint4*>(cur.pool)[a + L] = B4;
            } else {
                reinterpret_cast<uint2*>(cur.pool)[a] = e4m3x8(A4);
                reinterpret_cast<uint2*>(cur.pool)[a + L] = e4m3x8(B4);
            }
        }
    }
}
extern "C" __global__ void __launch_bounds__(32 * QK_WARPS, 5) qk_norm_rope_rows_bf16(QK_PARAMS) {
    qk_norm_rope_rows<2>(QK_PASS);
}
extern "C" __global__ void __launch_bounds__(32 * QK_WARPS, 5) qk_norm_rope_rows_e4m3(QK_PARAMS) {
    qk_norm_rope_rows<1>(QK_PASS);
}

// ---------------------------------------------------------------------------------------------------------
// kv_write_bf16 / kv_write_e4m3: scatter this step's K/V rows into the paged pools (bf16, or rounded to e4m3).
// k, v (T, Hkv, D) dense bf16; pools (blocks, 16, Hkv, D); row t of sequence rows_seq[t] at position
// rows_pos[t] goes to pool row block_tables[seq * max_blocks + pos / 16] * 16 + pos % 16.
// grid (T), block 128; HD = Hkv * D (a multiple of 8: moved 8 values at a time).
// ---------------------------------------------------------------------------------------------------------
#define KV_WRITE_ARGS                                                                                           \
    const __nv_bfloat16 *__restrict__ k, const __nv_bfloat16 *__restrict__ v, void *__restrict__ k_pool,       \
        void *__restrict__ v_pool, const int *__restrict__ rows_seq, const int *__restrict__ rows_pos,           \
        const int *__restrict__ block_tables, int max_blocks, int HD
template <int ES>
__device__ __forceinline__ void kv_write(KV_WRITE_ARGS) {
    pdl_entry();
    const int t = blockIdx.x;
    const int p = rows_pos[t];
    const size_t slot = (size_t)block_tables[(size_t)rows_seq[t] * max_blocks + p / KV_BLOCK] * KV_BLOCK + p % KV_BLOCK;
    const uint4* ks = reinterpret_cast<const uint4*>(k + (size_t)t * HD);
    const uint4* vs = reinterpret_cast<const uint4*>(v + (size_t)t * HD);
    uint8_t* kd = reinterpret_cast<uint8_t*>(k_pool) + slot * HD * ES;
    uint8_t* vd = reinterpret_cast<uint8_t*>(v_pool) + slot * HD * ES;
    for (int i = threadIdx.x; i < HD / 8; i += blockDim.x) {
        if constexpr (ES == 2) {
            reinterpret_cast<uint4*>(kd)[i] = ks[i];
            reinterpret_cast<uint4*>(vd)[i] = vs[i];
        } else {
            reinterpret_cast<uint2*>(kd)[i] = e4m3x8(ks[i]);
            reinterpret_cast<uint2*>(vd)[i] = e4m3x8(vs[i]);
        }
    }
}
extern "C" __global__ void kv_write_bf16(KV_WRITE_ARGS) { kv_write<2>(k, v, k_pool, v_pool, rows_seq, rows_pos,
                                                                      block_tables, max_blocks, HD); }
extern "C" __global__ void kv_write_e4m3(KV_WRITE_ARGS) { kv_write<1>(k, v, k_pool, v_pool, rows_seq, rows_pos,
                                                                      block_tables, max_blocks, HD); }

// kv_widen_e4m3: bf16 copies of blocks of e4m3 pools, for the wgmma prompt tile (attention_sm90a.cu), which reads
// bf16 pools only (layers/attention.py kv_widen_gpu): block i of k16 / v16 = block src[i] of k_pool / v_pool, each
// value widened exactly (e4m3x2_bf16x2), so the tile over the copies gives the bytes of the `_e4m3` tiles over the
// pools. grid (n, 2): y = 0 K, 1 V; block 256; bpb: bytes of an e4m3 block (16 Hkv D), a multiple of 16.
extern "C" __global__ void __launch_bounds__(256) kv_widen_e4m3(
    const uint8_t* __restrict__ k_pool, const uint8_t* __restrict__ v_pool, const int* __restrict__ src,
    __nv_bfloat16* __restrict__ k16, __nv_bfloat16* __restrict__ v16, int bpb) {
    const uint4* in = reinterpret_cast<const uint4*>((blockIdx.y ? v_pool : k_pool) + (size_t)src[blockIdx.x] * bpb);
    uint4* out = reinterpret_cast<uint4*>((blockIdx.y ? v16 : k16) + (size_t)blockIdx.x * bpb);
    for (int i = threadIdx.x; i < bpb / 16; i += blockDim.x) {
        const uint4 w = in[i];
        out[2 * i] = make_uint4(e4m3x2_bf16x2(w.x), e4m3x2_bf16x2(w.x >> 16), e4m3x2_bf16x2(w.y),
                                e4m3x2_bf16x2(w.y >> 16));
        out[2 * i + 1] = make_uint4(e4m3x2_bf16x2(w.z), e4m3x2_bf16x2(w.z >> 16), e4m3x2_bf16x2(w.w),
                                    e4m3x2_bf16x2(w.w >> 16));
    }
}

// attn_split_bf16_d{D}: grid (nrows, Hkv, Z), block D/2, dynamic smem attention_smem(D, 1); out unused.
// attn_fused_bf16_d{D}: grid (ceil(nrows / (16 FMT / G)), Hkv, 1), block FMT D / 2, dynamic smem
//                       attention_smem(D, FMT); part_ml / part_acc unused.
// attn_split_e4m3_d{D} / attn_fused_e4m3_d{D}: the same over e4m3 pools (the same launches; the split one is
//                       attention_tile.cuh attn_split8, dynamic smem attention_smem(D, 1, G=G, e4m3=True)).
#define ATTN_KERNELS(D, FMT)                                                                                  \
    extern "C" __global__ void __launch_bounds__(D / 2) attn_split_bf16_d##D(ATTN_ARGS) {                   \
        pdl_entry();                                                                                         \
        attn_tile<D, 1, true>(ATTN_PASS);                                                                    \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(FMT * D / 2) attn_fused_bf16_d##D(ATTN_ARGS) {             \
        pdl_entry();                                                                                         \
        attn_tile<D, FMT, false>(ATTN_PASS);                                                                 \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(D / 2) attn_split_e4m3_d##D(ATTN_ARGS) {                   \
        pdl_entry();                                                                                         \
        attn_split8<D, SPLIT8_STAGES>(                                                                        \
            q, reinterpret_cast<const uint8_t*>(k_pool), reinterpret_cast<const uint8_t*>(v_pool),           \
            rows_seq, rows_pos, block_tables, max_blocks, spans, n_spans, window, sliding, row0, nrows,      \
            Hq, Hkv, max_slots, part_ml, part_acc);                                                          \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(FMT * D / 2) attn_fused_e4m3_d##D(ATTN_ARGS) {             \
        pdl_entry();                                                                                         \
        attn_tile<D, FMT, false, true>(ATTN_PASS);                                                           \
    }
ATTN_KERNELS(64, 2)
ATTN_KERNELS(128, 2)
ATTN_KERNELS(256, 4)
ATTN_KERNELS(512, 2)

// attn_combine_bf16: fold the chunk partials of each (row, head) in increasing slot order (fold_weights /
// fold_acc, as the fused kernel) and normalise: out = bf16(A / L). grid (nrows, Hq), block D/4: thread t owns
// d = 4t .. 4t+3; partials are loaded 8 slots at a time (independent loads in flight), folded in order.
// out (T, Hq * D) bf16, row r = row0 + blockIdx.x. A row whose chunk count exceeds max_slots (caller's max_keys
// too small) gets NaN, loudly.
extern "C" __global__ void attn_combine_bf16(
    const float* __restrict__ part_ml, const float* __restrict__ part_acc,
    const int* __restrict__ rows_seq, const int* __restrict__ rows_pos, const int* __restrict__ spans, int n_spans,
    int window, int sliding, int row0, int Hq, int D, int max_slots, __nv_bfloat16* __restrict__ out) {
    pdl_entry();
    const int lr = blockIdx.x, h = blockIdx.y, r = row0 + lr, d = 4 * threadIdx.x;
    int lo, hi;
    key_range(r, rows_seq, rows_pos, spans, n_spans, window, sliding, lo, hi);
    const int ns = hi / CHUNK - lo / CHUNK + 1;
    const size_t base = ((size_t)lr * Hq + h) * max_slots;
    __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(out + ((size_t)r * Hq + h) * D + d);
    if (ns > max_slots) {
        const __nv_bfloat16 nan = __ushort_as_bfloat16((unsigned short)0x7fc0);
        o[0] = o[1] = __halves2bfloat162(nan, nan);
        return;
    }
    float M = -__int_as_float(0x7f800000), L = 0.f, A[4] = {0.f, 0.f, 0.f, 0.f};
    for (int z0 = 0; z0 < ns; z0 += 8) {
        float mv[8], lv[8];
        float4 av[8];
#pragma unroll
        for (int k = 0; k < 8; k++) {
            if (z0 + k < ns) {
                const size_t i = base + z0 + k;
                mv[k] = part_ml[2 * i];
                lv[k] = part_ml[2 * i + 1];
                av[k] = *reinterpret_cast<const float4*>(part_acc + i * D + d);
            }
        }
#pragma unroll
        for (int k = 0; k < 8; k++) {
            if (z0 + k < ns) {
                const FoldW w = fold_weights(M, L, mv[k], lv[k]);
                A[0] = fold_acc(A[0], av[k].x, w);
                A[1] = fold_acc(A[1], av[k].y, w);
                A[2] = fold_acc(A[2], av[k].z, w);
                A[3] = fold_acc(A[3], av[k].w, w);
            }
        }
    }
    o[0] = __floats2bfloat162_rn(__fdiv_rn(A[0], L), __fdiv_rn(A[1], L));
    o[1] = __floats2bfloat162_rn(__fdiv_rn(A[2], L), __fdiv_rn(A[3], L));
}
