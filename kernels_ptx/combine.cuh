// The experts' combine, shared by moe.cu (moe_combine_bf16, moe_down_combine_direct) and elementwise.cu
// (post_ffn_norms_pairs_bf16, which folds it into the norms that read its output): one arithmetic, one place.
//   e[t, n] = bf16( sum over token t's slots, in increasing EXPERT index (the numpy reference's order: experts
//             visited in index order), of f32(o[t*k+s, n]) ), an fp32 sum from 0; slots whose expert is outside
//             [0, E) are skipped.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#define MAX_K 16         // top-k slots per token the combines handle

// The token's slots in increasing expert index (the reference visits experts in index order; one token's experts
// are distinct from the router): order[0 .. n-1] = slot numbers. Found by one whole warp at once (all 32 lanes
// call it; lane s < k looks at slot s): slot s is kept iff its expert is in [0, E) and no lower slot holds the
// same expert (a repeat is dropped, the first kept), and its place is the number of kept slots with a lower
// expert. Writes order and *n (shared memory; the caller syncs before reading them). k <= 32.
__device__ __forceinline__ void slots_by_expert_warp(const int* __restrict__ idx_t, int k, int E, int* order,
                                                     int* n) {
    const int lane = threadIdx.x & 31;
    const int e = lane < k ? idx_t[lane] : -1;
    bool first = true;
    for (int s = 0; s < k; ++s) {
        const int es = __shfl_sync(0xffffffffu, e, s);
        if (s < lane && es == e) first = false;
    }
    const bool keep = lane < k && e >= 0 && e < E && first;
    const unsigned kept = __ballot_sync(0xffffffffu, keep);
    int rank = 0;
    for (int s = 0; s < k; ++s) {
        const int es = __shfl_sync(0xffffffffu, e, s);
        if (((kept >> s) & 1u) && es < e) ++rank;
    }
    if (keep) order[rank] = lane;
    if (lane == 0) *n = __popc(kept);
}

// acc[0..7] = the fp32 sums (before the bf16 rounding) of columns n0 .. n0 + 7 of pair rows o + order[r] * H,
// r < nv (o = the token's first pair row), added in r order. The 16-byte loads go out SB slots at a time before
// their adds (a memory-bound step: at SB = 8 a top-8 token's slots all in flight at once, in 32 registers; SB = 4
// takes 16, for kernels that gain more from the CTAs an SM than from the loads a thread); rows 16-byte aligned
// (H % 8 == 0).
template <int SB = 8>
__device__ __forceinline__ void combine8(const __nv_bfloat16* __restrict__ o, const int* order, int nv, int H,
                                         int n0, float (&acc)[8]) {
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[c] = 0.f;
#pragma unroll
    for (int r0 = 0; r0 < MAX_K; r0 += SB) {
        if (r0 >= nv) break;
        uint4 v[SB];
#pragma unroll
        for (int r = 0; r < SB; ++r)
            v[r] = r0 + r < nv ? __ldg(reinterpret_cast<const uint4*>(o + (size_t)order[r0 + r] * H + n0))
                               : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int r = 0; r < SB; ++r) {
            if (r0 + r < nv) {
                const uint32_t w[4] = {v[r].x, v[r].y, v[r].z, v[r].w};
#pragma unroll
                for (int c = 0; c < 8; ++c)
                    acc[c] = __fadd_rn(acc[c],
                                       __uint_as_float((c & 1) ? (w[c >> 1] & 0xffff0000u) : (w[c >> 1] << 16)));
            }
        }
    }
}
