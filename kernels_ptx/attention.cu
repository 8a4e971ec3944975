// Attention of one decoder layer on the GPU: q/k/v RMSNorm + NeoX RoPE, the paged KV scatter, and the
// attention itself (split over fixed 64-key chunks, then a fixed-order combine).
//
// Shapes (letters as in Python): T rows of this step, Hq query heads, Hkv kv heads, D head_dim,
// G = Hq / Hkv query heads per kv head; D in {64, 128, 256, 512} (attn_partial_bf16_d{D}, one template).
// KV pools (blocks, 16, Hkv, D) bf16: position p of a sequence lives
// in pool row  block_table[seq][p / 16] * 16 + p % 16.
//
// DETERMINISM. A query row (position p, head h) sees the contiguous key range [lo, hi]:
//   lo = max(0, p - W + 1) on sliding layers, 0 on full layers; hi = p, or, on sliding layers when p is inside
//   an image block (start, n), hi = start + n - 1 (the mask of layers.attention.mask is exactly this range).
// The range is cut at ABSOLUTE 64-key boundaries (chunk c = keys 64c .. 64c+63). One warp computes the partial
// softmax (m, l, acc[D]) of one (row, head, chunk); the combine kernel folds the chunks of a row in increasing c.
// Prefill, chunked prefill and decode all run these same two kernels, and the partial of a (row, head, chunk)
// depends only on that row's q and the chunk's keys, never on the launch shape: a query's output bytes are
// identical whatever else is in the launch. Float arithmetic whose rounding matters is written with explicit
// _rn intrinsics so that the compiler cannot contract it differently in different places.
#include <cuda_bf16.h>
#include <stdint.h>

#define KV_BLOCK 16      // positions per KV block
#define CHUNK 64         // keys per attention partial (two per lane)

__device__ __forceinline__ void unpack8(const uint4 u, float f[8]) {
    const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float2 t = __bfloat1622float2(b[i]);
        f[2 * i] = t.x;
        f[2 * i + 1] = t.y;
    }
}

// load_vec<N>: N consecutive bf16 (N = 2, 4, 8; address N * 2-byte aligned) -> N floats, one load.
template <int N> __device__ __forceinline__ void load_vec(const __nv_bfloat16* __restrict__ p, float f[N]);
template <> __device__ __forceinline__ void load_vec<8>(const __nv_bfloat16* __restrict__ p, float f[8]) {
    unpack8(__ldg(reinterpret_cast<const uint4*>(p)), f);
}
template <> __device__ __forceinline__ void load_vec<4>(const __nv_bfloat16* __restrict__ p, float f[4]) {
    const uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
    const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
    f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y;
}
template <> __device__ __forceinline__ void load_vec<2>(const __nv_bfloat16* __restrict__ p, float f[2]) {
    const unsigned int u = __ldg(reinterpret_cast<const unsigned int*>(p));
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u));
    f[0] = a.x; f[1] = a.y;
}

// store_vec<N>: N floats to N consecutive floats (address N * 4-byte aligned, 16 for N = 8), vector stores.
template <int N> __device__ __forceinline__ void store_vec(float* __restrict__ p, const float* f);
template <> __device__ __forceinline__ void store_vec<8>(float* __restrict__ p, const float* f) {
    reinterpret_cast<float4*>(p)[0] = make_float4(f[0], f[1], f[2], f[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(f[4], f[5], f[6], f[7]);
}
template <> __device__ __forceinline__ void store_vec<4>(float* __restrict__ p, const float* f) {
    reinterpret_cast<float4*>(p)[0] = make_float4(f[0], f[1], f[2], f[3]);
}
template <> __device__ __forceinline__ void store_vec<2>(float* __restrict__ p, const float* f) {
    reinterpret_cast<float2*>(p)[0] = make_float2(f[0], f[1]);
}

__device__ __forceinline__ float warp_sum(float v) {
    // xor butterfly: every lane ends with the same bits (each stage adds the same two values on both lanes)
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// ---------------------------------------------------------------------------------------------------------
// qk_norm_rope_bf16: per (row t, head) RMSNorm over D (q: q_norm weight, k: k_norm weight, v: no weight),
// then NeoX RoPE on q and k: pair (i, i + D/2) rotated by angle float(pos[t]) * inv_freq[i] (fp32 angle).
// grid (T, Hq + 2*Hkv): blockIdx.y < Hq -> q head; < Hq+Hkv -> k head; else v head. block D/2 threads
// (D % 64 == 0: whole warps, D = 64 is one warp), thread i owns elements i and i + D/2. Inputs are read
// with row strides (elements) so a fused QKV projection output can be read in place; for k=v layers pass
// v_in = the raw k (V = v_norm(raw k)).
// Outputs are dense: q_out (T, Hq, D), k_out (T, Hkv, D), v_out (T, Hkv, D) (k_out / v_out may be null).
// Fused KV write (k_pool non-null): the k and v rows also go straight into the paged pools (blocks, 16, Hkv, D)
// at pool row block_tables[rows_seq[t] * max_blocks + pos / 16] * 16 + pos % 16 (pos = positions[t]), the
// same bytes kv_write_bf16 would store.
// ---------------------------------------------------------------------------------------------------------
extern "C" __global__ void qk_norm_rope_bf16(
    const __nv_bfloat16* __restrict__ q_in, int q_stride,
    const __nv_bfloat16* __restrict__ k_in, int k_stride,
    const __nv_bfloat16* __restrict__ v_in, int v_stride,
    const __nv_bfloat16* __restrict__ q_w, const __nv_bfloat16* __restrict__ k_w,
    const float* __restrict__ inv_freq, const int* __restrict__ positions,
    int Hq, int Hkv, int D, float eps,
    __nv_bfloat16* __restrict__ q_out, __nv_bfloat16* __restrict__ k_out, __nv_bfloat16* __restrict__ v_out,
    __nv_bfloat16* __restrict__ k_pool, __nv_bfloat16* __restrict__ v_pool,
    const int* __restrict__ rows_seq, const int* __restrict__ block_tables, int max_blocks) {
    __shared__ float red[32];
    const int t = blockIdx.x, hy = blockIdx.y, i = threadIdx.x, half = D >> 1;
    const __nv_bfloat16* src;
    const __nv_bfloat16* w;
    __nv_bfloat16* dst;
    __nv_bfloat16* pool = nullptr;                   // k or v pool when the KV write is fused
    int kh = 0;                                      // kv head
    bool rope;
    if (hy < Hq) {                                   // q head hy
        src = q_in + (size_t)t * q_stride + (size_t)hy * D;
        dst = q_out + ((size_t)t * Hq + hy) * D;
        w = q_w; rope = true;
    } else if (hy < Hq + Hkv) {                      // k head hy - Hq
        const int h = hy - Hq;
        src = k_in + (size_t)t * k_stride + (size_t)h * D;
        dst = k_out ? k_out + ((size_t)t * Hkv + h) * D : nullptr;
        w = k_w; rope = true; pool = k_pool; kh = h;
    } else {                                         // v head hy - Hq - Hkv: no weight, no rope
        const int h = hy - Hq - Hkv;
        src = v_in + (size_t)t * v_stride + (size_t)h * D;
        dst = v_out ? v_out + ((size_t)t * Hkv + h) * D : nullptr;
        w = nullptr; rope = false; pool = v_pool; kh = h;
    }
    const float xa = __bfloat162float(src[i]), xb = __bfloat162float(src[i + half]);
    float ss = __fmaf_rn(xb, xb, __fmul_rn(xa, xa));
    ss = warp_sum(ss);
    const int nw = (half + 31) >> 5;
    if ((i & 31) == 0) red[i >> 5] = ss;
    __syncthreads();
    float tot = 0.f;
    for (int k = 0; k < nw; k++) tot = __fadd_rn(tot, red[k]);       // same order in every thread
    const float r = __frsqrt_rn(__fadd_rn(__fdiv_rn(tot, (float)D), eps));
    float ya = __fmul_rn(xa, r), yb = __fmul_rn(xb, r);
    if (w) {
        ya = __fmul_rn(ya, __bfloat162float(w[i]));
        yb = __fmul_rn(yb, __bfloat162float(w[i + half]));
    }
    if (rope) {
        const float ang = __fmul_rn((float)positions[t], inv_freq[i]);
        float s, c;
        sincosf(ang, &s, &c);                        // full-precision library sincos (not __sinf)
        const float oa = __fsub_rn(__fmul_rn(ya, c), __fmul_rn(yb, s));
        const float ob = __fadd_rn(__fmul_rn(yb, c), __fmul_rn(ya, s));
        ya = oa; yb = ob;
    }
    const __nv_bfloat16 ba = __float2bfloat16_rn(ya), bb = __float2bfloat16_rn(yb);
    if (dst) {
        dst[i] = ba;
        dst[i + half] = bb;
    }
    if (pool && k_pool) {
        const int p = positions[t];
        const size_t slot = (size_t)block_tables[(size_t)rows_seq[t] * max_blocks + p / KV_BLOCK] * KV_BLOCK + p % KV_BLOCK;
        __nv_bfloat16* pd = pool + (slot * Hkv + kh) * D;
        pd[i] = ba;
        pd[i + half] = bb;
    }
}

// ---------------------------------------------------------------------------------------------------------
// kv_write_bf16: scatter this step's K/V rows into the paged pools.
// k, v (T, Hkv, D) dense bf16; pools (blocks, 16, Hkv, D); row t of sequence rows_seq[t] at position
// rows_pos[t] goes to pool row block_tables[seq * max_blocks + pos / 16] * 16 + pos % 16.
// grid (T), block 128; HD = Hkv * D (a multiple of 8: copied as uint4 = 8 bf16).
// ---------------------------------------------------------------------------------------------------------
extern "C" __global__ void kv_write_bf16(
    const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v,
    __nv_bfloat16* __restrict__ k_pool, __nv_bfloat16* __restrict__ v_pool,
    const int* __restrict__ rows_seq, const int* __restrict__ rows_pos,
    const int* __restrict__ block_tables, int max_blocks, int HD) {
    const int t = blockIdx.x;
    const int p = rows_pos[t];
    const size_t slot = (size_t)block_tables[(size_t)rows_seq[t] * max_blocks + p / KV_BLOCK] * KV_BLOCK + p % KV_BLOCK;
    const uint4* ks = reinterpret_cast<const uint4*>(k + (size_t)t * HD);
    const uint4* vs = reinterpret_cast<const uint4*>(v + (size_t)t * HD);
    uint4* kd = reinterpret_cast<uint4*>(k_pool + slot * HD);
    uint4* vd = reinterpret_cast<uint4*>(v_pool + slot * HD);
    for (int i = threadIdx.x; i < HD / 8; i += blockDim.x) {
        kd[i] = ks[i];
        vd[i] = vs[i];
    }
}

// ---------------------------------------------------------------------------------------------------------
// Attention.
// ---------------------------------------------------------------------------------------------------------

// Key range [lo, hi] of row r (see the header). spans: int32 (S, n_spans, 2) (start, n), n = 0 unused; or null.
__device__ __forceinline__ void key_range(int r, const int* __restrict__ rows_seq, const int* __restrict__ rows_pos,
                                          const int* __restrict__ spans, int n_spans, int window, int sliding,
                                          int& lo, int& hi) {
    const int p = rows_pos[r];
    lo = sliding ? max(0, p - window + 1) : 0;
    hi = p;
    if (sliding && spans) {
        const int* sp = spans + (size_t)rows_seq[r] * n_spans * 2;
        for (int i = 0; i < n_spans; i++) {
            const int st = sp[2 * i], n = sp[2 * i + 1];
            if (n > 0 && p >= st && p < st + n) hi = max(hi, st + n - 1);
        }
    }
}

// attn_partial_bf16_d{D}: one warp per (row r, q head h, chunk slot z).
// q (T, Hq, D) bf16 (roped); pools (blocks, 16, Hkv, D) bf16; block_tables int32 (S, max_blocks).
// grid (ceil(nrows / QT), Hkv, max_slots), block (32, G, QT): threadIdx.y = head in the kv group, threadIdx.z =
// row in the tile. Row r = row0 + blockIdx.x * QT + threadIdx.z, head h = blockIdx.y * G + threadIdx.y,
// chunk c = lo / 64 + blockIdx.z (skipped when c > hi / 64).
// Writes, at index i = ((r - row0) * Hq + h) * max_slots + z:
//   part_ml[2i] = m (max score of the chunk), part_ml[2i+1] = l = sum_j exp(s_j - m),
//   part_acc[i * D + d] = sum_j exp(s_j - m) * v_j[d]    (j over the chunk's keys inside [lo, hi], in order)
// Score s_j = q . k_j (scaling 1.0), fp32, eight interleaved partial sums over d (d mod 8) joined in a fixed tree.
template <int D>
__device__ __forceinline__ void attn_partial(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_pool,
    const __nv_bfloat16* __restrict__ v_pool, const int* __restrict__ rows_seq, const int* __restrict__ rows_pos,
    const int* __restrict__ block_tables, int max_blocks, const int* __restrict__ spans, int n_spans,
    int window, int sliding, int row0, int nrows, int Hq, int Hkv, int max_slots,
    float* __restrict__ part_ml, float* __restrict__ part_acc) {
    const int lane = threadIdx.x;
    const int G = blockDim.y, QT = blockDim.z;
    const int lr = blockIdx.x * QT + threadIdx.z;              // row within this launch's group
    if (lr >= nrows) return;
    const int r = row0 + lr;
    const int kvh = blockIdx.y, h = kvh * G + threadIdx.y, z = blockIdx.z;
    int lo, hi;
    key_range(r, rows_seq, rows_pos, spans, n_spans, window, sliding, lo, hi);
    const int c = lo / CHUNK + z;
    if (c > hi / CHUNK) return;                                // this row has fewer chunks: slot unused
    const int jlo = max(lo, c * CHUNK), jhi = min(hi, c * CHUNK + CHUNK - 1);   // valid keys of the chunk
    const int* bt = block_tables + (size_t)rows_seq[r] * max_blocks;
    const size_t HD = (size_t)Hkv * D;
    const __nv_bfloat16* qr = q + ((size_t)r * Hq + h) * D;

    // --- scores: lane owns keys j0 = 64c + lane and j1 = j0 + 32 ---
    const int j0 = c * CHUNK + lane, j1 = j0 + 32;
    const bool v0 = j0 >= jlo && j0 <= jhi, v1 = j1 >= jlo && j1 <= jhi;
    // pool row of key j (only looked up for valid keys: table entries past hi may be junk); an invalid key
    // reads pool row 0 (always allocated) and its score is replaced by -inf below, so loads need no branch.
    const int row0k = v0 ? bt[j0 / KV_BLOCK] * KV_BLOCK + j0 % KV_BLOCK : 0;
    const int row1k = v1 ? bt[j1 / KV_BLOCK] * KV_BLOCK + j1 % KV_BLOCK : 0;
    const uint4* qv = reinterpret_cast<const uint4*>(qr);
    const uint4* k0 = reinterpret_cast<const uint4*>(k_pool + (size_t)row0k * HD + (size_t)kvh * D);
    const uint4* k1 = reinterpret_cast<const uint4*>(k_pool + (size_t)row1k * HD + (size_t)kvh * D);
    float a0[8], a1[8];
#pragma unroll
    for (int e = 0; e < 8; e++) { a0[e] = 0.f; a1[e] = 0.f; }
#pragma unroll 4
    for (int w = 0; w < D / 8; w++) {                          // d = 8w + e, increasing w
        float fq[8], f0[8], f1[8];
        unpack8(__ldg(qv + w), fq);
        unpack8(__ldg(k0 + w), f0);
        unpack8(__ldg(k1 + w), f1);
#pragma unroll
        for (int e = 0; e < 8; e++) {
            a0[e] = __fmaf_rn(fq[e], f0[e], a0[e]);
            a1[e] = __fmaf_rn(fq[e], f1[e], a1[e]);
        }
    }
    const float ninf = -__int_as_float(0x7f800000);
    float s0 = __fadd_rn(__fadd_rn(__fadd_rn(a0[0], a0[1]), __fadd_rn(a0[2], a0[3])),
                         __fadd_rn(__fadd_rn(a0[4], a0[5]), __fadd_rn(a0[6], a0[7])));
    float s1 = __fadd_rn(__fadd_rn(__fadd_rn(a1[0], a1[1]), __fadd_rn(a1[2], a1[3])),
                         __fadd_rn(__fadd_rn(a1[4], a1[5]), __fadd_rn(a1[6], a1[7])));
    s0 = v0 ? s0 : ninf;
    s1 = v1 ? s1 : ninf;
    const float m = warp_max(fmaxf(s0, s1));                   // finite: the chunk has >= 1 valid key
    const float p0 = v0 ? expf(__fsub_rn(s0, m)) : 0.f;
    const float p1 = v1 ? expf(__fsub_rn(s1, m)) : 0.f;
    const float l = warp_sum(__fadd_rn(p0, p1));

    // --- p . V: lane owns EPL = D / 32 elements, in SEG segments of VEC = min(8, EPL) consecutive ones:
    //     d = (32 * VEC) * seg + VEC * lane + e   (D = 256: 8 * lane + e; D = 512: 256 * seg + 8 * lane + e;
    //     D = 128: 4 * lane + e; D = 64: 2 * lane + e). Each segment is one coalesced 64 * VEC-byte load per key.
    //     Per element: acc[d] = fma(p_j, v_j[d], acc[d]) over the valid keys j in increasing order, for every D.
    constexpr int EPL = D / 32, VEC = EPL < 8 ? EPL : 8, SEG = EPL / VEC;
    static_assert(D % 64 == 0 && SEG * VEC * 32 == D, "D: 64, 128 or a multiple of 256");
    float acc[EPL];
#pragma unroll
    for (int i = 0; i < EPL; i++) acc[i] = 0.f;
    const int jb = jlo - c * CHUNK, je = jhi - c * CHUNK;      // valid key slots jb..je (warp-uniform)
#pragma unroll 4
    for (int jj = jb; jj <= je; jj++) {                        // increasing key order
        const float pj = __shfl_sync(0xffffffffu, jj < 32 ? p0 : p1, jj & 31);
        const int prow = __shfl_sync(0xffffffffu, jj < 32 ? row0k : row1k, jj & 31);   // valid: jb <= jj <= je
        const __nv_bfloat16* vr = v_pool + (size_t)prow * HD + (size_t)kvh * D;
#pragma unroll
        for (int sg = 0; sg < SEG; sg++) {
            float fv[VEC];
            load_vec<VEC>(vr + sg * 32 * VEC + lane * VEC, fv);
#pragma unroll
            for (int e = 0; e < VEC; e++) acc[sg * VEC + e] = __fmaf_rn(pj, fv[e], acc[sg * VEC + e]);
        }
    }
    const size_t i = ((size_t)lr * Hq + h) * max_slots + z;
    if (lane == 0) {
        part_ml[2 * i] = m;
        part_ml[2 * i + 1] = l;
    }
#pragma unroll
    for (int sg = 0; sg < SEG; sg++)
        store_vec<VEC>(part_acc + i * D + sg * 32 * VEC + lane * VEC, acc + sg * VEC);
}

#define ATTN_PARTIAL_ARGS                                                                                     \
    const __nv_bfloat16 *__restrict__ q, const __nv_bfloat16 *__restrict__ k_pool,                          \
        const __nv_bfloat16 *__restrict__ v_pool, const int *__restrict__ rows_seq,                         \
        const int *__restrict__ rows_pos, const int *__restrict__ block_tables, int max_blocks,             \
        const int *__restrict__ spans, int n_spans, int window, int sliding, int row0, int nrows, int Hq,  \
        int Hkv, int max_slots, float *__restrict__ part_ml, float *__restrict__ part_acc
#define ATTN_PARTIAL_PASS                                                                                     \
    q, k_pool, v_pool, rows_seq, rows_pos, block_tables, max_blocks, spans, n_spans, window, sliding, row0,  \
        nrows, Hq, Hkv, max_slots, part_ml, part_acc

// One instantiation per head_dim; the template body (and so the arithmetic per element) is shared.
extern "C" __global__ void __launch_bounds__(512) attn_partial_bf16_d64(ATTN_PARTIAL_ARGS) {
    attn_partial<64>(ATTN_PARTIAL_PASS);
}
extern "C" __global__ void __launch_bounds__(512) attn_partial_bf16_d128(ATTN_PARTIAL_ARGS) {
    attn_partial<128>(ATTN_PARTIAL_PASS);
}
extern "C" __global__ void __launch_bounds__(512) attn_partial_bf16_d256(ATTN_PARTIAL_ARGS) {
    attn_partial<256>(ATTN_PARTIAL_PASS);
}
extern "C" __global__ void __launch_bounds__(512) attn_partial_bf16_d512(ATTN_PARTIAL_ARGS) {
    attn_partial<512>(ATTN_PARTIAL_PASS);
}

// attn_combine_bf16: fold the chunk partials of each (row, head) in increasing chunk order and normalise.
// grid (nrows, Hq), block 128 (threads stride over d; D = 64 leaves threads 64..127 idle).
// out (T, Hq * D) bf16, row r = row0 + blockIdx.x.
// Fold (M, L, ACC) <- (m, l, acc):  M' = max(M, m); a = exp(M - M'); b = exp(m - M');
//   L = L * a + l * b;  ACC = ACC * a + acc * b.   Starts from M = -inf, L = 0, ACC = 0.
// A row whose chunk count exceeds max_slots (caller's max_keys too small) gets NaN, loudly.
extern "C" __global__ void attn_combine_bf16(
    const float* __restrict__ part_ml, const float* __restrict__ part_acc,
    const int* __restrict__ rows_seq, const int* __restrict__ rows_pos, const int* __restrict__ spans, int n_spans,
    int window, int sliding, int row0, int Hq, int D, int max_slots, __nv_bfloat16* __restrict__ out) {
    const int lr = blockIdx.x, h = blockIdx.y, r = row0 + lr;
    int lo, hi;
    key_range(r, rows_seq, rows_pos, spans, n_spans, window, sliding, lo, hi);
    const int ns = hi / CHUNK - lo / CHUNK + 1;
    const size_t base = ((size_t)lr * Hq + h) * max_slots;
    __nv_bfloat16* o = out + ((size_t)r * Hq + h) * D;
    if (ns > max_slots) {
        for (int d = threadIdx.x; d < D; d += blockDim.x) o[d] = __ushort_as_bfloat16((unsigned short)0x7fc0);
        return;
    }
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float M = -__int_as_float(0x7f800000), L = 0.f, A = 0.f;
        for (int z = 0; z < ns; z++) {
            const float m = part_ml[2 * (base + z)], l = part_ml[2 * (base + z) + 1];
            const float acc = part_acc[(base + z) * D + d];
            const float Mn = fmaxf(M, m);
            const float a = expf(__fsub_rn(M, Mn)), b = expf(__fsub_rn(m, Mn));
            L = __fmaf_rn(L, a, __fmul_rn(l, b));
            A = __fmaf_rn(A, a, __fmul_rn(acc, b));
            M = Mn;
        }
        o[d] = __float2bfloat16_rn(__fdiv_rn(A, L));
    }
}
