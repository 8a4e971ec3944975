// The attention tile of kernels_ptx/attention.cu (its header states the arithmetic and why a query's output bytes do
// not depend on the launch) and the pieces every attention kernel shares: key range, exp, fold, ldmatrix, cp.async.
// attention.cu instantiates the mma.sync tile (split, fused); attention_sm90a.cu builds its wgmma tile from the same
// pieces.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "cp_async.cuh"     // smem_u32, the copies

#define KV_BLOCK 16      // positions per KV block
#define CHUNK 64         // keys per attention partial

// ---------------------------------------------------------------------------------------------------------
// e4m3 KV pools (layers/attention.py KV_DTYPES "fp8"): a value is the bf16 value rounded to e4m3 (nearest even,
// saturated at +-448: bf16_e4m3x2); attention widens it back to that bf16 value exactly (every e4m3 value is one) and
// runs its bf16 code, so an e4m3 pool gives the bytes a bf16 pool holding the same values gives.
// ---------------------------------------------------------------------------------------------------------

// Two bf16 (low half first) -> two e4m3 (low byte first), nearest even, saturated.
__device__ __forceinline__ uint16_t bf16x2_e4m3x2(uint32_t w) {
    uint16_t r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n"
        : "=h"(r) : "f"(__uint_as_float(w & 0xffff0000u)), "f"(__uint_as_float(w << 16)));
    return r;
}

// Two e4m3 (low byte first) -> two bf16 (low half first), exact: through f16 (cvt.rn.f16x2.e4m3x2, exact) and f32.
__device__ __forceinline__ uint32_t e4m3x2_bf16x2(uint32_t v) {
    uint32_t r;
    asm("{\n\t.reg .b32 h;\n\t.reg .f16 a, b;\n\t.reg .f32 fa, fb;\n\t"
        "cvt.rn.f16x2.e4m3x2 h, %1;\n\tmov.b32 {a, b}, h;\n\tcvt.f32.f16 fa, a;\n\tcvt.f32.f16 fb, b;\n\t"
        "cvt.rn.bf16x2.f32 %0, fb, fa;\n\t}\n"
        : "=r"(r) : "h"((uint16_t)v));
    return r;
}

// A K / V chunk of an e4m3 pool lands in the upper half of its smem rows (bytes D .. 2D - 1 of each SROW row);
// kv8_widen rewrites every row in place as bf16 (bytes 0 .. 2D - 1). Warp w of NW takes rows w, w + NW, ...; lane l
// converts the row's bytes in pieces of at most 8 (E = D / 32 bytes a lane: bytes E l .. when E < 8, else 8 l +
// 256 k),
// and reads a batch of rows whole before any lane of the warp writes one (__syncwarp), so no byte is overwritten
// before it is read. Rows of other warps are never touched.
template <int D, int NW>
__device__ __forceinline__ void kv8_widen(uint8_t* buf, int warp, int lane) {
    constexpr int E = D / 32, SROW = 2 * D + 16, RPW = CHUNK / NW, BATCH = RPW < 8 ? RPW : 8;
    constexpr int PB = E < 8 ? E : 8, NP = E / PB;          // bytes a piece, pieces a lane a row
    static_assert(CHUNK % NW == 0 && RPW % BATCH == 0, "kv8_widen rows");
#pragma unroll
    for (int r0 = 0; r0 < RPW; r0 += BATCH) {
        uint32_t in[BATCH][NP][2];
#pragma unroll
        for (int b = 0; b < BATCH; b++) {
            const uint8_t* row = buf + (warp + NW * (r0 + b)) * SROW + D;
#pragma unroll
            for (int k = 0; k < NP; k++) {
                const uint8_t* p = row + PB * lane + 32 * PB * k;
                if constexpr (PB == 8) {
                    const uint2 u = *reinterpret_cast<const uint2*>(p);
                    in[b][k][0] = u.x;
                    in[b][k][1] = u.y;
                } else if constexpr (PB == 4) {
                    in[b][k][0] = *reinterpret_cast<const uint32_t*>(p);
                } else {
                    in[b][k][0] = *reinterpret_cast<const uint16_t*>(p);
                }
            }
        }
        __syncwarp();
#pragma unroll
        for (int b = 0; b < BATCH; b++) {
            uint8_t* row = buf + (warp + NW * (r0 + b)) * SROW;
#pragma unroll
            for (int k = 0; k < NP; k++) {
                uint8_t* q = row + 2 * (PB * lane + 32 * PB * k);
                const uint32_t* w = in[b][k];
                if constexpr (PB == 8) {
                    *reinterpret_cast<uint4*>(q) = make_uint4(e4m3x2_bf16x2(w[0]), e4m3x2_bf16x2(w[0] >> 16),
                                                              e4m3x2_bf16x2(w[1]), e4m3x2_bf16x2(w[1] >> 16));
                } else if constexpr (PB == 4) {
                    *reinterpret_cast<uint2*>(q) = make_uint2(e4m3x2_bf16x2(w[0]), e4m3x2_bf16x2(w[0] >> 16));
                } else {
                    *reinterpret_cast<uint32_t*>(q) = e4m3x2_bf16x2(in[b][k][0]);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// Attention.
// ---------------------------------------------------------------------------------------------------------

// Key range [lo, hi] of row r (see the header). spans: int32 (S, n_spans, 2) (start, n), n = 0 unused; or null.
__device__ __forceinline__ void key_range(int r, const int* __restrict__ rows_seq, const int* __restrict__ rows_pos,
                                          const int* __restrict__ spans, int n_spans, int window, int sliding,
                                          int& lo, int& hi) {
    const int p = rows_pos[r];
    lo = sliding ? max(0, p - window + 1) : 0;
    hi = p;
    if (sliding && spans) {
        const int* sp = spans + (size_t)rows_seq[r] * n_spans * 2;
        for (int i = 0; i < n_spans; i++) {
            const int st = sp[2 * i], n = sp[2 * i + 1];
            if (n > 0 && p >= st && p < st + n) hi = max(hi, st + n - 1);
        }
    }
}


// The per-position state of a tile (positions i < RP: launch rows row0 + lr0 + i), written by threads tid < RP: the
// key range [lo, hi] and the sequence (-1: past the launch's rows, lo 0, hi -1).
__device__ __forceinline__ void tile_position(int tid, int lr0, int row0, int nrows, const int* __restrict__ rows_seq,
                                              const int* __restrict__ rows_pos, const int* __restrict__ spans,
                                              int n_spans, int window, int sliding, int* p_lo, int* p_hi, int* p_seq) {
    const int lr = lr0 + tid;
    int lo = 0, hi = -1, s = -1;
    if (lr < nrows) {
        key_range(row0 + lr, rows_seq, rows_pos, spans, n_spans, window, sliding, lo, hi);
        s = rows_seq[row0 + lr];
    }
    p_lo[tid] = lo;
    p_hi[tid] = hi;
    p_seq[tid] = s;
}

// Tile row m = position index pi * G + head-in-group: usable (a position of the launch), position index, head.
__device__ __forceinline__ void tile_row(int m, int RP, int G, int kvh, const int* p_seq, bool& ok, int& pi, int& h) {
    ok = m < RP * G && p_seq[m / G] >= 0;
    pi = ok ? m / G : 0;
    h = kvh * G + m % G;
}

// A lane's rows (ok, position index) in the pass of sequence seq: active (usable and of seq), key range [lo, hi].
__device__ __forceinline__ void pass_rows(const bool (&ok)[2], const int (&pi)[2], int seq, const int* p_seq,
                                          const int* p_lo, const int* p_hi, bool (&act)[2], int (&lo)[2],
                                          int (&hi)[2]) {
#pragma unroll
    for (int rr = 0; rr < 2; rr++) {
        act[rr] = ok[rr] && p_seq[pi[rr]] == seq;
        lo[rr] = p_lo[pi[rr]];
        hi[rr] = p_hi[pi[rr]];
    }
}

// Two output values of a row: bf16(a0 / l), bf16(a1 / l), or bf16 NaN when the row had more chunks than the scratch
// (max_slots) allows.
__device__ __forceinline__ __nv_bfloat162 out_pair(float a0, float a1, float l, bool bad) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(__fdiv_rn(a0, l), __fdiv_rn(a1, l));
    const __nv_bfloat16 nan = __ushort_as_bfloat16((unsigned short)0x7fc0);
    return bad ? __halves2bfloat162(nan, nan) : v;
}

// The next pass of a tile: the sequence of the first position not done, every position of it marked done, and the
// keys some row of the pass may see, [kmin, kmax]; false once every position is done (CTA-uniform). Every lane of a
// warp calls it (RP <= 64): lane l looks at positions l and l + 32, and ballots and two reductions stand for the two
// scans over the positions, ~10 instructions a position, that each thread ran before (in the wgmma prompt tile all 12
// warps ran them; with desc_step its 2,048-token sliding launch went 148.1 -> 131.9 us, twenty-seventh session).
__device__ __forceinline__ bool next_pass(unsigned long long& done, const int* p_seq, const int* p_lo, const int* p_hi,
                                          int RP, int& seq, int& kmin, int& kmax) {
    const int l = threadIdx.x & 31;
    const int s0 = l < RP ? p_seq[l] : -1, s1 = l + 32 < RP ? p_seq[l + 32] : -1;
    const unsigned f0 = __ballot_sync(0xffffffffu, s0 >= 0 && !((done >> l) & 1));
    const unsigned f1 = __ballot_sync(0xffffffffu, s1 >= 0 && !((done >> (l + 32)) & 1));
    if (!(f0 | f1)) return false;
    seq = f0 ? __shfl_sync(0xffffffffu, s0, __ffs(f0) - 1) : __shfl_sync(0xffffffffu, s1, __ffs(f1) - 1);
    const bool m0 = s0 == seq, m1 = s1 == seq;           // (no position of seq is done yet: a pass marks them all)
    done |= (unsigned long long)__ballot_sync(0xffffffffu, m0) |
            (unsigned long long)__ballot_sync(0xffffffffu, m1) << 32;
    int lo = 0x7fffffff, hi = -1;
    if (m0) lo = p_lo[l], hi = p_hi[l];
    if (m1) lo = min(lo, p_lo[l + 32]), hi = max(hi, p_hi[l + 32]);
    kmin = __reduce_min_sync(0xffffffffu, lo);
    kmax = __reduce_max_sync(0xffffffffu, hi);
    return true;
}

// ---------------------------------------------------------------------------------------------------------
// Attention on the tensor cores.
//
// Work split. A CTA computes, for one kv head and one chunk at a time, a tile of MT m16 row blocks
// ("m-tiles") of (position, head) query rows: tile row m = position index pi * G + head-in-group hl, so the
// G heads of a kv head share every K/V byte. NWG = D / 64 warps per m-tile: warp wg computes the scores
// S = Q K^T of the chunk's keys [KW wg, KW wg + KW) (KW = 64 / NWG; all 64 keys when D = 64) over the full D,
// and P.V for output columns [64 wg, 64 wg + 64). Row max and row sum of p cross the NWG warps through smem,
// joined in warp order 0..NWG-1. K and V chunks, the Q tile and P (bf16) live in smem (ldmatrix fragments;
// rows padded by 16 bytes: conflict-free). Loads are cp.async with zero-fill: K(c+1) streams in during the
// softmax and P.V of c, V(c+1) during the scores of c+1.
//   split: MT = 1, one position (its G heads, padded to 16 rows); grid (rows, Hkv, Z): CTA z handles the chunk
//          slots z, z + Z, ... of its row (Z <= slots, from the launch shape only) and stores each partial.
//   fused: MT = FMT(D) (4 for D = 256, else 2), RP = 16 MT / G positions (consecutive launch rows) per tile;
//          grid (ceil(rows / RP), Hkv). (MT = 4 shares each K / V chunk among twice the rows: the sliding layers'
//          2,048-token prefill 284.9 -> 254.8 us on the H200, BENCHMARKS.md 7th session; D = 512 cannot: its
//          1,024 threads would need <= 64 registers; D <= 128 was not measured.) The
//          tile's rows may belong to several sequences: one pass per distinct sequence (rows of other
//          sequences are masked in that pass), chunks in increasing order inside a pass; each row is folded
//          only in its own pass, only for chunks that hold one of its keys.
// Per (row, chunk) the instruction sequence is the same in both kernels (attn_tile's body), hence the bits.
// ---------------------------------------------------------------------------------------------------------

// Rows g and g + 8 (out[0], out[1]) of the NWG warps' per-row partials red[w * 16 + row], joined in warp order
// 0 .. NWG-1 by op (the row max and the row sum of the mma.sync tile).
template <int NWG, class Op>
__device__ __forceinline__ void over_warps(const float* red, int g, float (&out)[2], Op op) {
#pragma unroll
    for (int rr = 0; rr < 2; rr++) {
        float v = red[g + 8 * rr];
#pragma unroll
        for (int w = 1; w < NWG; w++) v = op(v, red[w * 16 + g + 8 * rr]);
        out[rr] = v;
    }
}

// e^x = 2^(x * log2 e): one rounded multiply, then ex2.approx.ftz (rel. error ~2^-22). Inline PTX, so every
// kernel (split, fused, combine) runs the same two instructions. exp(-inf) = +0, exp(0) = 1.
__device__ __forceinline__ float exp_fixed(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(__fmul_rn(x, 1.4426950408889634f)));
    return r;
}

// The fold of one chunk partial (m, l, acc[]) into a row's running (M, L, A[]), in attn_combine_bf16 and in the
// fused kernel: M' = max(M, m); a = exp(M - M'); b = exp(m - M'); L = fma(L, a, l b); A = fma(A, a, acc b).
// Starts from M = -inf, L = 0, A = 0 (the first fold has a = 0, b = 1).
struct FoldW {
    float a, b;
};
__device__ __forceinline__ FoldW fold_weights(float& M, float& L, float m, float l) {
    const float Mn = fmaxf(M, m);
    FoldW w;
    w.a = exp_fixed(__fsub_rn(M, Mn));
    w.b = exp_fixed(__fsub_rn(m, Mn));
    L = __fmaf_rn(L, w.a, __fmul_rn(l, w.b));
    M = Mn;
    return w;
}
__device__ __forceinline__ float fold_acc(float A, float acc, FoldW w) {
    return __fmaf_rn(A, w.a, __fmul_rn(acc, w.b));
}

// D (16x8 f32) += A (16x16 bf16, row) * B (16x8 bf16, col). Fragments (g = lane / 4, t = lane % 4):
//   a0 = A[g][2t, 2t+1]  a1 = A[g+8][2t, 2t+1]  a2 = A[g][2t+8, 2t+9]  a3 = A[g+8][2t+8, 2t+9]
//   b0 = B[2t, 2t+1][g]  b1 = B[2t+8, 2t+9][g];  d0, d1 = D[g][2t, 2t+1]  d2, d3 = D[g+8][2t, 2t+1]
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Zero a lane's N mma D fragments (accumulators before a chain of mma16816).
template <int N> __device__ __forceinline__ void zero_frags(float (&d)[N][4]) {
#pragma unroll
    for (int n = 0; n < N; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) d[n][i] = 0.f;
}

// ldmatrix: lanes 8i .. 8i+7 give the row addresses of 8x8 bf16 matrix i; register i of lane (g, t) gets
// row g, columns 2t, 2t+1 of matrix i (.trans: rows 2t, 2t+1 of column g).
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)) : "memory");
}
__device__ __forceinline__ void ldsm_x2(uint32_t (&r)[2], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(smem_u32(p)) : "memory");
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)) : "memory");
}

// The chunk's scores s of a lane's two tile rows (rr = 0, 1: rows g, g + 8; s[n][2 rr + e] is key j0 + 8 n + 2 qd + e)
// masked by select (key j visible iff act[rr] and lo[rr] <= j <= hi[rr]), then each row's maximum over the lane's
// quad, which lane qd == 0 stores at red[16 wg + row] for over_warps. Every tile's one form, hence one instruction
// sequence.
template <int NTS>
__device__ __forceinline__ void mask_rowmax(float (&s)[NTS][4], int j0, const bool (&act)[2], const int (&lo)[2],
                                            const int (&hi)[2], int g, int qd, int wg, float* red) {
    const float NEG = -__int_as_float(0x7f800000);
    float mx[2] = {NEG, NEG};
#pragma unroll
    for (int n = 0; n < NTS; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int rr = i >> 1, j = j0 + 8 * n + 2 * qd + (i & 1);
            const bool v = act[rr] && j >= lo[rr] && j <= hi[rr];
            s[n][i] = v ? s[n][i] : NEG;
            mx[rr] = fmaxf(mx[rr], s[n][i]);
        }
#pragma unroll
    for (int rr = 0; rr < 2; rr++) {
        mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(0xffffffffu, mx[rr], 1));
        mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(0xffffffffu, mx[rr], 2));
    }
    if (qd == 0) {
        red[wg * 16 + g] = mx[0];
        red[wg * 16 + g + 8] = mx[1];
    }
}

// p = bf16(exp(s - m)) of the lane's scores into P (pw: the lane's first element of row g; row g + 8 lies 8 PROW
// further) and each row's l: the lane's sum (n ascending), then the quad butterfly; lane qd == 0 stores it at
// red[16 wg + row]. m = mrow (the row max over the warps); a row without keys in the chunk (m = -inf) gets p = 0.
template <int NTS, int PROW>
__device__ __forceinline__ void softmax_p(const float (&s)[NTS][4], const float (&mrow)[2], uint8_t* pw, int g, int qd,
                                          int wg, float* red) {
    const float NEG = -__int_as_float(0x7f800000);
    float lsum[2] = {0.f, 0.f};
#pragma unroll
    for (int rr = 0; rr < 2; rr++) {
        const float ms = mrow[rr] == NEG ? 0.f : mrow[rr];
#pragma unroll
        for (int n = 0; n < NTS; n++) {
            const float p0 = exp_fixed(__fsub_rn(s[n][2 * rr], ms));
            const float p1 = exp_fixed(__fsub_rn(s[n][2 * rr + 1], ms));
            const __nv_bfloat162 pb = __floats2bfloat162_rn(p0, p1);
            *reinterpret_cast<__nv_bfloat162*>(pw + rr * 8 * PROW + 16 * n) = pb;
            const float2 pf = __bfloat1622float2(pb);
            lsum[rr] = __fadd_rn(lsum[rr], __fadd_rn(pf.x, pf.y));
        }
        lsum[rr] = __fadd_rn(lsum[rr], __shfl_xor_sync(0xffffffffu, lsum[rr], 1));
        lsum[rr] = __fadd_rn(lsum[rr], __shfl_xor_sync(0xffffffffu, lsum[rr], 2));
    }
    if (qd == 0) {
        red[wg * 16 + g] = lsum[0];
        red[wg * 16 + g + 8] = lsum[1];
    }
}

template <int D> struct AttnCfg {
    static_assert(D == 64 || D == 128 || D == 256 || D == 512, "D: 64, 128, 256 or 512");
    static constexpr int NWG = D / 64;          // warps per m-tile; warp wg: output columns [64 wg, 64 wg + 64)
    static constexpr int KW = CHUNK / NWG;      // keys per warp for S (keys [KW wg, KW wg + KW) of the chunk)
    static constexpr int NTS = KW / 8;          // S n-tiles (8 keys) per warp
    static constexpr int SROW = 2 * D + 16;     // smem bytes per Q / K / V row
    static constexpr int PROW = 2 * CHUNK + 16; // smem bytes per P row
};
// Dynamic smem of attn_tile<D, MT>: K, V chunks; Q tile; P tile; row max / sum per (m-tile, warp, row);
// per-position lo, hi, seq. layers/attention.py: attention_smem() computes the same. The split tile keeps QR = G + 1
// Q rows (at most 16), the fused one 16 MT:
//   D=64: 23,360 / 28,288 B; D=128: 41,920 / 49,024 B; D=256: 79,040 / 90,496 / 113,408 B; D=512: 153,280 /
//   173,440 B (split with 16 Q rows / fused MT = 2 / fused MT = 4); split D = 256, G = 2: 72,176 B (3 CTAs an SM).

// attn_tile<D, MT, SPLIT>: see the block comment above. Arguments:
// q (T, Hq, D) bf16 (roped); pools (blocks, 16, Hkv, D) bf16; block_tables int32 (S, max_blocks); spans see
// key_range; rows row0 .. row0 + nrows - 1 of the launch (split: a group of the scratch); max_slots = chunk
// slots per (row, head) in the scratch (a row needing more gets NaN, also in the fused kernel).
// split writes, at i = ((r - row0) * Hq + h) * max_slots + z (z = c - lo / 64):
//   part_ml[2i] = m, part_ml[2i+1] = l, part_acc[i * D + d] = acc[d];
// fused writes out (T, Hq * D) bf16 = A / L of every row.
template <int D, int MT, bool SPLIT, bool F8 = false>
__device__ __forceinline__ void attn_tile(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_pool,
    const __nv_bfloat16* __restrict__ v_pool, const int* __restrict__ rows_seq, const int* __restrict__ rows_pos,
    const int* __restrict__ block_tables, int max_blocks, const int* __restrict__ spans, int n_spans,
    int window, int sliding, int row0, int nrows, int Hq, int Hkv, int max_slots,
    float* __restrict__ part_ml, float* __restrict__ part_acc, __nv_bfloat16* __restrict__ out) {
    using C = AttnCfg<D>;
    constexpr int NWG = C::NWG, KW = C::KW, NTS = C::NTS, SROW = C::SROW, PROW = C::PROW;
    constexpr int NT = MT * NWG * 32;           // threads
    constexpr int PPR = D / 8;                  // 16-byte pieces per Q row (and bf16 K / V row)
    // K / V pool rows: ES bytes a value, KPR 16-byte pieces a row, landing at byte KOFF of their smem row (e4m3: the
    // upper half, widened in place by kv8_widen)
    constexpr int ES = F8 ? 1 : 2, KPR = D * ES / 16, KOFF = F8 ? D : 0;
    static_assert(!(SPLIT && F8), "the split tile over e4m3 pools is attn_split8");
    static_assert((CHUNK * PPR) % NT == 0 && (16 * MT * PPR) % NT == 0 && (CHUNK * KPR) % NT == 0, "load loops");
    extern __shared__ __align__(16) uint8_t smem[];
    uint8_t* Ks = smem;                                        // [64 keys][SROW]
    uint8_t* Vs = Ks + CHUNK * SROW;                           // [64 keys][SROW]
    uint8_t* Qs = Vs + CHUNK * SROW;                           // [QR rows][SROW]
    // split: the one position's G rows, then a zero row that A rows G .. 15 read (QR = G + 1 <= 16: a CTA of
    // smaller G takes less shared memory, so 3 share an SM at D = 256); fused: the 16 MT rows
    const int QR = SPLIT ? min(Hq / Hkv + 1, 16) : 16 * MT;
    uint8_t* Ps = Qs + QR * SROW;                              // [16 MT rows][PROW]
    float* red_max = reinterpret_cast<float*>(Ps + 16 * MT * PROW);   // [MT][NWG][16]
    float* red_sum = red_max + MT * NWG * 16;                  // [MT][NWG][16]
    int* p_lo = reinterpret_cast<int*>(red_sum + MT * NWG * 16);       // [16 MT] per position of the tile
    int* p_hi = p_lo + 16 * MT;
    int* p_seq = p_hi + 16 * MT;                               // -1: past the launch's rows

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int mt = warp / NWG, wg = warp % NWG, g = lane >> 2, qd = lane & 3;
    const int G = Hq / Hkv, kvh = blockIdx.y;
    const int RP = SPLIT ? 1 : (16 * MT) / G;                  // positions per tile (rows RP * G used)
    // fused: the last tiles (usually the latest positions, the most chunks) are launched first
    const int lr0 = SPLIT ? (int)blockIdx.x : (int)(gridDim.x - 1 - blockIdx.x) * RP;
    const size_t HD = (size_t)Hkv * D;
    const float NEG = -__int_as_float(0x7f800000);

    if (tid < RP) tile_position(tid, lr0, row0, nrows, rows_seq, rows_pos, spans, n_spans, window, sliding, p_lo, p_hi,
                                p_seq);
    __syncthreads();

    // split: slots z0, z0 + zstep, ... of the one position (CTA-uniform exit when it has fewer chunks)
    const int z0 = SPLIT ? (int)blockIdx.z : 0, zstep = SPLIT ? (int)gridDim.z : 1;
    if (SPLIT && (p_seq[0] < 0 || z0 >= max_slots || p_lo[0] / CHUNK + z0 > p_hi[0] / CHUNK)) return;

    // this lane's two tile rows m = 16 mt + g (+8): position index, head, usable
    int rpi[2], rh[2];
    bool rok[2];
#pragma unroll
    for (int rr = 0; rr < 2; rr++) tile_row(16 * mt + g + 8 * rr, RP, G, kvh, p_seq, rok[rr], rpi[rr], rh[rr]);

    float M[2] = {NEG, NEG}, L[2] = {0.f, 0.f};                 // fused: running fold per row
    float A[8][4];
    zero_frags(A);

    // Q tile (once): row m = position pi * G + hl -> q[(row0 + lr0 + pi) * Hq + kvh * G + hl]; unused rows 0
#pragma unroll
    for (int it = 0; it < 16 * MT * PPR / NT; it++) {
        const int idx = tid + it * NT, m = idx / PPR, pc = idx % PPR, pi = m / G;
        const bool ok = m < RP * G && p_seq[pi] >= 0;
        const __nv_bfloat16* src = ok ? q + ((size_t)(row0 + lr0 + pi) * Hq + kvh * G + m % G) * D + 8 * pc : q;
        if (!SPLIT || m < QR) cp_async16(Qs + m * SROW + 16 * pc, src, ok);
    }
    // one chunk of K or V rows (keys 64c .. 64c+63) into dst; keys outside [kmin, kmax] are zeros, not read. Thread
    // tid copies piece tid % PPR of rows tid / PPR + RS i (RS = NT / PPR rows a step): when RS divides KV_BLOCK, row
    // w + RS r of each of the chunk's 4 blocks, so the chunk needs 4 block-table reads, not one a piece, and a piece
    // is a pointer step; a chunk whole in range copies without a predicate (attention_sm90a.cu's loader does the same;
    // there it took the 2,048-token sliding prefill from 193.7 to 148.6 us).
    auto load_kv = [&](uint8_t* dst, const __nv_bfloat16* __restrict__ pool, const int* __restrict__ bt, int c,
                       int kmin, int kmax) {
        constexpr int RS = NT / KPR;
        if constexpr (NT % KPR == 0 && KV_BLOCK % RS == 0) {
            const int w = tid / KPR, pc = tid % KPR;
            const uint8_t* src = reinterpret_cast<const uint8_t*>(pool);
            const uint32_t sd = smem_u32(dst) + KOFF + w * SROW + 16 * pc;
            const size_t step = (size_t)ES * RS * HD, piece = (size_t)ES * kvh * D + 16 * pc;
            const uint8_t* bp[CHUNK / KV_BLOCK];                // the thread's row w of each block
#pragma unroll
            for (int b = 0; b < CHUNK / KV_BLOCK; b++) {       // blocks with no key in range: not read
                const int k0 = c * CHUNK + b * KV_BLOCK;
                const bool any = k0 + KV_BLOCK - 1 >= kmin && k0 <= kmax;
                bp[b] = src + (any ? ((size_t)bt[k0 / KV_BLOCK] * KV_BLOCK + w) * ES * HD + piece : 0);
            }
            if (c * CHUNK >= kmin && c * CHUNK + CHUNK - 1 <= kmax) {   // (outside the loops: ptxas predicates both
#pragma unroll                                                         //  forms of every piece otherwise)
                for (int b = 0; b < CHUNK / KV_BLOCK; b++) {
                    const uint8_t* p = bp[b];
#pragma unroll
                    for (int r = 0; r < KV_BLOCK / RS; r++, p += step)
                        cp_async16(sd + (b * KV_BLOCK + RS * r) * SROW, p, true);
                }
            } else {
#pragma unroll
                for (int b = 0; b < CHUNK / KV_BLOCK; b++) {
                    const uint8_t* p = bp[b];
#pragma unroll
                    for (int r = 0; r < KV_BLOCK / RS; r++, p += step) {
                        const int j = c * CHUNK + b * KV_BLOCK + w + RS * r;
                        const bool ok = j >= kmin && j <= kmax;
                        cp_async16(sd + (b * KV_BLOCK + RS * r) * SROW, ok ? p : src, ok);
                    }
                }
            }
        } else {
#pragma unroll 4
            for (int it = 0; it < CHUNK * KPR / NT; it++) {
                const int idx = tid + it * NT, kk = idx / KPR, pc = idx % KPR, j = c * CHUNK + kk;
                const bool ok = j >= kmin && j <= kmax;
                const uint8_t* src = reinterpret_cast<const uint8_t*>(pool);
                if (ok)
                    src += (((size_t)bt[j / KV_BLOCK] * KV_BLOCK + j % KV_BLOCK) * HD + (size_t)kvh * D) * ES + 16 * pc;
                cp_async16(dst + KOFF + kk * SROW + 16 * pc, src, ok);
            }
        }
    };

    unsigned long long done = 0;                                // positions whose pass has run
    int seq, kmin, kmax;
    while (next_pass(done, p_seq, p_lo, p_hi, RP, seq, kmin, kmax)) {
        const int* bt = block_tables + (size_t)seq * max_blocks;
        bool ract[2];
        int rlo[2], rhi[2];
        pass_rows(rok, rpi, seq, p_seq, p_lo, p_hi, ract, rlo, rhi);
        const int cb = kmin / CHUNK + z0, cs = zstep;
        int ce = kmax / CHUNK;
        if (SPLIT) ce = min(ce, kmin / CHUNK + max_slots - 1);  // slots past the scratch: the combine NaNs the row

        load_kv(Ks, k_pool, bt, cb, kmin, kmax);
        cp_async_commit();                                      // group: (Q,) K(cb)
        load_kv(Vs, v_pool, bt, cb, kmin, kmax);
        cp_async_commit();                                      // group: V(cb)
        for (int c = cb; c <= ce; c += cs) {
            const int cn = c + cs;                              // next chunk of the pass, if <= ce
            cp_async_wait<1>();                                 // K(c) landed (V(c) may be in flight)
            __syncthreads();
            if constexpr (F8) {
                kv8_widen<D, NT / 32>(Ks, warp, lane);
                __syncthreads();
            }

            // --- S = Q K^T for rows of m-tile mt, keys KW wg + 8n + (0..7): d ascending, 16 per mma ---
            float s[NTS][4];
            zero_frags(s);
            {
                const int qr = 16 * mt + (lane & 15);
                const uint8_t* qa = Qs + (SPLIT ? min(qr, QR - 1) : qr) * SROW + 16 * (lane >> 4);
                const uint8_t* kb = Ks + (KW * wg + (lane & 7)) * SROW + 16 * ((lane >> 3) & 1);
#pragma unroll 4
                for (int ks = 0; ks < D / 16; ks++) {
                    uint32_t a[4];
                    ldsm_x4(a, qa + 32 * ks);
#pragma unroll
                    for (int n = 0; n < NTS; n++) {
                        uint32_t b[2];
                        ldsm_x2(b, kb + n * 8 * SROW + 32 * ks);
                        mma16816(s[n], a, b[0], b[1]);
                    }
                }
            }
            // mask (select): key j visible to the row iff it is in this pass and lo <= j <= hi; row max
            float* rmax = red_max + mt * NWG * 16;
            float* rsum = red_sum + mt * NWG * 16;
            mask_rowmax<NTS>(s, c * CHUNK + KW * wg, ract, rlo, rhi, g, qd, wg, rmax);
            __syncthreads();                                    // maxima visible; every warp is done with Ks
            if (cn <= ce) load_kv(Ks, k_pool, bt, cn, kmin, kmax);
            cp_async_commit();                                  // group: K(cn) (maybe empty)

            // --- m = max over the NWG warps; p = bf16(exp(s - m)) -> Ps; l: lane sum (n ascending), quad
            //     butterfly, then the warps in order 0..NWG-1 ---
            float mrow[2];
            over_warps<NWG>(rmax, g, mrow, [](float x, float y) { return fmaxf(x, y); });
            softmax_p<NTS, PROW>(s, mrow, Ps + (16 * mt + g) * PROW + 2 * (KW * wg + 2 * qd), g, qd, wg, rsum);
            cp_async_wait<1>();                                 // V(c) landed (K(cn) may be in flight)
            __syncthreads();                                    // ... for everyone; P and the sums visible
            if constexpr (F8) {
                kv8_widen<D, NT / 32>(Vs, warp, lane);
                __syncthreads();
            }
            float lrow[2];
            over_warps<NWG>(rsum, g, lrow, [](float x, float y) { return __fadd_rn(x, y); });

            // --- acc = P V for rows of m-tile mt, columns 64 wg + 8n + (0..7): keys ascending, 16 per mma ---
            float o[8][4];
            zero_frags(o);
            {
                const uint8_t* pa = Ps + (16 * mt + (lane & 15)) * PROW + 16 * (lane >> 4);
                // x4.trans matrices: (keys 0-7, cols +0-7), (keys 8-15, +0-7), (keys 0-7, +8-15), (keys 8-15, +8-15)
                const uint8_t* vb = Vs + ((lane & 7) + 8 * ((lane >> 3) & 1)) * SROW + 128 * wg + 16 * (lane >> 4);
#pragma unroll
                for (int ks = 0; ks < CHUNK / 16; ks++) {
                    uint32_t a[4];
                    ldsm_x4(a, pa + 32 * ks);
#pragma unroll
                    for (int np = 0; np < 4; np++) {
                        uint32_t b[4];
                        ldsm_x4_t(b, vb + 16 * ks * SROW + 32 * np);
                        mma16816(o[2 * np], a, b[0], b[1]);
                        mma16816(o[2 * np + 1], a, b[2], b[3]);
                    }
                }
            }

            if (SPLIT) {                                        // store the partial of slot z
                const int z = c - kmin / CHUNK;
#pragma unroll
                for (int rr = 0; rr < 2; rr++) {
                    if (!ract[rr]) continue;                    // rows m < G of the one position
                    const size_t i = ((size_t)lr0 * Hq + rh[rr]) * max_slots + z;
                    float* pa = part_acc + i * D + 64 * wg + 2 * qd;
#pragma unroll
                    for (int n = 0; n < 8; n++)
                        *reinterpret_cast<float2*>(pa + 8 * n) = make_float2(o[n][2 * rr], o[n][2 * rr + 1]);
                    if (wg == 0 && qd == 0) {
                        part_ml[2 * i] = mrow[rr];
                        part_ml[2 * i + 1] = lrow[rr];
                    }
                }
            } else {                                            // fold into the running state
#pragma unroll
                for (int rr = 0; rr < 2; rr++) {
                    if (!(ract[rr] && c >= rlo[rr] / CHUNK && c <= rhi[rr] / CHUNK)) continue;
                    const FoldW w = fold_weights(M[rr], L[rr], mrow[rr], lrow[rr]);
#pragma unroll
                    for (int n = 0; n < 8; n++) {
                        A[n][2 * rr] = fold_acc(A[n][2 * rr], o[n][2 * rr], w);
                        A[n][2 * rr + 1] = fold_acc(A[n][2 * rr + 1], o[n][2 * rr + 1], w);
                    }
                }
            }
            __syncthreads();                                    // every warp is done with Vs and Ps
            if (cn <= ce) load_kv(Vs, v_pool, bt, cn, kmin, kmax);
            cp_async_commit();                                  // group: V(cn) (maybe empty)
        }
    }
    cp_async_wait<0>();

    if (!SPLIT) {                                               // out = A / L (NaN: more chunks than max_slots)
#pragma unroll
        for (int rr = 0; rr < 2; rr++) {
            if (!rok[rr]) continue;
            const int pi = rpi[rr];
            const bool bad = p_hi[pi] / CHUNK - p_lo[pi] / CHUNK + 1 > max_slots;
            __nv_bfloat16* op = out + ((size_t)(row0 + lr0 + pi) * Hq + rh[rr]) * D + 64 * wg + 2 * qd;
#pragma unroll
            for (int n = 0; n < 8; n++) {
                *reinterpret_cast<__nv_bfloat162*>(op + 8 * n) = out_pair(A[n][2 * rr], A[n][2 * rr + 1], L[rr], bad);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// The split tile over e4m3 pools (attn_split_e4m3_d{D}): attn_tile<D, 1, true>'s work and bytes, with the e4m3 chunks
// kept as they are in shared memory (rows of D + 16 bytes, half a bf16 row) and each fragment widened in registers
// as it is loaded (e4m3x2_bf16x2, exact), in place of kv8_widen's pass over the chunk and its two CTA barriers. The
// room this saves holds more stages: NS of them, so that chunks c + zstep .. c + (NS - 1) zstep stream in while c
// is computed (one chunk in flight before: over e4m3 pools the split launches took as long as over bf16 ones, at
// half the bytes; D = 512, batch 64 and 256 at ~1k context, fifty-seventh session). One commit group a chunk holds
// its K and V.
// The fragments hold the bf16 tile's values in the bf16 tile's k slots, so every mma adds what it adds there:
//   S:   b0 = K[key g][16 ks + 2 qd, +1], b1 = K[key g][16 ks + 2 qd + 8, +9] (two 2-byte loads), as ldsm_x2 gives.
//   P.V: the n columns of a pair of mmas are permuted (a D element is the dot product of its own A row and B column,
//        whatever the column's place): o[2 np] takes columns d = 64 wg + 16 np + 2 g, o[2 np + 1] d + 1, so that one
//        2-byte load of a key's row gives a lane both columns; the keys (k slots) are the bf16 tile's, 2 qd, 2 qd + 1,
//        2 qd + 8, 2 qd + 9 of step ks. A lane then holds columns 64 wg + 16 np + 4 qd .. + 3 of its rows, stored
//        as one 16-byte partial piece.
// Shared memory (attention_smem(D, 1, G=G, e4m3=True)): K stages [NS][64][D + 16], V stages [NS][64][D + 16], then
// attn_tile's Q rows, P, row max / sum and per-position words.
// NS = SPLIT8_STAGES (layers/attention.py ATTN_SPLIT8_STAGES): 2. Measured (fifty-seventh session, ~1k context, batch
// 64 / 256): 3 stages at D = 256 (2 CTAs an SM in place of 3) 127.7 / 408.3 us against 112.5 / 368.0; at D = 512 (1
// CTA an SM either way) no difference beyond the runs' spread (99.8-114.5 / 306.8-333.8 against 110.2 / 317.8).
// ---------------------------------------------------------------------------------------------------------
#define SPLIT8_STAGES 2
template <int D, int NS>
__device__ __forceinline__ void attn_split8(
    const __nv_bfloat16* __restrict__ q, const uint8_t* __restrict__ k_pool, const uint8_t* __restrict__ v_pool,
    const int* __restrict__ rows_seq, const int* __restrict__ rows_pos, const int* __restrict__ block_tables,
    int max_blocks, const int* __restrict__ spans, int n_spans, int window, int sliding, int row0, int nrows, int Hq,
    int Hkv, int max_slots, float* __restrict__ part_ml, float* __restrict__ part_acc) {
    using C = AttnCfg<D>;
    constexpr int NWG = C::NWG, KW = C::KW, NTS = C::NTS, SROW = C::SROW, PROW = C::PROW;
    constexpr int NT = NWG * 32;                // threads
    constexpr int PPR = D / 8;                  // 16-byte pieces per Q row
    constexpr int R8 = D + 16, KPR = D / 16;    // e4m3 row: smem bytes, 16-byte pieces
    constexpr int RS = NT / KPR;                // rows a loader step (8 for every D)
    static_assert(RS * KPR == NT && KV_BLOCK % RS == 0, "attn_split8 loader");
    static_assert(NS >= 2 && NS <= 4, "attn_split8 stages");
    extern __shared__ __align__(16) uint8_t smem[];
    uint8_t* K8 = smem;                                        // [NS][64 keys][R8]
    uint8_t* V8 = K8 + NS * CHUNK * R8;                        // [NS][64 keys][R8]
    uint8_t* Qs = V8 + NS * CHUNK * R8;                        // [QR rows][SROW]
    const int G = Hq / Hkv, kvh = blockIdx.y, QR = min(G + 1, 16);
    uint8_t* Ps = Qs + QR * SROW;                              // [16 rows][PROW]
    float* red_max = reinterpret_cast<float*>(Ps + 16 * PROW);  // [NWG][16]
    float* red_sum = red_max + NWG * 16;                       // [NWG][16]
    int* p_lo = reinterpret_cast<int*>(red_sum + NWG * 16);    // [16]
    int* p_hi = p_lo + 16;
    int* p_seq = p_hi + 16;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int wg = warp, g = lane >> 2, qd = lane & 3;
    const int lr0 = blockIdx.x;
    const size_t HD = (size_t)Hkv * D;

    if (tid < 1) tile_position(tid, lr0, row0, nrows, rows_seq, rows_pos, spans, n_spans, window, sliding, p_lo, p_hi,
                               p_seq);
    __syncthreads();
    const int z0 = blockIdx.z, zstep = gridDim.z;
    if (p_seq[0] < 0 || z0 >= max_slots || p_lo[0] / CHUNK + z0 > p_hi[0] / CHUNK) return;
    const int kmin = p_lo[0], kmax = p_hi[0], klo[2] = {kmin, kmin}, khi[2] = {kmax, kmax};
    const int* bt = block_tables + (size_t)p_seq[0] * max_blocks;

    int rh[2];
    bool rok[2];
#pragma unroll
    for (int rr = 0; rr < 2; rr++) {
        int pi;
        tile_row(g + 8 * rr, 1, G, kvh, p_seq, rok[rr], pi, rh[rr]);
    }

    // Q rows (once): row m < G -> q[(row0 + lr0) * Hq + kvh * G + m]; row G (and any past it) zero
    for (int idx = tid; idx < QR * PPR; idx += NT) {
        const int m = idx / PPR, pc = idx % PPR;
        const bool ok = m < G;
        const __nv_bfloat16* src = ok ? q + ((size_t)(row0 + lr0) * Hq + kvh * G + m) * D + 8 * pc : q;
        cp_async16(Qs + m * SROW + 16 * pc, src, ok);
    }
    // chunk c's K and V rows into stage st: thread tid copies piece tid % KPR of rows tid / KPR + RS r of each of the
    // chunk's 4 blocks (as attn_tile's load_kv); keys outside [kmin, kmax] are zeros, not read. (One helper for both
    // loaders, with this one's single loop, gave the bf16 kernels the same instructions but made this tile 3% slower
    // at D = 256, batch 256: 368.0 / 370.0 us against 357.2 / 357.9, fifty-eighth session; so each keeps its own.)
    auto load8 = [&](int st, int c) {
        const int w = tid / KPR, pc = tid % KPR;
        const uint32_t sk = smem_u32(K8) + st * CHUNK * R8 + w * R8 + 16 * pc, sv = sk + NS * CHUNK * R8;
        const size_t step = (size_t)RS * HD, piece = (size_t)kvh * D + 16 * pc;
        const bool whole = c * CHUNK >= kmin && c * CHUNK + CHUNK - 1 <= kmax;
#pragma unroll
        for (int b = 0; b < CHUNK / KV_BLOCK; b++) {
            const int k0 = c * CHUNK + b * KV_BLOCK;
            const bool any = k0 + KV_BLOCK - 1 >= kmin && k0 <= kmax;   // blocks with no key in range: not read
            const size_t off = any ? ((size_t)bt[k0 / KV_BLOCK] * KV_BLOCK + w) * HD + piece : 0;
#pragma unroll
            for (int r = 0; r < KV_BLOCK / RS; r++) {
                const int j = k0 + w + RS * r;
                const bool ok = whole || (j >= kmin && j <= kmax);
                const size_t o = ok ? off + r * step : 0;
                const uint32_t d = (b * KV_BLOCK + RS * r) * R8;
                cp_async16(sk + d, k_pool + o, ok);
                cp_async16(sv + d, v_pool + o, ok);
            }
        }
    };

    const int cb = kmin / CHUNK + z0, cs = zstep;
    const int ce = min(kmax / CHUNK, kmin / CHUNK + max_slots - 1);   // slots past the scratch: the combine NaNs
#pragma unroll
    for (int i = 0; i < NS; i++) {                             // groups: Q and chunk cb, then cb + i cs (maybe empty)
        if (cb + i * cs <= ce) load8(i, cb + i * cs);
        cp_async_commit();
    }
    int st = 0;
    for (int c = cb; c <= ce; c += cs, st = st + 1 == NS ? 0 : st + 1) {
        cp_async_wait<NS - 1>();                               // chunk c landed (the next NS - 1 may be in flight)
        __syncthreads();
        const uint8_t* Ks = K8 + st * CHUNK * R8;
        const uint8_t* Vs = V8 + st * CHUNK * R8;

        // --- S = Q K^T, keys KW wg + 8n + (0..7): d ascending, 16 per mma ---
        float s[NTS][4];
        zero_frags(s);
        {
            const uint8_t* qa = Qs + min(lane & 15, QR - 1) * SROW + 16 * (lane >> 4);
            const uint8_t* kr = Ks + (KW * wg + g) * R8 + 2 * qd;
#pragma unroll 4
            for (int ks = 0; ks < D / 16; ks++) {
                uint32_t a[4];
                ldsm_x4(a, qa + 32 * ks);
#pragma unroll
                for (int n = 0; n < NTS; n++) {
                    const uint8_t* p = kr + n * 8 * R8 + 16 * ks;
                    const uint32_t b0 = e4m3x2_bf16x2(*reinterpret_cast<const uint16_t*>(p));
                    const uint32_t b1 = e4m3x2_bf16x2(*reinterpret_cast<const uint16_t*>(p + 8));
                    mma16816(s[n], a, b0, b1);
                }
            }
        }
        // mask (select): key j visible iff kmin <= j <= kmax; row max
        mask_rowmax<NTS>(s, c * CHUNK + KW * wg, rok, klo, khi, g, qd, wg, red_max);
        __syncthreads();                                       // maxima visible

        // --- m = max over the NWG warps; p = bf16(exp(s - m)) -> Ps; l: as attn_tile ---
        float mrow[2];
        over_warps<NWG>(red_max, g, mrow, [](float x, float y) { return fmaxf(x, y); });
        softmax_p<NTS, PROW>(s, mrow, Ps + g * PROW + 2 * (KW * wg + 2 * qd), g, qd, wg, red_sum);
        __syncthreads();                                       // P and the sums visible
        float lrow[2];
        over_warps<NWG>(red_sum, g, lrow, [](float x, float y) { return __fadd_rn(x, y); });

        // --- acc = P V: o[2 np] columns 64 wg + 16 np + 2 g, o[2 np + 1] the next (above); keys ascending ---
        float o[8][4];
        zero_frags(o);
        {
            const uint8_t* pa = Ps + (lane & 15) * PROW + 16 * (lane >> 4);
            const uint8_t* vr = Vs + 2 * qd * R8 + 64 * wg + 2 * g;   // key 2 qd, columns 64 wg + 2 g, + 1
#pragma unroll
            for (int ks = 0; ks < CHUNK / 16; ks++) {
                uint32_t a[4];
                ldsm_x4(a, pa + 32 * ks);
#pragma unroll
                for (int np = 0; np < 4; np++) {
                    const uint8_t* p = vr + 16 * ks * R8 + 16 * np;
                    const uint32_t x0 = *reinterpret_cast<const uint16_t*>(p);            // key 16 ks + 2 qd
                    const uint32_t x1 = *reinterpret_cast<const uint16_t*>(p + R8);       // + 1
                    const uint32_t x2 = *reinterpret_cast<const uint16_t*>(p + 8 * R8);   // + 8
                    const uint32_t x3 = *reinterpret_cast<const uint16_t*>(p + 9 * R8);   // + 9
                    // even column: the low bytes (key 2 qd in the low half), odd column: the high bytes
                    mma16816(o[2 * np], a, e4m3x2_bf16x2(__byte_perm(x0, x1, 0x0040)),
                             e4m3x2_bf16x2(__byte_perm(x2, x3, 0x0040)));
                    mma16816(o[2 * np + 1], a, e4m3x2_bf16x2(__byte_perm(x0, x1, 0x0051)),
                             e4m3x2_bf16x2(__byte_perm(x2, x3, 0x0051)));
                }
            }
        }

        // --- the partial of slot z: o[2 np][2 rr + j] is column 64 wg + 16 np + 4 qd + 2 j, o[2 np + 1] the next ---
        const int z = c - kmin / CHUNK;
#pragma unroll
        for (int rr = 0; rr < 2; rr++) {
            if (!rok[rr]) continue;                            // rows m < G
            const size_t i = ((size_t)lr0 * Hq + rh[rr]) * max_slots + z;
            float* pacc = part_acc + i * D + 64 * wg + 4 * qd;
#pragma unroll
            for (int np = 0; np < 4; np++)
                *reinterpret_cast<float4*>(pacc + 16 * np) = make_float4(o[2 * np][2 * rr], o[2 * np + 1][2 * rr],
                                                                          o[2 * np][2 * rr + 1],
                                                                          o[2 * np + 1][2 * rr + 1]);
            if (wg == 0 && qd == 0) {
                part_ml[2 * i] = mrow[rr];
                part_ml[2 * i + 1] = lrow[rr];
            }
        }
        __syncthreads();                                       // every warp is done with stage st and Ps
        if (c + NS * cs <= ce) load8(st, c + NS * cs);
        cp_async_commit();                                     // group: chunk c + NS cs (maybe empty)
    }
    cp_async_wait<0>();
}

// The arguments of every attention kernel (attention.cu, attention_sm90a.cu), and passing them on.
#define ATTN_ARGS                                                                                             \
    const __nv_bfloat16 *__restrict__ q, const __nv_bfloat16 *__restrict__ k_pool,                          \
        const __nv_bfloat16 *__restrict__ v_pool, const int *__restrict__ rows_seq,                         \
        const int *__restrict__ rows_pos, const int *__restrict__ block_tables, int max_blocks,             \
        const int *__restrict__ spans, int n_spans, int window, int sliding, int row0, int nrows, int Hq,  \
        int Hkv, int max_slots, float *__restrict__ part_ml, float *__restrict__ part_acc,                  \
        __nv_bfloat16 *__restrict__ out
#define ATTN_PASS                                                                                             \
    q, k_pool, v_pool, rows_seq, rows_pos, block_tables, max_blocks, spans, n_spans, window, sliding, row0,  \
        nrows, Hq, Hkv, max_slots, part_ml, part_acc, out
