// The MoE router's top-k, shared by the router kernels of linear.cu (logits = the linear family's gemm_bf16_f32
// arithmetic, then this epilogue in the same launch): softmax over a token's E logits, the k largest, the
// renormalised weights times per_expert_scale. A token's result reads only that token's logits, so it is the same
// alone or in any batch, whichever CTA runs it.
#pragma once
#include <stdint.h>

#define TOPK_MAXE 8          // experts per lane in the top-k: E <= 256
#define TOPK_MAXK 16

__device__ __forceinline__ float topk_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
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
// NE experts a lane (E <= 32 NE): the selection loops run over the lane's NE values only (every slot past E holds
// -inf / an absent p in either form, so NE = 4 for E <= 128 picks exactly what NE = TOPK_MAXE does, in half the
// instructions; a token's top-k is a serial chain of ~500 instructions in one warp). The sum of the chosen p is
// taken round by round (the same adds, in the same order, as summing them after the last round).
template <int NE>
__device__ void topk_token(const float* lg, const float* __restrict__ pes, float* weights, int* idx, int E, int k) {
    const int lane = threadIdx.x & 31;
    float v[NE], pw[NE];
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < NE; ++i) {
        const int e = lane + 32 * i;
        v[i] = e < E ? __ldcg(lg + e) : -INFINITY;          // L2: other CTAs wrote them
        pw[i] = e < E ? __ldg(pes + e) : 0.f;
        m = fmaxf(m, v[i]);
    }
    m = key_float(__reduce_max_sync(0xffffffffu, order_key(m)));  // the largest logit (a NaN one is never taken)
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < NE; ++i) {
        v[i] = lane + 32 * i < E ? expf(v[i] - m) : 0.f;
        s += v[i];
    }
    s = topk_warp_sum(s);
#pragma unroll
    for (int i = 0; i < NE; ++i) v[i] = lane + 32 * i < E ? v[i] / s : -1.f;   // p; -1 = absent / taken
    float sum = 0.f, myv = 0.f, myp = 0.f;                   // lane j keeps round j's p, pes and expert
    int myi = 0;
#pragma unroll 1
    for (int j = 0; j < k && j < TOPK_MAXK; ++j) {             // rolled: see topk_tokens
        float bv = -2.f; int bi = 0x7fffffff;                 // lane's best: largest p, lowest index on ties
#pragma unroll
        for (int i = 0; i < NE; ++i)
            if (v[i] > bv) { bv = v[i]; bi = lane + 32 * i; }
        const int kmax = __reduce_max_sync(0xffffffffu, order_key(bv));
        const int wi = __reduce_min_sync(0xffffffffu, order_key(bv) == kmax ? bi : 0x7fffffff);
        const int slot = (unsigned)wi >> 5;                   // warp-uniform
        float pl = 0.f;
#pragma unroll
        for (int i = 0; i < NE; ++i)
            if (i == slot) pl = pw[i];
        const float tv = key_float(kmax);                     // warp-uniform
        pl = __shfl_sync(0xffffffffu, pl, wi & 31);
        if (lane == j) { myv = tv; myp = pl; myi = wi; }
        sum += tv;                                            // every lane: the same sum, slot order
#pragma unroll
        for (int i = 0; i < NE; ++i)
            if (lane + 32 * i == wi) v[i] = -1.f;
    }
    if (lane < k) {
        weights[lane] = (myv / sum) * myp;
        idx[lane] = myi;
    }
}

// topk_token for J tokens of a warp at once (t[j], -1 = none: computed on -inf, nothing read or written), each
// token's arithmetic topk_token's step for step: one token's top-k is a serial chain of shuffles and warp
// reductions, so J chains interleaved take little longer than one. The one-token kernels keep topk_token (this form
// with J = 1 and its rounds unrolled took their launch at 1 token from 5.9 to 7.9 us, alone; not understood).
// test_gpu_router_bits holds both to the same bytes. Both roll the round loop: unrolled (16 rounds), router_bf16_s
// with J = 4 ran 24.0 -> 21.0 us alone at 2,048 tokens but 854 -> 1,007 us over the 29 launches of a 2,048-token
// prefill in the model; rolled, 823 us there, and the decode router at batch 1 310 -> 297 us a step (H200,
// twenty-eighth session, dev A/B in the model, medians of 3 rounds; BENCHMARKS.md).
template <int NE, int J>
__device__ __forceinline__ void topk_tokens(const float* logits, const float* __restrict__ pes, float* weights,
                                            int* idx, const int (&t)[J], int E, int k) {
    const int lane = threadIdx.x & 31;
    float v[J][NE], pw[NE], m[J];
#pragma unroll
    for (int i = 0; i < NE; ++i) pw[i] = lane + 32 * i < E ? __ldg(pes + lane + 32 * i) : 0.f;
#pragma unroll
    for (int j = 0; j < J; ++j) {
        m[j] = -INFINITY;
#pragma unroll
        for (int i = 0; i < NE; ++i) {
            const int e = lane + 32 * i;
            v[j][i] = e < E && t[j] >= 0 ? __ldcg(logits + (size_t)t[j] * E + e) : -INFINITY;   // L2: other CTAs'
            m[j] = fmaxf(m[j], v[j][i]);
        }
    }
#pragma unroll
    for (int j = 0; j < J; ++j)                               // the largest logit (a NaN one is never taken)
        m[j] = key_float(__reduce_max_sync(0xffffffffu, order_key(m[j])));
    float s[J];
#pragma unroll
    for (int j = 0; j < J; ++j) {
        s[j] = 0.f;
#pragma unroll
        for (int i = 0; i < NE; ++i) {
            v[j][i] = lane + 32 * i < E ? expf(v[j][i] - m[j]) : 0.f;
            s[j] += v[j][i];
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)                          // topk_warp_sum, the J sums side by side
#pragma unroll
        for (int j = 0; j < J; ++j) s[j] += __shfl_xor_sync(0xffffffffu, s[j], o);
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
        for (int i = 0; i < NE; ++i) v[j][i] = lane + 32 * i < E ? v[j][i] / s[j] : -1.f;   // p; -1 = absent / taken
    float sum[J], myv[J], myp[J];                             // lane r keeps round r's p, pes and expert
    int myi[J];
#pragma unroll
    for (int j = 0; j < J; ++j) {
        sum[j] = myv[j] = myp[j] = 0.f;
        myi[j] = 0;
    }
#pragma unroll 1
    for (int r = 0; r < k && r < TOPK_MAXK; ++r) {
        float bv[J];
        int bi[J], kmax[J], wi[J];
#pragma unroll
        for (int j = 0; j < J; ++j) {                         // lane's best: largest p, lowest index on ties
            bv[j] = -2.f;
            bi[j] = 0x7fffffff;
#pragma unroll
            for (int i = 0; i < NE; ++i)
                if (v[j][i] > bv[j]) { bv[j] = v[j][i]; bi[j] = lane + 32 * i; }
        }
#pragma unroll
        for (int j = 0; j < J; ++j) kmax[j] = __reduce_max_sync(0xffffffffu, order_key(bv[j]));
#pragma unroll
        for (int j = 0; j < J; ++j)
            wi[j] = __reduce_min_sync(0xffffffffu, order_key(bv[j]) == kmax[j] ? bi[j] : 0x7fffffff);
#pragma unroll
        for (int j = 0; j < J; ++j) {
            const int slot = (unsigned)wi[j] >> 5;            // warp-uniform
            float pl = 0.f;
#pragma unroll
            for (int i = 0; i < NE; ++i)
                if (i == slot) pl = pw[i];
            const float tv = key_float(kmax[j]);              // warp-uniform
            pl = __shfl_sync(0xffffffffu, pl, wi[j] & 31);
            if (lane == r) { myv[j] = tv; myp[j] = pl; myi[j] = wi[j]; }
            sum[j] += tv;                                     // every lane: the same sum, round order
#pragma unroll
            for (int i = 0; i < NE; ++i)
                if (lane + 32 * i == wi[j]) v[j][i] = -1.f;
        }
    }
#pragma unroll
    for (int j = 0; j < J; ++j)
        if (t[j] >= 0 && lane < k) {
            weights[(size_t)t[j] * k + lane] = (myv[j] / sum[j]) * myp[j];
            idx[(size_t)t[j] * k + lane] = myi[j];
        }
}

// After every thread of the CTA has written its logits: the last CTA of token group blockIdx.y to arrive
// (counters[blockIdx.y], an int zeroed once at allocation) resets the counter for the next launch (graph replays)
// and runs the top-k of tokens t0 .. t0 + nt - 1, warp w taking tokens w, w + warps, .., J of them at once.
template <int J>
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
    const int nw = blockDim.x >> 5;
    for (int tt = threadIdx.x >> 5; tt < nt; tt += J * nw) {   // warp-uniform
        int t[J];
#pragma unroll
        for (int j = 0; j < J; ++j) t[j] = tt + j * nw < nt && t0 + tt + j * nw < T ? t0 + tt + j * nw : -1;
        if constexpr (J == 1) {
            if (t[0] < 0) continue;
            float* wt = weights + (size_t)t[0] * k;
            int* it = idx + (size_t)t[0] * k;
            if (E <= 128) topk_token<4>(logits + (size_t)t[0] * E, pes, wt, it, E, k);
            else topk_token<TOPK_MAXE>(logits + (size_t)t[0] * E, pes, wt, it, E, k);
        } else {
            if (E <= 128) topk_tokens<4, J>(logits, pes, weights, idx, t, E, k);
            else topk_tokens<TOPK_MAXE, J>(logits, pes, weights, idx, t, E, k);
        }
    }
}
