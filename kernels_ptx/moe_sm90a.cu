// The NVFP4 experts on Hopper's wgmma (sm_90a): moe.cu's grouped path (moe_gate_up_mma_n* -> moe_down_mma_n*) with
// the same per-output arithmetic, bit for bit (moe_common.cuh states it), on warpgroup MMAs. layers/moe.py runs it
// on sm_90 from WG_MIN_T tokens (path "wgmma"); at T = 2048 its two expert kernels take 710 us per layer against
// the grouped path's 1,233 (BENCHMARKS.md, tenth session).
//
// Why the bits are the same: wgmma m64nNk16 with A from registers and B from shared memory computes each k16 step
// exactly as mma.sync m16n8k16 with the same fragments (measured on the H200, 2026-11-30: linear_sm90a.cu's
// header). Here A is the same register fragment moe.cu builds (the same exact NVFP4 -> bf16 decode of the same
// lane's 32 columns per super unit, the same step order), and B holds, for every step, the same 16 columns in the
// same k slots: the activations are first copied into a PERMUTED column order in which each step's 16 slots are
// contiguous (32 bytes), so that B can be staged with plain 16-byte cp.async pieces in the wgmma layout:
//   position 16 s + slot of a super unit (s = 2m + h the step, slot as in moe_common.cuh) holds
//     slot 2q + j      <- column 32q + 8m + 4h + j       (j = 0, 1)
//     slot 2q + 8 + j  <- column 32q + 8m + 4h + 2 + j
//   (columns >= K are zero). moe_permute_x makes that copy of x; the gate/up kernel writes u in it directly.
// Each super unit's 8 steps run from zeroed registers (not scale-d = 0: a chain of -0.0 products stays as the mma
// chain leaves it) and the unit's partial is added to the fp32 total with __fadd_rn from +0.0f, units ascending,
// exactly as nvfp4_mma_run does.
//
// CTA: 2 warpgroups (256 threads), one tile (expert e, grouped positions q0 .. q0 + nq - 1, nq <= NTOK) of
// moe_group_tiles with TS = NTOK. Warp w of a warpgroup owns 16 weight rows (its A rows g and g + 8); the
// warpgroup's 64 rows are wgmma's M, the tile's tokens (rounded up, with_tokens) its N. A cp.async pipeline of ST
// super units brings each stage's activation rows (128-byte swizzle, see b_desc) and the warps' NVFP4 bytes; the A
// fragments are decoded from shared memory.
// What the speed came from (H200, same call each, T = 2048 gate_up + down): the first version (no swizzle, weights
// loaded straight into registers, 1 CTA per SM) 955 + 785 us, slower than mma.sync (718 + 541); weights through
// shared memory (a register load in flight makes wgmma.fence wait for it) 915 + 752; 128-byte swizzle for the
// activations 662 + 583; one A buffer and <= 128 registers, so that 2 CTAs share an SM and hide each other's waits
// (the decisive step) 603 + 397 at 64 tokens per tile with 4 stages. Tenth session (the same test, another call;
// the kernels are issue-bound, so instructions pay): 531 + 372 before; the stage loads from 32-bit byte offsets,
// not per-piece 64-bit pointers that ptxas rebuilt from the parameters every unit under the 128-register cap (the
// unit loop 446 -> 331 SASS instructions) 453 + 346; no global load in the epilogues, gate and up rows of an
// output in one warp, 2 down blocks a CTA: 426 + 284; the step descriptors by one add each (b_desc_step): 423 + 282.
// Thirteenth session: MMAs as wide as the tile's tokens, not NTOK (a 508-token prompt's tiles hold ~32 of 64), and
// no copies of the activation rows they skip: T = 508 182.2 + 112.0 -> 151.8 + 98.6, T = 2048 430.8 + 290.8 ->
// 400.6 + 284.8 (one call; launches vary by ~ +-7 us). Thirty-third session: the down epilogue's outputs through
// shared memory as 16-byte stores (down_wg_body, 64-token tiles): a 2,048-token prefill's 30 moe_down_wg64 launches
// 7,964 -> 7,898 us, the eager step 40.67 -> 40.48 ms (medians of 10 single steps after idle, alternating in one
// process).
// At the decode batches (8-64 tokens, the wg32 kernels) they are not issue-bound: dev builds with a part left out
// (fifty-ninth session, whole expert calls, BENCHMARKS.md) took 7% less without the NVFP4 decode (30% of the N = 8
// unit loop's instructions), nothing less without the MMAs, 11-19% less without the weight loads and 31-35% less
// without loads and decode: each unit's arrival, decode and MMAs run one after the other, beside a large fixed rest.
// Stages released in pairs (one barrier per two units) took those calls -3% .. +0.5%: not kept. Clock stamps in each
// unit (sixtieth session) place most of that rest outside the loop: inside a CTA the weights stream at 71-74% of the
// copy rate, but the SMs' two CTA slots hold mainloops for only 60-75% of a launch (setup, first-stage latency, CTAs
// rounding up to whole rounds of the slots; 2.6-2.9 us from a CTA's entry to its loop). Half units decoded under the
// other half's MMAs, an activation-loader warp handing stages over by mbarriers, descriptors stepped by 64-bit adds
// (6% fewer loop instructions) and the first weight copies issued ahead of the setup's loads all lost or tied
// (BENCHMARKS.md).
#include <cuda_bf16.h>
#include <stdint.h>

#include "pdl.cuh"
#include "moe_common.cuh"
#include "xperm.cuh"      // perm_pos / perm_col: the permuted column order
#include "wgmma.cuh"

// xp (T, Kp) <- x (T, K) in the permuted order, Kp = 128 ceil(K / 128), zeros past K. grid (ceil(Kp / 8 / block),
// T), block <= Kp / 8: one 16-byte chunk of xp (words 4 j .. 4 j + 3 of a super unit, j = 0..15) per thread, from the
// 4-byte words at columns 32 i + perm_col(4 j) (i = 0..3) of x: a warp's 4 loads read its 2 super units' 512 bytes
// whole. (One 4-byte word a thread before: T = 2048 15.4 -> 4.2 us, graph-replayed; sixteenth session.)
extern "C" __global__ void __launch_bounds__(512) moe_permute_x(const bf16 *__restrict__ x, bf16 *__restrict__ xp,
                                                                int K, int Kp) {
    pdl_entry();
    const int t = blockIdx.y, ch = blockIdx.x * blockDim.x + threadIdx.x;   // chunk: super unit ch / 16, j = ch % 16
    if (8 * ch >= Kp) return;
    const int c0 = (ch >> 4) * 128 + perm_col(4 * (ch & 15));
    const uint32_t *xr = reinterpret_cast<const uint32_t *>(x + (size_t)t * K);
    uint32_t v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = c0 + 32 * i < K ? xr[(c0 + 32 * i) >> 1] : 0u;   // perm_col(4j + i) = c0 + 32 i
    reinterpret_cast<uint4 *>(xp + (size_t)t * Kp)[ch] = make_uint4(v[0], v[1], v[2], v[3]);
}

// Shared-memory descriptor of step s's B in the stage at st: K-major, 128-byte swizzle. The stage's X is 2 NTOK
// rows of 128 bytes, row u = 64-column half h (steps 4h .. 4h + 3) of token u - h NTOK; the 16-byte chunk c of a row
// (step 4h + c / 2, k half c % 2) lies at chunk c ^ (u % 8). The step starts 32 (s % 4) bytes into its half's first
// row; stride byte offset 1024 (8 rows), leading byte offset unused (1); the stage is 1024-byte aligned.
template <int NTOK> __device__ __forceinline__ uint64_t b_desc(uint32_t st, int s) {
    const uint32_t addr = st + (s >> 2) * (128 * NTOK) + 32 * (s & 3);
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) |
           ((uint64_t)1 << 62);
}
// The same descriptors from the low word of step 0's (lo0 = b_desc(st, 0)): a shared-window address is below 2^18,
// so the address field (bits 0..13, in 16-byte units) takes step s's offset without a carry into the other fields;
// one add a step instead of b_desc's five instructions, in the loop that issues them.
template <int NTOK> __device__ __forceinline__ uint64_t b_desc_step(uint32_t lo0, int s) {
    const uint32_t lo = lo0 + (((s >> 2) * (128 * NTOK) + 32 * (s & 3)) >> 4);
    return (uint64_t)lo | ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}

// A thread's cp.async pieces of every super unit, as 32-bit byte offsets from the kernel's base pointers, so that a
// unit's loads are a few adds each (the 64-bit address arithmetic of per-piece pointers, rebuilt from the kernel
// parameters every unit under the 128-register cap, had been ~200 of the unit loop's ~450 instructions).
//   X: piece j (0 .. NTOK/16 - 1) = chunk c = lane & 7 of row u = tid / 8 + 32 j (see b_desc): 8 lanes copy 128
//      contiguous bytes of a token into one 128-byte row. xo[j] = byte offset of the piece in X's permuted row
//      (unit 0); bit j of xok: a real token (else zero fill, from offset 0); bit j of xon: a token the MMAs read
//      (< N; the other pieces are not copied at all).
//   W: the lane's own NVFP4 words, as WRing loads them: rows g and g + 8 (h) of its warp's 16, columns 128 su + 32 q
//      .. + 31 (16 bytes; zeros past K) at WG_W + 16 (64 warp + 32 h + lane); the lanes with even q also copy the 4
//      scale bytes of columns 128 su + 64 (q >> 1) .. + 63 (theirs and lane q + 1's): row (warp, h, g)'s 8 scale
//      bytes of the unit lie at WG_S + 8 (16 warp + 8 h + g). Weights go through shared memory, not straight into
//      registers: an LDG still in flight into a register when wgmma.fence issues makes the fence wait for it (one
//      memory latency per unit; measured, see the header).
// Byte offsets fit 32 bits: the launcher checks the sizes of X and of the weights.
template <int NTOK>
struct WgLoad {
    uint32_t xo[NTOK / 16];
    uint32_t xok, xon;
    uint32_t xdst;                      // X piece 0's byte offset in a stage (piece j: + 4096 j)
    uint32_t wdst, sdst;                // row g's W / scale piece in a stage (row g + 8: + 512 / + 64)
    int K;
};

#define WG_W(NTOK) (256 * (NTOK))                  // stage layout: X, then W (8 KB), then the scales (1 KB)
#define WG_S(NTOK) (256 * (NTOK) + 8192)
#define WG_STAGE(NTOK) (256 * (NTOK) + 9216)
// Dynamic shared memory: up to 1 KB to align the stages to 1024 bytes (the swizzled layout's atoms), the stages,
// then the tile's NTOK row offsets (int), for the down projection its NTOK pair positions (int) and weights, then
// the expert's 6 global scale factors (gsc, 8 floats' room): the epilogues read no global memory but the outputs'.
#define WG_SMEM(NTOK, ST) (1024 + (ST) * WG_STAGE(NTOK) + 12 * (NTOK) + 32)
template <int NTOK> __device__ __forceinline__ float *wg_gsc(int *rowoff) {
    return reinterpret_cast<float *>(rowoff + 3 * NTOK);
}
__device__ __forceinline__ uint8_t *wg_stages(uint8_t *smem) {
    const uint32_t a = smem_u32(smem);
    return smem + (((a + 1023) & ~1023u) - a);
}

// rowoff: the tile's X rows (element offsets, -1 = no token).
template <int NTOK, int N>
__device__ __forceinline__ WgLoad<NTOK> wg_load_setup(const int *rowoff, int K) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, q = lane & 3, g = lane >> 2;
    WgLoad<NTOK> L;
    const int c = lane & 7, u0 = threadIdx.x >> 3;
    L.xok = L.xon = 0;
#pragma unroll
    for (int j = 0; j < NTOK / 16; ++j) {
        const int u = u0 + 32 * j, t = u % NTOK, h = u / NTOK;
        const int ro = rowoff[t];
        L.xo[j] = ro >= 0 ? 2u * (uint32_t)(ro + 64 * h + 8 * c) : 0u;
        L.xok |= (ro >= 0 ? 1u : 0u) << j;
        L.xon |= (t < N ? 1u : 0u) << j;
    }
    L.xdst = 128 * u0 + 16 * (c ^ (u0 & 7));
    L.wdst = WG_W(NTOK) + 16 * (64 * warp + lane);
    L.sdst = WG_S(NTOK) + 8 * (16 * warp + g) + 4 * (q >> 1);
    L.K = K;
    return L;
}

// The lane's two weight rows (A rows g and g + 8 of its warp's 16, h = 0 / 1): packed bytes w[h] + wo[h] at column
// 32 q, scales s[h] + so[h] at column 64 (q >> 1).
struct WgRows {
    const uint8_t *w[2], *s[2];
    uint32_t wo[2], so[2];
};

// Super unit su (X rows of the tile, the warps' weights R) into the stage at shared address st. Requires K % 64 ==
// 0 (16-byte packed pieces, 4-byte scale pieces; the launcher checks).
template <int NTOK>
__device__ __forceinline__ void wg_stage_load(const WgLoad<NTOK> &L, uint32_t st, const uint8_t *X, const WgRows &R,
                                              int su) {
    const uint32_t xu = 256u * su;
#pragma unroll
    for (int j = 0; j < NTOK / 16; ++j) {
        const bool ok = (L.xok >> j) & 1u;
        if ((L.xon >> j) & 1u) cp_async16(st + L.xdst + 4096 * j, X + (L.xo[j] + xu), ok);
    }
    const int q = threadIdx.x & 3;
    const bool wok = 128 * su + 32 * q < L.K, sok = 128 * su + 64 * (q >> 1) < L.K;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        cp_async16(st + L.wdst + 512 * h, R.w[h] + (R.wo[h] + 64u * su), wok);
        cp_async4_if(st + L.sdst + 64 * h, R.s[h] + (R.so[h] + 128u * su), sok ? 4u : 0u, !(q & 1));
    }
}

// The A fragments of the unit in the stage at generic address sp for the warp's 16 rows: steps 2m, 2m + 1 from word
// m of rows g and g + 8, exactly as nvfp4_mma_run builds them (MT = 1).
template <int NTOK>
__device__ __forceinline__ void wg_a(const uint8_t *sp, uint32_t (&a)[8][4]) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, q = lane & 3, g = lane >> 2;
    uint4 w[2];
    uint32_t S[2][2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        w[h] = *reinterpret_cast<const uint4 *>(sp + WG_W(NTOK) + 16 * (64 * warp + 32 * h + lane));
        const uint32_t s2 =
            *reinterpret_cast<const unsigned short *>(sp + WG_S(NTOK) + 8 * (16 * warp + 8 * h + g) + 2 * q);
        scales_bf16x2(s2, S[h][0], S[h][1]);
    }
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        uint32_t rg[4], rh[4];
        fp4x8_bf16(u4word(w[0], m), S[0][m >> 1], rg);
        fp4x8_bf16(u4word(w[1], m), S[1][m >> 1], rh);
        a[2 * m][0] = rg[0]; a[2 * m][1] = rh[0]; a[2 * m][2] = rg[1]; a[2 * m][3] = rh[1];
        a[2 * m + 1][0] = rg[2]; a[2 * m + 1][1] = rh[2]; a[2 * m + 1][2] = rg[3]; a[2 * m + 1][3] = rh[3];
    }
}

// For each of nb blocks of weight rows (rows(b, R) sets the lane's two rows of block b, WgRows), in order: tot
// (registers: the warpgroup's 64 rows x N tokens D fragment, element 4n + i = row 16 (warp & 3) + g (+ 8 for
// i >= 2), token 8n + 2q + (i & 1)) = the fp32 sum of the super units' partials, from +0.0f in ascending order, of
// the block's rows against the tile's rows of X (rowoff); then epi(b, tot, sp). ST stages run through the blocks' units
// as one sequence, so a block's first stages load while the one before finishes (no pipeline fill a block). Per
// unit: its 8 steps are issued into the zeroed partial (A decoded before); while they run, the next unit's stage is
// waited for and the previous unit's stage refilled; then the partial is added and the next unit's A fragments
// decoded (one A buffer: the registers allow 2 CTAs per SM, which hide each other's waits). epi of the last block
// runs with no cp.async group or wgmma pending and the stages free (barrier before it); the others run between
// units, with other stages in flight: sp, the stage of the block's last unit, is theirs to use once both warpgroups'
// MMAs of that unit are done (a barrier in epi), until the next unit's barrier (the stage's next load follows it).
// MULTI = false: nb must be 1 (no block loop).
// N (<= NTOK, a multiple of 8): the tokens the MMAs compute, the tile's nq rounded up to one of the widths
// with_tokens offers the kernel; the stages keep NTOK token rows, of which the MMAs read the first N.
template <int NTOK, int N, int ST, bool MULTI, class Rows, class Epi>
__device__ __forceinline__ void wg_mainloop(uint8_t *smem, const bf16 *Xe, const int *rowoff, int K, int nb,
                                            Rows rows, Epi epi) {
    const uint8_t *X = reinterpret_cast<const uint8_t *>(Xe);
    const int nsu = (K + 127) >> 7, nv = nb * nsu;
    const uint32_t sbase = smem_u32(smem);
    const uint32_t dlo = static_cast<uint32_t>(b_desc<NTOK>(sbase, 0));   // stage 0, step 0
    const WgLoad<NTOK> L = wg_load_setup<NTOK, N>(rowoff, K);
    // the next unit to load: unit ls of block lb (rows R)
    int ls = 0, lb = 0;
    WgRows R;
    rows(0, R);
    auto load_next = [&](int v) {
        wg_stage_load<NTOK>(L, sbase + (v % ST) * WG_STAGE(NTOK), X, R, ls);
        if (++ls == nsu && ++lb < nb) {
            ls = 0;
            rows(lb, R);
        }
    };
#pragma unroll
    for (int s = 0; s < ST - 1; ++s) {
        if (s < nv) load_next(s);
        cp_async_commit();
    }
    float part[N / 2], tot[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; ++i) tot[i] = part[i] = 0.f;
    uint32_t a[8][4];
    cp_async_wait<ST - 2>();                                  // unit 0
    fence_proxy_async();
    __syncthreads();
    wg_a<NTOK>(smem, a);
    int su = 0, b = 0;
    for (int v = 0; v < nv; ++v) {
        wg_fence();
        fence_acc(part);
#pragma unroll
        for (int s = 0; s < 8; ++s)
            wgmma_n<N>(part, a[s], b_desc_step<NTOK>(dlo + (v % ST) * (WG_STAGE(NTOK) >> 4), s));
        wg_commit();
        if (v + 1 < nv) {
            cp_async_wait<ST - 3>();                          // this thread's pieces of unit v + 1 have landed
            fence_proxy_async();                              // ... and are visible to the tensor cores
            __syncthreads();                                  // everyone's; unit v - 1's wgmmas are done
            if (v + ST - 1 < nv) load_next(v + ST - 1);       // into unit v - 1's stage
            cp_async_commit();                                // (maybe empty) keeps the group count uniform
        }
        wg_wait<0>();
        fence_acc(part);
#pragma unroll
        for (int i = 0; i < N / 2; ++i) {
            tot[i] = __fadd_rn(tot[i], part[i]);
            part[i] = 0.f;
        }
        if (MULTI && ++su == nsu && v + 1 < nv) {             // block b done, another follows
            epi(b, tot, smem + (v % ST) * WG_STAGE(NTOK));    // unit v's stage: refilled after the next barrier
#pragma unroll
            for (int i = 0; i < N / 2; ++i) tot[i] = 0.f;
            su = 0;
            ++b;
        }
        if (v + 1 < nv) wg_a<NTOK>(smem + ((v + 1) % ST) * WG_STAGE(NTOK), a);
    }
    cp_async_wait<0>();
    __syncthreads();                                          // the stages may be reused
    epi(b, tot, smem);
}

// f(TileN<N>()) for the smallest N = N0 - STEP j >= nq (1 .. N0; STEP a multiple of 8), a CTA-uniform branch: a
// tile of fewer tokens than NTOK issues narrower MMAs (each output's k16 steps and sums are the same for every N: the
// bits do not change) and copies only the activation rows they read. Dispatched at the top of the kernel, so each
// N's body is compiled on its own. The gate/up kernels take STEP 8; the down kernels STEP 24 (N = 64, 40, 16): with
// STEP 8 or 16 ptxas spilled 24-48 bytes in down_wg64's N = 64 loop, which sits at the 128-register cap (T = 2048:
// 290.8 -> 315.0 us against the kernel before; STEP 24 284.8 us. H200, dev A/B, BENCHMARKS.md thirteenth session).
template <int N> struct TileN { static constexpr int value = N; };
template <int N0, int STEP, class F> __device__ __forceinline__ void with_tokens(int nq, F f) {
    if constexpr (N0 > STEP) {
        if (nq <= N0 - STEP) {
            with_tokens<N0 - STEP, STEP>(nq, f);
            return;
        }
    }
    f(TileN<N0>());
}

// The lane's byte offsets of weight row r (of K columns): packed at column 32 q, scales (moe_common.cuh scale_row)
// at column 64 (q >> 1) of super unit 0 (unit su: + 128 su).
__device__ __forceinline__ void wg_row(uint32_t r, int K, uint32_t &wo, uint32_t &so) {
    const int q = threadIdx.x & 3;
    wo = r * (uint32_t)(K >> 1) + 16 * q;
    so = (uint32_t)scale_row(r, K) + 4 * (q >> 1);
}

// gate/up: grid (I / 64, max_tiles), block 256, tile blockIdx.y (exit if >= n_tiles). Warp w computes the outputs
// n = 64 blockIdx.x + 8 w + g: its A rows g are gate row n, its rows g + 8 up row n, so that each thread holds
// gate . x and up . x of the same outputs (no exchange between warps; at T = 2048, 450 -> 433 us against gate in
// one warpgroup and up in the other, which paired them through shared memory). x rows: xp (T, Hp),
// token perm[q] / k. up[q, pos] = bf16(gate_up_out(gate . x, up . x)) for the tile's grouped positions q, in the
// permuted order (row stride Ip = 128 ceil(I / 128)); the last CTA of a tile also writes the zeros of the columns I
// .. Ip - 1. Dynamic smem WG_SMEM(NTOK, ST). Requires I % 64 == 0 (the launcher checks).
template <int NTOK, int N, int ST>
__device__ __forceinline__ void gate_up_wg_body(const bf16 *__restrict__ xp, const int *__restrict__ perm,
                                                const int4 tl, const uint8_t *__restrict__ gw,
                                                const uint8_t *__restrict__ gs,
                                                const uint8_t *__restrict__ uw, const uint8_t *__restrict__ us,
                                                const float *__restrict__ gsc, bf16 *__restrict__ up, int H, int I,
                                                int k) {
    extern __shared__ __align__(128) uint8_t smem_wg[];
    uint8_t *stages = wg_stages(smem_wg);
    int *rowoff = reinterpret_cast<int *>(stages + ST * WG_STAGE(NTOK));
    const int e = tl.x, q0 = tl.y, nq = tl.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int Hp = (H + 127) & ~127, Ip = (I + 127) & ~127;
    float *g6 = wg_gsc<NTOK>(rowoff);
    for (int i = threadIdx.x; i < NTOK; i += blockDim.x) rowoff[i] = i < nq ? (perm[q0 + i] / k) * Hp : -1;
    if (threadIdx.x < 6) g6[threadIdx.x] = gsc[(size_t)e * 6 + threadIdx.x];
    __syncthreads();
    const int n = blockIdx.x * 64 + 8 * warp + g;            // the lane's output
    auto rows = [&](int, WgRows &R) {
        R.w[0] = gw; R.w[1] = uw; R.s[0] = gs; R.s[1] = us;
        wg_row((uint32_t)(e * I + n), H, R.wo[0], R.so[0]);
        R.wo[1] = R.wo[0]; R.so[1] = R.so[0];
    };
    auto epi = [&](int, auto &tot, uint8_t *) {               // tot: float[N / 2], N = the MMAs' tokens
        constexpr int N8 = sizeof(tot) / (4 * sizeof(float));
        const int lim = nq - 2 * q;                           // token 8j + 2q + c is real iff 8j + c < lim
        bf16 *col = up + (size_t)q0 * Ip + (n & ~127) + perm_pos(n & 127);
#pragma unroll
        for (int j = 0; j < N8; ++j)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int tok = 8 * j + 2 * q + c;
                if (8 * j + c < lim)
                    col[(size_t)tok * Ip] =
                        __float2bfloat16_rn(gate_up_out(tot[4 * j + c], tot[4 * j + 2 + c], g6, g6 + 2));
            }
    };
    wg_mainloop<NTOK, N, ST, false>(stages, xp, rowoff, H, 1, rows, epi);
    if (blockIdx.x == gridDim.x - 1)                          // the padding columns I .. Ip - 1 read as zeros
        for (int i = threadIdx.x; i < nq * (Ip - I); i += blockDim.x) {
            const int tok = i / (Ip - I), r = I + i % (Ip - I);
            up[(size_t)(q0 + tok) * Ip + (r & ~127) + perm_pos(r & 127)] = __float2bfloat16_rn(0.f);
        }
}

// down: grid (ceil(ceil(H / 128) / nbk), max_tiles), block 256; the CTA runs the 128-row blocks nbk blockIdx.x ..
// + nbk - 1 (those below H) of tile blockIdx.y one after the other through one stage ring; in block c, warpgroup w
// owns output rows 128 c + 64 w .. + 63 (warps past H compute a copy of the last 16 rows and store nothing); u rows
// of the tile: up (P, Ip) grouped positions q0 .. q0 + nq - 1. o[p, n] = bf16((down_e[n] . u[q] / g_down) * w[p]),
// p = perm[q], in PAIR order (moe.cu's down_grouped_body); moe_combine_bf16 sums the slots. The tile's p and w[p]
// are staged in shared memory beside the row offsets (with the global scales), so the stores wait on no global
// load: at T = 2048 this took the launch from 348 to 293 us (BENCHMARKS.md, tenth session).
template <int NTOK, int N, int ST>
__device__ __forceinline__ void down_wg_body(const bf16 *__restrict__ up, const int *__restrict__ perm,
                                             const int4 tl, const uint8_t *__restrict__ dw,
                                             const uint8_t *__restrict__ ds,
                                             const float *__restrict__ gsc, const float *__restrict__ weights,
                                             bf16 *__restrict__ o, int H, int I, int nbk) {
    extern __shared__ __align__(128) uint8_t smem_wg[];
    uint8_t *stages = wg_stages(smem_wg);
    int *rowoff = reinterpret_cast<int *>(stages + ST * WG_STAGE(NTOK));
    int *pos = rowoff + NTOK;
    float *wt = reinterpret_cast<float *>(pos + NTOK), *g6 = wg_gsc<NTOK>(rowoff);
    const int e = tl.x, q0 = tl.y, nq = tl.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int c0 = blockIdx.x * nbk, nb = min(nbk, (H + 127) / 128 - c0);
    const int Ip = (I + 127) & ~127;
    for (int i = threadIdx.x; i < NTOK; i += blockDim.x) {
        const int p = i < nq ? perm[q0 + i] : 0;
        rowoff[i] = i < nq ? (q0 + i) * Ip : -1;
        pos[i] = p;
        wt[i] = i < nq ? weights[p] : 0.f;
    }
    if (threadIdx.x < 6) g6[threadIdx.x] = gsc[(size_t)e * 6 + threadIdx.x];
    __syncthreads();
    const float *gd = g6 + 4;
    auto first = [&](int b) { return (c0 + b) * 128 + 16 * warp; };      // the warp's first row in block b
    // The block's outputs go out through shared memory (sp: a free stage, see wg_mainloop), token-major: 256 bytes a
    // token (the block's 128 rows), its 16-byte piece p (rows 8p .. 8p + 7) at (p ^ (token & 7)) << 4. Each warp puts
    // its 16 rows in with stmatrix.trans (the D fragment: lane (g, q) holds row g, tokens 2q and 2q + 1 of each 8 x 8
    // block; transposed, each stored line is one token's 8 rows), then the CTA stores whole 16-byte pieces of the
    // real tokens' rows (those past H not), in place of 4 two-byte stores a thread an 8-token block. Only in the
    // 64-token tiles (prompts): the decode batches' 32-token tiles, a few tokens each, store straight from the
    // fragments (with the staging, its two barriers a block: batch 16 / 64 / 128 decode steps 6.89 / 13.32 / 20.77 ->
    // 7.04 / 13.60 / 21.16 ms; H200, thirty-third session).
    auto epi = [&](int b, auto &tot, uint8_t *sp) {           // tot: float[N / 2], N = the MMAs' tokens
        constexpr int N8 = sizeof(tot) / (4 * sizeof(float));
        if constexpr (NTOK < 64) {
            const int lim = nq - 2 * q;                       // token 8n + 2q + c is real iff 8n + c < lim
            const int n0 = first(b);
            if (n0 >= H) return;
#pragma unroll
            for (int n = 0; n < N8; ++n)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int tok = 8 * n + 2 * q + c;
                    if (8 * n + c < lim) {
                        const float w = wt[tok];
                        bf16 *orow = o + (size_t)pos[tok] * H + n0 + g;
                        orow[0] = __float2bfloat16_rn(__fmul_rn(apply_global(tot[4 * n + c], gd), w));
                        orow[8] = __float2bfloat16_rn(__fmul_rn(apply_global(tot[4 * n + 2 + c], gd), w));
                    }
                }
            return;
        }
        const uint32_t os = smem_u32(sp);
        const int j = lane & 7, mi = lane >> 3, piece = 2 * warp + (mi & 1), base = (c0 + b) * 128;
        auto pk = [&](float x, float wx, float y, float wy) {   // bf16x2 (x's output low, y's high)
            const __nv_bfloat162 v = __floats2bfloat162_rn(__fmul_rn(apply_global(x, gd), wx),
                                                           __fmul_rn(apply_global(y, gd), wy));
            return *reinterpret_cast<const uint32_t *>(&v);
        };
        __syncthreads();                                      // both warpgroups' MMAs have read the stage
#pragma unroll
        for (int n = 0; n < N8; n += 2) {
            const float w0 = wt[8 * n + 2 * q], w1 = wt[8 * n + 2 * q + 1];
            const uint32_t r0 = pk(tot[4 * n], w0, tot[4 * n + 1], w1), r1 = pk(tot[4 * n + 2], w0, tot[4 * n + 3], w1);
            if (n + 1 < N8) {
                const float w2 = wt[8 * n + 8 + 2 * q], w3 = wt[8 * n + 9 + 2 * q];
                const int tok = 8 * (n + (mi >> 1)) + j;
                stmatrix_x4_trans(os + tok * 256 + ((piece ^ j) << 4), r0, r1,
                                  pk(tot[4 * n + 4], w2, tot[4 * n + 5], w3), pk(tot[4 * n + 6], w2, tot[4 * n + 7], w3));
            } else {                                          // an odd last 8-token block: lanes 0 .. 15
                stmatrix_x2_trans(os + (8 * n + j) * 256 + ((piece ^ j) << 4), r0, r1);
            }
        }
        __syncthreads();
        for (int i = threadIdx.x; i < nq * 16; i += blockDim.x) {
            const int tok = i >> 4, p = i & 15;
            if (base + 8 * p >= H) continue;
            const uint4 v = lds128(os + tok * 256 + ((p ^ (tok & 7)) << 4));
            *reinterpret_cast<uint4 *>(o + (size_t)pos[tok] * H + base + 8 * p) = v;
        }
    };
    auto rows = [&](int b, WgRows &R) {
        R.w[0] = R.w[1] = dw; R.s[0] = R.s[1] = ds;
        wg_row((uint32_t)(e * H + min(first(b), H - 16) + g), I, R.wo[0], R.so[0]);
        R.wo[1] = R.wo[0] + 8u * (uint32_t)(I >> 1);          // row g + 8
        R.so[1] = R.so[0] + 64u;                              // (rows are 16-aligned + g: g + 8, same block)
    };
    wg_mainloop<NTOK, N, ST, true>(stages, up, rowoff, I, nb, rows, epi);
}

// The down launch chained to the gate/up launch by a counter a tile (sync non-null; layers/moe.py WG_CHAIN): the
// gate/up CTAs of tile j each add 1 to sync[1 + j] once their stores of up (padding columns included) are released;
// the down launch goes with PDL and does not wait for the whole gate/up grid (griddepcontrol.wait), but each of its
// CTAs for the counter of its own tile to reach I / 64 (the gate/up grid's x). So the gate/up grid's last,
// part-empty wave of CTAs (2 an SM; ~86-127 tiles x 11 blocks at the decode batches) fills with the down CTAs of
// the tiles already done, and the boundary between the launches goes. No deadlock: PDL starts the down grid only
// once every gate/up CTA has started (they trigger at entry), so a waiting down CTA holds no slot a gate/up CTA needs.
// Everything else the down CTAs read (tiles, perm, weights) comes from launches before the gate/up one, which is
// plain. The last down CTA to leave (sync[0] counts them) zeroes sync[0 .. 1 + n_tiles) for the next call. So a
// chained down launch must follow its own gate/up launch on the stream: alone (a launch timed by itself, or run twice)
// its CTAs would wait for counters nobody raises, and trap after a second (tile_wait; the MoE timing test times
// the two together).
// H200, fortieth session (BENCHMARKS.md), whole moe_gpu calls at the real shapes, us: T = 8 93.5 -> 87.0, 16
// 125.9 -> 121.8, 64 181.0 -> 178.0, 128 189.9 -> 187.7, 512 265.9 -> 259.2, 2,048 700.8 -> 698.4; decode steps
// b16 6.8125 -> 6.7036 ms, b32 9.6851 -> 9.5368, b64 13.3820 -> 13.2586, b128 19.5166 -> 19.6174 (within its drift).
// (The two launches as one persistent grid taking items by ticket, tried first: T = 8 83.9, 16 119.6, 128 191.6,
// 2,048 773.0 us; b16 6.7523, b64 13.3548, b128 19.6672 ms: its CTAs hold every SM until the last item, so the
// dense MLP's branch waits. Not kept.)
__device__ __forceinline__ int ld_acquire_gpu(const int *p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void red_release_gpu(int *p, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void tile_done(int *cnt) {          // every thread, after its stores of up
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) red_release_gpu(cnt, 1);
}
// A misuse of the contract above (a chained down launch without its gate/up launch) would hang the GPU; instead
// the waiting thread gives up after CHAIN_WAIT_NS of GPU clock and traps, so the launch fails (H200:
// CUDA_ERROR_LAUNCH_FAILED at the next sync, 1.6 s after the launch; test_gpu_moe_wgmma_chain_alone_traps). A tile's
// gate/up CTAs take microseconds; the bound is a second, far from any real wait (but a debugger's breakpoint in a
// gate/up CTA that holds longer trips it). The bound's cost, decode A/B in one process (forty-first session): b8
// 5.0358 vs 5.0559 ms without it, b16 6.8051 vs 6.7951, b64 13.5915 vs 13.5931 (noise).
#define CHAIN_WAIT_NS 1000000000ull
__device__ __forceinline__ unsigned long long globaltimer_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
    return t;
}
__device__ __forceinline__ void tile_wait(const int *cnt, int n) {
    if (threadIdx.x == 0 && ld_acquire_gpu(cnt) < n) {
        const unsigned long long t0 = globaltimer_ns();
        while (ld_acquire_gpu(cnt) < n) {
            __nanosleep(128);
            if (globaltimer_ns() - t0 > CHAIN_WAIT_NS) __trap();
        }
    }
    __syncthreads();
}
__device__ __forceinline__ void chain_leave(int *sync, int nt, int ctas) {
    __shared__ int s_last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        s_last = atomicAdd(sync, 1) == ctas - 1;
    }
    __syncthreads();
    if (s_last)                                               // every other down CTA has left
        for (int i = threadIdx.x; i < 1 + nt; i += blockDim.x) sync[i] = 0;
}

// Kernels: (name, NTOK tokens per tile (= moe_group_tiles' TS), ST stages); moe.cu's grouped signatures, with xp /
// up in the permuted order, and sync (above; null: two plain launches); 2 CTAs per SM (<= 128 registers). Requires
// H % 64 == 0 and I % 64 == 0. The table in layers/moe.py (_WG_KERNELS) must match; it checks the shapes.
#define GU_WG(NAME, NTOK, ST)                                                                                     \
    extern "C" __global__ void __launch_bounds__(256, 2) NAME(                                                     \
        const bf16 *__restrict__ xp, const int *__restrict__ perm, const int4 *__restrict__ tiles,               \
        const int *__restrict__ n_tiles, const uint8_t *__restrict__ gw, const uint8_t *__restrict__ gs,          \
        const uint8_t *__restrict__ uw, const uint8_t *__restrict__ us, const float *__restrict__ gsc,            \
        bf16 *__restrict__ up, int H, int I, int k, int *sync) {                                                 \
        pdl_entry();                                                                                              \
        if ((int)blockIdx.y >= n_tiles[0]) return;                                                                \
        const int4 tl = tiles[blockIdx.y];                                                                        \
        with_tokens<NTOK, 8>(tl.z, [&](auto n) {                                                                  \
            gate_up_wg_body<NTOK, decltype(n)::value, ST>(xp, perm, tl, gw, gs, uw, us, gsc, up, H, I, k);        \
        });                                                                                                       \
        if (sync) tile_done(sync + 1 + blockIdx.y);                                                               \
    }
#define DN_WG(NAME, NTOK, ST)                                                                                     \
    extern "C" __global__ void __launch_bounds__(256, 2) NAME(                                                     \
        const bf16 *__restrict__ up, const int *__restrict__ perm, const int4 *__restrict__ tiles,               \
        const int *__restrict__ n_tiles, const uint8_t *__restrict__ dw, const uint8_t *__restrict__ ds,          \
        const float *__restrict__ gsc, const float *__restrict__ weights, bf16 *__restrict__ o, int H, int I,     \
        int nbk, int *sync) {                                                                                     \
        if (sync) pdl_trigger(); else pdl_entry();            /* chained: the tile's counter, not the grid */      \
        const int nt = __ldcg(n_tiles);                       /* .cg: not hoisted above pdl_entry's wait */        \
        if ((int)blockIdx.y < nt) {                                                                               \
            const int4 tl = __ldcg(tiles + blockIdx.y);                                                           \
            if (sync) tile_wait(sync + 1 + blockIdx.y, I / 64);                                                   \
            with_tokens<NTOK, 24>(tl.z, [&](auto n) {                                                             \
                down_wg_body<NTOK, decltype(n)::value, ST>(up, perm, tl, dw, ds, gsc, weights, o, H, I, nbk);     \
            });                                                                                                   \
        }                                                                                                         \
        if (sync) chain_leave(sync, nt, gridDim.x * gridDim.y);                                                   \
    }
GU_WG(moe_gate_up_wg32, 32, 5)
GU_WG(moe_gate_up_wg64, 64, 4)
DN_WG(moe_down_wg32, 32, 5)
DN_WG(moe_down_wg64, 64, 4)
