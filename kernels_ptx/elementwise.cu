// Elementwise and row-reduction kernels: the scaled embedding gather, RMSNorm (plain, + residual,
// + residual and layer scalar; per row or per head), and the head's fp32 helpers on (T, V) logits
// (soft-cap in place, argmax, logsumexp + key gather for the readout).
//
// Determinism: every row is reduced by a thread layout that depends only on the row width (n or V), never
// on the number of rows T, and the partial sums are combined in a fixed order (sequential per thread, an
// xor-butterfly per warp, warps in index order). So a row's bytes are the same alone or in any batch.
// bf16 values are widened to fp32 exactly (bits << 16) and rounded back with round-to-nearest-even.
#include <cuda_bf16.h>
#include <stdint.h>

#include "norm_rows.cuh"    // bf16, its load / store helpers, row_sum, the norm chains' pieces (linear.cu uses them too)
#include "combine.cuh"      // the experts' combine (post_ffn_norms_pairs_bf16)

// ------------------------------------------------------------------------------------------------------
// embed_bf16: out[t, :] = bf16(table[ids[t], :] * scale), as transformers multiplies the bf16 row by the
// bf16-rounded sqrt(H) (the fp32 product of two bf16 is exact, so only the final rounding matters).
// table (V, H) bf16, ids (T,) int32, out (T, H) bf16. grid (T), block (256). vec 8: H % 8 == 0 and 16-byte
// aligned pointers; else 1. An id outside [0, V) writes a NaN row (a loud bug, not a silent clamp).
// ------------------------------------------------------------------------------------------------------
template <int VEC>
__device__ void embed_row(bf16* out, const bf16* table, const int* ids, int H, int V, float scale) {
    const int t = blockIdx.x;
    const int id = ids[t];
    bf16* o = out + (size_t)t * H;
    const bool ok = id >= 0 && id < V;
    const bf16* e = table + (size_t)(ok ? id : 0) * H;
    for (int h = threadIdx.x * VEC; h < H; h += blockDim.x * VEC) {   // thread x owns vectors x, x+256, ...
        float f[VEC];
        load_bf16<VEC>(e + h, f);
#pragma unroll
        for (int j = 0; j < VEC; j++) f[j] = ok ? f[j] * scale : __int_as_float(0x7fffffff);
        store_bf16<VEC>(o + h, f);
    }
}

extern "C" __global__ void embed_bf16(bf16* __restrict__ out, const bf16* __restrict__ table,
                                      const int* __restrict__ ids, int T, int H, int V, float scale, int vec) {
    pdl_entry();
    if (blockIdx.x >= T) return;
    if (vec == 8) embed_row<8>(out, table, ids, H, V, scale);
    else embed_row<1>(out, table, ids, H, V, scale);
}

// ------------------------------------------------------------------------------------------------------
// RMSNorm of rows of width n:  y = x * (mean(x^2) + eps)^-0.5 [* w], rounded to bf16 (transformers:
// computed in fp32, cast to the input dtype). The fused forms follow the decoder's bf16 arithmetic:
//   rmsnorm_add_bf16:        out = bf16(res + bf16(y))                 (h = x + post_norm(a))
//   rmsnorm_add_scale_bf16:  out = bf16(bf16(res + bf16(y)) * scale)   (out = (h + norm(m)) * layer_scalar)
// Row r of rows = T * heads is head g = r % heads of token t = r / heads:
//   x row at x + t*ld_x + g*n, out (and res) row at out + t*ld_out + g*n   (elements; ld = heads*n if dense)
// so one launch norms q (T, Hq, D) per head, or the whole hidden state (heads = 1, n = H).
// w (n,) bf16 or nullptr (no-scale norm). out may alias x or res (each element is read, then written, by the
// same thread).
// Layout: block (TPR, R): R rows per block, TPR threads per row (a multiple of 32, chosen from n only).
// Thread x of a row owns the VEC-vectors x, x+TPR, x+2*TPR, ... of the row; it sums their squares in that
// order, the row's warps combine by xor-butterfly, then every thread adds the warp sums in warp order.
// ------------------------------------------------------------------------------------------------------

template <int VEC, bool ADD, bool SCALE>
__device__ void rmsnorm_rows(bf16* out, const bf16* x, const bf16* w, const bf16* res, int rows, int n, int heads,
                             long long ld_x, long long ld_out, float eps, float scale) {
    __shared__ float warp_sums[32];                 // [R][TPR/32] flattened: R * TPR <= 1024 threads
    const int tpr = blockDim.x, lane = threadIdx.x & 31, warps = tpr >> 5;
    const int r = blockIdx.x * blockDim.y + threadIdx.y;
    const bool active = r < rows;                   // no early return: all threads reach __syncthreads
    const int t = active ? r / heads : 0, g = active ? r % heads : 0;
    const bf16* xr = x + t * ld_x + (long long)g * n;
    const long long o_off = t * ld_out + (long long)g * n;
    const int nvec = n / VEC;

    float s = 0.f;
    if (active)
        for (int v = threadIdx.x; v < nvec; v += tpr) {
            float f[VEC];
            load_bf16<VEC>(xr + v * VEC, f);
#pragma unroll
            for (int j = 0; j < VEC; j++) s = fmaf(f[j], f[j], s);
        }
    s = row_sum(s, warp_sums + threadIdx.y * warps, warps, lane);
    if (!active) return;
    const float inv = 1.0f / sqrtf(s / (float)n + eps);    // IEEE div and sqrt (no fast-math)

    for (int v = threadIdx.x; v < nvec; v += tpr) {
        float f[VEC], wf[VEC], rf[VEC];
        load_bf16<VEC>(xr + v * VEC, f);
        if (w) load_bf16<VEC>(w + v * VEC, wf);
        if (ADD) load_bf16<VEC>(res + o_off + v * VEC, rf);
#pragma unroll
        for (int j = 0; j < VEC; j++) {
            float y = f[j] * inv;
            if (w) y *= wf[j];
            if (ADD) y = rf[j] + round_bf16(y);
            if (SCALE) y = round_bf16(y) * scale;
            f[j] = y;
        }
        store_bf16<VEC>(out + o_off + v * VEC, f);
    }
}

extern "C" __global__ void rmsnorm_bf16(bf16* out, const bf16* x, const bf16* __restrict__ w, int rows, int n,
                                        int heads, long long ld_x, long long ld_out, float eps, int vec) {
    pdl_entry();
    if (vec == 8) rmsnorm_rows<8, false, false>(out, x, w, nullptr, rows, n, heads, ld_x, ld_out, eps, 1.f);
    else rmsnorm_rows<1, false, false>(out, x, w, nullptr, rows, n, heads, ld_x, ld_out, eps, 1.f);
}

extern "C" __global__ void rmsnorm_add_bf16(bf16* out, const bf16* x, const bf16* __restrict__ w, const bf16* res,
                                            int rows, int n, int heads, long long ld_x, long long ld_out, float eps,
                                            int vec) {
    pdl_entry();
    if (vec == 8) rmsnorm_rows<8, true, false>(out, x, w, res, rows, n, heads, ld_x, ld_out, eps, 1.f);
    else rmsnorm_rows<1, true, false>(out, x, w, res, rows, n, heads, ld_x, ld_out, eps, 1.f);
}

extern "C" __global__ void rmsnorm_add_scale_bf16(bf16* out, const bf16* x, const bf16* __restrict__ w,
                                                  const bf16* res, int rows, int n, int heads, long long ld_x,
                                                  long long ld_out, float eps, float scale, int vec) {
    pdl_entry();
    if (vec == 8) rmsnorm_rows<8, true, true>(out, x, w, res, rows, n, heads, ld_x, ld_out, eps, scale);
    else rmsnorm_rows<1, true, true>(out, x, w, res, rows, n, heads, ld_x, ld_out, eps, scale);
}

// ------------------------------------------------------------------------------------------------------
// The decoder layer's chains of norms, one launch each (decode is launch-bound: performance.md). Each gives
// the bytes of the separate rmsnorm launches it replaces (same thread layout: TPR threads per row chosen from
// n alone, here with exactly one 8-vector per thread, TPR * 8 >= n; the same per-thread sums, row_sum, inv
// and roundings), so a row's bytes do not depend on which path ran. One row per block, grid (T).
//
// post_attn_norms_bf16 (after o_proj; a = o_proj output, x = residual):
//   h    = bf16(x + bf16(norm(a) * w_pa))        rmsnorm_add(a, post_attention_layernorm, add=x)
//   xn   = bf16(norm(h) * w_pf)                   rmsnorm(h, pre_feedforward_layernorm)
//   e_in = bf16(norm(h) * w_pf2)                  rmsnorm(h, pre_feedforward_layernorm_2)
// post_ffn_norms_bf16 (after the dense MLP (m) and the experts (e); h = the attention residual):
//   m1 = bf16(norm(m) * w1)                       rmsnorm(m, post_feedforward_layernorm_1)
//   s  = bf16(m1 + bf16(norm(e) * w2))            rmsnorm_add(e, post_feedforward_layernorm_2, add=m1)
//   x  = bf16(bf16(h + bf16(norm(s) * w3)) * c)   rmsnorm_add_scale(s, post_feedforward_layernorm, h, c)
//   xn = bf16(norm(x) * w4)  when w4 != null      the next layer's input_layernorm
// post_ffn_norms_pairs_bf16: the same, e = the experts' combine of their pair outputs, done here (combine.cuh)
// ------------------------------------------------------------------------------------------------------
template <bool PRE>
__device__ __forceinline__ void post_attn_norms(bf16* __restrict__ h, bf16* __restrict__ xn, bf16* __restrict__ e_in,
                                                const bf16* __restrict__ a, const bf16* __restrict__ x,
                                                const bf16* __restrict__ w_pa, const bf16* __restrict__ w_pf,
                                                const bf16* __restrict__ w_pf2, int n, float eps,
                                                bf16* __restrict__ r, const bf16* __restrict__ r_scale, float root,
                                                int xn_slots, int e_perm) {
    if (!PRE) pdl_entry();
    __shared__ float sums0[32], sums1[32];
    const int c = threadIdx.x * 8;
    const size_t row = (size_t)blockIdx.x * n;
    PostAttnW pw;
    post_attn_weights<PRE>(pw, w_pa, w_pf, w_pf2, r_scale, c, c < n, r != nullptr);
    pre_wait<PRE>();
    post_attn_row<PRE>(pw, h, xn, e_in, a, x, w_pa, w_pf, w_pf2, n, eps, r, row, r_scale, root, xn_slots, e_perm,
                       row, true, sums0, sums1);
}

#define POST_ATTN_ARGS                                                                                        \
    bf16 *__restrict__ h, bf16 *__restrict__ xn, bf16 *__restrict__ e_in, const bf16 *__restrict__ a,        \
        const bf16 *__restrict__ x, const bf16 *__restrict__ w_pa, const bf16 *__restrict__ w_pf,           \
        const bf16 *__restrict__ w_pf2, int n, float eps, bf16 *__restrict__ r, const bf16 *__restrict__ r_scale, \
        float root, int xn_slots, int e_perm
extern "C" __global__ void post_attn_norms_bf16(POST_ATTN_ARGS) {
    post_attn_norms<false>(h, xn, e_in, a, x, w_pa, w_pf, w_pf2, n, eps, r, r_scale, root, xn_slots, e_perm);
}
extern "C" __global__ void post_attn_norms_pre_bf16(POST_ATTN_ARGS) {
    post_attn_norms<true>(h, xn, e_in, a, x, w_pa, w_pf, w_pf2, n, eps, r, r_scale, root, xn_slots, e_perm);
}

// router_input_bf16: r alone from h (T, n): the bytes post_attn_norms_bf16 gives for the same h (same layout,
// sums and inv). grid (T), block TPR (one 8-vector per thread).
extern "C" __global__ void router_input_bf16(bf16* __restrict__ r, const bf16* __restrict__ h,
                                             const bf16* __restrict__ r_scale, int n, float eps, float root) {
    pdl_entry();
    __shared__ float sums[32];
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5, c = threadIdx.x * 8;
    const bool own = c < n;
    const size_t row = (size_t)blockIdx.x * n;
    float f[8], sf[8];
    if (own) load_bf16<8>(h + row + c, f);
    const float inv = inv_rms(row_sum(own ? sumsq8(f) : 0.f, sums, warps, lane), n, eps);
    if (own) router_row8(f, inv, wts<false>(nullptr, r_scale + c, sf), root, r + row + c);
}

// e's row values come either from e itself or (PAIRS) from the experts' pair outputs o (T*k, n) and idx (T, k),
// combined here with combine.cuh's arithmetic: bf16(the combine's fp32 sum), the bytes moe_combine_bf16 would
// have stored in e. One launch and no e round trip (post_ffn_norms_pairs_bf16).
template <bool PAIRS, bool PRE>
__device__ __forceinline__ void post_ffn_norms(bf16* __restrict__ x, bf16* __restrict__ xn,
                                               const bf16* __restrict__ m, const bf16* __restrict__ e,
                                               const int* __restrict__ idx, int k, int E,
                                               const bf16* __restrict__ h, const bf16* __restrict__ w1,
                                               const bf16* __restrict__ w2, const bf16* __restrict__ w3,
                                               const bf16* __restrict__ w4, int n, float eps, float scale,
                                               int xn_slots) {
    if (!PRE) pdl_entry();
    __shared__ float sums0[32], sums1[32], sums2[32], sums3[32];
    __shared__ int order[MAX_K];
    __shared__ int nvalid;
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5, c = threadIdx.x * 8;
    const bool own = c < n;
    const size_t row = (size_t)blockIdx.x * n;
    float w1f[8], w2f[8], w3f[8], w4f[8], wt[8];
    pre8<PRE>(w1 + c, w1f, own);
    pre8<PRE>(w2 + c, w2f, own);
    pre8<PRE>(w3 + c, w3f, own);
    pre8<PRE>(w4 + c, w4f, own && w4);
    pre_wait<PRE>();
    float fm[8], fe[8], hr[8], sv[8], xv[8], y[8];
    if (PAIRS && threadIdx.x < 32) slots_by_expert_warp(idx + (size_t)blockIdx.x * k, k, E, order, &nvalid);
    if (own) load_bf16<8>(m + row + c, fm);
    if (PRE && own) load_bf16<8>(h + row + c, hr);
    if (PAIRS) {
        __syncthreads();                             // order, nvalid
        if (own) {
            combine8<PRE ? 8 : 4>(e + row * k, order, nvalid, n, c, fe);   // (plain: 4, see below)
#pragma unroll
            for (int j = 0; j < 8; j++) fe[j] = round_bf16(fe[j]);
        }
    } else if (own) {
        load_bf16<8>(e + row + c, fe);
    }
    const float2 me = row_sum2(own ? sumsq8(fm) : 0.f, own ? sumsq8(fe) : 0.f, sums0, sums1, warps, lane);
    const float inv_m = inv_rms(me.x, n, eps), inv_e = inv_rms(me.y, n, eps);
    if (own) {
        float m1[8];
        norm8(fm, inv_m, wts<PRE>(w1f, w1 + c, wt), m1);
        norm8(fe, inv_e, wts<PRE>(w2f, w2 + c, wt), y);
#pragma unroll
        for (int j = 0; j < 8; j++) sv[j] = round_bf16(m1[j] + y[j]);
    }
    const float inv_s = inv_rms(row_sum(own ? sumsq8(sv) : 0.f, sums2, warps, lane), n, eps);
    if (own) {
        norm8(sv, inv_s, wts<PRE>(w3f, w3 + c, wt), y);
        if (!PRE) load_bf16<8>(h + row + c, hr);
#pragma unroll
        for (int j = 0; j < 8; j++) xv[j] = round_bf16(round_bf16(hr[j] + y[j]) * scale);
        store_bf16<8>(x + row + c, xv);
    }
    if (w4 == nullptr) return;                       // uniform over the block: no barrier is skipped by some
    const float inv_x = inv_rms(row_sum(own ? sumsq8(xv) : 0.f, sums3, warps, lane), n, eps);
    if (own) {
        norm8(xv, inv_x, wts<PRE>(w4f, w4 + c, wt), y);
        store_cols8(xn + row, c, y, xn_slots ? COL_SLOTS : COL_ROWS);
    }
}

#define POST_FFN_ARGS                                                                                         \
    bf16 *__restrict__ x, bf16 *__restrict__ xn, const bf16 *__restrict__ m, const bf16 *__restrict__ e,     \
        const bf16 *__restrict__ h, const bf16 *__restrict__ w1, const bf16 *__restrict__ w2,               \
        const bf16 *__restrict__ w3, const bf16 *__restrict__ w4, int n, float eps, float scale, int xn_slots
#define POST_FFN_PAIRS_ARGS                                                                                   \
    bf16 *__restrict__ x, bf16 *__restrict__ xn, const bf16 *__restrict__ m, const bf16 *__restrict__ o,     \
        const int *__restrict__ idx, int k, int E, const bf16 *__restrict__ h, const bf16 *__restrict__ w1, \
        const bf16 *__restrict__ w2, const bf16 *__restrict__ w3, const bf16 *__restrict__ w4, int n, float eps, \
        float scale, int xn_slots
extern "C" __global__ void post_ffn_norms_bf16(POST_FFN_ARGS) {
    post_ffn_norms<false, false>(x, xn, m, e, nullptr, 0, 0, h, w1, w2, w3, w4, n, eps, scale, xn_slots);
}
extern "C" __global__ void post_ffn_norms_pre_bf16(POST_FFN_ARGS) {
    post_ffn_norms<false, true>(x, xn, m, e, nullptr, 0, 0, h, w1, w2, w3, w4, n, eps, scale, xn_slots);
}
// o (T*k, n) bf16 pair outputs (row t*k + s: token t's slot s), idx (T, k): e = their combine (see above).
// The plain form (T > 16) at 40 registers, 4 CTAs of 352 threads an SM (56 and 3 with the combine's loads 8 slots
// at a time): H200, the launch alone at the real shapes (graph-replayed, bytes equal), 508 tokens 13.58 -> 10.91 us,
// 2,048 tokens 47.69 -> 47.10 (forty-seventh session; at 40 registers with 8 slots a batch it spilled: 50.99).
extern "C" __global__ void __maxnreg__(40) post_ffn_norms_pairs_bf16(POST_FFN_PAIRS_ARGS) {
    post_ffn_norms<true, false>(x, xn, m, o, idx, k, E, h, w1, w2, w3, w4, n, eps, scale, xn_slots);
}
extern "C" __global__ void post_ffn_norms_pairs_pre_bf16(POST_FFN_PAIRS_ARGS) {
    post_ffn_norms<true, true>(x, xn, m, o, idx, k, E, h, w1, w2, w3, w4, n, eps, scale, xn_slots);
}

// ------------------------------------------------------------------------------------------------------
// softcap_f32: x = cap * tanh(x / cap) in place over n fp32 (the final logit soft-cap, cap = 30).
// Elementwise, so any grid is deterministic; grid-stride loop.
// ------------------------------------------------------------------------------------------------------
extern "C" __global__ void softcap_f32(float* x, long long n, float cap) {
    pdl_entry();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] = cap * tanhf(x[i] / cap);
}

// ------------------------------------------------------------------------------------------------------
// Row reductions over fp32 logits (T, V), row-major, in two passes so that one row still spreads over many
// SMs at T = 1. Pass 1: grid (C, T), block (256): block c reduces the chunk [c*CHUNK, min(V, (c+1)*CHUNK))
// of row t into partials[t*C + c]; C = ceil(V / CHUNK). Pass 2: grid (T), block (32): one warp folds the C
// partials of its row. CHUNK and the block shapes are fixed, so a row's result never depends on T.
// The work buffer holds two (T, C) fp32/int32 planes: plane 0 at work, plane 1 at work + T*C.
// ------------------------------------------------------------------------------------------------------
#define CHUNK 2048
#define PASS1_THREADS 256

// numpy's argmax order: NaN above everything (the first NaN wins), else larger value, then lower index.
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
    if (v != v) return bv == bv || i < bi;
    if (bv != bv) return false;
    return v > bv || (v == bv && i < bi);
}

// Fold (v, i) pairs over the warp: `better` is a strict total order on distinct indices, so the winner is
// the same whatever the combination order.
__device__ __forceinline__ void warp_best(float& v, int& i) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, m);
        int oi = __shfl_xor_sync(0xffffffffu, i, m);
        if (better(ov, oi, v, i)) { v = ov; i = oi; }
    }
}

// argmax pass 1: (best value, its index) of each chunk. Index INT_MAX with -inf means an empty chunk.
extern "C" __global__ void argmax_partial_f32(const float* __restrict__ logits, float* __restrict__ work, int T,
                                              int V) {
    pdl_entry();
    __shared__ float sv[PASS1_THREADS / 32];
    __shared__ int si[PASS1_THREADS / 32];
    const int c = blockIdx.x, t = blockIdx.y, C = gridDim.x;
    const float* row = logits + (size_t)t * V;
    const int end = min(V, (c + 1) * CHUNK);
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int j = c * CHUNK + threadIdx.x; j < end; j += PASS1_THREADS) {    // ascending j: the first of ties kept
        const float v = row[j];
        if (better(v, j, bv, bi)) { bv = v; bi = j; }
    }
    warp_best(bv, bi);
    if ((threadIdx.x & 31) == 0) { sv[threadIdx.x >> 5] = bv; si[threadIdx.x >> 5] = bi; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int k = 1; k < PASS1_THREADS / 32; k++)
            if (better(sv[k], si[k], bv, bi)) { bv = sv[k]; bi = si[k]; }
        work[(size_t)t * C + c] = bv;
        reinterpret_cast<int*>(work)[(size_t)T * C + (size_t)t * C + c] = bi;
    }
}

// argmax pass 2: out[t] = index of the row's maximum (int32).
extern "C" __global__ void argmax_final_f32(const float* __restrict__ work, int* __restrict__ out, int T, int C) {
    pdl_entry();
    const int t = blockIdx.x;
    const float* pv = work + (size_t)t * C;
    const int* pi = reinterpret_cast<const int*>(work) + (size_t)T * C + (size_t)t * C;
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int c = threadIdx.x; c < C; c += 32)
        if (better(pv[c], pi[c], bv, bi)) { bv = pv[c]; bi = pi[c]; }
    warp_best(bv, bi);
    if (threadIdx.x == 0) out[t] = bi;
}

// Warp sum by xor-butterfly: every lane ends with the same bits (a+b == b+a in IEEE).
__device__ __forceinline__ float warp_sum(float s) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) s += __shfl_xor_sync(0xffffffffu, s, m);
    return s;
}

__device__ __forceinline__ float warp_max(float s) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) s = fmaxf(s, __shfl_xor_sync(0xffffffffu, s, m));
    return s;
}

// logsumexp pass 1: chunk max m_c, then s_c = sum over the chunk of exp(x - m_c) (the chunk is re-read from
// L1/L2). Thread x sums j = x, x+256, ... in order; warps fold by butterfly; thread 0 adds warps in order.
extern "C" __global__ void lse_partial_f32(const float* __restrict__ logits, float* __restrict__ work, int T, int V) {
    pdl_entry();
    __shared__ float red[PASS1_THREADS / 32];
    const int c = blockIdx.x, t = blockIdx.y, C = gridDim.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float* row = logits + (size_t)t * V;
    const int begin = c * CHUNK, end = min(V, (c + 1) * CHUNK);

    float m = -INFINITY;
    int nan = 0;                                     // fmaxf skips NaN: flag it so the row's lse becomes NaN
    for (int j = begin + threadIdx.x; j < end; j += PASS1_THREADS) {
        m = fmaxf(m, row[j]);
        nan |= row[j] != row[j];
    }
    nan = __syncthreads_or(nan);
    m = warp_max(m);
    if (lane == 0) red[warp] = m;
    __syncthreads();
    m = red[0];
    for (int k = 1; k < PASS1_THREADS / 32; k++) m = fmaxf(m, red[k]);
    __syncthreads();                                 // red is reused below

    float s = 0.f;
    if (m != -INFINITY)                              // an all -inf chunk contributes 0 (avoid -inf - -inf)
        for (int j = begin + threadIdx.x; j < end; j += PASS1_THREADS) s += expf(row[j] - m);
    s = warp_sum(s);
    if (lane == 0) red[warp] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        s = 0.f;
        for (int k = 0; k < PASS1_THREADS / 32; k++) s += red[k];
        work[(size_t)t * C + c] = nan ? __int_as_float(0x7fffffff) : m;
        work[(size_t)T * C + (size_t)t * C + c] = nan ? __int_as_float(0x7fffffff) : s;
    }
}

// readout pass 2: lse[t] = M + log(sum_c s_c * exp(m_c - M)), M = max_c m_c (lane x folds c = x, x+32, ...
// in order, then a butterfly; a row with a NaN gets NaN, an all -inf row -inf);
// keys_out[t, k] = logits[t, keys[k]] for the K option-key token ids (NaN for an id outside [0, V)).
extern "C" __global__ void readout_final_f32(const float* __restrict__ work, const float* __restrict__ logits,
                                             const int* __restrict__ keys, float* __restrict__ lse,
                                             float* __restrict__ keys_out, int T, int V, int C, int K) {
    pdl_entry();
    const int t = blockIdx.x;
    const float* pm = work + (size_t)t * C;
    const float* ps = work + (size_t)T * C + (size_t)t * C;
    float M = -INFINITY;
    for (int c = threadIdx.x; c < C; c += 32) M = fmaxf(M, pm[c]);
    M = warp_max(M);
    float S = 0.f;                                   // s_c == 0: an all -inf chunk (skip: -inf - -inf);
    for (int c = threadIdx.x; c < C; c += 32)        // s_c NaN: a NaN chunk, kept so lse is NaN
        S += ps[c] == 0.f ? 0.f : ps[c] * expf(pm[c] - M);
    S = warp_sum(S);
    if (threadIdx.x == 0) lse[t] = M + logf(S);
    for (int k = threadIdx.x; k < K; k += 32) {
        const int id = keys[k];
        keys_out[(size_t)t * K + k] = (id >= 0 && id < V) ? logits[(size_t)t * V + id] : __int_as_float(0x7fffffff);
    }
}

// ---------------------------------------------------------------------------------------------------------
// gelu_mul_bf16: the dense MLP's gate: out[i] = bf16( bf16(gelu_tanh(gate[i])) * up[i] ), as transformers'
// bf16 model computes act_fn(gate_proj(x)) * up_proj(x) (the activation rounds to bf16, then the product).
// Flat over n = T * I elements; each element is independent, so batching cannot change a byte.
extern "C" __global__ void gelu_mul_bf16(bf16* __restrict__ out, const bf16* __restrict__ gate,
                                         const bf16* __restrict__ up, long long n) {
    pdl_entry();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float g = bf16_to_f32(reinterpret_cast<const uint16_t*>(gate)[i]);
    float a = 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
    float u = bf16_to_f32(reinterpret_cast<const uint16_t*>(up)[i]);
    reinterpret_cast<uint16_t*>(out)[i] = f32_to_bf16(round_bf16(a) * u);
}
