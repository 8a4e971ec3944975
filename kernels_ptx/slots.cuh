// x16_bf16's slot order (linear_sm90a.cu, `_ss`): each 64-column unit of a row holds its columns in the order of the
// k16 steps' slots, 16-byte piece 2j + h = columns 64u + 32h + 4j + 0..3, then 64u + 32h + 16 + 4j + 0..3. Producers
// that write their output in this order (the dense MLP's gelu tile, the norm chains' xn, the wgmma attention's
// `_slots` kernels for o_proj) spare the next `_ss` launch its x16_bf16 copy. Rows of Kp = 64 ceil(K / 64) columns; the producers here need K % 64 == 0 (Kp = K).
#pragma once

// column c -> its element in the slot-ordered row (4 consecutive columns from c % 4 == 0 stay consecutive)
__device__ __forceinline__ int slot_pos(int c) {
    const int r = c & 31;
    return (c & ~63) + 8 * (2 * ((r & 15) >> 2) + ((c >> 5) & 1)) + (r & 3) + 4 * (r >> 4);
}
// 16-byte piece pc of a slot-ordered row (pc = 8 u + 2 j + h) -> its first column; its second 4 are 16 further on
// (slot_pos's inverse on the pieces: x16_bf16 and w16_fp8 gather each piece from these two runs of 4 columns)
__device__ __forceinline__ int slot_col(int pc) {
    const int t = pc & 7;
    return 64 * (pc >> 3) + 32 * (t & 1) + 4 * (t >> 1);
}
