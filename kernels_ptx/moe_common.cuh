// Shared by moe.cu (sm_90: mma.sync) and moe_sm90a.cu (wgmma): the pieces of the NVFP4 experts' per-output
// arithmetic that both kernel files must compute identically (the contract is stated below), and their
// weight ring.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "cp_async.cuh"

typedef __nv_bfloat16 bf16;

// global scale, per expert per projection: gsc[(e*3 + proj)*2 + {0,1}] = (mult, div);
// CT: (1, weight_global_scale) -> acc / g ; ModelOpt: (weight_scale_2, 1) -> acc * wsf2. One rounding each.
// acc is the kernels' sum of the operands q*s*2^-8 (see the decode below): times 2^8 first, exactly.
// explicit _rn intrinsics below: no FMA contraction, so every template variant rounds identically
__device__ __forceinline__ float apply_global(float acc, const float* g2) {
    return __fdiv_rn(__fmul_rn(__fmul_rn(acc, 256.f), g2[0]), g2[1]);
}

__device__ __forceinline__ float gelu_tanh_f(float x) {
    const float c = 0.7978845608028654f;   // sqrt(2/pi)
    const float x3 = __fmul_rn(__fmul_rn(__fmul_rn(0.044715f, x), x), x);      // numpy's ((0.044715*x)*x)*x
    const float t = tanhf(__fmul_rn(c, __fadd_rn(x, x3)));
    return __fmul_rn(__fmul_rn(0.5f, x), __fadd_rn(1.0f, t));
}

// u = gelu(gate) * up of one output, both from their fp32 sums: moe.cu's and moe_sm90a.cu's gate/up epilogue.
__device__ __forceinline__ float gate_up_out(float accg, float accu, const float* gg, const float* gu) {
    return __fmul_rn(gelu_tanh_f(apply_global(accg, gg)), apply_global(accu, gu));
}

// ===================================================================================================
// Tensor-core NVFP4 experts.
//
// ONE per-output arithmetic for every T and every launch path (decode "direct" and grouped/prefill):
//   acc = fp32 (IEEE, RN) sum over the 128-column super units in ascending order, from 0, of each unit's
//   partial = chain of its 8 mma.sync.m16n8k16.bf16 steps from a zero accumulator (the tensor core truncates
//   its accumulator at every step, so a chain over the whole K would drift toward zero); then the same
//   epilogues as before (global scale (acc*mult)/div, gelu(gate)*up -> bf16 u; bf16(down*w) per slot; combine
//   = fp32 sum over the token's slots in increasing expert index from 0, one bf16 rounding).
// Weight rows are the mma M dimension (16 rows per m-tile), token rows the N dimension (8 per n-tile; absent
// tokens are zero columns: a D element depends only on its own A row and B column, so padding / the other
// tokens in the tile cannot change a real token's bits). The unit partials are independent chains, so a kernel
// may compute them in different warps (the direct path does) as long as they are then added in ascending K
// from 0 as above: the tiling (rows per warp, units per warp, tokens per CTA, which kernel) changes nothing.
//
// K order (the same for A and B, so the product is the plain dot product, summed in a fixed order):
//   super unit su = 128 columns [128su, 128su+128), ascending; lane (g = lane/4, q = lane%4) owns the 32
//   columns c0 = 128su + 32q .. c0+31 of its rows (16 packed bytes = one 16-byte load, 2 scale bytes).
//   Inside a super unit, word m = 0..3 (columns c0+8m .. c0+8m+7) feeds mma steps 2m and 2m+1 (ascending):
//     step 2m+h:  k slots {2q, 2q+1}   <- columns c0 + 8m + 4h + {0, 1}
//                 k slots {2q+8, 2q+9} <- columns c0 + 8m + 4h + {2, 3}
//   A (16x16 row):  a0 = W[g][+0,+1]  a1 = W[g+8][+0,+1]  a2 = W[g][+2,+3]  a3 = W[g+8][+2,+3]
//   B (16x8 col):   b0 = X[tok g][+0,+1]  b1 = X[tok g][+2,+3]  (one 32-bit word each of the 16-byte X load)
//   D (16x8):       d0, d1 = W row g, tokens 2q, 2q+1;  d2, d3 = W row g+8, tokens 2q, 2q+1.
//   Columns >= K (K % 16 == 0, the last super unit may be partial) are zero in both A and B; every path runs
//   the same ceil(K/128)*8 steps.
// NVFP4 -> bf16 in registers, exact, from the DEVICE WORD LAYOUT (moe.cu moe_fp4_repack rewrites every packed
// 32-bit word once, at upload; layers/moe.py fp4_device_words is its numpy twin): the word of columns 8j .. 8j+7
// holds column pair p (columns 8j+2p, 8j+2p+1) with the even column in the low 16 bits and the odd one at the same
// places of the high 16 bits; e2m1 code bits (sign, e1, e0, m) at
//     p = 0: 15, 8, 7, 6     p = 1: 12, 5, 4, 3     p = 2: 9, 2, 1, 0     p = 3: 11, 10, 14, 13
// so that pair p's bf16x2 bit pattern R_p (sign at bit 15 / 31, e1 e0 m at bits 8..6 / 24..22, the rest zero) is
// one AND (p = 0) or a shift and an AND (p = 1, 2) away. Pair 3's bits need three shifts (+4, -2, -7), done at once
// by one 32 x 32 -> 64-bit multiply of the masked word by 2^20 + 2^25 + 2^31 (the three shifted copies land on
// disjoint bits: no carries), a funnel shift right by 27 and an AND. As bf16, R_p = q * 2^-126 exactly
// (exponent field e1 e0, mantissa m000000; codes 0 and 0.5 are subnormal: mul.rn.bf16x2 keeps subnormal inputs),
// and one mul.rn.bf16x2 by S' = s * 2^118 (the block scale: e4m3 -> f16 by cvt (exact) -> f32, times 2^118 (exact;
// s <= 448 < 2^9, so S' < 2^127) -> bf16 (exact)) gives the mma operand q * s * 2^-8 exactly: <= 6 significant bits
// in [2^-18, 10.5], normal. Signed zeros stay signed. The tensor core's products and fp32 sums of operands all
// scaled by 2^-8 are the unscaled ones times 2^-8, bit for bit, as long as no product or sum falls below fp32's
// normal range (|x| < ~2^-110 in the activations); apply_global multiplies the sum back by 2^8 (exact). 13
// instructions per 8 weights (the mask steps, one multiply per bf16 pair), against 19 of the byte-table decode this
// replaced; the expert kernels are issue-bound at prompt sizes (BENCHMARKS.md, eighth session). At the decode batches
// the decode is ~7% of a whole expert call (fifty-ninth session, dev builds without it; moe_sm90a.cu's header).
// ===================================================================================================

__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t bmul2(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// two e4m3 scale bytes (byte 0 = block of columns c0..c0+15, byte 1 = c0+16..c0+31) -> bf16x2 broadcasts of
// s * 2^118 (the decode's S', see above)
__device__ __forceinline__ void scales_bf16x2(uint32_t s2, uint32_t& S0, uint32_t& S1) {
    uint32_t h2;
    const unsigned short in = (unsigned short)(s2 & 0xffffu);
    asm("{\n\t.reg .b16 a;\n\tmov.b16 a, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, a;\n\t}" : "=r"(h2) : "h"(in));
    const __half2 hh = *reinterpret_cast<const __half2*>(&h2);
    const float p118 = 0x1p118f;                                 // 2^118
    const float f0 = __fmul_rn(__low2float(hh), p118), f1 = __fmul_rn(__high2float(hh), p118);
    __nv_bfloat162 b0 = __floats2bfloat162_rn(f0, f0), b1 = __floats2bfloat162_rn(f1, f1);
    S0 = *reinterpret_cast<uint32_t*>(&b0);
    S1 = *reinterpret_cast<uint32_t*>(&b1);
}

// The 8 e2m1 codes of one device-layout word (columns +0 .. +7, see above) times the bf16x2 scale S' = s * 2^118
// (scales_bf16x2) -> 4 bf16x2 operands q * s * 2^-8: (+0,+1) (+2,+3) (+4,+5) (+6,+7).
__device__ __forceinline__ void fp4x8_bf16(uint32_t w, uint32_t S, uint32_t (&r)[4]) {
    const uint32_t M = 0x81C081C0u;                       // sign -> bit 15, e1 e0 m -> bits 8..6, both halves
    r[0] = bmul2(w & M, S);
    r[1] = bmul2((w << 3) & M, S);
    r[2] = bmul2((w << 6) & M, S);
    const unsigned long long p3 = (unsigned long long)(w & 0x6C006C00u) * 0x82100000ull;   // pair 3's bits x 3 shifts
    r[3] = bmul2((uint32_t)(p3 >> 27) & M, S);
}

// One checkpoint word (nibble i = column +i, e2m1 bits s e1 e0 m from the top) -> the device word layout above.
__device__ __forceinline__ uint32_t fp4_device_word(uint32_t v) {
    const int pos[4][4] = {{15, 8, 7, 6}, {12, 5, 4, 3}, {9, 2, 1, 0}, {11, 10, 14, 13}};   // pair p: s e1 e0 m
    uint32_t r = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const uint32_t c = (v >> (4 * i)) & 15u;
        const int half = (i & 1) ? 16 : 0, p = i >> 1;
#pragma unroll
        for (int b = 0; b < 4; ++b) r |= ((c >> (3 - b)) & 1u) << (half + pos[p][b]);
    }
    return r;
}

// NVFP4 block scales, DEVICE SCALE LAYOUT (moe.cu moe_scale_blocks moves them once, at upload; layers/moe.py
// fp4_scale_blocks is the numpy twin): the e4m3 bytes of a (rows, K/16) scale matrix (rows % 16 == 0) as
// [rows / 16][nsu][16 rows][8 bytes], nsu = ceil(K / 128), zeros past K / 16: the 8 scale bytes of one row's
// 128-column super unit lie beside those of the 15 other rows of its 16-row block, so the rows a warp reads for one
// unit share whole sectors (in the checkpoint layout each row's 8 bytes took a 32-byte sector of their own: 23-28% of
// the expert kernels' sectors, ncu, nineteenth session).
// Byte offset of row r's scales of super unit 0 (unit su: + 128 su; the row 8 further in its block: + 64).
__device__ __forceinline__ size_t scale_row(size_t r, int K) {
    return ((r >> 4) * (size_t)((K + 127) >> 7)) * 128 + (r & 15) * 8;
}

__device__ __forceinline__ uint32_t u4word(const uint4& v, int m) { return m == 0 ? v.x : m == 1 ? v.y : m == 2 ? v.z : v.w; }

// Per-warp register ring of NVFP4 weights: D super units in flight, MT m-tiles of 16 rows each (row pointers of the
// lane's row g, packed bytes and scale_row; row g+8 is 8 rows further, g < 8 of a 16-row block). Loads are 16 bytes
// when K % 32 == 0 (aligned rows), otherwise two predicated 8-byte halves; columns >= K load as zeros (codes 0,
// scale 0).
template <int MT, int D>
struct WRing {
    uint4 w[D][MT][2];
    uint32_t s[D][MT][2];
    const uint8_t* wr[MT];
    const uint8_t* sr[MT];
    size_t rb8;                  // bytes of 8 packed rows
    int K, nsu, q;
    bool al16;

    __device__ __forceinline__ void init(const uint8_t* const (&w_)[MT], const uint8_t* const (&s_)[MT], int K_, int lane) {
        #pragma unroll
        for (int m = 0; m < MT; ++m) { wr[m] = w_[m]; sr[m] = s_[m]; }
        K = K_; q = lane & 3; nsu = (K + 127) >> 7; al16 = (K & 31) == 0;
        rb8 = (size_t)8 * (K >> 1);
    }
    __device__ __forceinline__ void load(int r, int su) {
        const int c0 = (su << 7) + 32 * q;
        const bool in = su < nsu;
        const bool full = in && al16 && c0 + 32 <= K;
        const bool lo = in && c0 + 16 <= K, hi = in && c0 + 32 <= K;
        #pragma unroll
        for (int m = 0; m < MT; ++m)
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const uint8_t* wp = wr[m] + h * rb8 + (c0 >> 1);
                const uint8_t* sp = sr[m] + h * 64 + (su << 7) + 2 * q;
                if (full) {
                    w[r][m][h] = __ldg((const uint4*)wp);
                    s[r][m][h] = __ldg((const unsigned short*)sp);
                } else {
                    const uint2 z = make_uint2(0, 0);
                    const uint2 a = lo ? __ldg((const uint2*)wp) : z, b = hi ? __ldg((const uint2*)(wp + 8)) : z;
                    w[r][m][h] = make_uint4(a.x, a.y, b.x, b.y);
                    s[r][m][h] = (lo ? (uint32_t)__ldg(sp) : 0u) | (hi ? (uint32_t)__ldg(sp + 1) << 8 : 0u);
                }
            }
    }
    __device__ __forceinline__ void prologue() {
        #pragma unroll
        for (int r = 0; r < D; ++r) load(r, r);
    }
};
