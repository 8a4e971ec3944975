// MoE block kernels (Gemma-4 26B-A4B): router, grouping of (token, slot) pairs by expert, NVFP4 experts
// (gate/up with gated GELU, down scaled by the routing weight) and a deterministic combine.
// bf16 activations, fp32 accumulation, NVFP4 weights decoded in registers (checkpoint.md sections 2 and 6).
//
// Shapes (same letters as Python): T tokens, H hidden, E experts, k top-k, P = T*k (token, slot) pairs,
// I expert intermediate. A pair p = t*k + s is token t's slot s.
//
// Expert kernels come in token-tile-cap variants (moe_gate_up_nvfp4[_c4|_c2|_c1], moe_down_nvfp4[...]) that
// differ only in registers; the launcher picks by min(8, T).
//
// Determinism: every output element has a fixed reduction order that depends only on K (the in-feature
// count) and the lane layout, never on T, on the group sizes or on which tokens share an expert; no float
// atomics anywhere. A row's bytes are identical alone or inside any batch.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;

#define FULL 0xffffffffu

__device__ __forceinline__ float bf16_bits_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_bits_hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }
__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

__device__ __forceinline__ float warp_sum(float v) {
    // butterfly: at each level both partners add the same two values (a+b == b+a bitwise),
    // so every lane ends with the same, layout-fixed sum.
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}

// ---------------------------------------------------------------------------------------------------
// Router, part 1: logits (T, E) fp32.
//   r = bf16(bf16(bf16(h * rsqrt(mean(h^2) + eps)) * scale) * H^-0.5)   (the roundings transformers does
//   in a bf16 model: no-scale norm computed in fp32 and cast back, then two bf16 elementwise products)
//   logits[t, e] = sum_j r[t, j] * proj[e, j]   fp32, fixed order (lane-strided 8-column chunks, then a
//   butterfly), NOT rounded to bf16 (bf16 logits would create exact ties in the top-k).
// grid (ceil(T/RT), ceil(E/4)), block 128 = 4 warps; warp w of block (bx, by) computes expert by*4+w for the
// RT tokens bx*RT.. ; dynamic shared: RT*H bf16 (the r rows). Needs H % 8 == 0.
#define RT 4
extern "C" __global__ void __launch_bounds__(128) router_logits_bf16(
    const bf16* __restrict__ h,        // (T, H)
    const bf16* __restrict__ proj,     // (E, H)
    const bf16* __restrict__ scale,    // (H,)  router.scale
    float* __restrict__ logits,        // (T, E)
    int T, int H, int E, float eps, float root)
{
    extern __shared__ __align__(16) unsigned char smem_r[];
    bf16* r = (bf16*)smem_r;                                   // (RT, H)
    __shared__ float rinv[RT];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int t0 = blockIdx.x * RT;

    // 1. per token (warp w <-> token t0+w): 1/sqrt(mean(h^2) + eps), fixed order.
    if (warp < RT) {
        const int t = t0 + warp;
        float s = 0.f;
        if (t < T) {
            const bf16* hr = h + (size_t)t * H;
            for (int j = lane; j < H; j += 32) { float v = __bfloat162float(hr[j]); s = fmaf(v, v, s); }
        }
        s = warp_sum(s);
        if (lane == 0) rinv[warp] = 1.0f / sqrtf(s / (float)H + eps);
    }
    __syncthreads();
    // 2. r rows into shared (zeros for tokens past T).
    for (int i = threadIdx.x; i < RT * H; i += blockDim.x) {
        const int tt = i / H, j = i - tt * H, t = t0 + tt;
        float v = 0.f;
        if (t < T) {
            v = round_bf16(__bfloat162float(h[(size_t)t * H + j]) * rinv[tt]);
            v = round_bf16(v * __bfloat162float(scale[j]));
            v = v * root;
        }
        r[i] = __float2bfloat16_rn(v);
    }
    __syncthreads();
    // 3. one expert per warp: lane handles 8-column chunks c = lane, lane+32, ... (16-byte loads).
    const int e = blockIdx.y * 4 + warp;
    if (e >= E) return;
    const bf16* pr = proj + (size_t)e * H;
    float acc[RT];
    #pragma unroll
    for (int tt = 0; tt < RT; ++tt) acc[tt] = 0.f;
    #pragma unroll 4
    for (int c = lane; c < H / 8; c += 32) {                     // unrolled for loads in flight; order unchanged
        const uint4 wv = __ldg((const uint4*)(pr + 8 * c));
        const uint32_t wa[4] = {wv.x, wv.y, wv.z, wv.w};
        #pragma unroll
        for (int tt = 0; tt < RT; ++tt) {
            const uint4 xv = *(const uint4*)(r + tt * H + 8 * c);
            const uint32_t xa[4] = {xv.x, xv.y, xv.z, xv.w};
            #pragma unroll
            for (int q = 0; q < 4; ++q) {
                acc[tt] = fmaf(bf16_bits_lo(wa[q]), bf16_bits_lo(xa[q]), acc[tt]);
                acc[tt] = fmaf(bf16_bits_hi(wa[q]), bf16_bits_hi(xa[q]), acc[tt]);
            }
        }
    }
    #pragma unroll
    for (int tt = 0; tt < RT; ++tt) {
        const float v = warp_sum(acc[tt]);
        if (lane == 0 && t0 + tt < T) logits[(size_t)(t0 + tt) * E + e] = v;
    }
}

// ---------------------------------------------------------------------------------------------------
// Router, part 2: softmax over all E (fp32), top-k (descending; ties -> lower expert index, as numpy's stable
// argsort of -p), renormalise over the k, times per_expert_scale[idx].
// grid ceil(T/4), block 128: one warp per token. E <= 256 (lane holds experts lane + 32*i), k <= 16.
#define RK_MAXE 8
#define RK_MAXK 16
extern "C" __global__ void __launch_bounds__(128) router_topk_f32(
    const float* __restrict__ logits,  // (T, E)
    const float* __restrict__ pes,     // (E,)  router.per_expert_scale
    float* __restrict__ weights,       // (T, k)
    int* __restrict__ idx,             // (T, k)
    int T, int E, int k)
{
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int t = blockIdx.x * 4 + warp;
    if (t >= T) return;
    const float* lg = logits + (size_t)t * E;
    float v[RK_MAXE];
    float m = -INFINITY;
    #pragma unroll
    for (int i = 0; i < RK_MAXE; ++i) {
        const int e = lane + 32 * i;
        v[i] = e < E ? lg[e] : -INFINITY;
        m = fmaxf(m, v[i]);
    }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL, m, o));
    float s = 0.f;
    #pragma unroll
    for (int i = 0; i < RK_MAXE; ++i) {
        const int e = lane + 32 * i;
        v[i] = e < E ? expf(v[i] - m) : 0.f;
        s += v[i];
    }
    s = warp_sum(s);
    #pragma unroll
    for (int i = 0; i < RK_MAXE; ++i) v[i] = lane + 32 * i < E ? v[i] / s : -1.f;   // p; -1 = absent/taken

    float topv[RK_MAXK];
    int topi[RK_MAXK];
    #pragma unroll
    for (int j = 0; j < RK_MAXK; ++j) {
        topv[j] = 0.f; topi[j] = 0;
        if (j < k) {
            // lane's best: largest p, lowest index on ties (i ascending == index ascending)
            float bv = -2.f; int bi = 0x7fffffff;
            #pragma unroll
            for (int i = 0; i < RK_MAXE; ++i)
                if (v[i] > bv) { bv = v[i]; bi = lane + 32 * i; }
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float ov = __shfl_xor_sync(FULL, bv, o);
                const int oi = __shfl_xor_sync(FULL, bi, o);
                if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
            }
            topv[j] = bv; topi[j] = bi;
            #pragma unroll
            for (int i = 0; i < RK_MAXE; ++i)
                if (lane + 32 * i == bi) v[i] = -1.f;
        }
    }
    if (lane == 0) {
        float sum = 0.f;
        #pragma unroll
        for (int j = 0; j < RK_MAXK; ++j) if (j < k) sum += topv[j];       // slot order 0..k-1
        #pragma unroll
        for (int j = 0; j < RK_MAXK; ++j)
            if (j < k) {
                weights[(size_t)t * k + j] = (topv[j] / sum) * pes[topi[j]];
                idx[(size_t)t * k + j] = topi[j];
            }
    }
}

// ---------------------------------------------------------------------------------------------------
// Grouping: counting sort of the P = T*k pairs by expert, stable (pair order p = t*k+s, so by token within an
// expert). Outputs: offsets (E+1) (group e = perm[offsets[e] .. offsets[e+1])), perm (P) pair indices,
// active (E) the experts with >= 1 pair in increasing order (first n_active valid), n_active (1).
// Pairs whose expert is outside [0, E) are dropped (the combine skips them too).
// One block of 1024 threads (32 warps); warp w owns pairs [w*seg, (w+1)*seg), seg = ceil(P/32); within a
// warp, lanes with the same expert are found with __match_any_sync. Integer-only, deterministic. E <= 256.
#define G_MAXE 256
extern "C" __global__ void __launch_bounds__(1024) moe_group(
    const int* __restrict__ idx,       // (P,)
    int P, int E,
    int* __restrict__ offsets,         // (E+1,)
    int* __restrict__ perm,            // (P,)
    int* __restrict__ active,          // (E,)
    int* __restrict__ n_active)        // (1,)
{
    __shared__ int hist[32][G_MAXE];     // per-warp counts, then per-warp start within the expert's group
    __shared__ int off[G_MAXE + 1];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int i = threadIdx.x; i < 32 * G_MAXE; i += blockDim.x) (&hist[0][0])[i] = 0;
    __syncthreads();
    const int seg = (P + 31) / 32;
    const int p0 = warp * seg, p1 = min(P, p0 + seg);
    const unsigned lt = (1u << lane) - 1u;
    // pass 1: per-warp histogram
    for (int base = p0; base < p1; base += 32) {
        const int p = base + lane;
        int e = p < p1 ? idx[p] : -1;
        if (e < 0 || e >= E) e = -1;
        const unsigned mask = __match_any_sync(FULL, e);
        if (e >= 0 && (mask & lt) == 0) hist[warp][e] += __popc(mask);
        __syncwarp();
    }
    __syncthreads();
    // exclusive scan over warps, per expert; totals into off[e]
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int run = 0;
        for (int w = 0; w < 32; ++w) { const int c = hist[w][e]; hist[w][e] = run; run += c; }
        off[e] = run;
    }
    __syncthreads();
    // exclusive scan over experts (warp 0: lane owns experts 8*lane .. 8*lane+7), and the active list
    if (warp == 0) {
        int cnt[8], sum = 0, nact = 0;
        #pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int e = 8 * lane + i;
            cnt[i] = e < E ? off[e] : 0;
            sum += cnt[i];
            nact += cnt[i] > 0;
        }
        int incl = sum, inca = nact;
        #pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int a = __shfl_up_sync(FULL, incl, o), b = __shfl_up_sync(FULL, inca, o);
            if (lane >= o) { incl += a; inca += b; }
        }
        int run = incl - sum, ra = inca - nact;
        __syncwarp();
        #pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int e = 8 * lane + i;
            if (e < E) {
                off[e] = run; offsets[e] = run;
                if (cnt[i] > 0) active[ra++] = e;
            }
            run += cnt[i];
        }
        if (lane == 31) { offsets[E] = incl; off[E] = incl; n_active[0] = inca; }
    }
    __syncthreads();
    // pass 2: positions, in pair order
    for (int base = p0; base < p1; base += 32) {
        const int p = base + lane;
        int e = p < p1 ? idx[p] : -1;
        if (e < 0 || e >= E) e = -1;
        const unsigned mask = __match_any_sync(FULL, e);
        int start = 0;
        if (e >= 0) start = off[e] + hist[warp][e];
        __syncwarp();
        if (e >= 0) {
            perm[start + __popc(mask & lt)] = p;
            if ((mask & lt) == 0) hist[warp][e] += __popc(mask);
        }
        __syncwarp();
    }
}

// ---------------------------------------------------------------------------------------------------
// NVFP4 row dot products. Weight row r: packed bytes wr[r] (K/2), e4m3 block scales sr[r] (K/16).
// Chunk c = 16 columns 16c..16c+15 = 8 packed bytes (two u32 words, low nibble = even column) + scale byte c.
// Lane handles chunks c = lane, lane+32, ...; within a chunk columns in increasing order, one fp32 FMA each;
// then a butterfly over lanes. The per-(row, token) order depends only on K: independent of TM / group size.
// Decode: e2m1 magnitude -> f16 high byte via PRMT lookup (00 38 3C 3E 40 42 44 46), sign -> bit 15;
// the block scale e4m3 -> f16 with cvt.rn.f16x2.e4m3x2 (exact); q*s in f16 is exact (checkpoint.md section 1),
// then converted to fp32 and FMA'd with the bf16 activation (exact in fp32) into the fp32 accumulator.

__device__ __forceinline__ __half2 e4m3_to_half2_lo(uint32_t byte) {
    // scale byte in the low byte of a 16-bit pair -> f16x2 (low half = the scale); broadcast the low half
    uint32_t out;
    const unsigned short in = (unsigned short)(byte & 0xffu);
    asm("{\n\t.reg .b16 a;\n\tmov.b16 a, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, a;\n\t}" : "=r"(out) : "h"(in));
    __half2 h2 = *reinterpret_cast<__half2*>(&out);
    return __low2half2(h2);
}

// 4 codes (16 bits: nibbles n0..n3 of w >> 0..15) -> two f16x2: (n0, n1), (n2, n3)
__device__ __forceinline__ void e2m1x4_to_half2(uint32_t w, __half2& a, __half2& b) {
    const uint32_t bytes = __byte_perm(0x3E3C3800u, 0x46444240u, w & 0x7777u);  // lut[n0..n3] in bytes 0..3
    uint32_t ab = __byte_perm(bytes, 0u, 0x1404u);     // [0, lut n0, 0, lut n1]
    uint32_t bb = __byte_perm(bytes, 0u, 0x3424u);     // [0, lut n2, 0, lut n3]
    ab |= ((w << 12) & 0x8000u) | ((w << 24) & 0x80000000u);   // sign of n0 (bit 3) -> 15, n1 (bit 7) -> 31
    bb |= ((w << 4) & 0x8000u) | ((w << 16) & 0x80000000u);    // sign of n2 (bit 11) -> 15, n3 (bit 15) -> 31
    a = *reinterpret_cast<__half2*>(&ab);
    b = *reinterpret_cast<__half2*>(&bb);
}

// decode one chunk (16 values, exact) into float w16[16]
__device__ __forceinline__ void nvfp4_chunk(uint2 packed, uint32_t sbyte, float* w16) {
    const __half2 s = e4m3_to_half2_lo(sbyte);
    const uint32_t words[2] = {packed.x, packed.y};
    #pragma unroll
    for (int q = 0; q < 2; ++q) {
        __half2 p0, p1, p2, p3;
        e2m1x4_to_half2(words[q], p0, p1);
        e2m1x4_to_half2(words[q] >> 16, p2, p3);
        const float2 f0 = __half22float2(__hmul2(p0, s));
        const float2 f1 = __half22float2(__hmul2(p1, s));
        const float2 f2 = __half22float2(__hmul2(p2, s));
        const float2 f3 = __half22float2(__hmul2(p3, s));
        w16[8 * q + 0] = f0.x; w16[8 * q + 1] = f0.y; w16[8 * q + 2] = f1.x; w16[8 * q + 3] = f1.y;
        w16[8 * q + 4] = f2.x; w16[8 * q + 5] = f2.y; w16[8 * q + 6] = f3.x; w16[8 * q + 7] = f3.y;
    }
}

// acc[r][t] = sum_j W_r[j] * xs[t][j] (before the global scale), R rows, TM activation rows in shared
// (xs: TM rows of K bf16, 32-byte aligned rows since K % 16 == 0).
template <int R, int TM>
__device__ __forceinline__ void nvfp4_dot(const uint8_t* const (&wr)[R], const uint8_t* const (&sr)[R],
                                          const bf16* xs, int K, int lane, float (&acc)[R][TM]) {
    #pragma unroll
    for (int r = 0; r < R; ++r)
        #pragma unroll
        for (int t = 0; t < TM; ++t) acc[r][t] = 0.f;
    const int nc = K >> 4;
    for (int c = lane; c < nc; c += 32) {
        uint2 pk[R]; uint32_t sb[R];
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            pk[r] = __ldg((const uint2*)(wr[r] + 8 * c));
            sb[r] = __ldg(sr[r] + c);
        }
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            float w16[16];
            nvfp4_chunk(pk[r], sb[r], w16);
            #pragma unroll
            for (int t = 0; t < TM; ++t) {
                const uint4* xp = (const uint4*)(xs + (size_t)t * K + 16 * c);
                const uint4 xa = xp[0], xb = xp[1];
                const uint32_t xw[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
                float a = acc[r][t];
                #pragma unroll
                for (int q = 0; q < 8; ++q) {
                    a = fmaf(w16[2 * q], bf16_bits_lo(xw[q]), a);
                    a = fmaf(w16[2 * q + 1], bf16_bits_hi(xw[q]), a);
                }
                acc[r][t] = a;
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < R; ++r)
        #pragma unroll
        for (int t = 0; t < TM; ++t) acc[r][t] = warp_sum(acc[r][t]);
}

// global scale, per expert per projection: gsc[(e*3 + proj)*2 + {0,1}] = (mult, div);
// CT: (1, weight_global_scale) -> acc / g ; ModelOpt: (weight_scale_2, 1) -> acc * wsf2. One rounding each.
// explicit _rn intrinsics below: no FMA contraction, so every template variant rounds identically
__device__ __forceinline__ float apply_global(float acc, const float* g2) { return __fdiv_rn(__fmul_rn(acc, g2[0]), g2[1]); }

__device__ __forceinline__ float gelu_tanh_f(float x) {
    const float c = 0.7978845608028654f;   // sqrt(2/pi)
    const float x3 = __fmul_rn(__fmul_rn(__fmul_rn(0.044715f, x), x), x);      // numpy's ((0.044715*x)*x)*x
    const float t = tanhf(__fmul_rn(c, __fadd_rn(x, x3)));
    return __fmul_rn(__fmul_rn(0.5f, x), __fadd_rn(1.0f, t));
}

// ---------------------------------------------------------------------------------------------------
// gate/up: for each grouped position q of expert e (pair p = perm[q], token t = p / k):
//   u[q, n] = bf16( gelu_tanh(gate_e[n] . x[t] / g_gate) * (up_e[n] . x[t] / g_up) )   fp32 math, one rounding.
// grid (ceil(I/8), min(E, P)), block 128: block (bx, j) handles expert active[j] (exits if j >= n_active),
// outputs n = 8*bx + 2*warp + {0,1}; it walks the expert's group in token tiles of 8/4/2/1 (tm <= cap), the
// tile's x rows staged in dynamic shared memory (cap * H bf16). Needs H % 16 == 0.
template <int TM>
__device__ __forceinline__ void gate_up_tile(const bf16* xs, int q0, int n0, int n1, int I, int H, int lane,
                                             const uint8_t* const (&wr)[4], const uint8_t* const (&sr)[4],
                                             const float* gg, const float* gu, bf16* u) {
    float acc[4][TM];
    nvfp4_dot<4, TM>(wr, sr, xs, H, lane, acc);
    #pragma unroll
    for (int t = 0; t < TM; ++t) {
        if (lane == t) {
            const float g0 = apply_global(acc[0][t], gg), g1 = apply_global(acc[1][t], gg);
            const float u0 = apply_global(acc[2][t], gu), u1 = apply_global(acc[3][t], gu);
            bf16* row = u + (size_t)(q0 + t) * I;
            row[n0] = __float2bfloat16_rn(__fmul_rn(gelu_tanh_f(g0), u0));
            if (n1 != n0) row[n1] = __float2bfloat16_rn(__fmul_rn(gelu_tanh_f(g1), u1));
        }
    }
}

template <int CAP>
__device__ __forceinline__ void gate_up_body(
    const bf16* __restrict__ x,          // (T, H) pre_feedforward_layernorm_2(h)
    const int* __restrict__ offsets,     // (E+1,)
    const int* __restrict__ perm,        // (P,)
    const int* __restrict__ active,      // (E,)
    const int* __restrict__ n_active,    // (1,)
    const uint8_t* __restrict__ gw,      // (E, I, H/2)  gate packed
    const uint8_t* __restrict__ gs,      // (E, I, H/16) gate e4m3 scales
    const uint8_t* __restrict__ uw,      // (E, I, H/2)  up packed
    const uint8_t* __restrict__ us,      // (E, I, H/16) up scales
    const float* __restrict__ gsc,       // (E, 3, 2) (mult, div) for gate, up, down
    bf16* __restrict__ u,                // (P, I) grouped order
    int H, int I, int k, int cap)
{
    cap = min(cap, CAP);
    extern __shared__ __align__(16) unsigned char smem_gu[];
    bf16* xs = (bf16*)smem_gu;                                  // (cap, H)
    const int j = blockIdx.y;
    if (j >= n_active[0]) return;
    const int e = active[j];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int n0 = blockIdx.x * 8 + 2 * warp, n1 = n0 + 1;
    const bool live = n0 < I;
    if (!live) n0 = I - 1;
    if (n1 >= I) n1 = n0;
    const size_t rb = (size_t)H / 2, sbz = (size_t)H / 16;
    const size_t eo = (size_t)e * I;
    const uint8_t* const wr[4] = {gw + (eo + n0) * rb, gw + (eo + n1) * rb, uw + (eo + n0) * rb, uw + (eo + n1) * rb};
    const uint8_t* const sr[4] = {gs + (eo + n0) * sbz, gs + (eo + n1) * sbz, us + (eo + n0) * sbz, us + (eo + n1) * sbz};
    const float* gg = gsc + ((size_t)e * 3 + 0) * 2;
    const float* gu = gsc + ((size_t)e * 3 + 1) * 2;
    const int qa = offsets[e], qb = offsets[e + 1];
    for (int q0 = qa; q0 < qb;) {
        const int rem = min(qb - q0, cap);
        const int tm = rem >= 8 ? 8 : rem >= 4 ? 4 : rem >= 2 ? 2 : 1;
        __syncthreads();                                         // previous tile's readers are done
        // stage x rows of the tile: 16-byte copies, row t <- x[perm[q0+t] / k]
        const int v16 = H / 8;
        for (int i = threadIdx.x; i < tm * v16; i += blockDim.x) {
            const int t = i / v16, c = i - t * v16;
            const int tok = perm[q0 + t] / k;
            ((uint4*)(xs + (size_t)t * H))[c] = ((const uint4*)(x + (size_t)tok * H))[c];
        }
        __syncthreads();
        if (live) {
            if (CAP >= 8 && tm == 8) gate_up_tile<(CAP >= 8 ? 8 : 1)>(xs, q0, n0, n1, I, H, lane, wr, sr, gg, gu, u);
            else if (CAP >= 4 && tm == 4) gate_up_tile<(CAP >= 4 ? 4 : 1)>(xs, q0, n0, n1, I, H, lane, wr, sr, gg, gu, u);
            else if (CAP >= 2 && tm == 2) gate_up_tile<(CAP >= 2 ? 2 : 1)>(xs, q0, n0, n1, I, H, lane, wr, sr, gg, gu, u);
            else gate_up_tile<1>(xs, q0, n0, n1, I, H, lane, wr, sr, gg, gu, u);
        }
        q0 += tm;
    }
}

// ---------------------------------------------------------------------------------------------------
// down: for each grouped position q of expert e (pair p = perm[q]):
//   o[p, n] = bf16( (down_e[n] . u[q] / g_down) * weights[p] )   fp32 product, one rounding.
// grid (ceil(H/16), min(E, P)), block 128: outputs n = 16*bx + 4*warp + {0..3}; u tiles (cap * I bf16) in
// dynamic shared. Needs I % 16 == 0.
template <int TM>
__device__ __forceinline__ void down_tile(const bf16* us_, int q0, const int (&n)[4], int H, int lane,
                                          const uint8_t* const (&wr)[4], const uint8_t* const (&sr)[4], int I,
                                          const float* gd, const int* perm, const float* weights, bf16* o) {
    float acc[4][TM];
    nvfp4_dot<4, TM>(wr, sr, us_, I, lane, acc);
    #pragma unroll
    for (int t = 0; t < TM; ++t) {
        if (lane == t) {
            const int p = perm[q0 + t];
            const float w = weights[p];
            bf16* row = o + (size_t)p * H;
            #pragma unroll
            for (int r = 0; r < 4; ++r)
                if (r == 0 || n[r] != n[r - 1]) row[n[r]] = __float2bfloat16_rn(__fmul_rn(apply_global(acc[r][t], gd), w));
        }
    }
}

template <int CAP>
__device__ __forceinline__ void down_body(
    const bf16* __restrict__ u,          // (P, I) grouped order
    const int* __restrict__ offsets,     // (E+1,)
    const int* __restrict__ perm,        // (P,)
    const int* __restrict__ active,      // (E,)
    const int* __restrict__ n_active,    // (1,)
    const uint8_t* __restrict__ dw,      // (E, H, I/2)
    const uint8_t* __restrict__ ds,      // (E, H, I/16)
    const float* __restrict__ gsc,       // (E, 3, 2)
    const float* __restrict__ weights,   // (P,) = (T, k) routing weights
    bf16* __restrict__ o,                // (P, H) pair order
    int H, int I, int cap)
{
    cap = min(cap, CAP);
    extern __shared__ __align__(16) unsigned char smem_dn[];
    bf16* xs = (bf16*)smem_dn;                                  // (cap, I)
    const int j = blockIdx.y;
    if (j >= n_active[0]) return;
    const int e = active[j];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int nb = blockIdx.x * 16 + 4 * warp;
    const bool live = nb < H;
    int n[4];
    #pragma unroll
    for (int r = 0; r < 4; ++r) n[r] = min(nb + r, H - 1);      // clamped rows repeat the last; not stored twice
    const size_t rb = (size_t)I / 2, sbz = (size_t)I / 16;
    const size_t eo = (size_t)e * H;
    const uint8_t* const wr[4] = {dw + (eo + n[0]) * rb, dw + (eo + n[1]) * rb, dw + (eo + n[2]) * rb, dw + (eo + n[3]) * rb};
    const uint8_t* const sr[4] = {ds + (eo + n[0]) * sbz, ds + (eo + n[1]) * sbz, ds + (eo + n[2]) * sbz, ds + (eo + n[3]) * sbz};
    const float* gd = gsc + ((size_t)e * 3 + 2) * 2;
    const int qa = offsets[e], qb = offsets[e + 1];
    for (int q0 = qa; q0 < qb;) {
        const int rem = min(qb - q0, cap);
        const int tm = rem >= 8 ? 8 : rem >= 4 ? 4 : rem >= 2 ? 2 : 1;
        __syncthreads();
        const int v16 = I / 8;
        for (int i = threadIdx.x; i < tm * v16; i += blockDim.x) {
            const int t = i / v16, c = i - t * v16;
            ((uint4*)(xs + (size_t)t * I))[c] = ((const uint4*)(u + (size_t)(q0 + t) * I))[c];
        }
        __syncthreads();
        if (live) {
            if (CAP >= 8 && tm == 8) down_tile<(CAP >= 8 ? 8 : 1)>(xs, q0, n, H, lane, wr, sr, I, gd, perm, weights, o);
            else if (CAP >= 4 && tm == 4) down_tile<(CAP >= 4 ? 4 : 1)>(xs, q0, n, H, lane, wr, sr, I, gd, perm, weights, o);
            else if (CAP >= 2 && tm == 2) down_tile<(CAP >= 2 ? 2 : 1)>(xs, q0, n, H, lane, wr, sr, I, gd, perm, weights, o);
            else down_tile<1>(xs, q0, n, H, lane, wr, sr, I, gd, perm, weights, o);
        }
        q0 += tm;
    }
}

// Entry points: the token-tile cap is a compile-time bound too, so the decode variants (_c1: T == 1) carry
// only the 1-row tile and fewer registers. The per-row arithmetic is the same in every variant (the tile
// size only changes how many rows share the weight loads), so results do not depend on the variant.
#define GATE_UP_ENTRY(NAME, CAP) \
extern "C" __global__ void __launch_bounds__(128) NAME( \
    const bf16* __restrict__ x, const int* __restrict__ offsets, const int* __restrict__ perm, \
    const int* __restrict__ active, const int* __restrict__ n_active, const uint8_t* __restrict__ gw, \
    const uint8_t* __restrict__ gs, const uint8_t* __restrict__ uw, const uint8_t* __restrict__ us, \
    const float* __restrict__ gsc, bf16* __restrict__ u, int H, int I, int k, int cap) { \
    gate_up_body<CAP>(x, offsets, perm, active, n_active, gw, gs, uw, us, gsc, u, H, I, k, cap); }
GATE_UP_ENTRY(moe_gate_up_nvfp4, 8)
GATE_UP_ENTRY(moe_gate_up_nvfp4_c4, 4)
GATE_UP_ENTRY(moe_gate_up_nvfp4_c2, 2)
GATE_UP_ENTRY(moe_gate_up_nvfp4_c1, 1)

#define DOWN_ENTRY(NAME, CAP) \
extern "C" __global__ void __launch_bounds__(128) NAME( \
    const bf16* __restrict__ u, const int* __restrict__ offsets, const int* __restrict__ perm, \
    const int* __restrict__ active, const int* __restrict__ n_active, const uint8_t* __restrict__ dw, \
    const uint8_t* __restrict__ ds, const float* __restrict__ gsc, const float* __restrict__ weights, \
    bf16* __restrict__ o, int H, int I, int cap) { \
    down_body<CAP>(u, offsets, perm, active, n_active, dw, ds, gsc, weights, o, H, I, cap); }
DOWN_ENTRY(moe_down_nvfp4, 8)
DOWN_ENTRY(moe_down_nvfp4_c4, 4)
DOWN_ENTRY(moe_down_nvfp4_c2, 2)
DOWN_ENTRY(moe_down_nvfp4_c1, 1)

// ---------------------------------------------------------------------------------------------------
// combine: out[t, n] = bf16( sum over token t's slots, in increasing EXPERT index (the numpy reference's
// order: experts visited in index order), of f32(o[t*k+s, n]) ), fp32 sum starting from 0. Slots whose expert
// is outside [0, E) are skipped. grid (T, ceil(H/256)), block 256; k <= 16.
extern "C" __global__ void __launch_bounds__(256) moe_combine_bf16(
    const bf16* __restrict__ o,          // (P, H)
    const int* __restrict__ idx,         // (T, k)
    bf16* __restrict__ out,              // (T, H)
    int T, int H, int k, int E)
{
    __shared__ int order[RK_MAXK];
    __shared__ int nvalid;
    const int t = blockIdx.x;
    if (threadIdx.x == 0) {
        // selection by expert index (k tiny); experts of one token are distinct
        int cnt = 0, last = -1;
        for (int r = 0; r < k; ++r) {
            int best = -1, be = 0x7fffffff;
            for (int s = 0; s < k; ++s) {
                const int e = idx[(size_t)t * k + s];
                if (e >= 0 && e < E && e > last && e < be) { be = e; best = s; }
            }
            if (best < 0) break;
            order[cnt++] = best; last = be;
        }
        nvalid = cnt;
    }
    __syncthreads();
    const int n = blockIdx.y * blockDim.x + threadIdx.x;
    if (n >= H) return;
    float acc = 0.f;
    for (int r = 0; r < nvalid; ++r)
        acc += __bfloat162float(o[((size_t)t * k + order[r]) * H + n]);
    out[(size_t)t * H + n] = __float2bfloat16_rn(acc);
}
