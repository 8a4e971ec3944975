// Weight-only linear layers: Y (T, N) = X (T, K) @ W (N, K)^T, X bf16, fp32 accumulation, Y bf16 (or f32
// for the tied head). W is FP8 e4m3 with a per-tensor / per-channel / 128x128-block fp32 scale, or bf16.
//
// Two kernel families with ONE per-output arithmetic, so a row's output never depends on T or on where the
// row sits in the batch (policy.md "Determinism"): the memory-bound family `_t8.._t64` below (decode,
// T <= 64) and the smem-tiled prefill family `_p` (further down) that reproduces it bit for bit. The contract:
//   - (decode family) CTA = 8 warps = the 8 K-slices, tile 16 N-rows x (8*NT) tokens, grid (ceil(N/16), ceil(T/(8*NT))).
//   - K is cut into 64-wide units u = 0..ceil(K/64)-1; unit u belongs to warp (slice) u % 8, and each warp
//     walks its units in ascending order, 4 mma.sync m16n8k16 steps per unit into its own fp32 accumulator.
//   - the 8 slice partials are summed in the fixed order 0,1,..,7 (__fadd_rn; via smem here, in registers in
//     the prefill family), then the per-tensor/channel scale (__fmul_rn), then the round to bf16 and the store.
//   The per-output arithmetic is therefore a function of (K, the row's weights, the token's x) only; NT
//   (tokens per CTA, 8/16/32/64, picked from T by the launcher) and the grid change nothing but which
//   outputs share a CTA. The mma computes each D element independently of the other rows/columns.
//   Weight bytes are read once per call when T <= 8*NT = 64 (one CTA column); beyond that once per
//   64-token tile (L2 catches most re-reads).
//
// Fragments come straight from global memory with 16-byte loads, no smem: lane (g = lane/4, q = lane%4)
// owns K columns [64u + 16q, 64u + 16q + 16) of unit u, for W rows g and g+8 and for X tokens g. The mma's
// logical k slots are mapped to physical K so that those 16 contiguous columns feed the lane's fragments
// (a fixed permutation of K inside each 16-wide mma step; the same for A and B, so the dot product is the
// same sum, only its order inside the tensor core differs from the textbook one, and it is fixed):
//   step j (0..3) of unit u, lane q:  slots {2q, 2q+1}   <- physical K 64u + 16q + 4j + {0, 1}
//                                     slots {2q+8, 2q+9} <- physical K 64u + 16q + 4j + {2, 3}
//   A (16x16, row-major, W rows):  a[0] = W[g][+0,+1]  a[1] = W[g+8][+0,+1]  a[2] = W[g][+2,+3]  a[3] = W[g+8][+2,+3]
//   B (16x8, "col", X^T):          b[0] = X[g][+0,+1]  b[1] = X[g][+2,+3]
//   D (16x8):                      d[0..1] = Y rows g   tokens 2q, 2q+1;  d[2..3] = rows g+8, tokens 2q, 2q+1
// so each bf16 pair is simply one 32-bit word of the lane's 16-byte X (or bf16 W) load.
//
// FP8 -> bf16 in registers, exact: e4m3 byte seeeemmm placed as bf16 bits s.0000eeee.mmm0000 is the value
// times 2^-120 (e4m3 subnormals land on bf16 subnormals, same mantissa), then one bf16x2 multiply by 2^120
// (exact: the result is a normal bf16 with <= 4 significant bits). Integer ops + 1 HMUL2 per 2 weights, no
// conversion-unit work. NaN codes (0x7F/0xFF) do not survive (checkpoints hold none).
//
// Scales: per-tensor / per-channel multiply the finished fp32 sum (epilogue, S[row * s_stride], stride 0 for
// tensor); 128x128 blocks: each 64-K unit lies inside one K block and the CTA's 16 rows inside one N block,
// so a unit is accumulated from 0 into a fresh fp32 tile and added as acc = fma(unit_sum, S[n/128][k/128], acc).
// Requirements (checked by the launcher): K % 16 == 0, 16-byte aligned base pointers (cuMemAlloc gives 256).

#include <cuda_bf16.h>
#include <stdint.h>

#define SLICES 8        // warps per CTA = fixed K-slices (part of the determinism contract: never change per T)
#define ROWS 16         // N rows per CTA (one m16 tile)
#define UNR_FP8 4       // units whose weight loads are issued together (memory-level parallelism): 4 KB per warp
#define UNR_BF16 2

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

// W: fp8 (N, K) bytes | bf16 (N, K). S: FMT_FP8: f32 S[row * s_arg] (s_arg 0 tensor, 1 channel);
// FMT_FP8BLK: f32 (ceil(N/128), s_arg = ceil(K/128)); FMT_BF16: unused. X (T, K) bf16. Y (T, N) bf16 | f32.
template <int FMT, int NT, bool F32OUT>
__device__ __forceinline__ void linear_body(const void *__restrict__ W, const float *__restrict__ S, int s_arg,
                                            const __nv_bfloat16 *__restrict__ X, void *__restrict__ Y,
                                            int T, int N, int K) {
    __shared__ float red[SLICES][NT * 4][32];                 // slice partials in D-fragment order, lane fastest
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, q = lane & 3;
    const int row0 = blockIdx.x * ROWS;                       // first N row of this CTA
    const int t0 = blockIdx.y * (8 * NT);                     // first token of this CTA
    const int rg = row0 + g, rh = row0 + g + 8;               // the lane's two W rows
    const int units = (K + 63) >> 6;                          // 64-wide K units

    float acc[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[n][i] = 0.f;

    constexpr int WV = FMT == FMT_BF16 ? 2 : 1;               // 16-byte loads per W row per unit per lane
    constexpr int UNR = FMT == FMT_BF16 ? UNR_BF16 : UNR_FP8;
    for (int u0 = warp; u0 < units; u0 += SLICES * UNR) {
        // 1) issue the weight loads of up to UNR units of this slice (units u0, u0+8, ...), zeros outside
        uint4 wraw[UNR][2][WV];
#pragma unroll
        for (int r = 0; r < UNR; ++r) {
            const int kk = ((u0 + r * SLICES) << 6) + 16 * q;  // the lane's first K column in that unit
            const bool kin = (u0 + r * SLICES) < units && kk < K;
#pragma unroll
            for (int v = 0; v < WV; ++v) {
                const uint4 z = make_uint4(0, 0, 0, 0);
                if (FMT == FMT_BF16) {
                    const __nv_bfloat16 *w16 = reinterpret_cast<const __nv_bfloat16 *>(W);
                    wraw[r][0][v] = (kin && rg < N) ? ldg16(w16 + (size_t)rg * K + kk + 8 * v) : z;
                    wraw[r][1][v] = (kin && rh < N) ? ldg16(w16 + (size_t)rh * K + kk + 8 * v) : z;
                } else {
                    const uint8_t *w8 = reinterpret_cast<const uint8_t *>(W);
                    wraw[r][0][v] = (kin && rg < N) ? ldg16(w8 + (size_t)rg * K + kk) : z;
                    wraw[r][1][v] = (kin && rh < N) ? ldg16(w8 + (size_t)rh * K + kk) : z;
                }
            }
        }
        // 2) per unit (ascending): A fragments for the 4 steps, then every token tile
#pragma unroll
        for (int r = 0; r < UNR; ++r) {
            const int u = u0 + r * SLICES;
            if (u >= units) break;                            // warp-uniform
            const int kk = (u << 6) + 16 * q;
            const bool kin = kk < K;
            uint32_t a[4][4];                                 // [step j][fragment reg]
            if (FMT == FMT_BF16) {
                // row word m of the lane's 16 columns = columns 16q+2m, +1 (bf16 pair); step j uses words 2j, 2j+1
                const uint32_t *rgw = reinterpret_cast<const uint32_t *>(&wraw[r][0][0]);   // 8 words, row g
                const uint32_t *rhw = reinterpret_cast<const uint32_t *>(&wraw[r][1][0]);   // 8 words, row g+8
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    a[j][0] = rgw[2 * j]; a[j][1] = rhw[2 * j]; a[j][2] = rgw[2 * j + 1]; a[j][3] = rhw[2 * j + 1];
                }
            } else {
                // fp8 word j = columns 16q+4j .. +3 -> (lo = cols +0,+1, hi = cols +2,+3)
                const uint32_t *rgw = reinterpret_cast<const uint32_t *>(&wraw[r][0][0]);   // 4 words, row g
                const uint32_t *rhw = reinterpret_cast<const uint32_t *>(&wraw[r][1][0]);   // 4 words, row g+8
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    e4m3x4_to_bf16x4(rgw[j], a[j][0], a[j][2]);
                    e4m3x4_to_bf16x4(rhw[j], a[j][1], a[j][3]);
                }
            }
            float bscale = 0.f;                               // block scale of (row0/128, k/128): CTA-uniform
            if (FMT == FMT_FP8BLK) bscale = __ldg(S + (size_t)(row0 >> 7) * s_arg + ((u << 6) >> 7));
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                const int t = t0 + 8 * n + g;                 // the lane's token (B column g)
                uint4 x0 = make_uint4(0, 0, 0, 0), x1 = x0;
                if (kin && t < T) {
                    x0 = ldg16(X + (size_t)t * K + kk);       // columns 16q .. 16q+7
                    x1 = ldg16(X + (size_t)t * K + kk + 8);   // columns 16q+8 .. 16q+15
                }
                const uint32_t xw[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
                mma_unit<FMT>(acc[n], a, xw, bscale);
            }
        }
    }

    // 3) fixed-order reduction of the 8 slices, epilogue scale, store
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) red[warp][n * 4 + i][lane] = acc[n][i];
    __syncthreads();
    for (int idx = threadIdx.x; idx < NT * 4 * 32; idx += SLICES * 32) {
        const int e = idx >> 5, l = idx & 31;                 // element e = n*4 + i of lane l's D fragments
        float s = red[0][e][l];
#pragma unroll
        for (int w = 1; w < SLICES; ++w) s = __fadd_rn(s, red[w][e][l]);
        const int row = row0 + (l >> 2) + ((e & 2) ? 8 : 0);  // d[2], d[3] are rows g+8
        const int tok = t0 + 8 * (e >> 2) + 2 * (l & 3) + (e & 1);
        if (row < N && tok < T) {
            if (FMT == FMT_FP8) s = __fmul_rn(s, __ldg(S + (size_t)row * s_arg));
            if (F32OUT) reinterpret_cast<float *>(Y)[(size_t)tok * N + row] = s;
            else reinterpret_cast<__nv_bfloat16 *>(Y)[(size_t)tok * N + row] = __float2bfloat16_rn(s);
        }
    }
}

// --- prefill tile (T > 64): the same per-output arithmetic, W and X staged in shared memory --------------
// The decode family re-reads X from L2 for every 16 rows, which caps it far below the tensor cores at large
// T. This kernel computes a 64-row x 32-token tile per CTA: 8 warps as 4 (16 rows) x 2 (16 tokens), every
// warp walks ALL K units in ascending order and keeps the 8 slice partials apart in registers
// (acc[u % 8]), then sums them 0..7 exactly as the decode family's smem reduction does. Each unit's step
// sequence, k permutation, zero padding and block-scale fma are the decode family's, so every output is
// bit-identical to it (the batch-invariance test compares T=300 here against T=1/7/33 there).
// Smem per stage (one 64-K unit): W 64 rows x 64 B (fp8, rows contiguous) or x 144 B (bf16: 128 + 16 pad,
// conflict-free 16-byte lane reads), X 32 tokens x 144 B. 4 stages, cp.async with zero-fill.
#define P_ROWS 64
#define P_TOK 32
#define P_STAGES 4
#define P_XSTRIDE 144

__device__ __forceinline__ void cp_async16(void *smem, const void *gmem, bool ok) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(gmem), "r"(ok ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int NPEND> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(NPEND));
}

template <int FMT> struct PrefillSmem {
    static constexpr int WSTRIDE = FMT == FMT_BF16 ? P_XSTRIDE : 64;        // bytes per W row in a stage
    static constexpr int WBYTES = P_ROWS * WSTRIDE;
    static constexpr int STAGE = WBYTES + P_TOK * P_XSTRIDE;
    static constexpr int TOTAL = P_STAGES * STAGE;                          // fp8 34816 B, bf16 55296 B
};

template <int FMT, bool F32OUT>
__device__ __forceinline__ void linear_prefill_body(const void *__restrict__ W, const float *__restrict__ S, int s_arg,
                                                    const __nv_bfloat16 *__restrict__ X, void *__restrict__ Y,
                                                    int T, int N, int K) {
    using SM = PrefillSmem<FMT>;
    extern __shared__ __align__(16) uint8_t smem[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const int wr = warp & 3, wt = warp >> 2;                  // warp's 16-row group and 16-token group
    const int row0 = blockIdx.x * P_ROWS, t0 = blockIdx.y * P_TOK;
    const int units = (K + 63) >> 6;

    // stage loader for unit u: every thread issues its 16-byte pieces (zero-filled outside N, T, K)
    auto load = [&](int u, int stage) {
        uint8_t *sw = smem + stage * SM::STAGE, *sx = sw + SM::WBYTES;
        if (FMT == FMT_BF16) {
            const __nv_bfloat16 *w16 = reinterpret_cast<const __nv_bfloat16 *>(W);
#pragma unroll
            for (int i = 0; i < 2; ++i) {                     // 64 rows x 8 pieces of 8 columns
                const int idx = tid + 256 * i, r = idx >> 3, c = idx & 7, k = (u << 6) + 8 * c;
                const bool ok = row0 + r < N && k < K;
                cp_async16(sw + r * SM::WSTRIDE + 16 * c, ok ? (const void *)(w16 + (size_t)(row0 + r) * K + k) : W, ok);
            }
        } else {                                              // 64 rows x 4 pieces of 16 columns
            const int r = tid >> 2, c = tid & 3, k = (u << 6) + 16 * c;
            const bool ok = row0 + r < N && k < K;
            const uint8_t *w8 = reinterpret_cast<const uint8_t *>(W);
            cp_async16(sw + r * SM::WSTRIDE + 16 * c, ok ? (const void *)(w8 + (size_t)(row0 + r) * K + k) : W, ok);
        }
        const int tk = tid >> 3, c = tid & 7, k = (u << 6) + 8 * c;   // 32 tokens x 8 pieces of 8 columns
        const bool ok = t0 + tk < T && k < K;
        cp_async16(sx + tk * P_XSTRIDE + 16 * c, ok ? (const void *)(X + (size_t)(t0 + tk) * K + k) : (const void *)X, ok);
    };

    float acc[SLICES][2][4];                                  // [slice u % 8][token tile][D fragment]
#pragma unroll
    for (int s = 0; s < SLICES; ++s)
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[s][n][i] = 0.f;

#pragma unroll
    for (int p = 0; p < P_STAGES - 1; ++p) {                  // prologue: units 0 .. P_STAGES-2
        if (p < units) load(p, p);
        cp_async_commit();
    }
    for (int u8 = 0; u8 < units; u8 += SLICES) {
#pragma unroll
        for (int s = 0; s < SLICES; ++s) {                    // unit u = u8 + s belongs to slice s
            const int u = u8 + s;
            if (u >= units) break;                            // CTA-uniform
            cp_async_wait<P_STAGES - 2>();                    // unit u's group has landed (this thread's part)
            __syncthreads();                                  // ... everyone's; and stage (u-1) % 4 is free
            if (u + P_STAGES - 1 < units) load(u + P_STAGES - 1, (s + P_STAGES - 1) % P_STAGES);
            cp_async_commit();                                // (maybe empty) keeps the group count uniform
            const uint8_t *sw = smem + (s % P_STAGES) * SM::STAGE, *sx = sw + SM::WBYTES;
            const int r1 = 16 * wr + g;                       // rows g and g+8 of the warp's group
            uint32_t a[4][4];
            if (FMT == FMT_BF16) {
                uint4 v[4] = {*reinterpret_cast<const uint4 *>(sw + r1 * SM::WSTRIDE + 32 * q),
                              *reinterpret_cast<const uint4 *>(sw + r1 * SM::WSTRIDE + 32 * q + 16),
                              *reinterpret_cast<const uint4 *>(sw + (r1 + 8) * SM::WSTRIDE + 32 * q),
                              *reinterpret_cast<const uint4 *>(sw + (r1 + 8) * SM::WSTRIDE + 32 * q + 16)};
                const uint32_t *rgw = reinterpret_cast<const uint32_t *>(&v[0]), *rhw = reinterpret_cast<const uint32_t *>(&v[2]);
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    a[j][0] = rgw[2 * j]; a[j][1] = rhw[2 * j]; a[j][2] = rgw[2 * j + 1]; a[j][3] = rhw[2 * j + 1];
                }
            } else {
                const uint4 vg = *reinterpret_cast<const uint4 *>(sw + r1 * SM::WSTRIDE + 16 * q);
                const uint4 vh = *reinterpret_cast<const uint4 *>(sw + (r1 + 8) * SM::WSTRIDE + 16 * q);
                const uint32_t rgw[4] = {vg.x, vg.y, vg.z, vg.w}, rhw[4] = {vh.x, vh.y, vh.z, vh.w};
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    e4m3x4_to_bf16x4(rgw[j], a[j][0], a[j][2]);
                    e4m3x4_to_bf16x4(rhw[j], a[j][1], a[j][3]);
                }
            }
            float bscale = 0.f;
            if (FMT == FMT_FP8BLK) bscale = __ldg(S + (size_t)(row0 >> 7) * s_arg + (u >> 1));
#pragma unroll
            for (int n = 0; n < 2; ++n) {
                const uint8_t *xr = sx + (16 * wt + 8 * n + g) * P_XSTRIDE + 32 * q;   // token g of tile n
                const uint4 x0 = *reinterpret_cast<const uint4 *>(xr), x1 = *reinterpret_cast<const uint4 *>(xr + 16);
                const uint32_t xw[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
                mma_unit<FMT>(acc[s][n], a, xw, bscale);
            }
        }
    }
    cp_async_wait<0>();

    // slices summed 0..7 in order (as the decode family's smem reduction), scale, store
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float v = acc[0][n][i];
#pragma unroll
            for (int s = 1; s < SLICES; ++s) v = __fadd_rn(v, acc[s][n][i]);
            const int row = row0 + 16 * wr + g + ((i & 2) ? 8 : 0);
            const int tok = t0 + 16 * wt + 8 * n + 2 * q + (i & 1);
            if (row < N && tok < T) {
                if (FMT == FMT_FP8) v = __fmul_rn(v, __ldg(S + (size_t)row * s_arg));
                if (F32OUT) reinterpret_cast<float *>(Y)[(size_t)tok * N + row] = v;
                else reinterpret_cast<__nv_bfloat16 *>(Y)[(size_t)tok * N + row] = __float2bfloat16_rn(v);
            }
        }
}

// Exported kernels, one per (weight format, output dtype, NT) plus the prefill tile `_p`. Same signature for all:
//   (W, S, s_arg, X (T, K) bf16, Y (T, N), T, N, K); block (256);
//   _t8.._t64: grid (ceil(N/16), ceil(T/(8*NT))), no dynamic smem;
//   _p: grid (ceil(N/64), ceil(T/32)), dynamic smem 34816 B (fp8) / 55296 B (bf16).
#define LINEAR_KERNEL(name, FMT, NT, F32OUT)                                                                   \
    extern "C" __global__ void __launch_bounds__(SLICES * 32)                                                \
    name(const void *__restrict__ W, const float *__restrict__ S, int s_arg, const __nv_bfloat16 *__restrict__ X, \
         void *__restrict__ Y, int T, int N, int K) {                                                        \
        linear_body<FMT, NT, F32OUT>(W, S, s_arg, X, Y, T, N, K);                                            \
    }

#define LINEAR_FAMILY(prefix, FMT, F32OUT)                                                                     \
    LINEAR_KERNEL(prefix##_t8, FMT, 1, F32OUT)                                                               \
    LINEAR_KERNEL(prefix##_t16, FMT, 2, F32OUT)                                                              \
    LINEAR_KERNEL(prefix##_t32, FMT, 4, F32OUT)                                                              \
    LINEAR_KERNEL(prefix##_t64, FMT, 8, F32OUT)                                                              \
    extern "C" __global__ void __launch_bounds__(256, 2)                                                     \
    prefix##_p(const void *__restrict__ W, const float *__restrict__ S, int s_arg,                           \
               const __nv_bfloat16 *__restrict__ X, void *__restrict__ Y, int T, int N, int K) {             \
        linear_prefill_body<FMT, F32OUT>(W, S, s_arg, X, Y, T, N, K);                                        \
    }

LINEAR_FAMILY(gemm_fp8_bf16, FMT_FP8, false)        // FP8 e4m3, per-tensor (s_arg 0) / per-channel (s_arg 1)
LINEAR_FAMILY(gemm_fp8blk_bf16, FMT_FP8BLK, false)  // FP8 e4m3, 128x128 block scales (s_arg = ceil(K/128))
LINEAR_FAMILY(gemm_bf16_bf16, FMT_BF16, false)      // bf16 weights (router, bf16 checkpoints)
LINEAR_FAMILY(gemm_bf16_f32, FMT_BF16, true)        // bf16 weights, f32 out (tied head logits)
