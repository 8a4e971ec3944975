// Row helpers of the norm kernels, shared by elementwise.cu (the norms, the chains of norms) and linear.cu (the
// router's form that makes its own input rows: the post-attention chain, then the logits and the top-k). bf16 <->
// fp32 conversions, 8-vector loads and stores, the row reduction, and the post-attention chain's weights and row.
// Determinism: see elementwise.cu's header (a row's thread layout depends on its width only).
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "pdl.cuh"          // pre_wait's griddepcontrol
#include "slots.cuh"        // x16_bf16's slot order: the norm chains' xn for the next `_ss` launch
#include "xperm.cuh"        // the experts' permuted column order: post_attn_norms' e_in for their wgmma path

typedef __nv_bfloat16 bf16;

__device__ __forceinline__ float bf16_to_f32(uint16_t b) { return __uint_as_float((uint32_t)b << 16); }
__device__ __forceinline__ uint16_t f32_to_bf16(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }
__device__ __forceinline__ float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

// Load / store VEC consecutive bf16 as fp32. VEC == 8 is one 16-byte access (the caller guarantees 16-byte
// alignment); VEC == 1 is a plain 2-byte access. Element j of the uint4 sits in word j/2, low half first.
template <int VEC>
__device__ __forceinline__ void load_bf16(const bf16* p, float* f) {
    if (VEC == 8) {
        uint4 u = *reinterpret_cast<const uint4*>(p);
        uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            f[2 * k] = __uint_as_float(w[k] << 16);
            f[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
        }
    } else {
        f[0] = bf16_to_f32(*reinterpret_cast<const uint16_t*>(p));
    }
}

// 8 fp32 -> 4 words of bf16 pairs, element j in word j/2, low half first (load_bf16's order)
__device__ __forceinline__ void pack_bf16x8(const float* f, uint32_t (&w)[4]) {
#pragma unroll
    for (int k = 0; k < 4; k++) w[k] = (uint32_t)f32_to_bf16(f[2 * k]) | ((uint32_t)f32_to_bf16(f[2 * k + 1]) << 16);
}

template <int VEC>
__device__ __forceinline__ void store_bf16(bf16* p, const float* f) {
    if (VEC == 8) {
        uint32_t w[4];
        pack_bf16x8(f, w);
        *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
        *reinterpret_cast<uint16_t*>(p) = f32_to_bf16(f[0]);
    }
}

// The row's total from each thread's partial s: xor-butterfly per warp (every lane gets the warp sum), then
// every thread adds the row's warp sums in warp order. sums: this row's `warps` shared slots. Every thread of
// the block must call it (it may __syncthreads); the caller does not reuse `sums` before a later barrier.
__device__ __forceinline__ float row_sum(float s, float* sums, int warps, int lane) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) s += __shfl_xor_sync(0xffffffffu, s, m);
    if (warps > 1) {
        if (lane == 0) sums[threadIdx.x >> 5] = s;
        __syncthreads();
        s = 0.f;
        for (int k = 0; k < warps; k++) s += sums[k];
    }
    return s;
}

// Two independent rows' totals at once (a's and b's partials): each with row_sum's arithmetic step for step (the same
// butterfly, the warp sums added in warp order), so the bits of row_sum(a, sa, ..) and row_sum(b, sb, ..); one barrier
// and one pass over the shared slots instead of two (post_ffn_norms' m and e: alone, T = 1 3.40 -> 3.11 us, the 2,048-row
// pairs form 48.9 -> 47.4 us; H200, forty-third session). Same calling rules as row_sum.
__device__ __forceinline__ float2 row_sum2(float a, float b, float* sa, float* sb, int warps, int lane) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) {
        a += __shfl_xor_sync(0xffffffffu, a, m);
        b += __shfl_xor_sync(0xffffffffu, b, m);
    }
    if (warps > 1) {
        if (lane == 0) {
            sa[threadIdx.x >> 5] = a;
            sb[threadIdx.x >> 5] = b;
        }
        __syncthreads();
        a = 0.f;
        b = 0.f;
        for (int k = 0; k < warps; k++) {
            a += sa[k];
            b += sb[k];
        }
    }
    return make_float2(a, b);
}

// The decoder layer's chains of norms (elementwise.cu's header of them states their arithmetic): their pieces.
__device__ __forceinline__ float sumsq8(const float* f) {
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < 8; j++) s = fmaf(f[j], f[j], s);
    return s;
}

// y = bf16(f * inv * w) for the 8 values (the rmsnorm_rows product order), kept as the stored bf16 values; wf =
// the 8 weights as fp32 (wts below)
__device__ __forceinline__ void norm8(const float* f, float inv, const float* wf, float* y) {
#pragma unroll
    for (int j = 0; j < 8; j++) y[j] = round_bf16(f[j] * inv * wf[j]);
}

// The norm chains come in two forms with one arithmetic (layers/norm.py picks by T): PRE (the `_pre` kernels, a few
// rows: decode) fetches every weight vector first, before griddepcontrol.wait, and every activation right after
// it, so no load waits behind a reduction; the plain kernels (prompts: thousands of rows) load each vector where
// it is used, which keeps them at 31-56 registers and 3+ CTAs an SM (PRE takes 71-96: 1-2 at 352 threads; the
// 2,048-token prefill lost 1.5 ms with it, H200 2026-11-30). wts: the 8 weights at w, preloaded (PRE) or loaded now.
template <bool PRE>
__device__ __forceinline__ const float* wts(const float* pre, const bf16* w, float* tmp) {
    if (PRE) return pre;
    load_bf16<8>(w, tmp);
    return tmp;
}
template <bool PRE>
__device__ __forceinline__ void pre8(const bf16* w, float* dst, bool on) {
    if (PRE && on) load_bf16<8>(w, dst);
}
// PRE: the weights are fetched, then griddepcontrol.wait, then the next launch is let go (so early grids do not
// chain); plain: pdl_entry.
template <bool PRE>
__device__ __forceinline__ void pre_wait() {
    if (PRE) {
        pdl_wait();
        pdl_trigger();
    }
}

__device__ __forceinline__ float inv_rms(float s, int n, float eps) { return 1.0f / sqrtf(s / (float)n + eps); }

// Columns c .. c + 7 of a row, as store_bf16<8> stores them (COL_ROWS), or at their places in another column order:
// x16_bf16's slot order (COL_SLOTS: slots.cuh, two runs of 4 columns, 8 bytes each; rows of n % 64 == 0), the norm
// chains' xn for the next `_ss` launch; the experts' permuted order (COL_PERM: xperm.cuh, four pairs, 4 bytes each; rows
// of n % 128 == 0), post_attn_norms' e_in for the experts' gate/up tile (no moe_permute_x copy).
enum ColOrder { COL_ROWS = 0, COL_SLOTS = 1, COL_PERM = 2 };
__device__ __forceinline__ void store_cols8(bf16* rowp, int c, const float* y, int order) {
    if (order == COL_ROWS) {
        store_bf16<8>(rowp + c, y);
        return;
    }
    uint32_t w[4];
    pack_bf16x8(y, w);
    if (order == COL_SLOTS) {
        *reinterpret_cast<uint2*>(rowp + slot_pos(c)) = make_uint2(w[0], w[1]);
        *reinterpret_cast<uint2*>(rowp + slot_pos(c + 4)) = make_uint2(w[2], w[3]);
        return;
    }
#pragma unroll
    for (int j = 0; j < 4; j++) *reinterpret_cast<uint32_t*>(rowp + (c & ~127) + perm_pos((c & 127) + 2 * j)) = w[j];
}

// r = bf16(bf16(bf16(f * inv) * scale) * root): the MoE router's input (no-scale norm, router.scale, H^-0.5,
// each product rounded as transformers' bf16 model does); linear.cu's router kernels take it from here.
__device__ __forceinline__ void router_row8(const float* f, float inv, const float* sf, float root, bf16* r) {
    float y[8];
#pragma unroll
    for (int j = 0; j < 8; j++) y[j] = round_bf16(round_bf16(f[j] * inv) * sf[j]) * root;
    store_bf16<8>(r, y);
}

// post_attn_norms' weight vectors of a thread's 8 columns c .. c + 7: loaded by post_attn_weights before
// griddepcontrol.wait (PRE), or where they are used (plain: post_attn_row reads them through wts).
struct PostAttnW {
    float pa[8], pf[8], pf2[8], r[8];
};
template <bool PRE>
__device__ __forceinline__ void post_attn_weights(PostAttnW& pw, const bf16* __restrict__ w_pa,
                                                  const bf16* __restrict__ w_pf, const bf16* __restrict__ w_pf2,
                                                  const bf16* __restrict__ r_scale, int c, bool own, bool router) {
    pre8<PRE>(w_pa + c, pw.pa, own);
    pre8<PRE>(w_pf + c, pw.pf, own);
    pre8<PRE>(w_pf2 + c, pw.pf2, own);
    pre8<PRE>(r_scale + c, pw.r, own && router);
}

// One row of the chain (see above) at element offset `row` of a, x, h, xn and e_in, by one 8-vector a thread
// (c = 8 threadIdx.x, own = c < n): h, xn, e_in stored when `store`, the router's input r at r + roff (a row of the
// router input in global memory, or of a shared-memory copy) when r is not null. Every thread of the block calls it
// (row_sum's barriers); sums0 / sums1: two rows of `warps` shared slots (see row_sum for their reuse).
template <bool PRE>
__device__ __forceinline__ void post_attn_row(const PostAttnW& pw, bf16* __restrict__ h, bf16* __restrict__ xn,
                                              bf16* __restrict__ e_in, const bf16* __restrict__ a,
                                              const bf16* __restrict__ x, const bf16* __restrict__ w_pa,
                                              const bf16* __restrict__ w_pf, const bf16* __restrict__ w_pf2, int n,
                                              float eps, bf16* r, size_t roff, const bf16* __restrict__ r_scale,
                                              float root, int xn_slots, int e_perm, size_t row, bool store,
                                              float* sums0, float* sums1) {
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5, c = threadIdx.x * 8;
    const bool own = c < n;
    float f[8], xr[8], hv[8], y[8], wt[8];
    if (own) load_bf16<8>(a + row + c, f);
    if (PRE && own) load_bf16<8>(x + row + c, xr);
    const float inv_a = inv_rms(row_sum(own ? sumsq8(f) : 0.f, sums0, warps, lane), n, eps);
    if (own) {
        norm8(f, inv_a, wts<PRE>(pw.pa, w_pa + c, wt), y);
        if (!PRE) load_bf16<8>(x + row + c, xr);
#pragma unroll
        for (int j = 0; j < 8; j++) hv[j] = round_bf16(xr[j] + y[j]);
        if (store) store_bf16<8>(h + row + c, hv);
    }
    const float inv_h = inv_rms(row_sum(own ? sumsq8(hv) : 0.f, sums1, warps, lane), n, eps);
    if (own) {
        if (store) {
            norm8(hv, inv_h, wts<PRE>(pw.pf, w_pf + c, wt), y);
            store_cols8(xn + row, c, y, xn_slots ? COL_SLOTS : COL_ROWS);
            norm8(hv, inv_h, wts<PRE>(pw.pf2, w_pf2 + c, wt), y);
            store_cols8(e_in + row, c, y, e_perm ? COL_PERM : COL_ROWS);
        }
        if (r) router_row8(hv, inv_h, wts<PRE>(pw.r, r_scale + c, wt), root, r + roff + c);
    }
}
