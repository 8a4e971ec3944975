// The wgmma prefill tile `_w` (sm_90a: Hopper's warpgroup MMA) for FP8 tensor / channel weights: the per-output
// arithmetic of linear.cu's decode family and its `_p` / `_g128` tiles, bit for bit, at 1.5-2x their rate
// (BENCHMARKS.md, fifth session).
// Plain and multi launches (as `_g128`) and the dense MLP's gate_up_gelu (as `_p`); layers/linear.py picks it.
//
// Why the bits are the same (measured on the H200, 2026-11-30, before this kernel was written: 147,456 outputs of
// chained k16 steps, operands spread over 2^-20 .. 2^20, non-zero accumulators, no bit differed):
//   - wgmma m64nNk16 with A from registers and B from shared memory computes each 16-wide k step exactly as
//     mma.sync m16n8k16 with the same fragments does;
//   - within one k16 step the result does not depend on which of the 16 k slots holds which (A, B) product pair
//     (any permutation of the 16 slots, applied to A and B alike, gave the same bits; a permutation across steps
//     does not, since each step rounds into the fp32 accumulator).
// So step j of unit u may hold the contract's 16 columns {64u + 16q + 4j + r: q, r = 0..3} in any slot order that
// A and B share. This kernel puts them in the order the wgmma shared-memory layout can take in 8-byte pieces:
//   B core matrix 0 of step j (slots 0..7):  X columns 64u + 4j + 0..3,  64u + 16 + 4j + 0..3
//   B core matrix 1 (slots 8..15):           X columns 64u + 32 + 4j + 0..3, 64u + 48 + 4j + 0..3
//   A (lane q holds slots 2q, 2q+1 and 2q+8, 2q+9): W columns 64u + 16(q>>1) + 2(q&1) + 4j + {0, 1} and the same
//   + 32, i.e. half of word j of the 16-byte pieces at 16(q>>1) and 32 + 16(q>>1), gathered with one byte_perm
//   and converted exactly as everywhere (e4m3x4_to_bf16x4).
// Everything else is `_g128`'s: units in slice-major order, each slice summed from 0.0f into a fresh accumulator
// (zeroed registers, not wgmma's scale-d = 0, so that a slice of -0.0 products stays as the mma chain leaves it),
// folded into the total in slice order 0..7 (__fadd_rn from -0.0f, so that slice 0 enters as is; empty slices fold
// +0.0f), then store_out (scale, round).
//
// CTA: 2 warpgroups (256 threads) x 64 rows = 128 W rows, x 128 tokens (wgmma m64n128k16, A = W rows from
// registers, B = X tokens from shared memory); grid (sum_p ceil(N_p/128), ceil(T/128)); gelu: the 64 gate rows and
// the 64 up rows of 64 outputs, grid (ceil(N/64), ceil(T/128)). Stages (one 64-K unit each, cp.async with zero
// fill, W_STAGES deep): W 128 rows x 64 B, X in the wgmma "no swizzle" K-major layout: step j = 2 k halves x 128
// tokens x 16 B, the token groups' core matrices side by side (stride byte offset 128, leading byte offset 2 KB;
// on the H200, 2026-11-30, core matrices 256 B apart ran at `_g128`'s rate), the steps 32 B apart beyond that so
// that the 8-byte cp.async pieces land in 2 wavefronts. A unit's stage is refilled two units later: its wgmmas are
// known to be done then (wgmma.wait_group 1 after each unit's commit, and the barrier of the next unit).
#include <cuda_bf16.h>
#include <stdint.h>

#include "pdl.cuh"
#include "linear_common.cuh"
#include "wgmma.cuh"

#define W_ROWS 128                          // W rows per CTA (2 warpgroups x 64)
#define W_TOK 128                           // tokens per CTA (wgmma N)
#define W_STAGES 5
#define W_WBYTES (W_ROWS * 64)              // fp8 W of one unit
#define W_XSTEP (W_TOK * 32 + 32)           // bytes per k16 step of X: 2 core-matrix columns of 128 tokens + 32 pad
#define W_XBYTES (4 * W_XSTEP)              // bf16 X of one unit
#define W_STAGE (W_WBYTES + W_XBYTES)       // 24704 B
#define W_SMEM (W_STAGES * W_STAGE + 64 * 4 * 256)   // + the fp32 slice totals: 189056 B dynamic smem
#define W_GATE (64 * 2 * 128)               // gelu: + the gate tile's bf16 values (205440 B in all)

__device__ __forceinline__ void cp_async8(uint32_t dst, const void *src, bool ok) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 8 : 0) : "memory");
}
// Shared-memory matrix descriptor, no swizzle: start address, leading (k half) byte offset W_TOK * 16 (the 16 token
// groups of one k half lie side by side, 2 KB), stride (token group) byte offset 128.
__device__ __forceinline__ uint64_t x_desc(uint32_t addr) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((W_TOK * 16) >> 4) << 16) | ((uint64_t)(128 >> 4) << 32);
}

// One thread's cp.async pieces of a unit, the parts that do not change from unit to unit. W: pieces i = 0, 1 are
// stage row (tid >> 2) + 64 i, 16 bytes at column 16 (tid & 3). X: pieces i = 0..7 are warp instruction
// wi = warp + 8 i: k half kc = warp & 1, token tb + 16 i with tb = 4 (warp >> 1) + (lane >> 3); lane: j = lane & 3,
// h = (lane >> 2) & 1; the piece = X columns 64u + 32 kc + 16 h + 4 j .. + 3 (8 B): 64 contiguous bytes per token
// in global memory, 2 shared-memory wavefronts per instruction (W_XSTEP's pad).
struct WLoad {
    const uint8_t *w[2];                // piece i's W row, column 16 (tid & 3)
    const __nv_bfloat16 *x;             // X token (t0 + tb), column xcol
    uint32_t wdst, xdst;                // piece 0's byte offset in a stage (piece i: + 4096 i / + 256 i)
    int wrows[2], xtoks;                // rows left in piece i's W from its row / X tokens left from piece 0's
    int wcol, xcol;                     // the pieces' column inside a unit
};

// Stage rows 0..63 come from W0's rows row0.., rows 64..127 from W1's rows row0 + row1.. (plain: W1 = W0, row1 = 64;
// gelu: W1 = up, row1 = 0, so that warpgroup 1 computes the up rows of warpgroup 0's gate rows).
__device__ __forceinline__ WLoad w_load_setup(const uint8_t *W0, const uint8_t *W1, int row1,
                                              const __nv_bfloat16 *X, int row0, int t0, int N, int K, int T) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int j = lane & 3, h = (lane >> 2) & 1, kc = warp & 1, tb = 4 * (warp >> 1) + (lane >> 3);
    WLoad L;
    L.wcol = 16 * (tid & 3);
    L.xcol = 32 * kc + 16 * h + 4 * j;
    L.w[0] = W0 + (size_t)(row0 + (tid >> 2)) * K + L.wcol;
    L.w[1] = W1 + (size_t)(row0 + row1 + (tid >> 2)) * K + L.wcol;
    L.x = X + (size_t)(t0 + tb) * K + L.xcol;
    L.wdst = (tid >> 2) * 64 + L.wcol;
    L.xdst = W_WBYTES + j * W_XSTEP + kc * (W_TOK * 16) + tb * 16 + h * 8;
    L.wrows[0] = N - row0 - (tid >> 2);
    L.wrows[1] = N - row0 - row1 - (tid >> 2);
    L.xtoks = T - t0 - tb;
    return L;
}

// Unit u into the stage at byte offset st (generic smem + st for W, shared-window sbase + st for X); zero fill
// outside N, T and K (K % 16 == 0, so a piece is wholly inside or outside).
__device__ __forceinline__ void w_stage_load(const WLoad &L, uint8_t *smem, uint32_t sbase, uint32_t st, int u, int K,
                                             const void *W, const void *X) {
    const int k0 = u << 6;
    const bool wk = k0 + L.wcol < K, xk = k0 + L.xcol < K;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const bool ok = wk && L.wrows[i] > 0;
        cp_async16(smem + st + L.wdst + 4096 * i, ok ? (const void *)(L.w[i] + k0) : W, ok);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const bool ok = xk && 16 * i < L.xtoks;
        cp_async8(sbase + st + L.xdst + 256 * i, ok ? (const void *)(L.x + (size_t)(16 * i) * K + k0) : X, ok);
    }
}

// Slice-major order (linear_common.cuh slice_major_unit), one step at a time: the unit after u.
__device__ __forceinline__ int w_next_unit(int u, int units) { return u + 8 < units ? u + 8 : (u & 7) + 1; }

// The A fragments of step j = 0..3 for the lane's rows r, r + 8 (stage bytes sw; see the header for the slots).
__device__ __forceinline__ void w_stage_a(const uint8_t *sw, int r, int q, uint32_t (&a)[4][4]) {
    const int c = 16 * (q >> 1);
    const uint4 ga = *reinterpret_cast<const uint4 *>(sw + r * 64 + c);
    const uint4 gb = *reinterpret_cast<const uint4 *>(sw + r * 64 + 32 + c);
    const uint4 ha = *reinterpret_cast<const uint4 *>(sw + (r + 8) * 64 + c);
    const uint4 hb = *reinterpret_cast<const uint4 *>(sw + (r + 8) * 64 + 32 + c);
    const uint32_t wga[4] = {ga.x, ga.y, ga.z, ga.w}, wgb[4] = {gb.x, gb.y, gb.z, gb.w};
    const uint32_t wha[4] = {ha.x, ha.y, ha.z, ha.w}, whb[4] = {hb.x, hb.y, hb.z, hb.w};
    const uint32_t sel = (q & 1) ? 0x7632u : 0x5410u;        // the lane's half of each word, from both pieces
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        e4m3x4_to_bf16x4(__byte_perm(wga[j], wgb[j], sel), a[j][0], a[j][2]);
        e4m3x4_to_bf16x4(__byte_perm(wha[j], whb[j], sel), a[j][1], a[j][3]);
    }
}

// The loop state: the unit consumed now (uc) and its stage (sc); the next unit to load (ul) and its stage (sl).
struct WState {
    int uc, sc, ul, sl;
};

// One unit (the i-th in slice-major order) of the warpgroup's 64 rows x 128 tokens; A fragments in a[BUF].
template <int BUF>
__device__ __forceinline__ void w_unit(int i, int units, WState &S, const WLoad &L, uint8_t *smem, uint32_t sbase,
                                       const void *W0, const __nv_bfloat16 *__restrict__ X, int K, int r, int q,
                                       float (&acc)[64], float *tot, uint32_t (&a)[2][4][4]) {
    cp_async_wait<W_STAGES - 3>();                            // unit i's pieces (this thread's) have landed
    fence_proxy_async();                                      // ... and are visible to the tensor cores
    __syncthreads();                                          // everyone's; unit i-2's wgmmas are done
    if (i + W_STAGES - 2 < units) {
        w_stage_load(L, smem, sbase, S.sl * W_STAGE, S.ul, K, W0, X);
        S.ul = w_next_unit(S.ul, units);
        S.sl = S.sl + 1 == W_STAGES ? 0 : S.sl + 1;
    }
    cp_async_commit();                                        // (maybe empty) keeps the group count uniform
    const uint32_t st = S.sc * W_STAGE;
    w_stage_a(smem + st, r, q, a[BUF]);
    wg_fence();
    fence_acc(acc);
#pragma unroll
    for (int j = 0; j < 4; ++j) wgmma_n<128>(acc, a[BUF][j], x_desc(sbase + st + W_WBYTES + j * W_XSTEP));
    wg_commit();
    const int u = S.uc;
    S.uc = w_next_unit(u, units);
    S.sc = S.sc + 1 == W_STAGES ? 0 : S.sc + 1;
    if (u + 8 >= units) {                                     // the last unit of slice u % 8: fold it
        wg_wait<0>();
        fence_acc(acc);
#pragma unroll
        for (int e = 0; e < 64; ++e) {                        // tot starts at -0.0f: -0 + x == x, bit for bit
            float &t = tot[e * 256 + threadIdx.x];
            t = __fadd_rn(t, acc[e]);
            acc[e] = 0.f;
        }
    } else {
        wg_wait<1>();                                         // unit i-1's wgmmas are done: a[BUF ^ 1] is free
    }
}

// tot[e * 256 + tid] (shared) = the folded slice sums of the warpgroup's 64 stage rows (w_load_setup: W0 / W1) x 128
// tokens (from t0) against X, element e of the m64n128 D fragment. Leaves no cp.async group or wgmma pending.
__device__ __forceinline__ void w_mainloop(uint8_t *smem, uint32_t sbase, const void *W0, const void *W1, int row1,
                                           int N, const __nv_bfloat16 *__restrict__ X, int T, int K, int row0, int t0,
                                           int r, int q, float *tot) {
    const int units = (K + 63) >> 6;
    float acc[64];
    uint32_t a[2][4][4];
#pragma unroll
    for (int e = 0; e < 64; ++e) {
        acc[e] = 0.f;
        tot[e * 256 + threadIdx.x] = -0.f;                    // so that slice 0's fold is tot = acc exactly
    }
    const WLoad L = w_load_setup(reinterpret_cast<const uint8_t *>(W0), reinterpret_cast<const uint8_t *>(W1), row1, X,
                                 row0, t0, N, K, T);
    WState S = {0, 0, 0, 0};
#pragma unroll
    for (int s = 0; s < W_STAGES - 2; ++s) {                  // prologue: the first W_STAGES-2 units
        if (s < units) {
            w_stage_load(L, smem, sbase, s * W_STAGE, S.ul, K, W0, X);
            S.ul = w_next_unit(S.ul, units);
        }
        cp_async_commit();
    }
    S.sl = W_STAGES - 2;
    for (int i = 0; i < units; i += 2) {
        w_unit<0>(i, units, S, L, smem, sbase, W0, X, K, r, q, acc, tot, a);
        if (i + 1 < units) w_unit<1>(i + 1, units, S, L, smem, sbase, W0, X, K, r, q, acc, tot, a);
    }
    wg_wait<0>();
    cp_async_wait<0>();
    for (int s = units; s < SLICES; ++s)                      // empty slices (K < 512): their partial is +0.0f
#pragma unroll
        for (int e = 0; e < 64; ++e) tot[e * 256 + threadIdx.x] = __fadd_rn(tot[e * 256 + threadIdx.x], 0.f);
}

// GELU: projection 0 = gate, 1 = up (same N), 64 rows per CTA: warpgroup 0 runs the gate rows, warpgroup 1 the up
// rows of the same outputs, in one K loop; warpgroup 0 leaves gelu_in of each output (bf16-rounded, so exact in
// bf16) in shared memory and warpgroup 1 stores gelu_mul(gate, up) into projection 0's Y, as store_out<.., GELU> does.
template <bool GELU>
__device__ __forceinline__ void w_body(const __nv_bfloat16 *__restrict__ X, int T, int K, const Proj &q0,
                                       const Proj &q1, const Proj &q2, const Proj &q3) {
    extern __shared__ __align__(128) uint8_t smem[];
    pdl_trigger();
    pdl_wait();
    constexpr int RT = GELU ? 64 : W_ROWS;                    // output rows per CTA
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    int b = blockIdx.x;
    const Proj p0 = GELU ? q0 : pick(b, RT, q0, q1, q2, q3);
    const Proj p1 = GELU ? q1 : p0;
    const int row0 = b * RT, t0 = blockIdx.y * W_TOK;
    const int r = 16 * warp + g;                              // the lane's first stage row (and r + 8)
    const uint32_t sbase = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    float *tot = reinterpret_cast<float *>(smem + W_STAGES * W_STAGE);    // this thread's: [e * 256 + tid]
    w_mainloop(smem, sbase, p0.W, p1.W, GELU ? 0 : 64, p0.N, X, T, K, row0, t0, r, q, tot);
    // D fragment of m64n128: element 4n + i = row (16 warp-in-group + g, + 8 for i >= 2), token 8n + 2q + (i & 1)
    const int rr = GELU ? r - 64 * (warp >> 2) : r;           // the lane's first output row in the CTA's tile
    if (GELU) {
        __nv_bfloat16 *gate = reinterpret_cast<__nv_bfloat16 *>(smem + W_SMEM);  // [e * 128 + tid of warpgroup 0]
        if (warp < 4) {
#pragma unroll
            for (int e = 0; e < 64; ++e) {
                const int row = row0 + rr + ((e & 2) ? 8 : 0);
                const float v = row < p0.N ? gelu_in<FMT_FP8>(p0, tot[e * 256 + threadIdx.x], row) : 0.f;
                gate[e * 128 + threadIdx.x] = __float2bfloat16_rn(v);
            }
        }
        __syncthreads();
        if (warp >= 4) {                                      // warpgroup 1: the up rows, and the stores
#pragma unroll
            for (int n = 0; n < 16; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int e = 4 * n + i, row = row0 + rr + ((i & 2) ? 8 : 0), tok = t0 + 8 * n + 2 * q + (i & 1);
                    if (row < p0.N && tok < T)
                        reinterpret_cast<__nv_bfloat16 *>(p0.Y)[(size_t)tok * p0.N + row] =
                            gelu_mul(__bfloat162float(gate[e * 128 + threadIdx.x - 128]),
                                     gelu_in<FMT_FP8>(p1, tot[e * 256 + threadIdx.x], row));
                }
        }
    } else {
#pragma unroll
        for (int n = 0; n < 16; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int e = 4 * n + i, row = row0 + rr + ((i & 2) ? 8 : 0), tok = t0 + 8 * n + 2 * q + (i & 1);
                const float v = tot[e * 256 + threadIdx.x];
                if (row < p0.N && tok < T) store_out<FMT_FP8, false, false>(p0, p0, v, v, row, tok);
            }
    }
}

// linear.cu's signature (X, T, K, 4 x (W, S, s_arg, Y, N)); FP8 e4m3 weights with a per-tensor (s_arg 0) /
// per-channel (1) scale; block 256; requires K % 16 == 0 and 16-byte aligned X, W (the launcher checks).
//   gemm_fp8_bf16_w: Y_p = X @ W_p^T (bf16) for projections 0..3; grid (sum_p ceil(N_p/128), ceil(T/128)), dynamic
//     smem W_SMEM;
//   gelu_fp8_bf16_w: projection 0 = gate, 1 = up, Y_0 = act; grid (ceil(N/64), ceil(T/128)), dynamic smem
//     W_SMEM + W_GATE.
#define W_PARAMS                                                                                                \
    const __nv_bfloat16 *__restrict__ X, int T, int K, const void *W0, const float *S0, int sa0, void *Y0, int N0, \
        const void *W1, const float *S1, int sa1, void *Y1, int N1, const void *W2, const float *S2, int sa2,     \
        void *Y2, int N2, const void *W3, const float *S3, int sa3, void *Y3, int N3
#define W_PROJS {{W0, S0, sa0, Y0, N0}, {W1, S1, sa1, Y1, N1}, {W2, S2, sa2, Y2, N2}, {W3, S3, sa3, Y3, N3}}
extern "C" __global__ void __launch_bounds__(256, 1) gemm_fp8_bf16_w(W_PARAMS) {
    const Proj p[4] = W_PROJS;
    w_body<false>(X, T, K, p[0], p[1], p[2], p[3]);
}
extern "C" __global__ void __launch_bounds__(256, 1) gelu_fp8_bf16_w(W_PARAMS) {
    const Proj p[4] = W_PROJS;
    w_body<true>(X, T, K, p[0], p[1], p[2], p[3]);
}
