// MoE block kernels (Gemma-4 26B-A4B): grouping of (token, slot) pairs by expert, the NVFP4 experts on tensor
// cores (gate/up with gated GELU, down scaled by the routing weight) and a deterministic combine. The router is in
// linear.cu. bf16 activations, NVFP4 weights decoded exactly to bf16 mma operands in registers (checkpoint.md
// sections 2 and 6), fp32 accumulation.
//
// Shapes (same letters as Python): T tokens, H hidden, E experts, k top-k, P = T*k (token, slot) pairs,
// I expert intermediate. A pair p = t*k + s is token t's slot s.
//
// Two launch paths with ONE per-output arithmetic (layers/moe.py picks by T): direct (small T:
// moe_gate_up_direct -> moe_down_combine_direct) and grouped (moe_group_tiles -> moe_gate_up_mma_n* ->
// moe_down_mma_n* -> moe_combine_bf16, n* = token-tile width).
//
// Determinism: every output element has a fixed reduction order that depends only on K (128-column K blocks,
// each a fresh mma chain, added in fp32 in increasing order) and never on T, on the group sizes or on which
// tokens share an expert; no float atomics anywhere. A row's bytes are identical alone or inside any batch.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "pdl.cuh"          // pdl_entry / pdl_trigger / pdl_wait: programmatic dependent launch
#include "moe_common.cuh"   // the experts' arithmetic shared with moe_sm90a.cu (wgmma)
#include "combine.cuh"      // slots_by_expert_warp, combine8: the combine shared with elementwise.cu

#define FULL 0xffffffffu
#define MAX_E 256        // experts the grouping handles (layers/moe.py checks E <= 256)

// ---------------------------------------------------------------------------------------------------
// Grouping: counting sort of the P = T*k pairs by expert, stable (pair order p = t*k+s, so by token within an
// expert). Outputs: offsets (E+1) (group e = perm[offsets[e] .. offsets[e+1])), perm (P) pair indices,
// active (E) the experts with >= 1 pair in increasing order (first n_active valid), n_active (1).
// Pairs whose expert is outside [0, E) are dropped (the combine skips them too).
// Then each expert's group is cut into tiles of TS grouped positions for the grouped expert
// kernels: tiles[i] = (e, q0, nq, 0) in expert order, n_tiles[0] = count (<= n_active + P/TS).
// One launch of E CTAs, a CTA per expert (moe_group_place); thread i of a CTA owns the contiguous chunk of pairs
// [i per, (i + 1) per), per = ceil(P / blockDim.x). CTA e counts every expert's pairs into a shared histogram
// (atomics: order-free), takes its offset, its rank among the active experts and its first tile from it (one block
// scan of the three sums over the threads' runs of experts), writes offsets[e] (CTA 0 also offsets[E], n_active,
// n_tiles), active[rank] = e, its tiles, and its pairs' perm entries (a block scan of the threads' counts of e:
// ascending p). Integer-only, deterministic. (Before: the one-CTA form, 32 warps ranking lanes by
// __match_any_sync, ~36 us at T = 2048 on the H200, its MATCH instructions queued on one SM; then a count launch
// (moe_group_count, CTA e counting its expert into global memory) before this one; BENCHMARKS.md twenty-third and
// twenty-fourth sessions.)

// Exclusive prefixes of v[0 .. N-1] over the block (blockDim.x a multiple of 32, <= 1024); total: the block's sums.
// Every thread calls it; ws: 32 N ints of shared memory, free again on return.
template <int N> __device__ __forceinline__ void block_scan(int (&v)[N], int* ws, int (&total)[N]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int x[N];
    #pragma unroll
    for (int j = 0; j < N; ++j) x[j] = v[j];
    #pragma unroll
    for (int o = 1; o < 32; o <<= 1)
        #pragma unroll
        for (int j = 0; j < N; ++j) {
            const int y = __shfl_up_sync(FULL, x[j], o);
            if (lane >= o) x[j] += y;
        }
    if (lane == 31)
        #pragma unroll
        for (int j = 0; j < N; ++j) ws[32 * j + warp] = x[j];
    __syncthreads();
    if (warp == 0)
        #pragma unroll
        for (int j = 0; j < N; ++j) {
            int w = lane < nw ? ws[32 * j + lane] : 0;
            #pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int y = __shfl_up_sync(FULL, w, o);
                if (lane >= o) w += y;
            }
            ws[32 * j + lane] = w;                       // inclusive over warps
        }
    __syncthreads();
    #pragma unroll
    for (int j = 0; j < N; ++j) {
        total[j] = ws[32 * j + nw - 1];
        v[j] = (warp ? ws[32 * j + warp - 1] : 0) + x[j] - v[j];
    }
    __syncthreads();
}

// The calling thread's chunk of pairs [a, b).
__device__ __forceinline__ void chunk_of(int P, int& a, int& b) {
    const int per = (P + blockDim.x - 1) / blockDim.x;
    a = min(P, (int)threadIdx.x * per);
    b = min(P, a + per);
}

#define GROUP_CHUNK 16   // pairs a thread holds in registers (layers/moe.py _group_threads: ~16 a thread)
extern "C" __global__ void __launch_bounds__(1024) moe_group_place(
    const int* __restrict__ idx, int P, int E, int* __restrict__ offsets, int* __restrict__ perm,
    int* __restrict__ active, int* __restrict__ n_active, int TS, int4* __restrict__ tiles, int* __restrict__ n_tiles) {
    pdl_entry();
    __shared__ int ws[3 * 32], mine[4], hist[MAX_E];
    const int e = blockIdx.x;
    for (int x = threadIdx.x; x < E; x += blockDim.x) hist[x] = 0;
    __syncthreads();
    int a, b, own = 0;                                   // own: the chunk's pairs of expert e
    chunk_of(P, a, b);
    // A chunk of up to GROUP_CHUNK pairs stays in registers from one round of loads (16-byte ones where the chunk
    // allows) for both passes; longer chunks (P > GROUP_CHUNK * 1024) are read from idx in each. (Before, each pass
    // loaded its chunk 4 bytes at a time, 4 loads in flight: ncu put ~80% of the stall samples on those waits;
    // T = 2,048 13.06 -> 6.71 us, H200, same bytes. ld.global.cg: the router wrote idx, and ptxas keeps these loads
    // after the PDL wait, unlike ld.global.nc; pdl.cuh.)
    const bool held = b - a <= GROUP_CHUNK;
    int hv[GROUP_CHUNK];
    if (held) {
        const bool vec = ((reinterpret_cast<uintptr_t>(idx + a)) & 15) == 0;
#pragma unroll
        for (int j = 0; j < GROUP_CHUNK; j += 4) {
            if (vec && a + j + 4 <= b) {
                const int4 w = __ldcg(reinterpret_cast<const int4 *>(idx + a + j));
                hv[j] = w.x; hv[j + 1] = w.y; hv[j + 2] = w.z; hv[j + 3] = w.w;
            } else {
#pragma unroll
                for (int i = 0; i < 4; ++i) hv[j + i] = a + j + i < b ? __ldcg(idx + a + j + i) : -1;
            }
        }
#pragma unroll
        for (int j = 0; j < GROUP_CHUNK; ++j) {
            if (hv[j] >= 0 && hv[j] < E) atomicAdd(&hist[hv[j]], 1);
            own += hv[j] == e;
        }
    } else {
        for (int p = a; p < b; ++p) {
            const int x = idx[p];
            if (x >= 0 && x < E) atomicAdd(&hist[x], 1);
            own += x == e;
        }
    }
    __syncthreads();
    // the experts' prefixes: thread i sums its run of experts [i q, (i + 1) q) (q = ceil(E / threads)) -- pairs,
    // active, tiles --, one block scan, then the thread that holds e walks its run up to e
    const int q = (E + blockDim.x - 1) / blockDim.x, x0 = min(E, (int)threadIdx.x * q), x1 = min(E, x0 + q);
    int v[3] = {0, 0, 0}, total[3];
    for (int x = x0; x < x1; ++x) {
        const int cx = hist[x];
        v[0] += cx;
        v[1] += cx > 0;
        v[2] += (cx + TS - 1) / TS;
    }
    block_scan<3>(v, ws, total);
    if (e >= x0 && e < x1) {
        for (int x = x0; x < e; ++x) {
            const int cx = hist[x];
            v[0] += cx;
            v[1] += cx > 0;
            v[2] += (cx + TS - 1) / TS;
        }
        mine[0] = v[0]; mine[1] = v[1]; mine[2] = v[2]; mine[3] = hist[e];
    }
    __syncthreads();
    const int off = mine[0], rank = mine[1], tb = mine[2], c = mine[3];
    if (threadIdx.x == 0) {
        offsets[e] = off;
        if (c > 0) active[rank] = e;
        if (e == 0) {
            offsets[E] = total[0];
            n_active[0] = total[1];
            n_tiles[0] = total[2];
        }
    }
    for (int j = threadIdx.x; j < (c + TS - 1) / TS; j += blockDim.x)
        tiles[tb + j] = make_int4(e, off + j * TS, min(TS, c - j * TS), 0);
    if (c == 0) return;                                  // uniform over the block
    int w[1] = {own}, tw[1];
    block_scan<1>(w, ws, tw);
    int pos = off + w[0];
    if (held) {
#pragma unroll
        for (int j = 0; j < GROUP_CHUNK; ++j)
            if (hv[j] == e) perm[pos++] = a + j;
    } else {
        for (int p = a; p < b; ++p)
            if (idx[p] == e) perm[pos++] = p;
    }
}

// The packed NVFP4 experts into the device word layout (moe_common.cuh), in place, once at upload: w holds n 32-bit
// words (columns 8j .. 8j+7 each; K % 16 == 0 keeps a word inside its row). Grid-stride; not idempotent.
extern "C" __global__ void __launch_bounds__(256) moe_fp4_repack(uint32_t* __restrict__ w, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) w[i] = fp4_device_word(w[i]);
}

// The NVFP4 block scales into the device scale layout (moe_common.cuh scale_row), once at upload: src (rows, kb) e4m3
// bytes (rows % 16 == 0: the expert stack's rows one after the other), dst [rows / 16][nsu][16][8], nsu = ceil(kb / 8),
// zeros past kb. One 8-byte word of dst a thread, grid-stride. (layers/moe.py fp4_scale_blocks is its numpy twin.)
extern "C" __global__ void __launch_bounds__(256) moe_scale_blocks(const uint8_t* __restrict__ src,
                                                                   uint2* __restrict__ dst, int rows, int kb) {
    const int nsu = (kb + 7) >> 3, words = (rows >> 4) * nsu * 16;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < words; i += gridDim.x * blockDim.x) {
        const int blk = i / (nsu * 16), su = (i >> 4) % nsu, r = 16 * blk + (i & 15);
        uint32_t v[2] = {0u, 0u};
#pragma unroll
        for (int b = 0; b < 8; ++b) {
            const int c = 8 * su + b;
            if (c < kb) v[b >> 2] |= (uint32_t)src[(size_t)r * kb + c] << (8 * (b & 3));
        }
        dst[i] = make_uint2(v[0], v[1]);
    }
}

// ---------------------------------------------------------------------------------------------------
// combine (combine.cuh's arithmetic): out[t, n] = bf16( sum over token t's slots, in increasing EXPERT index, of
// f32(o[t*k+s, n]) ), fp32 sum starting from 0. Slots whose expert is outside [0, E) are skipped. grid (T,
// ceil(H / (8 COMB_THREADS))), block COMB_THREADS; k <= 16. Thread i owns columns 8i .. 8i + 7 of its CTA's
// 8 COMB_THREADS: it requests its slots' 8 columns 8 slots at a time (16-byte loads when H % 8 == 0, so the rows are
// 16-byte aligned; element loads otherwise), then adds them column by column in slot order (the same adds as one
// column per thread: a memory-bound kernel with a token's loads in flight together).
#define COMB_THREADS 128
extern "C" __global__ void __launch_bounds__(COMB_THREADS) moe_combine_bf16(
    const bf16* __restrict__ o,          // (P, H)
    const int* __restrict__ idx,         // (T, k)
    bf16* __restrict__ out,              // (T, H)
    int T, int H, int k, int E)
{
    pdl_entry();
    __shared__ int order[MAX_K];
    __shared__ int nvalid;
    const int t = blockIdx.x;
    if (threadIdx.x < 32) slots_by_expert_warp(idx + (size_t)t * k, k, E, order, &nvalid);
    __syncthreads();
    const int n0 = 8 * (blockIdx.y * COMB_THREADS + threadIdx.x), nv = nvalid;
    if (n0 >= H) return;
    bf16* dst = out + (size_t)t * H + n0;
    float acc[8];
    if ((H & 7) == 0) {                                          // then n0 + 8 <= H, rows 16-byte aligned
        combine8(o + (size_t)t * k * H, order, nv, H, n0, acc);
        uint32_t w[4];
        #pragma unroll
        for (int c = 0; c < 4; ++c)
            w[c] = (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(acc[2 * c])) |
                   ((uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(acc[2 * c + 1])) << 16);
        *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
        return;
    }
    for (int c = 0; c < 8; ++c) acc[c] = 0.f;                    // element loads, the same adds in the same order
    for (int r = 0; r < nv; ++r) {
        const bf16* row = o + ((size_t)t * k + order[r]) * H + n0;
        for (int c = 0; c < 8 && n0 + c < H; ++c) acc[c] = __fadd_rn(acc[c], __bfloat162float(row[c]));
    }
    for (int c = 0; c < 8 && n0 + c < H; ++c) dst[c] = __float2bfloat16_rn(acc[c]);
}

// B source 1: whole token rows resident in shared memory (row stride rs bytes), rows >= nrows and columns
// >= K read as zeros.
struct SrcRows {
    const unsigned char* base;
    int rs, nrows, K;
    __device__ __forceinline__ void begin(int) {}
    __device__ __forceinline__ uint4 b(int row, int su, int c) const {
        const int col = (su << 7) + 8 * c;
        if (row < nrows && col < K) return *(const uint4*)(base + (size_t)row * rs + 2 * col);
        return make_uint4(0, 0, 0, 0);
    }
};

// B source 2: a CTA-wide cp.async pipeline of STAGES super units; stage = NTOK rows x 256 bytes (128 bf16).
// The 16-byte chunk c (columns 8c..8c+7) of row r lives at chunk c ^ (((c >> 3) & 1) << 1) ^ (r & 1): the 8
// lanes of an LDS.128 phase (rows g, g+1; q = 0..3; chunk 4q+m) then hit 8 different bank groups.
// rowoff[r] = element offset of row r in X, -1 = absent (zero-filled); columns >= K zero-filled.
// begin(su) must be called by every thread of the CTA for su = 0, 1, ... in order (it holds a barrier).
__device__ __forceinline__ int swz(int r, int c) { return c ^ (((c >> 3) & 1) << 1) ^ (r & 1); }

template <int NTOK, int STAGES>
struct SrcStages {
    unsigned char* smem;
    const bf16* X;
    const int* rowoff;
    int K, nsu;
    const unsigned char* cur;
    __device__ __forceinline__ void load(int su, int st) {
        unsigned char* sb = smem + (size_t)st * NTOK * 256;
        for (int i = threadIdx.x; i < NTOK * 16; i += blockDim.x) {
            const int r = i >> 4, c = i & 15, col = (su << 7) + 8 * c;
            const int ro = rowoff[r];
            const bool ok = ro >= 0 && col < K;
            cp_async16(sb + r * 256 + 16 * swz(r, c), ok ? (const void*)(X + (size_t)ro + col) : (const void*)X, ok);
        }
    }
    __device__ __forceinline__ void prologue() {
        #pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) {
            if (s < nsu) load(s, s);
            cp_async_commit();
        }
    }
    __device__ __forceinline__ void begin(int su) {
        cp_async_wait<STAGES - 2>();             // this thread's copies of super unit su have landed
        __syncthreads();                          // everyone's; and stage (su-1) % STAGES is no longer read
        if (su + STAGES - 1 < nsu) load(su + STAGES - 1, (su + STAGES - 1) % STAGES);
        cp_async_commit();                        // possibly empty: keeps the group count uniform
        cur = smem + (size_t)(su % STAGES) * NTOK * 256;
    }
    __device__ __forceinline__ uint4 b(int row, int, int c) const {
        return *(const uint4*)(cur + row * 256 + 16 * swz(row, c));
    }
    __device__ __forceinline__ void drain() { cp_async_wait<0>(); }
};

// d = 0: MT x NT mma D fragments (the run's total, and each super unit's fresh partial).
template <int MT, int NT>
__device__ __forceinline__ void zero_frags(float (&d)[MT][NT][4]) {
    #pragma unroll
    for (int m = 0; m < MT; ++m)
        #pragma unroll
        for (int n = 0; n < NT; ++n)
            #pragma unroll
            for (int i = 0; i < 4; ++i) d[m][n][i] = 0.f;
}

// The shared inner loop: acc[mt][n] += W_mt (16 rows) x X (tokens 8n..8n+7) over all K, in the fixed order
// described above. Identical instruction sequence per output element for every MT / NT / D / source.
template <int MT, int NT, int D, class Src>
__device__ __forceinline__ void nvfp4_mma_run(float (&acc)[MT][NT][4], WRing<MT, D>& wr, Src& src, int lane) {
    const int g = lane >> 2, q = lane & 3;
    zero_frags(acc);
    for (int su0 = 0; su0 < wr.nsu; su0 += D) {
        #pragma unroll
        for (int r = 0; r < D; ++r) {
            const int su = su0 + r;
            if (su >= wr.nsu) break;                             // uniform over the CTA
            src.begin(su);
            uint32_t S[MT][2][2];
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                #pragma unroll
                for (int h = 0; h < 2; ++h) scales_bf16x2(wr.s[r][mt][h], S[mt][h][0], S[mt][h][1]);
            // the super unit's 8 mma steps go into a FRESH accumulator (from 0), added to the fp32 total below:
            // the mma accumulator is truncated (round toward zero) at every step, so one chain over all of K
            // drifts toward zero by ~K/16 half-ulps; per 128-column unit that bias stays ~8 half-ulps of the
            // unit's partial sum, and the units are summed in IEEE fp32 (RN).
            float part[MT][NT][4];
            zero_frags(part);
            #pragma unroll
            for (int m = 0; m < 4; ++m) {                         // word m -> steps 2m, 2m+1
                uint32_t a[MT][2][4];
                #pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    uint32_t rg[4], rh[4];
                    fp4x8_bf16(u4word(wr.w[r][mt][0], m), S[mt][0][m >> 1], rg);
                    fp4x8_bf16(u4word(wr.w[r][mt][1], m), S[mt][1][m >> 1], rh);
                    a[mt][0][0] = rg[0]; a[mt][0][1] = rh[0]; a[mt][0][2] = rg[1]; a[mt][0][3] = rh[1];
                    a[mt][1][0] = rg[2]; a[mt][1][1] = rh[2]; a[mt][1][2] = rg[3]; a[mt][1][3] = rh[3];
                }
                #pragma unroll
                for (int n = 0; n < NT; ++n) {
                    const uint4 bv = src.b(8 * n + g, su, 4 * q + m);
                    #pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma_bf16_16816(part[mt][n], a[mt][0], bv.x, bv.y);
                        mma_bf16_16816(part[mt][n], a[mt][1], bv.z, bv.w);
                    }
                }
            }
            #pragma unroll
            for (int m = 0; m < MT; ++m)
                #pragma unroll
                for (int n = 0; n < NT; ++n)
                    #pragma unroll
                    for (int i = 0; i < 4; ++i) acc[m][n][i] = __fadd_rn(acc[m][n][i], part[m][n][i]);
            wr.load(r, su + D);                                   // refill the slot (zeros past the end)
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// DIRECT path (small T, no grouping), v3: split-K over WARPS with the block partials kept apart. The per-output
// arithmetic is exactly nvfp4_mma_run's (MT = NT = 1): super unit su's partial is its own 8-step mma chain from
// a zero accumulator with the same A / B operands (token column 0 = the pair's token, columns 1..7 zero), and
// the output's fp32 accumulator is acc = 0.f; acc = __fadd_rn(acc, part[su]) for su = 0, 1, .., nsu-1 (the
// same IEEE adds in the same order, starting from +0.0f), only done by one thread from shared memory after the
// warps have stored their units' partials. So the bits equal the grouped path's (and the v2 direct kernels').

// Per-warp ring of NVFP4 weights in SHARED memory for the direct kernels: DS super units of the warp in flight at
// no register cost but their scales (a register ring holds 16 registers a unit, so only 2-3 fitted). Slot r holds
// lane l's two 16-byte pieces (rows g and g + 8 of the unit's 32 columns 32q..) at uint4 (2r + h) * 32 + l of the
// warp's slots (lane-contiguous: conflict-free), written by that lane's own cp.async and read back by the same
// lane after its own cp.async.wait_group (no barrier needed; the "memory" clobbers keep the compiler from moving
// the read across the wait or the refill). The bytes are WRing's: 16-byte pieces when K % 32 == 0, else two
// 8-byte halves, columns >= K zero-filled; the two scale bytes a row half go to registers with ldg as there. Every
// load call commits one group (an empty one past the warp's last unit), so take(r) always waits for all groups
// but the DS - 1 newest.
template <int DS>
struct SRing {
    uint32_t s[DS][2];
    uint4* slots;                // the warp's DS * 2 * 32 uint4
    const uint8_t* wr;           // the lane's row g: packed bytes, scale_row
    const uint8_t* sr;
    size_t rb8;                  // bytes of 8 packed rows
    int K, nsu, q, lane;
    bool al16;

    __device__ __forceinline__ void init(const uint8_t* w_, const uint8_t* s_, int K_, int lane_, uint4* slots_) {
        wr = w_; sr = s_; K = K_; lane = lane_; q = lane & 3; nsu = (K + 127) >> 7; al16 = (K & 31) == 0;
        rb8 = (size_t)8 * (K >> 1); slots = slots_;
    }
    __device__ __forceinline__ void load(int r, int su) {
        if (su < nsu) {
            const int c0 = (su << 7) + 32 * q;
            const bool lo = c0 + 16 <= K, hi = c0 + 32 <= K;
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const uint8_t* wp = wr + h * rb8 + (c0 >> 1);
                const uint8_t* sp = sr + h * 64 + (su << 7) + 2 * q;
                uint4* d = slots + (2 * r + h) * 32 + lane;
                if (al16) {                                   // c0 % 32 == 0 == K % 32: all 16 bytes or none
                    cp_async16(d, hi ? (const void*)wp : (const void*)wr, hi);
                    s[r][h] = hi ? (uint32_t)__ldg((const unsigned short*)sp) : 0u;
                } else {
                    cp_async8(d, lo ? (const void*)wp : (const void*)wr, lo);
                    cp_async8((uint8_t*)d + 8, hi ? (const void*)(wp + 8) : (const void*)wr, hi);
                    s[r][h] = (lo ? (uint32_t)__ldg(sp) : 0u) | (hi ? (uint32_t)__ldg(sp + 1) << 8 : 0u);
                }
            }
        }
        cp_async_commit();
    }
    __device__ __forceinline__ void take(int r, uint4 (&w)[2], uint32_t (&sc)[2]) const {
        cp_async_wait<DS - 1>();
        w[0] = slots[(2 * r) * 32 + lane];
        w[1] = slots[(2 * r + 1) * 32 + lane];
        sc[0] = s[r][0];
        sc[1] = s[r][1];
    }
};

// One super unit's partial of a 16-row m-tile against the (single) token row of src: part = mma chain over the
// unit's 8 k16 steps from zero, the same operand order as nvfp4_mma_run (word m -> steps 2m, 2m+1). w, sc: the
// unit's packed rows g, g + 8 and their scale bytes (SRing::take).
__device__ __forceinline__ void direct_unit_partial(float (&part)[4], const uint4 (&w)[2], const uint32_t (&sc)[2],
                                                    const SrcRows& src, int su, int lane) {
    const int g = lane >> 2, q = lane & 3;
    uint32_t S[2][2];
    #pragma unroll
    for (int h = 0; h < 2; ++h) scales_bf16x2(sc[h], S[h][0], S[h][1]);
    #pragma unroll
    for (int i = 0; i < 4; ++i) part[i] = 0.f;
    #pragma unroll
    for (int m = 0; m < 4; ++m) {
        uint32_t a[2][4], rg[4], rh[4];
        fp4x8_bf16(u4word(w[0], m), S[0][m >> 1], rg);
        fp4x8_bf16(u4word(w[1], m), S[1][m >> 1], rh);
        a[0][0] = rg[0]; a[0][1] = rh[0]; a[0][2] = rg[1]; a[0][3] = rh[1];
        a[1][0] = rg[2]; a[1][1] = rh[2]; a[1][2] = rg[3]; a[1][3] = rh[3];
        const uint4 bv = src.b(g, su, 4 * q + m);
        mma_bf16_16816(part, a[0], bv.x, bv.y);
        mma_bf16_16816(part, a[1], bv.z, bv.w);
    }
}

// A warp's share of the super units of one 16-row m-tile: units j, j+S, j+2S, .. (< nsu), DS of them in flight
// in the ring (slot i % DS holds the warp's i-th unit, refilled with its (i+DS)-th as soon as it is read back,
// before its MMAs). Unit su's partial for rows g, g+8 (token column 0 = lanes q == 0: d0, d2) goes to
// pbuf[su*16 + g], pbuf[su*16 + g + 8]. The caller has loaded units 0 .. DS-1 (ring.load(r, j + S r)).
template <int DS>
__device__ __forceinline__ void direct_units(const SrcRows& src, int j, int S, float* pbuf, int lane, SRing<DS>& ring) {
    const int g = lane >> 2, q = lane & 3;
    const int nsu = ring.nsu;
    const int my_n = j < nsu ? (nsu - 1 - j) / S + 1 : 0;
    for (int i0 = 0; i0 < my_n; i0 += DS) {
        #pragma unroll
        for (int r = 0; r < DS; ++r) {
            const int i = i0 + r;
            if (i >= my_n) break;                                    // uniform over the warp
            const int su = j + S * i;
            uint4 w[2];
            uint32_t sc[2];
            ring.take(r, w, sc);
            ring.load(r, su + S * DS);                               // the warp's (i+DS)-th unit (none past nsu)
            float part[4];
            direct_unit_partial(part, w, sc, src, su, lane);
            if (q == 0) { pbuf[su * 16 + g] = part[0]; pbuf[su * 16 + g + 8] = part[2]; }
        }
    }
    cp_async_wait<0>();                                          // no copy left in flight (empty groups)
}

// gate/up, DIRECT: one CTA per (16 intermediate rows n0.., pair p = t*k + s), S = blockDim.x / 64 warps per
// projection: warp w computes projection w / S (0 gate, 1 up) over the super units j, j+S, .. (j = w % S),
// GU_DIRECT_DS of them in flight in its shared ring, storing each unit's partial; then thread n (< 16) sums row n's
// partials in increasing unit order from 0 for both projections and writes
//   u[p, n0+n] = bf16(gelu(gate_e[n] . x[t] / g_gate) * (up_e[n] . x[t] / g_up)),  e = idx[p]  (u in PAIR order).
// grid (I/16, P), block 64*S (launcher: S = 4 -> 256 threads, 8 warps; 352 CTAs at T=1; each warp <= 6 units of
// the 22 at H = 2816). Dynamic shared: x[t] (H bf16), the partials (2 * nsu * 16 fp32), then the rings of the 2S
// warps (DS slots of 1 KiB each): 2*H + 128*nsu + 2048*S*DS bytes, nsu = ceil(H/128) (layers/moe.py
// _direct_shared). Pairs with e outside [0, E) are skipped.
// The weights wait in shared memory (SRing), not in a register ring, as in moe_down_combine_direct below.
// Residency: 63 registers and 33 KiB at DS = 3, so 4 CTAs fit an SM and 3 of them fit beside a CTA of the dense
// MLP's gate/up GEMV that runs on the branch meanwhile (64 KiB of shared memory, 63 registers): all 352 start at
// once. With the register ring at D = 3 (76 registers) only 2 fitted there, and the rest entered over ~5 us as the
// GEMV's CTAs left (per-CTA timestamps, thirty-eighth session).
// Measured (H200, decode graphs in one process, ms a step at batch 1 / 2 / 4, thirty-eighth session, BENCHMARKS.md;
// the same bytes in every form):
// - register ring D = 3, 3 CTAs an SM: 2.3354 / 2.9257 / 3.9540; D = 2, 4 an SM: 2.2963 / 2.8703 / 3.8485.
// - Against D = 2 with the register-ring down kernel (2.3113 / 2.8754 / 3.8587 in that process): this kernel
//   at DS = 3 with the shared-ring down 2.2853 / 2.8629 / 3.7903.
// - The register-ring gate/up with the shared-ring down: 2.2880 / 2.8331 / 3.8500.
// - More units in flight was slower: DS = 4 2.3346 / 2.8933 / 3.8712, DS = 5 2.3958 / 2.9195 / 3.9101. A batch-1
//   launch still takes ~14 us for 17.8 MB with all its CTAs resident; what binds it is not the bytes in flight.
#define GU_DIRECT_DS 3
extern "C" __global__ void __launch_bounds__(256, 4) moe_gate_up_direct(
    const bf16* __restrict__ x,          // (T, H)
    const int* __restrict__ idx,         // (T, k)
    const uint8_t* __restrict__ gw, const uint8_t* __restrict__ gs,
    const uint8_t* __restrict__ uw, const uint8_t* __restrict__ us,
    const float* __restrict__ gsc,       // (E, 3, 2)
    bf16* __restrict__ u,                // (P, I) pair order
    int H, int I, int k, int E)
{
    constexpr int DS = GU_DIRECT_DS;
    pdl_entry();
    extern __shared__ __align__(16) unsigned char smem_gud[];
    const int p = blockIdx.y, e = idx[p];
    if (e < 0 || e >= E) return;                                  // uniform over the CTA
    const int t = p / k, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int S = blockDim.x >> 6, proj = warp / S, j = warp - proj * S;
    const int n0 = blockIdx.x * 16, nsu = (H + 127) >> 7;
    float* pbuf = (float*)(smem_gud + 2 * (size_t)H);             // [2][nsu][16] fp32 partials (2H % 16 == 0)
    uint4* slots = (uint4*)(smem_gud + 2 * (size_t)H + 128 * (size_t)nsu) + (size_t)warp * DS * 64;
    const size_t row = (size_t)e * I + n0 + (lane >> 2);
    SRing<DS> ring;
    ring.init((proj ? uw : gw) + row * (H >> 1), (proj ? us : gs) + scale_row(row, H), H, lane, slots);
    #pragma unroll
    for (int r = 0; r < DS; ++r) ring.load(r, j + S * r);         // weight loads in flight before the x copy
    const uint4* xr = (const uint4*)(x + (size_t)t * H);
    for (int i = threadIdx.x; i < (H >> 3); i += blockDim.x) ((uint4*)smem_gud)[i] = xr[i];
    __syncthreads();
    const SrcRows src{smem_gud, 2 * H, 1, H};
    direct_units<DS>(src, j, S, pbuf + (size_t)proj * nsu * 16, lane, ring);
    __syncthreads();
    if (threadIdx.x < 16) {
        const int n = threadIdx.x;
        float accg = 0.f, accu = 0.f;                             // nvfp4_mma_run's acc: from 0, units ascending
        #pragma unroll 8
        for (int su = 0; su < nsu; ++su) {
            accg = __fadd_rn(accg, pbuf[su * 16 + n]);
            accu = __fadd_rn(accu, pbuf[(nsu + su) * 16 + n]);
        }
        const float* gg = gsc + ((size_t)e * 3 + 0) * 2;
        const float* gu = gsc + ((size_t)e * 3 + 1) * 2;
        u[(size_t)p * I + n0 + n] = __float2bfloat16_rn(__fmul_rn(gelu_tanh_f(apply_global(accg, gg)), apply_global(accu, gu)));
    }
}

// down + combine, DIRECT: one CTA per (16 output rows n0.., token t), S = blockDim.x / (32 k) warps per slot:
// warp w serves the token's (w / S)-th valid slot in increasing expert index (the combine order) over the super
// units j, j+S, .. (j = w % S) of K = I, DN_DIRECT_DS in flight in its shared ring (SRing), storing each unit's
// partial. Then thread (r, n) (r < nvalid, n < 16) sums slot r's row-n partials in increasing unit order from 0 ->
// o = bf16((acc / g_down) * w[p]) and thread n (< 16) adds the slots in order from 0: out[t, n0+n] =
// bf16(sum_r f32(o_r)) (moe_combine_bf16's arithmetic). grid (H/16, T), block 32*k*S (launcher: S = 2 at k = 8 ->
// 512 threads, 16 warps; 176 CTAs at T = 1, up to 2 per SM; each warp 3 of the 6 units at I = 704, all 3 in
// flight before the wait). Dynamic shared: k*I bf16 (the token's u rows, slot rank order), k*nsu*16 fp32
// partials, then the rings of the k*S warps (DS slots of 1 KiB each): 2*k*I + 64*k*nsu + 1024*k*S*DS bytes, nsu =
// ceil(I/128).
// PDL: launched with the attribute right after moe_gate_up_direct, which is launched WITHOUT it (so the router, or
// the upload, that wrote idx and weights had finished before moe_gate_up_direct began, and so before this kernel
// could launch): idx is read and the first down rows are fetched before griddepcontrol.wait; u (moe_gate_up_direct's
// output) is read and out written only after it.
#define DN_DIRECT_DS 3
extern "C" __global__ void __launch_bounds__(512, 2) moe_down_combine_direct(
    const bf16* __restrict__ u,          // (P, I) pair order
    const int* __restrict__ idx,         // (T, k)
    const float* __restrict__ weights,   // (T, k)
    const uint8_t* __restrict__ dw, const uint8_t* __restrict__ ds,
    const float* __restrict__ gsc,
    bf16* __restrict__ out,              // (T, H)
    int H, int I, int k, int E)
{
    pdl_trigger();
    extern __shared__ __align__(16) unsigned char smem_dd[];
    __shared__ int order[MAX_K];
    __shared__ int nvalid;
    __shared__ float vals[MAX_K][16];
    const int t = blockIdx.y, n0 = blockIdx.x * 16;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int S = blockDim.x / (32 * k), sr = warp / S, j = warp - sr * S;
    const int nsu = (I + 127) >> 7;
    float* pbuf = (float*)(smem_dd + 2 * (size_t)k * I);          // [k][nsu][16] fp32 partials (2kI % 32 == 0)
    if (threadIdx.x < 32) slots_by_expert_warp(idx + (size_t)t * k, k, E, order, &nvalid);
    __syncthreads();
    const int nv = nvalid;
    const bool live = sr < nv;                                    // warp-uniform
    SRing<DN_DIRECT_DS> ring;
    if (live) {
        const int e = idx[t * k + order[sr]];
        const size_t row = (size_t)e * H + n0 + (lane >> 2);
        uint4* slots = (uint4*)(smem_dd + 2 * (size_t)k * I + 64 * (size_t)k * nsu) + (size_t)warp * DN_DIRECT_DS * 64;
        ring.init(dw + row * (I >> 1), ds + scale_row(row, I), I, lane, slots);
        #pragma unroll
        for (int r = 0; r < DN_DIRECT_DS; ++r) ring.load(r, j + S * r);
    }
    pdl_wait();                                                   // u follows moe_gate_up_direct
    // the valid slots' u rows -> shared, slot rank r at r*I (all threads)
    for (int i = threadIdx.x; i < nv * (I >> 3); i += blockDim.x) {
        const int r = i / (I >> 3), c = i - r * (I >> 3);
        ((uint4*)(smem_dd + (size_t)r * I * 2))[c] = ((const uint4*)(u + ((size_t)t * k + order[r]) * I))[c];
    }
    __syncthreads();
    if (live) {
        const SrcRows src{smem_dd + (size_t)sr * I * 2, 2 * I, 1, I};
        direct_units<DN_DIRECT_DS>(src, j, S, pbuf + (size_t)sr * nsu * 16, lane, ring);
    }
    __syncthreads();
    if (threadIdx.x < 16 * nv) {
        const int r = threadIdx.x >> 4, n = threadIdx.x & 15;
        const int p = t * k + order[r], e = idx[p];
        float acc = 0.f;                                          // nvfp4_mma_run's acc: from 0, units ascending
        for (int su = 0; su < nsu; ++su) acc = __fadd_rn(acc, pbuf[(r * nsu + su) * 16 + n]);
        const float* gd = gsc + ((size_t)e * 3 + 2) * 2;
        vals[r][n] = __bfloat162float(__float2bfloat16_rn(__fmul_rn(apply_global(acc, gd), weights[p])));
    }
    __syncthreads();
    if (threadIdx.x < 16) {
        float a = 0.f;
        for (int r = 0; r < nv; ++r) a += vals[r][threadIdx.x];
        out[(size_t)t * H + n0 + threadIdx.x] = __float2bfloat16_rn(a);
    }
}

// ---------------------------------------------------------------------------------------------------
// GROUPED path: moe_group_tiles (below) sorts the pairs by expert (stable) and cuts every expert's group into
// tiles of TS = 8*NT grouped positions: tiles[i] = (e, q0, nq, 0), tile order = expert order.
// gate/up: grid (ceil(I/64), max_tiles), block 128 (4 warps), tile blockIdx.y (exit if >= n_tiles). Warp w owns
// intermediate rows n0 = 64*bx + 16w .. +15 as two m-tiles (gate rows, up rows: MT = 2, the gelu pairs land in
// the same lane), all NT n-tiles. x rows of the tile (token perm[q]/k) stream through a 3-stage cp.async
// pipeline. u is written in GROUPED order (row q). Dynamic shared: 256 B (row offsets) + GSTAGES * 8*NT * 256 B.
#define GSTAGES 3

// Both grouped bodies' pipeline: the warp's two weight rows (wrow / srow, K columns) through a D-deep ring, the tile's
// 8*NT rows of x (element offsets off(i), -1 past the tile, into the first 256 B of smem) through the GSTAGES stages
// after them, and nvfp4_mma_run into acc.
template <int NT, int D, class Off>
__device__ __forceinline__ void grouped_run(float (&acc)[2][NT][4], const uint8_t* const (&wrow)[2],
                                            const uint8_t* const (&srow)[2], int K, unsigned char* smem,
                                            const bf16* __restrict__ x, Off off, int lane) {
    constexpr int NTOK = 8 * NT;
    int* rowoff = (int*)smem;
    WRing<2, D> ring;
    ring.init(wrow, srow, K, lane);
    ring.prologue();
    for (int i = threadIdx.x; i < NTOK; i += blockDim.x) rowoff[i] = off(i);
    __syncthreads();
    SrcStages<NTOK, GSTAGES> src{smem + 256, x, rowoff, K, ring.nsu, nullptr};
    src.prologue();
    nvfp4_mma_run<2, NT, D>(acc, ring, src, lane);
    src.drain();
}

template <int NT, int D>
__device__ __forceinline__ void gate_up_grouped_body(
    const bf16* __restrict__ x, const int* __restrict__ perm, const int4* __restrict__ tiles,
    const int* __restrict__ n_tiles, const uint8_t* __restrict__ gw, const uint8_t* __restrict__ gs,
    const uint8_t* __restrict__ uw, const uint8_t* __restrict__ us, const float* __restrict__ gsc,
    bf16* __restrict__ u, int H, int I, int k)
{
    extern __shared__ __align__(16) unsigned char smem_gug[];         // dynamic: 256 B of row offsets, then the stages
    if ((int)blockIdx.y >= n_tiles[0]) return;                    // uniform
    const int4 tl = tiles[blockIdx.y];
    const int e = tl.x, q0 = tl.y, nq = tl.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int nn = blockIdx.x * 64 + 16 * warp;
    const bool live = nn < I;
    const int n0 = live ? nn : I - 16;                            // dead warps compute a copy, store nothing
    const size_t row = (size_t)e * I + n0 + g;
    const uint8_t* const wrow[2] = {gw + row * (H >> 1), uw + row * (H >> 1)};
    const uint8_t* const srow[2] = {gs + scale_row(row, H), us + scale_row(row, H)};
    float acc[2][NT][4];
    grouped_run<NT, D>(acc, wrow, srow, H, smem_gug, x, [&](int i) { return i < nq ? (perm[q0 + i] / k) * H : -1; },
                       lane);
    if (!live) return;
    const float* gg = gsc + ((size_t)e * 3 + 0) * 2;
    const float* gu = gsc + ((size_t)e * 3 + 1) * 2;
    #pragma unroll
    for (int n = 0; n < NT; ++n)
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int col = 8 * n + 2 * q + (i & 1), r = g + 8 * (i >> 1);
            if (col < nq)
                u[(size_t)(q0 + col) * I + n0 + r] = __float2bfloat16_rn(gate_up_out(acc[0][n][i], acc[1][n][i], gg, gu));
        }
}

// down: grid (ceil(H/128), max_tiles), block 128; warp w owns output rows 128*bx + 32w .. +31 (MT = 2 m-tiles,
// each clamped to the last full m-tile if past H and then not stored); u rows of the tile (grouped positions
// q0..q0+nq-1, contiguous) through the same pipeline. o[p, n] = bf16((down_e[n] . u[q] / g_down) * w[p]),
// p = perm[q], o in PAIR order; moe_combine_bf16 sums the slots.
template <int NT, int D>
__device__ __forceinline__ void down_grouped_body(
    const bf16* __restrict__ u, const int* __restrict__ perm, const int4* __restrict__ tiles,
    const int* __restrict__ n_tiles, const uint8_t* __restrict__ dw, const uint8_t* __restrict__ ds,
    const float* __restrict__ gsc, const float* __restrict__ weights, bf16* __restrict__ o, int H, int I)
{
    extern __shared__ __align__(16) unsigned char smem_dg[];          // dynamic: 256 B of row offsets, then the stages
    if ((int)blockIdx.y >= n_tiles[0]) return;
    const int4 tl = tiles[blockIdx.y];
    const int e = tl.x, q0 = tl.y, nq = tl.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    int base[2];
    bool live[2];
    #pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
        const int nn = blockIdx.x * 128 + 32 * warp + 16 * mt;
        live[mt] = nn < H;
        base[mt] = live[mt] ? nn : H - 16;
    }
    const uint8_t* const wrow[2] = {dw + ((size_t)e * H + base[0] + g) * (I >> 1), dw + ((size_t)e * H + base[1] + g) * (I >> 1)};
    const uint8_t* const srow[2] = {ds + scale_row((size_t)e * H + base[0] + g, I),
                                    ds + scale_row((size_t)e * H + base[1] + g, I)};
    float acc[2][NT][4];
    grouped_run<NT, D>(acc, wrow, srow, I, smem_dg, u, [&](int i) { return i < nq ? (q0 + i) * I : -1; }, lane);
    const float* gd = gsc + ((size_t)e * 3 + 2) * 2;
    #pragma unroll
    for (int n = 0; n < NT; ++n)
        #pragma unroll
        for (int c = 0; c < 2; ++c) {
            const int col = 8 * n + 2 * q + c;
            if (col < nq) {
                const int p = perm[q0 + col];
                const float w = weights[p];
                bf16* orow = o + (size_t)p * H;
                #pragma unroll
                for (int mt = 0; mt < 2; ++mt)
                    if (live[mt]) {
                        orow[base[mt] + g] = __float2bfloat16_rn(__fmul_rn(apply_global(acc[mt][n][c], gd), w));
                        orow[base[mt] + g + 8] = __float2bfloat16_rn(__fmul_rn(apply_global(acc[mt][n][2 + c], gd), w));
                    }
            }
        }
}

// D: super units in each warp's weight ring; MINB: CTAs per SM the register budget must allow (3 = at most 168
// registers for n2 / n4, 2 for n8). n1 (the decode batches) runs a 2-unit ring at 4 CTAs per SM (128 registers):
// its kernels are bound by the NVFP4 decode's issue slots more than by loads in flight, and the 4th CTA gave
// 148.0 -> 133.2 us (T = 16) and 217.7 -> 198.6 us (T = 64) for gate_up + down on the H200 (BENCHMARKS.md, 7th
// session; D = 3 at 4 CTAs: 135.0 / 199.0; D = 4 at 4 CTAs spills: 194.8 / 281.3).
#define GU_GROUPED(NAME, NT, D, MINB) \
extern "C" __global__ void __launch_bounds__(128, MINB) NAME( \
    const bf16* __restrict__ x, const int* __restrict__ perm, const int4* __restrict__ tiles, \
    const int* __restrict__ n_tiles, const uint8_t* __restrict__ gw, const uint8_t* __restrict__ gs, \
    const uint8_t* __restrict__ uw, const uint8_t* __restrict__ us, const float* __restrict__ gsc, \
    bf16* __restrict__ u, int H, int I, int k) { \
    pdl_entry(); \
    gate_up_grouped_body<NT, D>(x, perm, tiles, n_tiles, gw, gs, uw, us, gsc, u, H, I, k); }
GU_GROUPED(moe_gate_up_mma_n1, 1, 2, 4)
GU_GROUPED(moe_gate_up_mma_n2, 2, 4, 3)
GU_GROUPED(moe_gate_up_mma_n4, 4, 2, 3)
GU_GROUPED(moe_gate_up_mma_n8, 8, 2, 2)

#define DN_GROUPED(NAME, NT, D, MINB) \
extern "C" __global__ void __launch_bounds__(128, MINB) NAME( \
    const bf16* __restrict__ u, const int* __restrict__ perm, const int4* __restrict__ tiles, \
    const int* __restrict__ n_tiles, const uint8_t* __restrict__ dw, const uint8_t* __restrict__ ds, \
    const float* __restrict__ gsc, const float* __restrict__ weights, bf16* __restrict__ o, int H, int I) { \
    pdl_entry(); \
    down_grouped_body<NT, D>(u, perm, tiles, n_tiles, dw, ds, gsc, weights, o, H, I); }
DN_GROUPED(moe_down_mma_n1, 1, 2, 4)
DN_GROUPED(moe_down_mma_n2, 2, 4, 3)
DN_GROUPED(moe_down_mma_n4, 4, 2, 3)
DN_GROUPED(moe_down_mma_n8, 8, 2, 2)
