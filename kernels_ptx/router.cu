// The MoE router of a decoder layer in ONE launch: logits (T, E) = r (T, H) . proj (E, H)^T in fp32, then, by the
// last CTA of each token group to finish, softmax over E, top-k, renormalisation over the k, times
// per_expert_scale. r is the router's input row, computed by elementwise.cu (post_attn_norms_bf16 or
// router_input_bf16): r = bf16(bf16(bf16(h * rms(h)^-1) * router.scale) * H^-0.5).
//
// Determinism: a logit is one warp's sum over lane-strided 8-column chunks (fixed per H), then an xor
// butterfly; the top-k of a token reads only that token's logits. Which CTA finishes last changes nothing but
// who runs the (same) top-k code, so a token's weights and experts are the same alone or in any batch.
// No float atomics; the only atomic is the integer arrival counter.
#include <cuda_bf16.h>
#include <stdint.h>

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
__device__ void topk_token(const float* lg, const float* __restrict__ pes, float* weights, int* idx, int E, int k) {
    const int lane = threadIdx.x & 31;
    float v[MAXE];
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < MAXE; ++i) {
        const int e = lane + 32 * i;
        v[i] = e < E ? __ldcg(lg + e) : -INFINITY;          // L2: other CTAs wrote them
        m = fmaxf(m, v[i]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL, m, o));
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < MAXE; ++i) {
        v[i] = lane + 32 * i < E ? expf(v[i] - m) : 0.f;
        s += v[i];
    }
    s = warp_sum(s);
#pragma unroll
    for (int i = 0; i < MAXE; ++i) v[i] = lane + 32 * i < E ? v[i] / s : -1.f;   // p; -1 = absent / taken
    float topv[MAXK];
    int topi[MAXK];
#pragma unroll
    for (int j = 0; j < MAXK; ++j) {
        topv[j] = 0.f; topi[j] = 0;
        if (j < k) {
            float bv = -2.f; int bi = 0x7fffffff;             // lane's best: largest p, lowest index on ties
#pragma unroll
            for (int i = 0; i < MAXE; ++i)
                if (v[i] > bv) { bv = v[i]; bi = lane + 32 * i; }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float ov = __shfl_xor_sync(FULL, bv, o);
                const int oi = __shfl_xor_sync(FULL, bi, o);
                if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
            }
            topv[j] = bv; topi[j] = bi;
#pragma unroll
            for (int i = 0; i < MAXE; ++i)
                if (lane + 32 * i == bi) v[i] = -1.f;
        }
    }
    if (lane == 0) {
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < MAXK; ++j) if (j < k) sum += topv[j];
#pragma unroll
        for (int j = 0; j < MAXK; ++j)
            if (j < k) {
                weights[j] = (topv[j] / sum) * pes[topi[j]];
                idx[j] = topi[j];
            }
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
    __shared__ int last;
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
    __threadfence();                                       // this thread's logits, visible before the arrival
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counters + blockIdx.y, 1) == (int)gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (threadIdx.x == 0) counters[blockIdx.y] = 0;        // ready for the next launch (graph replays)
    for (int tt = warp; tt < RT; tt += ew) {
        const int t = t0 + tt;
        if (t < T) topk_token(logits + (size_t)t * E, pes, weights + (size_t)t * k, idx + (size_t)t * k, E, k);
    }
}
