// The experts' permuted column order (moe_sm90a.cu's header): in each 128-column super unit, position 16 s + slot
// (s = 2m + h the k16 step) holds column 32q + 8m + 4h + j for slot 2q + j and 32q + 8m + 4h + 2 + j for slot
// 2q + 8 + j (j = 0, 1), so that each step's 16 columns are 32 contiguous bytes. moe_permute_x and the gate/up tile
// write it; so does post_attn_norms (elementwise.cu) for the experts' input when their wgmma path takes it.
#pragma once

// Column c (0..127) of a super unit -> its position in the permuted order (c and c + 1, c even, stay adjacent); word
// w (0..63) of the permuted order <- column perm_col(w) (2 bf16).
__device__ __forceinline__ int perm_pos(int c) {
    const int q = c >> 5, m = (c >> 3) & 3, h = (c >> 2) & 1, r = c & 3;
    return 16 * (2 * m + h) + (r < 2 ? 2 * q + r : 2 * q + 6 + r);
}
__device__ __forceinline__ int perm_col(int w) {
    const int s = w >> 3, wi = w & 7;
    return 32 * (wi & 3) + 8 * (s >> 1) + 4 * (s & 1) + 2 * (wi >> 2);
}
