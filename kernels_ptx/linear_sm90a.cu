// The wgmma prefill tile `_ws` (sm_90a: Hopper's warpgroup MMA) for FP8 tensor / channel weights: the per-output
// arithmetic of linear.cu's decode family and its `_p` / `_g128` tiles, bit for bit, at 2.3-3.2x their rate (T = 2048)
// (BENCHMARKS.md, fifth and ninth sessions). Plain and multi launches (as `_g128`) and the dense MLP's gate_up_gelu
// (as `_p`); layers/linear.py picks it. `_ss` (end of the file) is the same tile fed from bf16, slot-ordered copies
// of W and X, for long prompts; `_wb` (gemm_bf16_f32_ws) the same tile for the tied head's bf16 table and f32 logits.
//
// Why the bits are the same (measured on the H200, 2026-11-30, before the first wgmma kernel was written: 147,456
// outputs of chained k16 steps, operands spread over 2^-20 .. 2^20, non-zero accumulators, no bit differed):
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
// Tile: 128 W rows x 128 tokens (wgmma m64n128k16, A = W rows from registers, B = X tokens from shared memory);
// gelu: the 64 gate rows and the 64 up rows of 64 outputs. Stages (one 64-K unit each, cp.async with zero fill):
// W 128 rows x 64 B, X in the wgmma "no swizzle" K-major layout: step j = 2 k halves x 128 tokens x 16 B, the token
// groups' core matrices side by side (stride byte offset 128, leading byte offset 2 KB; on the H200, 2026-11-30,
// core matrices 256 B apart ran at `_g128`'s rate), the steps 32 B apart beyond that so that the 8-byte cp.async
// pieces land in 2 wavefronts.
//
// CTA: 3 warpgroups, persistent. Warpgroups 0 and 1 compute (stage rows 0..63 / 64..127: the A fragments converted
// from the stage's FP8 bytes, 4 wgmmas a unit), warpgroup 2 loads. Each CTA runs the tiles blockIdx.x, + gridDim.x,
// .. (row tile fastest; grid min(tiles, SMs)); the loader runs ahead across tiles, so a tile's pipeline fill and its
// epilogue overlap the neighbouring tiles' work. Per stage two mbarriers: full (the 128 loader threads arrive once
// their pieces have landed and are fenced for the tensor cores: cp.async.wait_group WS_LAG units later, then
// fence.proxy.async) and empty (the 8 compute warps arrive once the unit's wgmmas are done). setmaxnreg moves
// registers from the loader (72 a thread) to the compute warpgroups (216; ptxas allocates each region within its
// budget), so that the slice totals live in registers beside the accumulators (64 + 64 a thread).
// What the speed came from (H200, 2026-11-30, T = 2048 q+k+v, us): the fifth session's non-persistent form (2
// warpgroups that each loaded, converted and computed, totals in shared memory, a barrier a unit) 317; its loads
// moved to a loader warpgroup, totals still in shared memory (6 stages) 296; totals in registers (8 stages) 218.
// The compute warps issue ~140 instructions a unit (the FP8 conversion ~85 of them), the loader's ~85.
#include <cuda_bf16.h>
#include <stdint.h>

#include "pdl.cuh"
#include "linear_common.cuh"
#include "wgmma.cuh"
#include "slots.cuh"

#define W_ROWS 128                          // W rows per tile (2 warpgroups x 64)
#define W_TOK 128                           // tokens per tile (wgmma N)
#define W_WBYTES (W_ROWS * 64)              // fp8 W of one unit
#define W_XSTEP (W_TOK * 32 + 32)           // bytes per k16 step of X: 2 core-matrix columns of 128 tokens + 32 pad
#define W_XBYTES (4 * W_XSTEP)              // bf16 X of one unit
#define W_STAGE (W_WBYTES + W_XBYTES)       // 24704 B
#define W_GATE (64 * 2 * 128)               // gelu: + the gate and up halves the warpgroups exchange (bf16)
#define W_OUT (W_TOK * W_ROWS * 2)          // plain: + the tile's bf16 outputs on their way out (ws_store_tile)

// Shared-memory matrix descriptor, no swizzle: start address, leading (k half) byte offset NT * 16 (the NT / 8 token
// groups of one k half lie side by side: 2 KB for a tile of W_TOK tokens), stride (token group) byte offset 128.
template <int NT = W_TOK> __device__ __forceinline__ uint64_t x_desc(uint32_t addr) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((NT * 16) >> 4) << 16) | ((uint64_t)(128 >> 4) << 32);
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

#define WS_STAGES 8                         // unit m (counted across the CTA's tiles) uses stage m % WS_STAGES
#define WS_LAG 2                            // loader: unit m's full barrier is arrived after unit m + WS_LAG is issued
                                            // (deadlock-free while WS_LAG <= WS_STAGES - 2)
#define WS_THREADS 384
#define WS_BARS (WS_STAGES * W_STAGE)       // full[WS_STAGES], empty[WS_STAGES]
#define WS_SMEM (WS_BARS + 2 * WS_STAGES * 8)   // 197,760 B dynamic smem (+ W_OUT: 230,528; gelu + W_GATE: 214,144)
#define WS_REGS_COMPUTE 216                 // setmaxnreg: 2 x 128 x 216 + 128 x 72 = 384 x 168 (the launch's)
#define WS_REGS_LOAD 72

// `_ss` (the same tile from bf16, slot-ordered copies of W and X; see the section before w16_fp8): stage m % SS_STAGES
// is A (128 W rows x 128 B) then B (128 tokens x 128 B), each in wgmma's K-major 128-byte swizzled layout (8-row atoms
// of 1024 B, 1024-byte aligned).
#define S_ABYTES (W_ROWS * 128)             // bf16 W (or X) of one unit
#define SS_STAGES 6
#define SS_BARS (SS_STAGES * 2 * S_ABYTES)
#define SS_SMEM (SS_BARS + 2 * SS_STAGES * 8)   // 196,704 B dynamic smem (+ W_OUT: 229,472; gelu + W_GATE: 213,088)
// `_ws` for bf16 weights and f32 outputs (the tied head, gemm_bf16_f32_ws / _ws64; see their entries), in tiles of
// NT = 128 or 64 tokens (forms F_WB, F_WB64): stage m % stages is the unit's 128 W rows in X's layout (the same 8-byte
// pieces, rows for tokens), then the NT tokens of X in the same layout, so that both wgmma operands come from shared
// memory at the same slots and the compute warps convert nothing. The f32 outputs go out from registers.
#define W_XSTEP_N(NT) ((NT) * 32 + 32)      // bytes per k16 step of NT tokens (W_XSTEP: W_TOK)
#define WB_STAGE_N(NT) (W_XBYTES + 4 * W_XSTEP_N(NT))   // 33,024 / 24,832 B for NT = 128 / 64
// The tile's forms: `_ws` (FP8 W converted into registers), `_ss` (bf16 copies, swizzled) and `_wb` (bf16 W as it is,
// the head; two token widths). Per form: tokens a tile, stages, smem bytes before the gelu buffers, the mbarriers'
// offset, and the offsets of stage `slot`'s W (A) and X (B) bytes. `_wb`: 6 / 8 stages (198,240 / 198,784 B).
enum { F_WS = 0, F_SS = 1, F_WB = 2, F_WB64 = 3 };
template <int F> __host__ __device__ constexpr bool is_wb() { return F == F_WB || F == F_WB64; }
template <int F> __host__ __device__ constexpr int tile_tok() { return F == F_WB64 ? 64 : W_TOK; }
template <int F> __host__ __device__ constexpr int ring_stages() {
    return F == F_SS ? SS_STAGES : F == F_WB ? 6 : F == F_WB64 ? 8 : WS_STAGES;
}
template <int F> __host__ __device__ constexpr uint32_t ring_bars() {
    return F == F_SS ? SS_BARS : is_wb<F>() ? ring_stages<F>() * WB_STAGE_N(tile_tok<F>()) : WS_BARS;
}
template <int F> __host__ __device__ constexpr int ring_smem() {
    return F == F_SS ? SS_SMEM : is_wb<F>() ? ring_bars<F>() + 2 * ring_stages<F>() * 8 : WS_SMEM;
}
template <int F> __device__ __forceinline__ uint32_t a_off(uint32_t slot) {
    return F == F_SS ? slot * 2 * S_ABYTES : is_wb<F>() ? slot * WB_STAGE_N(tile_tok<F>()) : slot * W_STAGE;
}
template <int F> __device__ __forceinline__ uint32_t x_off(uint32_t slot) {
    return F == F_SS     ? slot * 2 * S_ABYTES + S_ABYTES
           : is_wb<F>() ? slot * WB_STAGE_N(tile_tok<F>()) + W_XBYTES
                        : slot * W_STAGE + W_WBYTES;
}
// Tile `tile` of a launch -> row tile b and first token t0 (tiles of NT tokens). `_ws`: row tiles fastest (as the
// decode order); `_ss`: token tiles fastest, so that the CTAs running at once share a few row tiles of the bf16 W copy
// (twice the FP8 bytes: a 2,048-token q+k+v's 46 MB, re-read from DRAM for every token tile the other way) and all of
// X's copy.
template <bool SS, int NT = W_TOK>
__device__ __forceinline__ void tile_at(int tile, int row_tiles, int T, int &b, int &t0) {
    const int token_tiles = (T + NT - 1) / NT;
    b = SS ? tile / token_tiles : tile % row_tiles;
    t0 = (SS ? tile % token_tiles : tile / row_tiles) * NT;
}

// The mbarriers of a ring of S stages: full[S], empty[S].
template <int S> __device__ __forceinline__ uint32_t ws_full(uint32_t bars, uint32_t m) { return bars + 8 * (m % S); }
template <int S> __device__ __forceinline__ uint32_t ws_empty(uint32_t bars, uint32_t m) {
    return bars + 8 * (S + m % S);
}
template <int S> __device__ __forceinline__ uint32_t ws_parity(uint32_t m) { return (m / S) & 1; }
// A loader's hand-over of unit m (its pieces committed as one cp.async group): unit m - WS_LAG's full barrier once
// this thread's pieces of it have landed and are fenced for the tensor cores; ring_drain: the last ones, at the end.
template <int S> __device__ __forceinline__ void ring_handoff(uint32_t bars, uint32_t m) {
    if (m >= WS_LAG) {
        cp_async_wait<WS_LAG>();
        fence_proxy_async();
        mbar_arrive(ws_full<S>(bars, m - WS_LAG));
    }
}
template <int S> __device__ __forceinline__ void ring_drain(uint32_t bars, uint32_t m) {
    cp_async_wait<0>();
    fence_proxy_async();
    for (uint32_t i = m > WS_LAG ? m - WS_LAG : 0; i < m; ++i) mbar_arrive(ws_full<S>(bars, i));
}
// The loaders' walk (ws_load, ss_load, wb_load): every unit of every tile of this CTA, in the compute warpgroups'
// order. tile(t) points the thread's sources at tile t; unit(k0, st) copies the unit of K columns k0 .. k0 + 63 into
// the stage at offset st; each unit's pieces are one cp.async group, handed over by ring_handoff.
template <int F, class Tile, class Unit>
__device__ __forceinline__ void ring_load(uint32_t bars, int tiles, int units, Tile &&tile, Unit &&unit) {
    constexpr int S = ring_stages<F>();
    uint32_t m = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        tile(t);
        for (int n = 0, u = 0; n < units; ++n, u = w_next_unit(u, units), ++m) {
            mbar_wait(ws_empty<S>(bars, m), ws_parity<S>(m) ^ 1);
            unit(u << 6, a_off<F>(m % S));
            cp_async_commit();
            ring_handoff<S>(bars, m);
        }
    }
    ring_drain<S>(bars, m);
}
// The calling thread's warpgroup, warp-uniform as far as ptxas can tell (a shuffle from lane 0): wgmma under a branch
// on threadIdx.x itself is serialized (ptxas C7518, "WG.DP in divergent path").
__device__ __forceinline__ int warpgroup() { return __shfl_sync(0xffffffffu, threadIdx.x >> 7, 0); }

// Row tiles of a launch (RT rows per tile; gelu: one projection's).
template <bool GELU>
__device__ __forceinline__ int ws_row_tiles(const Proj &q0, const Proj &q1, const Proj &q2, const Proj &q3) {
    constexpr int RT = GELU ? 64 : W_ROWS;
    if (GELU) return (q0.N + RT - 1) / RT;
    return (q0.N + RT - 1) / RT + (q1.N + RT - 1) / RT + (q2.N + RT - 1) / RT + (q3.N + RT - 1) / RT;
}
// Tile `tile` of a launch (tile_at): its projection, first W row (row0, within that projection's rows) and first token.
template <bool SS, bool GELU, int NT = W_TOK>
__device__ __forceinline__ Proj tile_proj(int tile, int row_tiles, int T, const Proj &q0, const Proj &q1,
                                          const Proj &q2, const Proj &q3, int &row0, int &t0) {
    constexpr int RT = GELU ? 64 : W_ROWS;
    int b;
    tile_at<SS, NT>(tile, row_tiles, T, b, t0);
    const Proj p0 = GELU ? q0 : pick(b, RT, q0, q1, q2, q3);
    row0 = b * RT;
    return p0;
}

// Loader warpgroup: every unit of every tile of this CTA, in the compute warpgroups' order. Thread pt = 0..127:
// W pieces i = 0..3 = stage row (pt >> 2) + 32 i, 16 bytes at column 16 (pt & 3); X pieces (kc, i) = token
// tb + 16 i with tb = 4 (pt >> 5) + (lane >> 3), columns 32 kc + 16 h + 4 j .. + 3 with j = lane & 3,
// h = (lane >> 2) & 1: 64 contiguous bytes per token, 2 shared-memory wavefronts per instruction (W_XSTEP's pad).
// Rows past N and tokens past T are loaded from row N - 1 / token T - 1 instead: each output depends on one W row
// and one X token only, and those outputs are never stored, so an edge tile costs what any other does (the predicated
// zero fill made the edge tile of a 507-token launch ~1.6x slower: the critical path of launches of one wave). Only
// columns past K are zero-filled (units with k0 + 64 > K: none in the real model's shapes): 20 cp.async and ~40
// other instructions a unit.

// One unit of the thread's NT / 16 rows of a bf16 operand of NT rows in X's layout (ws_load's X pieces; wb_load's W
// rows too): row i's 8-byte piece at the thread's column (src[i] points there) to dst + 256 i, the piece 32 columns on
// to dst + NT * 16 + 256 i. xl_edge: a unit with k0 + 64 > K, columns past K zero-filled (xcol: the thread's column;
// zsrc: any valid address).
template <int NT = W_TOK>
__device__ __forceinline__ void xl_whole(uint32_t dst, const __nv_bfloat16 *const (&src)[8], int k0) {
#pragma unroll
    for (int i = 0; i < NT / 16; ++i) {
        cp_async8_full(dst + 256 * i, src[i] + k0);
        cp_async8_full(dst + NT * 16 + 256 * i, src[i] + k0 + 32);
    }
}
template <int NT = W_TOK>
__device__ __forceinline__ void xl_edge(uint32_t dst, const __nv_bfloat16 *const (&src)[8], int k0, int K, int xcol,
                                        const void *zsrc) {
#pragma unroll
    for (int kc = 0; kc < 2; ++kc)
#pragma unroll
        for (int i = 0; i < NT / 16; ++i) {
            const bool ok = k0 + 32 * kc + xcol < K;
            cp_async8(dst + (NT * 16) * kc + 256 * i, ok ? (const void *)(src[i] + k0 + 32 * kc) : zsrc, ok);
        }
}

template <bool GELU>
__device__ __forceinline__ void ws_load(uint32_t sbase, uint32_t bars, const __nv_bfloat16 *X, int T, int K,
                                        const Proj &q0, const Proj &q1, const Proj &q2, const Proj &q3) {
    const int pt = threadIdx.x - 256, lane = pt & 31;
    const int j = lane & 3, h = (lane >> 2) & 1, tb = 4 * (pt >> 5) + (lane >> 3);
    const int wrow = pt >> 2, wcol = 16 * (pt & 3), xcol = 16 * h + 4 * j;
    const uint32_t wdst = sbase + wrow * 64 + wcol, xdst = sbase + W_WBYTES + j * W_XSTEP + tb * 16 + h * 8;
    const int units = (K + 63) >> 6, row_tiles = ws_row_tiles<GELU>(q0, q1, q2, q3);
    const int tiles = row_tiles * ((T + W_TOK - 1) / W_TOK);
    const uint8_t *w[4];
    const __nv_bfloat16 *x[8];
    ring_load<F_WS>(bars, tiles, units, [&](int tile) {
        int row0, t0;
        const Proj p0 = tile_proj<false, GELU>(tile, row_tiles, T, q0, q1, q2, q3, row0, t0);
#pragma unroll
        for (int i = 0; i < 4; ++i) {                         // stage rows 64.. : the up rows (gelu) / rows + 64
            const int row = min(row0 + wrow + 32 * i - (GELU && i >= 2 ? 64 : 0), p0.N - 1);
            w[i] = reinterpret_cast<const uint8_t *>(GELU && i >= 2 ? q1.W : p0.W) + (size_t)row * K + wcol;
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) x[i] = X + (size_t)min(t0 + tb + 16 * i, T - 1) * K + xcol;
    }, [&](int k0, uint32_t st) {
        if (k0 + 64 <= K) {
#pragma unroll
            for (int i = 0; i < 4; ++i) cp_async16_full(wdst + st + 2048 * i, w[i] + k0);
            xl_whole(xdst + st, x, k0);
        } else {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const bool ok = k0 + wcol < K;
                cp_async16(wdst + st + 2048 * i, ok ? (const void *)(w[i] + k0) : X, ok);
            }
            xl_edge(xdst + st, x, k0, K, xcol, X);
        }
    });
}

// `_ss`'s loader: A from the bf16 copy of W (w16_fp8), X from the slot-ordered copy of X (x16_bf16), rows of Kp = 64
// units whose columns past K are already +0 there (no zero fill), into the stage's two swizzled 128-row halves:
// thread pt copies rows (pt >> 3) + 16 i, i = 0..7, 16-byte piece pt & 7 of the row's 128 bytes, so that 8 lanes
// copy one row's whole line into one line of the atom, both sides. Rows past N / tokens past T: row N - 1 / token
// T - 1 (as `_ws`).
template <bool GELU>
__device__ __forceinline__ void ss_load(uint32_t sbase, uint32_t bars, const __nv_bfloat16 *X, int T, int K,
                                        const Proj &q0, const Proj &q1, const Proj &q2, const Proj &q3) {
    const int pt = threadIdx.x - 256, prow = pt >> 3, pc = pt & 7;
    const uint32_t dst = sbase + (prow >> 3) * 1024 + (prow & 7) * 128 + ((pc ^ (prow & 7)) << 4);
    const int units = (K + 63) >> 6, row_tiles = ws_row_tiles<GELU>(q0, q1, q2, q3), kp = 64 * units;
    const int tiles = row_tiles * ((T + W_TOK - 1) / W_TOK);
    const __nv_bfloat16 *w[8], *x[8];
    ring_load<F_SS>(bars, tiles, units, [&](int tile) {
        int row0, t0;
        const Proj p0 = tile_proj<true, GELU>(tile, row_tiles, T, q0, q1, q2, q3, row0, t0);
#pragma unroll
        for (int i = 0; i < 8; ++i) {                         // stage rows 64.. : the up rows (gelu) / rows + 64
            const bool up = GELU && i >= 4;
            const int row = min(row0 + prow + 16 * i - (up ? 64 : 0), p0.N - 1);
            w[i] = reinterpret_cast<const __nv_bfloat16 *>(up ? q1.W : p0.W) + (size_t)row * kp + 8 * pc;
            x[i] = X + (size_t)min(t0 + prow + 16 * i, T - 1) * kp + 8 * pc;
        }
    }, [&](int k0, uint32_t st) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            cp_async16_full(dst + st + 2048 * i, w[i] + k0);
            cp_async16_full(dst + st + S_ABYTES + 2048 * i, x[i] + k0);
        }
    });
}

// `_wb`'s loader (the tied head: bf16 W; form F, tiles of NT = tile_tok<F>() tokens): `_ws`'s X pieces for both
// operands, the stage's 128 W rows in X's layout (row tb + 16 i where X has token tb + 16 i), then the tile's NT tokens
// of X in the same layout (tokens tb + 16 i, i < NT / 16), tile by tile as ws_load's (ring_load). Rows past N /
// tokens past T: row N - 1 / token T - 1 (as `_ws`).
template <int F>
__device__ __forceinline__ void wb_load(uint32_t sbase, uint32_t bars, const __nv_bfloat16 *X, int T, int K,
                                        const Proj &q0, const Proj &q1, const Proj &q2, const Proj &q3) {
    constexpr int NT = tile_tok<F>();
    const int pt = threadIdx.x - 256, lane = pt & 31;
    const int j = lane & 3, h = (lane >> 2) & 1, tb = 4 * (pt >> 5) + (lane >> 3), xcol = 16 * h + 4 * j;
    const uint32_t wdst = sbase + j * W_XSTEP + tb * 16 + h * 8;
    const uint32_t xdst = sbase + W_XBYTES + j * W_XSTEP_N(NT) + tb * 16 + h * 8;
    const int units = (K + 63) >> 6, row_tiles = ws_row_tiles<false>(q0, q1, q2, q3);
    const int tiles = row_tiles * ((T + NT - 1) / NT);
    const __nv_bfloat16 *w[8], *x[8];
    ring_load<F>(bars, tiles, units, [&](int tile) {
        int row0, t0;
        const Proj p0 = tile_proj<false, false, NT>(tile, row_tiles, T, q0, q1, q2, q3, row0, t0);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            w[i] = reinterpret_cast<const __nv_bfloat16 *>(p0.W) + (size_t)min(row0 + tb + 16 * i, p0.N - 1) * K + xcol;
            x[i] = X + (size_t)min(t0 + tb + 16 * i, T - 1) * K + xcol;
        }
    }, [&](int k0, uint32_t st) {
        if (k0 + 64 <= K) {
            xl_whole(wdst + st, w, k0);
            xl_whole<NT>(xdst + st, x, k0);
        } else {
            xl_edge(wdst + st, w, k0, K, xcol, X);
            xl_edge<NT>(xdst + st, x, k0, K, xcol, X);
        }
    });
}

// One unit of a compute warpgroup: A fragments into a[BUF] (SS: A read from the stage by the wgmmas: rows
// 64 wg .. 64 wg + 63 are the warpgroup's 8 atoms, a k16 step 32 bytes on), 4 wgmmas, and the stage(s) handed back
// (`pend`: the previous unit's stage while its wgmmas may still run). The last unit of a slice is folded into tot.
// acc / tot: the D fragments of m64nNk16, N = the form's tokens a tile (NT / 2 a thread).
template <int F, int BUF, int NT = tile_tok<F>()>
__device__ __forceinline__ void ws_unit(int &u, int units, uint32_t &m, int &pend, uint8_t *smem, uint32_t sbase,
                                        uint32_t bars, int r, int q, int wg, float (&acc)[NT / 2],
                                        float (&tot)[NT / 2], uint32_t (&a)[2][4][4]) {
    constexpr int S = ring_stages<F>();
    const uint32_t slot = m % S, xs = sbase + x_off<F>(slot);
    mbar_wait(ws_full<S>(bars, m), ws_parity<S>(m));
    if (F == F_WS) w_stage_a(smem + a_off<F>(slot), r, q, a[BUF]);
    wg_fence();
    fence_acc(acc);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        if constexpr (F == F_SS)
            wgmma_ss<128>(acc, sw_desc(sbase + a_off<F>(slot) + wg * 8192 + 32 * j, 16, 1024),
                          sw_desc(xs + 32 * j, 16, 1024));
        else if constexpr (is_wb<F>())                        // the warpgroup's 64 rows: 8 row groups of 128 B on
            wgmma_ss<NT>(acc, x_desc(sbase + a_off<F>(slot) + wg * 1024 + j * W_XSTEP),
                         x_desc<NT>(xs + j * W_XSTEP_N(NT)));
        else
            wgmma_n<128>(acc, a[BUF][j], x_desc(xs + j * W_XSTEP));
    }
    wg_commit();
    const bool lead = (threadIdx.x & 31) == 0;
    if (u + 8 >= units) {                                     // the last unit of slice u % 8: fold it
        wg_wait<0>();
        fence_acc(acc);
        if (lead) {
            if (pend >= 0) mbar_arrive(ws_empty<S>(bars, pend));
            mbar_arrive(ws_empty<S>(bars, m));
        }
        pend = -1;
#pragma unroll
        for (int e = 0; e < NT / 2; ++e) {                    // tot starts at -0.0f: -0 + x == x, bit for bit
            tot[e] = __fadd_rn(tot[e], acc[e]);
            acc[e] = 0.f;
        }
    } else {
        wg_wait<1>();                                         // the previous unit's wgmmas are done
        if (lead && pend >= 0) mbar_arrive(ws_empty<S>(bars, pend));
        pend = m;
    }
    u = w_next_unit(u, units);
    ++m;
}

// The scales of the lane's two output rows, row and row + 8, of projection p (FP8 tensor / channel; a row past N: 0),
// read at a tile's start so that the epilogue waits on no load (store_out / gelu_in read one for each of the 64
// elements: 64 dependent loads that ptxas did not merge; H200, T = 2,048, launch copies included: q+k+v 194.6 ->
// 187.9 us, gate_up_gelu 115.4 -> 107.9); the epilogues then use linear_common.cuh's scaled_bf16.
__device__ __forceinline__ float2 row_scales(const float *S, int sa, int N, int row) {
    return make_float2(row < N ? __ldg(S + (size_t)row * sa) : 0.f, row + 8 < N ? __ldg(S + (size_t)(row + 8) * sa) : 0.f);
}

// The epilogues' last step: one staged 16-byte piece v (the bf16 outputs of columns c0 .. c0 + 7 of token tok) to
// Y (T, N): whole where the row holds all 8 and Y's rows are 16-byte aligned (vec: y_vec), else element by element;
// columns past N and tokens past T are not stored.
__device__ __forceinline__ bool y_vec(const Proj &p0) {
    return (p0.N & 7) == 0 && (reinterpret_cast<uintptr_t>(p0.Y) & 15) == 0;
}
__device__ __forceinline__ void store_piece(const Proj &p0, int tok, int T, int c0, bool vec, const uint4 &v) {
    if (tok >= T || c0 >= p0.N) return;
    __nv_bfloat16 *y = reinterpret_cast<__nv_bfloat16 *>(p0.Y) + (size_t)tok * p0.N + c0;
    if (vec && c0 + 8 <= p0.N) {
        *reinterpret_cast<uint4 *>(y) = v;
    } else {                                                  // an edge piece, or rows not 16-byte aligned
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int e = 0; e < 8; ++e)
            if (c0 + e < p0.N) reinterpret_cast<uint16_t *>(y)[e] = (uint16_t)(w[e >> 1] >> (16 * (e & 1)));
    }
}

// The gelu epilogue's half of warpgroup WG (0: gate sums, 1: up sums, of the same outputs; see ws_compute): hand
// gelu_in of the elements the other warpgroup stores (e = 32 .. 63 / 0 .. 31) to it through `give`, then compute
// gelu_mul(gate, up) for the others with its values from `take`. Named barriers 1 / 4: gate / up written; 2 / 3:
// gate / up read (arrived only when the CTA has another tile: `more`). The warpgroup's 64 tokens x 64 outputs then go
// out through `take` (8 KB, read by then; barrier 6 + WG, its 128 threads): token-major lines of 128 bytes, output
// column c (SLOTS: slot_pos(c), x16_bf16's slot order, N % 64 == 0, so Kp = N; slots.cuh) at element c of the line,
// its 16-byte piece p at (p ^ (token & 7)) << 4 so that neither side conflicts; then 8 lanes store a token's line
// with 16-byte stores (rows past N / tokens past T are not stored), in place of 32 two-byte stores a thread 4 rows
// apart in the slot order. Row0: the tile's first output row (a multiple of 64).
template <int WG, bool SLOTS>
__device__ __forceinline__ void ws_gelu_half(const float (&tot)[64], const Proj &p0, float2 sc, __nv_bfloat16 *give,
                                             __nv_bfloat16 *take, int row0, int rl, int t0, int T, int q, int tg,
                                             bool more) {
    constexpr int GIVE = WG == 0 ? 32 : 0, KEEP = 32 - GIVE;
    const int row = row0 + rl;
    if (WG == 0) bar_sync<2, 256>();                          // the other warpgroup has read `give`
    else bar_sync<3, 256>();
#pragma unroll
    for (int e = 0; e < 32; ++e) {
        const int r = row + ((e & 2) ? 8 : 0);
        give[e * 128 + tg] = __float2bfloat16_rn(r < p0.N ? scaled_bf16(tot[GIVE + e], (e & 2) ? sc.y : sc.x) : 0.f);
    }
    if (WG == 0) {
        bar_arrive<1, 256>();
        bar_sync<4, 256>();
    } else {
        bar_arrive<4, 256>();
        bar_sync<1, 256>();
    }
    __nv_bfloat16 o[32];
#pragma unroll
    for (int e = 0; e < 32; ++e) {
        const float mine = scaled_bf16(tot[KEEP + e], (e & 2) ? sc.y : sc.x);
        const float other = __bfloat162float(take[e * 128 + tg]);
        o[e] = WG == 0 ? gelu_mul(mine, other) : gelu_mul(other, mine);
    }
    bar_sync<6 + WG, 128>();                                  // `take` read by the whole warpgroup
    uint8_t *line = reinterpret_cast<uint8_t *>(take);
#pragma unroll
    for (int e = 0; e < 32; ++e) {                            // element KEEP + e: token 8 ((KEEP + e) / 4) + 2q + (e & 1)
        const int tl = 8 * (e >> 2) + 2 * q + (e & 1), c = rl + ((e & 2) ? 8 : 0);
        const int pos = SLOTS ? slot_pos(c) : c;
        *reinterpret_cast<__nv_bfloat16 *>(line + tl * 128 + (((pos >> 3) ^ (tl & 7)) << 4) + 2 * (pos & 7)) = o[e];
    }
    bar_sync<6 + WG, 128>();
    const int pc = tg & 7, c0 = row0 + 8 * pc;
    const bool vec = y_vec(p0);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int tl = 16 * i + (tg >> 3), tok = t0 + KEEP * 2 + tl;
        const uint4 v = lds128(smem_u32(line) + tl * 128 + ((pc ^ (tl & 7)) << 4));
        store_piece(p0, tok, T, c0, vec, v);
    }
    if (more) {
        if (WG == 0) bar_arrive<3, 256>();
        else bar_arrive<2, 256>();
    }
}

// The plain epilogue: the tile's 128 rows x 128 tokens, scaled and rounded (store_out's bytes: bf16(v * S[row])), go
// out through shared memory `out` (W_OUT bytes after the ring), token-major: 256 bytes a token, its 16-byte piece p
// (rows 8p .. 8p + 7) at (p ^ (token & 7)) << 4, so that neither side conflicts. Each warp puts its 16 rows in with 8
// stmatrix.trans (the D fragment of m64n128 is stmatrix's: lane (g, q) holds row g, tokens 2q and 2q + 1 of each 8 x 8
// block; transposed, each of its 8 stored lines is one token's 8 rows), then stores 16 tokens' whole rows, 16 bytes a
// lane (rows past N / tokens past T are not stored), in place of 64 two-byte stores a thread (the tensor cores wait
// while the warps store; H200, with the row scales above, launch copies included: T = 2,048 q+k+v ~188 -> 181.5 us,
// down ~59.5 -> 55.3). Named barrier 5 (the 256 compute threads): the previous tile's lines are read before new ones
// go in, and all are in before any is read.
__device__ __forceinline__ uint32_t bf16x2_scaled(float a, float b, float s) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(__fmul_rn(a, s), __fmul_rn(b, s));   // .x (a) in the low half
    return *reinterpret_cast<const uint32_t *>(&v);
}
__device__ __forceinline__ void ws_store_tile(const float (&tot)[64], float2 sc, const Proj &p0, uint32_t out, int row0,
                                              int t0, int T) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, j = lane & 7, mi = lane >> 3;
    const uint32_t piece = 2 * warp + (mi & 1);               // stmatrix: lane's line j of matrix mi (h = mi & 1)
    bar_sync<5, 256>();
#pragma unroll
    for (int n = 0; n < 16; n += 2) {                         // matrices (n, h 0), (n, h 1), (n + 1, 0), (n + 1, 1)
        const int tok = 8 * (n + (mi >> 1)) + j;
        stmatrix_x4_trans(out + tok * 256 + ((piece ^ j) << 4), bf16x2_scaled(tot[4 * n], tot[4 * n + 1], sc.x),
                          bf16x2_scaled(tot[4 * n + 2], tot[4 * n + 3], sc.y),
                          bf16x2_scaled(tot[4 * n + 4], tot[4 * n + 5], sc.x),
                          bf16x2_scaled(tot[4 * n + 6], tot[4 * n + 7], sc.y));
    }
    bar_sync<5, 256>();
    const int pc = lane & 15, row = row0 + 8 * pc;
    const bool vec = y_vec(p0);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const int tl = 16 * warp + 2 * k + (lane >> 4), tok = t0 + tl;
        const uint4 v = lds128(out + tl * 256 + ((pc ^ (tl & 7)) << 4));
        store_piece(p0, tok, T, row, vec, v);
    }
}

// `_wb`'s epilogue: the tile's f32 sums as they are (store_out's bytes for bf16 W and f32 out: no scale, no rounding),
// from the D fragments straight to Y (T, N) f32; lane (g, q) of warp w holds rows row = row0 + 16 w + g and row + 8,
// tokens t0 + 8 n + 2 q + {0, 1}. Each store instruction writes 8 consecutive rows of 4 tokens: whole 32-byte sectors.
template <int NT>
__device__ __forceinline__ void wb_store_tile(const float (&tot)[NT / 2], const Proj &p0, int row, int t0, int T) {
    const int q = threadIdx.x & 3;
    float *y = reinterpret_cast<float *>(p0.Y);
#pragma unroll
    for (int e = 0; e < NT / 2; ++e) {
        const int r = row + ((e & 2) ? 8 : 0), tok = t0 + 8 * (e >> 2) + 2 * q + (e & 1);
        if (r < p0.N && tok < T) y[(size_t)tok * p0.N + r] = tot[e];
    }
}

// Compute warpgroups, per tile: the mainloop, then scale, round and store (ws_store_tile). Gelu: the two warpgroups
// hold the gate (0) and up (1) sums of the same outputs and each stores half of them, gelu_mul(gate, up) into
// projection 0's Y as store_out<.., GELU> does: warpgroup 0 the tokens 0..63 of the tile (elements e < 32), 1 the
// tokens 64..127. Each hands the other gelu_in of the half it does not store (bf16-rounded, so exact in bf16)
// through shared memory: `gate` (warpgroup 0's, e >= 32) and `up` (warpgroup 1's, e < 32), 8 KB each; named
// barriers 1 / 4 = gate / up written, 2 / 3 = gate / up read. (Warpgroup 1 had stored all of them while 0 waited:
// T = 2048 142.1 -> 128.5 us, 343 -> 379 TFLOP/s against the plain tile's ~425; sixteenth session.)
template <bool GELU, int F, bool SLOTS>
__device__ __forceinline__ void ws_compute(uint8_t *smem, uint32_t sbase, uint32_t bars, const __nv_bfloat16 *X, int T,
                                           int K, const Proj &q0, const Proj &q1, const Proj &q2, const Proj &q3) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int r = 16 * warp + g;                              // the lane's first stage row (and r + 8)
    const int rr = GELU ? r - 64 * (warp >> 2) : r;           // the lane's first output row in the tile
    constexpr int NT = tile_tok<F>(), E = NT / 2;             // tokens a tile; D fragment elements a thread
    const int units = (K + 63) >> 6, row_tiles = ws_row_tiles<GELU>(q0, q1, q2, q3);
    const int tiles = row_tiles * ((T + NT - 1) / NT);
    __nv_bfloat16 *gate = reinterpret_cast<__nv_bfloat16 *>(smem + ring_smem<F>());    // [(e - 32) * 128 + thread in group]
    __nv_bfloat16 *up = gate + 32 * 128;                                        // [e * 128 + thread in group]
    const int wg = warpgroup(), tg = threadIdx.x & 127;
    if (GELU) {                                               // both buffers start free
        if (wg == 1) bar_arrive<2, 256>();
        else bar_arrive<3, 256>();
    }
    uint32_t m = 0;
    float acc[E];                                             // zero at every tile's start: each tile ends in a fold
    uint32_t a[2][4][4];
#pragma unroll
    for (int e = 0; e < E; ++e) acc[e] = 0.f;
    float tot[E];
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        int row0, t0;
        const Proj p0 = tile_proj<F == F_SS, GELU, NT>(tile, row_tiles, T, q0, q1, q2, q3, row0, t0);
        const bool upw = GELU && wg == 1;                   // gelu: warpgroup 1 holds the up projection's sums
        const float2 sc = is_wb<F>() ? make_float2(0.f, 0.f)  // (bf16 W: no scale)
                                     : row_scales(upw ? q1.S : p0.S, upw ? q1.sa : p0.sa, p0.N, row0 + rr);
#pragma unroll
        for (int e = 0; e < E; ++e) tot[e] = -0.f;
        int pend = -1;
        for (int n = 0, u = 0; n < units; n += 2) {
            ws_unit<F, 0>(u, units, m, pend, smem, sbase, bars, r, q, wg, acc, tot, a);
            if (n + 1 < units) ws_unit<F, 1>(u, units, m, pend, smem, sbase, bars, r, q, wg, acc, tot, a);
        }
        wg_wait<0>();                                         // (a no-op: the last unit was a slice end) so that
        fence_acc(acc);                                       // ptxas need not wait in the loop
        for (int s = units; s < SLICES; ++s)                  // empty slices (K < 512): their partial is +0.0f
#pragma unroll
            for (int e = 0; e < E; ++e) tot[e] = __fadd_rn(tot[e], 0.f);
        // D fragment of m64nNT: element 4n + i = row (16 warp-in-group + g, + 8 for i >= 2), token 8n + 2q + (i & 1)
        if constexpr (GELU) {
            if (wg == 0)
                ws_gelu_half<0, SLOTS>(tot, p0, sc, gate, up, row0, rr, t0, T, q, tg, tile + gridDim.x < tiles);
            else ws_gelu_half<1, SLOTS>(tot, p0, sc, up, gate, row0, rr, t0, T, q, tg, tile + gridDim.x < tiles);
        } else if constexpr (is_wb<F>()) {
            wb_store_tile<NT>(tot, p0, row0 + rr, t0, T);
        } else {
            ws_store_tile(tot, sc, p0, sbase + ring_smem<F>(), row0, t0, T);
        }
    }
}

template <bool GELU, int F, bool SLOTS>
__device__ __forceinline__ void ws_body(const __nv_bfloat16 *__restrict__ X, int T, int K, const Proj &q0,
                                        const Proj &q1, const Proj &q2, const Proj &q3) {
    extern __shared__ __align__(1024) uint8_t smem[];        // (`_ss`: swizzled atoms, 1024-byte aligned)
    constexpr bool SS = F == F_SS;
    constexpr int S = ring_stages<F>();
    pdl_trigger();
    pdl_wait();
    const uint32_t sbase = smem_u32(smem);
    if (SS && threadIdx.x == 0 && (sbase & 1023)) __trap();  // loudly: the swizzle would read other bytes
    const uint32_t bars = sbase + ring_bars<F>();
    if (threadIdx.x < S) {
        mbar_init(bars + 8 * threadIdx.x, 128);               // full: the loader's 128 threads
        mbar_init(bars + 8 * (S + threadIdx.x), 8);           // empty: the 8 compute warps
    }
    __syncthreads();
    if (warpgroup() == 2) {
        regs_dec<WS_REGS_LOAD>();
        if (SS) ss_load<GELU>(sbase, bars, X, T, K, q0, q1, q2, q3);
        else if (is_wb<F>()) wb_load<F>(sbase, bars, X, T, K, q0, q1, q2, q3);
        else ws_load<GELU>(sbase, bars, X, T, K, q0, q1, q2, q3);
        return;
    }
    regs_inc<WS_REGS_COMPUTE>();
    ws_compute<GELU, F, SLOTS>(smem, sbase, bars, X, T, K, q0, q1, q2, q3);
}

// linear.cu's signature (X, T, K, 4 x (W, S, s_arg, Y, N)); FP8 e4m3 weights with a per-tensor (s_arg 0) /
// per-channel (1) scale; requires K % 16 == 0 and 16-byte aligned X, W (the launcher checks). Block WS_THREADS,
// grid (min(tiles, SMs), 1, 1), tiles = row tiles x ceil(T / 128):
//   gemm_fp8_bf16_ws: Y_p = X @ W_p^T (bf16) for projections 0..3; row tiles sum_p ceil(N_p / 128); dynamic smem
//     WS_SMEM;
//   gelu_fp8_bf16_ws: projection 0 = gate, 1 = up, Y_0 = act; row tiles ceil(N / 64); dynamic smem WS_SMEM + W_GATE.
#define W_PARAMS                                                                                                \
    const __nv_bfloat16 *__restrict__ X, int T, int K, const void *W0, const float *S0, int sa0, void *Y0, int N0, \
        const void *W1, const float *S1, int sa1, void *Y1, int N1, const void *W2, const float *S2, int sa2,     \
        void *Y2, int N2, const void *W3, const float *S3, int sa3, void *Y3, int N3
#define W_PROJS {{W0, S0, sa0, Y0, N0}, {W1, S1, sa1, Y1, N1}, {W2, S2, sa2, Y2, N2}, {W3, S3, sa3, Y3, N3}}
// One entry point of the tile: ws_body<GELU, F, SLOTS> over W_PARAMS (also `_ss`'s, at the end of the file).
#define W_ENTRY(NAME, GELU, F, SLOTS)                                                                           \
    extern "C" __global__ void __launch_bounds__(WS_THREADS) NAME(W_PARAMS) {                                   \
        const Proj p[4] = W_PROJS;                                                                              \
        ws_body<GELU, F, SLOTS>(X, T, K, p[0], p[1], p[2], p[3]);                                               \
    }
W_ENTRY(gemm_fp8_bf16_ws, false, F_WS, false)
W_ENTRY(gelu_fp8_bf16_ws, true, F_WS, false)
// gemm_bf16_f32_ws / _ws64 (`_wb`, the tied head): Y_p (T, N_p) f32 = X @ W_p^T, W_p bf16 (N_p, K) as it is (S_p
// unused), the decode family's gemm_bf16_f32 bits (tot = the slice sums folded in order, stored unrounded), in tiles
// of 128 / 64 tokens; grid (min(tiles, SMs), 1, 1), tiles = sum_p ceil(N_p / 128) x ceil(T / tokens); dynamic smem
// ring_smem<F_WB / F_WB64>() (198,240 / 198,784 B). H200 (2026-12-02, the head alone, 262,144 x 2,816): the 64-token
// tile 459 / 477 us at T = 33 / 64 against the 128-token tile's 527 / 549; a 96-token tile (7 stages) ran 665 / 691 us
// at T = 80 / 96 against 558 / 574, so T > 64 takes the 128-token tile.
W_ENTRY(gemm_bf16_f32_ws, false, F_WB, false)
W_ENTRY(gemm_bf16_f32_ws64, false, F_WB64, false)

// ---- `_ss`: the same tile with both wgmma operands from shared memory ----
// For long prompts: the FP8 -> bf16 conversion is done once per launch instead of once per token tile, and X is put
// in the slot order once, so that the loader copies whole 128-byte lines of both operands (`_ws` copies X in 8-byte
// pieces: the slots of a k16 step are 4 groups of 4 columns 16 apart). w16_fp8 writes a bf16 copy of the launch's
// weights, x16_bf16 one of X, into scratch buffers (layers/linear.py reserve_w16); `_ss` reads both through the
// loader in wgmma's K-major 128-byte swizzled layout. The copies hold each 64-column unit in the slots' order (header):
// 16-byte piece 2j + h of a row's unit = slots 8h .. 8h + 7 of k16 step j = columns 64u + 32h + 4j + 0..3 and
// 64u + 32h + 16 + 4j + 0..3; columns past K are +0 (as `_ws`'s zero fill). So a k16 step is 32 contiguous bytes of
// each row on both sides, and every product meets the X column that `_ws` meets it with, in the same step: the same
// bits. Rows of Kp = 64 ceil(K / 64) columns. Both: rows by CTA rows (blockIdx.y), 8 threads a unit, thread t writing
// piece t (a warp 512 contiguous bytes) from the unit's two words of it (a warp reads the units' 256 / 512
// contiguous bytes); grid (ceil(8 units / block), rows (x16) or ceil(rows / COPY_ROWS) (w16), ..), block <= 512.
// (The first form numbered the pieces of all rows in one index and divided it by the units, a 64-bit division a
// thread: H200, 2,048-token prefill, w16_fp8 1.88 ms at 2.56 TB/s and x16_bf16 1.07 ms at 2.78 TB/s over 117
// launches each.) slot_col (slots.cuh): a piece's first column.
// w16_fp8 takes COPY_ROWS rows a CTA (grid y = ceil(rows / COPY_ROWS)), a thread the same piece of each, all its
// loads issued before its first store: one row a CTA left a thread 8 bytes in flight (the q+k+v copy, 8,192 x 2,816:
// 22.47 -> 17.99 us, 3.08 -> 3.85 TB/s, graph-replayed; the smaller copies unchanged; twenty-fourth session).
#define COPY_ROWS 4

// w16_fp8: Y_p (N_p, Kp) bf16 for projections p = blockIdx.z (W_p e4m3 (N_p, K)), grid y = ceil(the largest N_p /
// COPY_ROWS). PDL: the weights are read before griddepcontrol.wait, Y written after it (the previous `_ss` launch may
// still read Y).
extern "C" __global__ void __launch_bounds__(512) w16_fp8(int K, const uint8_t *__restrict__ W0, uint4 *Y0, int N0,
                                                          const uint8_t *__restrict__ W1, uint4 *Y1, int N1,
                                                          const uint8_t *__restrict__ W2, uint4 *Y2, int N2,
                                                          const uint8_t *__restrict__ W3, uint4 *Y3, int N3) {
    const int p = blockIdx.z, units = (K + 63) >> 6, row0 = blockIdx.y * COPY_ROWS;
    const uint8_t *W = p == 0 ? W0 : p == 1 ? W1 : p == 2 ? W2 : W3;
    uint4 *Y = p == 0 ? Y0 : p == 1 ? Y1 : p == 2 ? Y2 : Y3;
    const int N = p == 0 ? N0 : p == 1 ? N1 : p == 2 ? N2 : N3;
    const int pc = blockIdx.x * blockDim.x + threadIdx.x, c0 = slot_col(pc);
    const bool own = pc < 8 * units;
    uint32_t w0[COPY_ROWS], w1[COPY_ROWS];
#pragma unroll
    for (int r = 0; r < COPY_ROWS; ++r) {
        const bool ok = own && row0 + r < N;
        const uint8_t *wr = W + (size_t)(row0 + r) * K;
        w0[r] = ok && c0 < K ? __ldg(reinterpret_cast<const uint32_t *>(wr + c0)) : 0u;
        w1[r] = ok && c0 + 16 < K ? __ldg(reinterpret_cast<const uint32_t *>(wr + c0 + 16)) : 0u;
    }
    pdl_wait();
    pdl_trigger();
    if (!own) return;
#pragma unroll
    for (int r = 0; r < COPY_ROWS; ++r) {
        if (row0 + r >= N) break;
        uint4 v;
        e4m3x4_to_bf16x4(w0[r], v.x, v.y);
        e4m3x4_to_bf16x4(w1[r], v.z, v.w);
        Y[(size_t)(row0 + r) * 8 * units + pc] = v;
    }
}

// x16_bf16: Y (T, Kp) bf16 = X (T, K) bf16 in the slot order, grid y = T (one row a CTA: X is mostly in L2, written
// just before, and COPY_ROWS rows took 4.60 us against 3.77 at T = 2048, K = 2816; twenty-fourth session). pdl_entry:
// X is the previous kernel's output.
extern "C" __global__ void __launch_bounds__(512) x16_bf16(const __nv_bfloat16 *X, uint4 *Y, int T, int K) {
    pdl_entry();
    const int units = (K + 63) >> 6, row = blockIdx.y;
    const int pc = blockIdx.x * blockDim.x + threadIdx.x, c0 = slot_col(pc);
    if (pc >= 8 * units) return;
    const __nv_bfloat16 *xr = X + (size_t)row * K;
    uint2 a = make_uint2(0, 0), b = make_uint2(0, 0);
    if (c0 < K) a = *reinterpret_cast<const uint2 *>(xr + c0);
    if (c0 + 16 < K) b = *reinterpret_cast<const uint2 *>(xr + c0 + 16);
    Y[(size_t)row * 8 * units + pc] = make_uint4(a.x, a.y, b.x, b.y);
}

// gemm_fp8_bf16_ss / gelu_fp8_bf16_ss: `_ws`'s launches (same arguments, grid and block) with X = x16_bf16's copy and
// W_p = w16_fp8's (rows of Kp; K and S_p as for `_ws`); dynamic smem SS_SMEM (+ W_GATE for gelu).
W_ENTRY(gemm_fp8_bf16_ss, false, F_SS, false)
W_ENTRY(gelu_fp8_bf16_ss, true, F_SS, false)
// gelu_fp8_bf16_ss_slots: gelu_fp8_bf16_ss with act in x16_bf16's slot order (N % 64 == 0), which the dense MLP's
// down projection then takes as its `_ss` X without an x16_bf16 launch (layers/linear.py, model_gpu.py).
W_ENTRY(gelu_fp8_bf16_ss_slots, true, F_SS, true)
