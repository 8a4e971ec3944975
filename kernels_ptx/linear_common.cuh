// Shared by linear.cu (sm_90) and linear_sm90a.cu (wgmma): the per-output arithmetic's pieces that both kernel
// files must compute identically (linear.cu's header states the contract): the K-slice constants, the mma.sync
// unit, the exact FP8 -> bf16 conversion, the gelu epilogue, the projection picker and the store.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "cp_async.cuh"

#define SLICES 8        // warps per CTA = fixed K-slices (part of the determinism contract: never change per T)
#define ROWS 16         // N rows per CTA (one m16 tile)

enum { FMT_FP8 = 0, FMT_FP8BLK = 1, FMT_BF16 = 2 };

__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One 64-wide K unit for one 8-token column tile: four m16n8k16 steps over the unit's fragments a[j] against
// the tokens' 16 x-words, accumulated into acc in fp32. For 128x128 block scales the unit is summed from zero and
// then added as fma(unit, scale, acc). Both kernel families call this, which is why their bits are equal.
template <int FMT>
__device__ __forceinline__ void mma_unit(float (&acc)[4], const uint32_t (&a)[4][4], const uint32_t (&xw)[8],
                                         float bscale) {
    if (FMT == FMT_FP8BLK) {
        float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int j = 0; j < 4; ++j) mma16816(part, a[j], xw[2 * j], xw[2 * j + 1]);
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[i] = __fmaf_rn(part[i], bscale, acc[i]);
    } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) mma16816(acc, a[j], xw[2 * j], xw[2 * j + 1]);
    }
}

// Four e4m3 bytes (b0 b1 b2 b3, b0 lowest = lowest K) -> lo = bf16x2(b0, b1), hi = bf16x2(b2, b3), exact.
__device__ __forceinline__ void e4m3x4_to_bf16x4(uint32_t w, uint32_t &lo, uint32_t &hi) {
    uint32_t p = __byte_perm(w, 0, 0x3120);                  // bytes (b0, b2, b1, b3): pairs (b0,b1) in bytes 0,2
    // bytes 0 and 2 of p -> the two bf16 halves: sign to bit 15/31, eeeemmm to bits 10..4 / 26..20
    uint32_t l = ((p << 8) & 0x80008000u) | ((p << 4) & 0x07F007F0u);   // (b0, b1) * 2^-120
    uint32_t h = (p & 0x80008000u) | ((p >> 4) & 0x07F007F0u);          // (b2, b3) * 2^-120
    const uint32_t two120 = 0x7B807B80u;                                 // bf16x2 (2^120, 2^120)
    asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(lo) : "r"(l), "r"(two120));
    asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(hi) : "r"(h), "r"(two120));
}

__device__ __forceinline__ uint4 ldg16(const void *p) { return __ldg(reinterpret_cast<const uint4 *>(p)); }
__device__ __forceinline__ uint4 ldcg16(const void *p) { return __ldcg(reinterpret_cast<const uint4 *>(p)); }


// elementwise.cu gelu_mul_bf16 for one element, from the two bf16-rounded fp32 inputs: the same source
// expression (so the same PTX: mul/fma/ex2.approx/rcp.approx sequence of tanhf, no mul+add pair that ptxas
// could contract differently) -> bf16( bf16(gelu_tanh(g)) * u ).
__device__ __forceinline__ __nv_bfloat16 gelu_mul(float g, float u) {
    float a = 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
    float ar = __bfloat162float(__float2bfloat16_rn(a));
    return __float2bfloat16_rn(ar * u);
}

// One projection of a fused launch: weights, scale (see linear_body), output (T, N).
struct Proj {
    const void *W;
    const float *S;
    int sa;
    void *Y;
    int N;
};

// The projection of row tile b (tiles of `rt` rows: projection 0's ceil(N0/rt) tiles, then projection 1's, ...);
// b becomes the tile index inside it. CTA-uniform, no local memory.
__device__ __forceinline__ Proj pick(int &b, int rt, const Proj &p0, const Proj &p1, const Proj &p2, const Proj &p3) {
    int n = (p0.N + rt - 1) / rt;
    if (b < n) return p0;
    b -= n;
    n = (p1.N + rt - 1) / rt;
    if (b < n) return p1;
    b -= n;
    n = (p2.N + rt - 1) / rt;
    if (b < n) return p2;
    b -= n;
    return p3;
}

// Epilogue of one output element from its finished slice sum(s): scale, round, (gelu_mul), store.
// gelu: one projection's finished sum -> its bf16-rounded value (scaled first for FP8 tensor / channel);
// scaled_bf16 is the FP8 case with the row's scale s read already (linear_sm90a.cu reads it once a tile).
__device__ __forceinline__ float scaled_bf16(float v, float s) {
    return __bfloat162float(__float2bfloat16_rn(__fmul_rn(v, s)));
}
template <int FMT>
__device__ __forceinline__ float gelu_in(const Proj &p, float v, int row) {
    if (FMT == FMT_FP8) return scaled_bf16(v, __ldg(p.S + (size_t)row * p.sa));
    return __bfloat162float(__float2bfloat16_rn(v));
}

template <int FMT, bool F32OUT, bool GELU>
__device__ __forceinline__ void store_out(const Proj &p0, const Proj &p1, float v0, float v1, int row, int tok) {
    const size_t o = (size_t)tok * p0.N + row;
    if (GELU) {
        reinterpret_cast<__nv_bfloat16 *>(p0.Y)[o] = gelu_mul(gelu_in<FMT>(p0, v0, row), gelu_in<FMT>(p1, v1, row));
        return;
    }
    if (FMT == FMT_FP8) v0 = __fmul_rn(v0, __ldg(p0.S + (size_t)row * p0.sa));
    if (F32OUT) {
        reinterpret_cast<float *>(p0.Y)[o] = v0;
    } else {
        reinterpret_cast<__nv_bfloat16 *>(p0.Y)[o] = __float2bfloat16_rn(v0);
    }
}

// The i-th unit in slice-major order (slice s = u % 8 holds units s, s+8, ..; slices 0..units%8-1 one more).
__device__ __forceinline__ int slice_major_unit(int i, int units) {
    const int a = units >> 3, rm = units & 7, big = rm * (a + 1);
    if (i < big) {
        const int s = i / (a + 1);
        return s + 8 * (i - s * (a + 1));
    }
    const int i2 = i - big, s = rm + i2 / a;                 // a >= 1 here (i < units)
    return s + 8 * (i2 - (s - rm) * a);
}
