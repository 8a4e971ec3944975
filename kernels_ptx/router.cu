// The MoE router of a decoder layer in ONE launch: logits (T, E) = r (T, H) . proj (E, H)^T in fp32, then, by the
// last CTA of each token group to finish, softmax over E, top-k, renormalisation over the k, times
// per_expert_scale. r is the router's input row, computed by elementwise.cu (post_attn_norms_bf16 or
// router_input_bf16): r = bf16(bf16(bf16(h * rms(h)^-1) * router.scale) * H^-0.5).
//
// Determinism: a logit is one warp's sum over lane-strided 8-column chunks (fixed per H), then an xor
// butterfly; the top-k of a token reads only that token's logits. Which CTA finishes last changes nothing but
// who runs the (same) top-k code, so a token's weights and experts are the same alone or in any batch.
// No float atomics; the only atomic is the integer arrival counter.
// Two kernel shapes, one arithmetic: router_bf16 (decode, T <= 4: a warp per expert) and router_bf16_t* (T > 4:
// register tiles of tokens x experts over shared-memory K blocks); every logit is the same per-lane fmaf chain
// and the same xor-tree sum in both, every top-k the same topk_token, so the bits do not depend on the kernel.
#include <cuda_bf16.h>
#include <stdint.h>

#include "pdl.cuh"          // pdl_entry / pdl_trigger / pdl_wait: programmatic dependent launch

typedef __nv_bfloat16 bf16;
#define FULL 0xffffffffu
#define RT 4             // tokens per CTA (one top-k warp each)
#define EW 4             // experts per CTA (one logits warp each)
#define MAXE 8           // experts per lane in the top-k: E <= 256
#define MAXK 16

__device__ __forceinline__ float bits_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bits_hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}

// Top-k of one token (one warp): softmax over the E logits (fp32, max-subtracted, expf), the k largest p
// (descending; ties -> lower expert index, numpy's stable argsort of -p), weights = p / sum(top p) (slot order)
// * pes[expert].
// Selection: each round, every lane takes its best p (strict >: its lowest index on ties), then the warp takes the
// largest of those with redux.sync on an order-preserving integer key of the float (key(a) < key(b) exactly when
// a < b, for every non-NaN float: non-negative floats keep their bits, negative ones flip all but the sign), and
// among the lanes holding that largest value the lowest expert index (a second redux). The same choice, round by
// round, as a compare-and-swap butterfly over (value, index), in 2 warp reductions instead of 10 shuffles. pes is
// read with the logits (one round trip) and the chosen expert's factor taken from its lane; lane j writes slot j.
// The max of the logits the same way (it may differ from a fmaxf butterfly only in the sign of a zero max, which
// changes no exp(v - max)).
__device__ __forceinline__ int order_key(float v) {
    const int b = __float_as_int(v);
    return b ^ ((b >> 31) & 0x7fffffff);
}
__device__ __forceinline__ float key_float(int k) { return __int_as_float(k ^ ((k >> 31) & 0x7fffffff)); }
__device__ void topk_token(const float* lg, const float* __restrict__ pes, float* weights, int* idx, int E, int k) {
    const int lane = threadIdx.x & 31;
    float v[MAXE], pw[MAXE];
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < MAXE; ++i) {
        const int e = lane + 32 * i;
        v[i] = e < E ? __ldcg(lg + e) : -INFINITY;          // L2: other CTAs wrote them
        pw[i] = e < E ? __ldg(pes + e) : 0.f;
        m = fmaxf(m, v[i]);
    }
    m = key_float(__reduce_max_sync(FULL, order_key(m)));  // the largest logit (a NaN one is never taken)
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < MAXE; ++i) {
        v[i] = lane + 32 * i < E ? expf(v[i] - m) : 0.f;
        s += v[i];
    }
    s = warp_sum(s);
#pragma unroll
    for (int i = 0; i < MAXE; ++i) v[i] = lane + 32 * i < E ? v[i] / s : -1.f;   // p; -1 = absent / taken
    float topv[MAXK], myv = 0.f, myp = 0.f;                 // lane j keeps round j's p, pes and expert
    int myi = 0;
#pragma unroll
    for (int j = 0; j < MAXK; ++j) {
        topv[j] = 0.f;
        if (j < k) {
            float bv = -2.f; int bi = 0x7fffffff;             // lane's best: largest p, lowest index on ties
#pragma unroll
            for (int i = 0; i < MAXE; ++i)
                if (v[i] > bv) { bv = v[i]; bi = lane + 32 * i; }
            const int kmax = __reduce_max_sync(FULL, order_key(bv));
            const int wi = __reduce_min_sync(FULL, order_key(bv) == kmax ? bi : 0x7fffffff);
            const int slot = (unsigned)wi >> 5;               // warp-uniform
            float pl = 0.f;
#pragma unroll
            for (int i = 0; i < MAXE; ++i)
                if (i == slot) pl = pw[i];
            topv[j] = key_float(kmax);                        // warp-uniform
            pl = __shfl_sync(FULL, pl, wi & 31);
            if (lane == j) { myv = topv[j]; myp = pl; myi = wi; }
#pragma unroll
            for (int i = 0; i < MAXE; ++i)
                if (lane + 32 * i == wi) v[i] = -1.f;
        }
    }
    float sum = 0.f;                                       // every lane: the same sum, slot order
#pragma unroll
    for (int j = 0; j < MAXK; ++j) if (j < k) sum += topv[j];
    if (lane < k) {
        weights[lane] = (myv / sum) * myp;
        idx[lane] = myi;
    }
}

// After every thread of the CTA has written its logits: the last CTA of token group blockIdx.y to arrive
// (counters[blockIdx.y], an int zeroed once at allocation) resets the counter for the next launch (graph replays)
// and runs the top-k of tokens t0 .. t0 + nt - 1, warp w taking tokens w, w + warps, ...
__device__ __forceinline__ void arrive_then_topk(int* counters, const float* logits, const float* __restrict__ pes,
                                                 float* __restrict__ weights, int* __restrict__ idx, int t0, int nt,
                                                 int T, int E, int k) {
    __shared__ int last;
    __threadfence();                                       // this thread's logits, visible before the arrival
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counters + blockIdx.y, 1) == (int)gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (threadIdx.x == 0) counters[blockIdx.y] = 0;
    for (int tt = threadIdx.x >> 5; tt < nt; tt += blockDim.x >> 5) {
        const int t = t0 + tt;
        if (t < T) topk_token(logits + (size_t)t * E, pes, weights + (size_t)t * k, idx + (size_t)t * k, E, k);
    }
}

// grid (ceil(E/EW), ceil(T/RT)), block 32*EW, EW = blockDim.x / 32 experts per CTA (1..4; the launcher picks EW
// = 1 when T <= RT: 128 one-warp CTAs at E = 128, so every expert row streams from its own warp at once; else 4).
// Warp w of CTA (bx, by) computes the logits of expert e = bx*EW + w for tokens by*RT .. +RT-1 (lane c-chunks:
// columns 8c..8c+7, c = lane, lane+32, ... ascending; two fmaf per bf16 pair, low half first; a lane's
// chunks are loaded RU at a time (all 11 at H = 2816) before its FMAs, which run in the same order as ever), writes
// them to logits (T, E); the last CTA of token group `by` to arrive (counters[by], an int zeroed once at
// allocation and reset here by that CTA) runs the top-k of its tokens (warp w: tokens w, w+EW, ..). Neither EW nor
// RU changes a bit: each logit is the same per-lane fmaf chain and butterfly, the top-k reads only its token.
// Needs H % 8 == 0, 16-byte aligned r / proj rows, E <= 256, k <= 16.
#define RU 12            // chunks per lane in flight (H <= 8*32*RU = 3072 in one batch)
extern "C" __global__ void __launch_bounds__(128) router_bf16(
    const bf16* __restrict__ r, const bf16* __restrict__ proj, const float* __restrict__ pes,
    float* logits, int* counters, float* __restrict__ weights, int* __restrict__ idx, int T, int H, int E, int k) {
    pdl_trigger();                                         // (PDL) the expert rows are fetched before the wait
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, ew = blockDim.x >> 5;
    const int e = blockIdx.x * ew + warp, t0 = blockIdx.y * RT;
    if (e < E) {
        const bf16* pr = proj + (size_t)e * H;
        const int nc = H / 8;
        float acc[RT];
#pragma unroll
        for (int tt = 0; tt < RT; ++tt) acc[tt] = 0.f;
        for (int cb = lane; cb < nc; cb += 32 * RU) {
            uint4 wv[RU];
#pragma unroll
            for (int u = 0; u < RU; ++u) {
                const int c = cb + 32 * u;
                wv[u] = c < nc ? __ldg(reinterpret_cast<const uint4*>(pr + 8 * c)) : make_uint4(0, 0, 0, 0);
            }
            pdl_wait();                                    // r (and every write) follows the previous kernel
#pragma unroll
            for (int tt = 0; tt < RT; ++tt) {
                if (t0 + tt >= T) break;
                const bf16* rr = r + (size_t)(t0 + tt) * H;
                uint4 xv[RU];
#pragma unroll
                for (int u = 0; u < RU; ++u) {
                    const int c = cb + 32 * u;
                    xv[u] = c < nc ? __ldg(reinterpret_cast<const uint4*>(rr + 8 * c)) : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
                for (int u = 0; u < RU; ++u) {
                    if (cb + 32 * u >= nc) break;                  // chunks in ascending c, as one plain loop
                    const uint32_t wa[4] = {wv[u].x, wv[u].y, wv[u].z, wv[u].w};
                    const uint32_t xa[4] = {xv[u].x, xv[u].y, xv[u].z, xv[u].w};
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        acc[tt] = fmaf(bits_lo(wa[q]), bits_lo(xa[q]), acc[tt]);
                        acc[tt] = fmaf(bits_hi(wa[q]), bits_hi(xa[q]), acc[tt]);
                    }
                }
            }
        }
#pragma unroll
        for (int tt = 0; tt < RT; ++tt) {
            const float v = warp_sum(acc[tt]);
            if (lane == 0 && t0 + tt < T) logits[(size_t)(t0 + tt) * E + e] = v;
        }
    }
    pdl_wait();                                            // warps without an expert: before the counter
    arrive_then_topk(counters, logits, pes, weights, idx, t0, RT, T, E, k);
}

// ------------------------------------------------------------------------------------------------------------
// Prefill / batch path (T > 4): the same logits bit for bit, from register tiles over shared-memory K blocks.
//
// CTA tile: TT = WT*NT tokens x EC = WE*NE experts; WT x WE warps, warp (wt, we) owns tokens t0 + wt*NT .. +NT-1
// and experts e0 + we*NE .. +NE-1 (t0 = blockIdx.y*TT, e0 = blockIdx.x*EC), i.e. NT*NE logits, each reduced over
// the warp's 32 lanes exactly as router_bf16 does: K is walked in blocks of 256 columns (32 chunks of 8), K block
// kb holding chunk c = 32*kb + lane for every lane, so lane l still owns chunks l, l+32, .. in ascending order;
// per chunk the fmaf order is q = 0..3, low half then high half, from acc = 0.f (router_bf16's chain per
// (token, expert), only interleaved with the warp's other NT*NE chains); lanes whose chunk is past H/8 skip it
// (as router_bf16's `break`). The 32 lane partials of a logit are then added with the xor tree of warp_sum
// (offsets 16, 8, 4, 2, 1), done "transposed" (reduce_tree: every stage keeps half of the values and trades the
// other half with the partner lane, so each add is still (lane's partial) + (partner's partial) over the same lane
// subsets: the same tree, the same bits, ~3 instructions per logit instead of 10).
// K blocks stream through ST shared-memory stages with cp.async (16 B each, zero-filled past T / E / H; the
// zeros are never used: no FMA of a skipped chunk, no store of a padded row): stage s = kb % ST holds rows
// [0, TT) = r rows t0.., rows [TT, TT+EC) = proj rows e0.., 32 uint4 (256 columns) each.
// Top-k: the last CTA of token tile blockIdx.y (counters[blockIdx.y]: an int per TT >= 4 tokens, so the (T+3)/4
// counters of moe_workspace suffice; zeroed once, reset by that CTA) runs topk_token for its TT tokens.
// One stage (offset O) of reduce_tree over G values per lane; n = G >> log2(16/O) values held before it.
template <int G, int O>
__device__ __forceinline__ void tree_stage(float (&v)[G], int lane) {
    constexpr int n = G * O / 16;
    if constexpr (n > 1) {
        constexpr int half = n / 2;
        const uint32_t up = (lane & O) ? FULL : 0u;      // keep the upper half? (bit blends: v stays in registers)
#pragma unroll
        for (int i = 0; i < half; ++i) {
            const uint32_t lo = __float_as_uint(v[i]), hi = __float_as_uint(v[i + half]);
            const float send = __uint_as_float((lo & up) | (hi & ~up));
            const float keep = __uint_as_float((hi & up) | (lo & ~up));
            v[i] = keep + __shfl_xor_sync(FULL, send, O);
        }
    } else {
        v[0] += __shfl_xor_sync(FULL, v[0], O);
    }
}

template <int G>
__device__ __forceinline__ float reduce_tree(float (&v)[G], int lane) {
    // G values per lane (a power of two <= 32), all lanes' partials of G logits -> the full sum of logit
    // lane >> (5 - log2 G), in v[0]. Stage o (16, 8, 4, 2, 1): while a lane holds n > 1 values it keeps the upper
    // half (lane & o) or the lower half and sends the other half to lane ^ o, which keeps the opposite half;
    // once n == 1 it is warp_sum's own step v += shfl_xor(v, o). Either way every value after stage o is
    // S(lane) + S(lane ^ o), S the previous stage's sum over the same lane subset: warp_sum's tree.
    tree_stage<G, 16>(v, lane);
    tree_stage<G, 8>(v, lane);
    tree_stage<G, 4>(v, lane);
    tree_stage<G, 2>(v, lane);
    tree_stage<G, 1>(v, lane);
    return v[0];
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool ok) {
    // 16 bytes global -> shared, bypassing L1; ok == false: 16 zero bytes (src not read)
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(ok ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

__device__ __forceinline__ uint32_t word(const uint4& v, int q) {
    return q == 0 ? v.x : q == 1 ? v.y : q == 2 ? v.z : v.w;
}

template <int NT, int NE, int WT, int WE, int ST>
__device__ __forceinline__ void router_tile(
    const bf16* __restrict__ r, const bf16* __restrict__ proj, const float* __restrict__ pes,
    float* logits, int* counters, float* __restrict__ weights, int* __restrict__ idx, int T, int H, int E, int k) {
    constexpr int TT = WT * NT, EC = WE * NE, ROWS = TT + EC, NTH = 32 * WT * WE;
    constexpr int N = NT * NE, G = N < 32 ? N : 32, NG = N / G;
    constexpr int SH = G == 32 ? 0 : G == 16 ? 1 : G == 8 ? 2 : G == 4 ? 3 : G == 2 ? 4 : 5;
    static_assert((N & (N - 1)) == 0 && N % G == 0, "NT*NE: a power of two");
    static_assert(TT >= 4, "one arrival counter per >= 4 tokens (moe_workspace's (T+3)/4 counters)");
    extern __shared__ uint4 stage[];                     // [ST][ROWS][32] uint4
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wt = warp / WE, we = warp % WE;
    const int t0 = blockIdx.y * TT, e0 = blockIdx.x * EC;
    const int nc = H / 8, nkb = (nc + 31) / 32;          // 8-column chunks, K blocks of 32 chunks

    // K block kb -> stage s: ROWS*32 16-byte pieces, piece i = (row i/32, chunk 32*kb + i%32); thread x copies
    // pieces p*NTH + x (p < PER), all of its lane's chunk c = 32*kb + lane. Row pointers are set up once.
    constexpr int PER = (ROWS * 32 + NTH - 1) / NTH;
    const bf16* rowp[PER];                               // row start + 8*lane, or nullptr (row past T / E)
#pragma unroll
    for (int p = 0; p < PER; ++p) {
        const int row = (p * NTH + threadIdx.x) >> 5;
        rowp[p] = nullptr;
        if (row < TT) {
            if (t0 + row < T) rowp[p] = r + (size_t)(t0 + row) * H + 8 * lane;
        } else if (row < ROWS) {
            if (e0 + row - TT < E) rowp[p] = proj + (size_t)(e0 + row - TT) * H + 8 * lane;
        }
    }
    auto load = [&](int kb, int s) {
        uint4* dst = stage + s * ROWS * 32 + threadIdx.x;
        const bool cok = kb * 32 + lane < nc;
#pragma unroll
        for (int p = 0; p < PER; ++p) {
            if (ROWS * 32 % NTH == 0 || p * NTH + (int)threadIdx.x < ROWS * 32) {
                const bool ok = cok && rowp[p] != nullptr;
                cp_async16(dst + p * NTH, ok ? rowp[p] + 256 * kb : r, ok);
            }
        }
    };

    float acc[NT][NE];
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int j = 0; j < NE; ++j) acc[i][j] = 0.f;

#pragma unroll
    for (int s = 0; s < ST - 1; ++s) {                   // prologue: K blocks 0 .. ST-2 in flight
        if (s < nkb) load(s, s);
        cp_async_commit();                               // (empty groups keep the count uniform)
    }
    for (int kb = 0; kb < nkb; ++kb) {
        cp_async_wait<ST - 2>();                         // this thread's pieces of K block kb have landed
        __syncthreads();                                 // everyone's; and stage (kb-1)%ST is no longer read
        if (kb + ST - 1 < nkb) load(kb + ST - 1, (kb + ST - 1) % ST);
        cp_async_commit();
        const int c = kb * 32 + lane;                    // this lane's chunk: columns 8c .. 8c+7
        if (c < nc) {
            const uint4* sb = stage + (kb % ST) * ROWS * 32 + lane;
            uint4 xv[NT], wv[NE];
#pragma unroll
            for (int i = 0; i < NT; ++i) xv[i] = sb[(wt * NT + i) * 32];
#pragma unroll
            for (int j = 0; j < NE; ++j) wv[j] = sb[(TT + we * NE + j) * 32];
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                float xl[NT], xh[NT], wl[NE], wh[NE];
#pragma unroll
                for (int i = 0; i < NT; ++i) { xl[i] = bits_lo(word(xv[i], q)); xh[i] = bits_hi(word(xv[i], q)); }
#pragma unroll
                for (int j = 0; j < NE; ++j) { wl[j] = bits_lo(word(wv[j], q)); wh[j] = bits_hi(word(wv[j], q)); }
#pragma unroll
                for (int i = 0; i < NT; ++i)
#pragma unroll
                    for (int j = 0; j < NE; ++j) {
                        acc[i][j] = fmaf(wl[j], xl[i], acc[i][j]);
                        acc[i][j] = fmaf(wh[j], xh[i], acc[i][j]);
                    }
            }
        }
    }
    cp_async_wait<0>();

    // logits: group gi of G consecutive (token-major) accumulators -> lane holds logit gi*G + (lane >> SH)
#pragma unroll
    for (int gi = 0; gi < NG; ++gi) {
        float v[G];
#pragma unroll
        for (int u = 0; u < G; ++u) v[u] = acc[(gi * G + u) / NE][(gi * G + u) % NE];
        const float s = reduce_tree<G>(v, lane);
        const int f = gi * G + (lane >> SH);
        const int t = t0 + wt * NT + f / NE, e = e0 + we * NE + f % NE;
        if ((lane & ((1 << SH) - 1)) == 0 && t < T && e < E) logits[(size_t)t * E + e] = s;
    }

    arrive_then_topk(counters, logits, pes, weights, idx, t0, TT, T, E, k);
}

// router_bf16_t<TT>x<EC>: grid (ceil(E/EC), ceil(T/TT)), block 32*WT*WE, dynamic shared ST*(TT+EC)*512 bytes
// (the launcher, layers/moe.py router_gpu, keeps this table). Same arguments and requirements as router_bf16
// (H % 8 == 0, 16-byte aligned r / proj rows, E <= 256, k <= 16); any H (K blocks), any T >= 1.
//   t8x8:   4 warps of 4 tokens x 4 experts, 5 stages (40 KiB, no opt-in): small batches (many CTAs)
//   t16x16: 4 warps of 8 x 8, 4 stages (64 KiB): mid batches (~0.25 B of L2 reads per FMA)
//   t8x32:  8 warps of 4 x 8, 4 stages (80 KiB; ~96 registers: 2 CTAs per SM): 129 .. 384 tokens
//   t16x32w16: 16 warps of 4 x 8, 4 stages (96 KiB): 385 .. 1536 tokens
// (8 warps of 8 x 8 over 16 x 32 and 8 of 4 x 4 over 8 x 16 were slower everywhere: layers/moe.py router_tile.)
#define ROUTER_TILE(name, NT, NE, WT, WE, ST, MINB)                                                          \
    extern "C" __global__ void __launch_bounds__(32 * WT * WE, MINB) name(                                   \
        const bf16* __restrict__ r, const bf16* __restrict__ proj, const float* __restrict__ pes,           \
        float* logits, int* counters, float* __restrict__ weights, int* __restrict__ idx, int T, int H, int E, \
        int k) {                                                                                             \
        pdl_entry();                                                                                         \
        router_tile<NT, NE, WT, WE, ST>(r, proj, pes, logits, counters, weights, idx, T, H, E, k);            \
    }
ROUTER_TILE(router_bf16_t8x8, 4, 4, 2, 2, 5, 1)
ROUTER_TILE(router_bf16_t16x16, 8, 8, 2, 2, 4, 1)
ROUTER_TILE(router_bf16_t8x32, 4, 8, 2, 4, 4, 2)
ROUTER_TILE(router_bf16_t16x32w16, 4, 8, 4, 4, 4, 1)
