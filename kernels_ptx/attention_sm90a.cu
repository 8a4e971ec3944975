// The fused prefill attention on wgmma (sm_90a): attn_fused_wg_bf16_d256 (the sliding layers) and
// attn_fused_wg_bf16_d512 (the full layers), the bytes of attention.cu's attn_fused_bf16_d256 / _d512 (its header
// states the arithmetic) at a higher rate. d256, 2,048-token sliding prefill on the H200: 255.4 -> 207.7 us
// (2026-11-30, BENCHMARKS.md fifteenth session); then 207.6 -> 194.9 us with K and V handed over apart, and -> 193.3
// us with S issued a chunk ahead (507 tokens: 33.4 -> 32.2 us; graph-replayed, nineteenth session); then 193.7 ->
// 148.6 us (507 tokens: 32.2 -> 25.5 us) with a loader that reads a chunk's 4 block numbers once for its K and V and
// copies whole chunks without predicates (twenty-third session). d512 (the same session, same call): 2,048-token full
// prefill 751.7 -> 398.5 us against attn_fused_bf16_d512, 1,024 tokens 207.6 -> 125.1, 507 tokens 63.5 -> 53.0.
// Twenty-seventh session: next_pass warp-collective and the descriptors stepped by one add (desc_step; the d256
// tile 4,800 -> 3,592 SASS instructions): d256 2,048 tokens 148.1 -> 131.9 us, 508 25.4 -> 22.1; d512 395.5 -> 385.9,
// 52.5 -> 50.8. Measured and not kept (BENCHMARKS.md): each compute warpgroup computing S over the whole chunk
// (no row-max / row-sum exchange, P kept in registers) and a loader that hands stages over with
// cp.async.mbarrier.arrive.noinc, alone or together: no faster (ncu: the compute warps' per-chunk instruction chain
// binds, ~750 SASS instructions a warp a chunk, 2 compute warps a scheduler; not the loads, not the exchange).
//
// `_slots` forms of both (twenty-fifth session) store the output rows in x16_bf16's slot order for o_proj's `_ss`
// launch (store_unit_slots), which then needs no x16_bf16 copy of them.
//
// Same tile, other work split. A CTA takes 64 query rows (RP = 64 / G positions of one kv head) and walks the same
// chunks in the same passes, for DV = 256 columns of the output: all of them at d256, half blockIdx.z of them at d512
// (two CTAs a tile, each computing the whole S = Q K^T over d 512 and p, and its own half of P.V: the fp32 accumulators
// of 512 columns do not fit two warpgroups' registers). Warpgroups 0 and 1 compute, warpgroup 2 loads:
//   - S = Q K^T: compute warpgroup j takes the 64 rows x keys 32 j .. 32 j + 31 of the chunk (m64n32k16, d ascending
//     16 a step, both operands from shared memory). With 2 K stages (d256), chunk c + 1's S is issued as soon as chunk
//     c's is done, so it runs during chunk c's softmax, P.V and fold (issued after P.V, it had overlapped the fold
//     only, and ptxas serialized the wgmmas for want of registers: C7511). With 1 (d512: the shared memory holds no
//     second 64 KB stage) it is issued after chunk c's P.V, once the loader has had chunk c's softmax to bring K(c + 1).
//   - P.V: warpgroup j takes the 64 rows x columns 128 j .. 128 j + 127 of the CTA's DV over all 64 keys
//     (m64n128k16, keys ascending 16 a step, P from registers, V transposed (MN-major) from shared memory).
//   - the loader (128 threads, setmaxnreg: 56 registers a thread, the compute threads 224) copies Q once, then each
//     chunk's K into one of WKS stages and its V (the CTA's DV columns) into one of WVS (cp.async, zero fill for keys
//     outside the pass's range, as the mma.sync tile), handed over by mbarriers (full: landed and fenced for the tensor
//     cores; empty: both warpgroups done, with K after S, with V after P.V). K and V are apart so that a chunk's S
//     need not wait for its V, nor the next K for this chunk's P.V. (d256 WKS = 3 was slower: 231.4 us, with 208 KB
//     of shared memory.)
// Why the bits are the mma.sync tile's:
//   - each 16-wide k step of a wgmma computes what mma.sync m16n8k16 computes from the same operands (measured before
//     the first wgmma kernel: linear_sm90a.cu's header; A from shared memory and the transposed B here too: every byte
//     equal, test_gpu_attention_wg_matches_mma), and every product chain runs the same steps in the same order from
//     zeroed registers;
//   - the row sum of p keeps the mma.sync tile's order: per key group of its warps (NG = D / 64 groups of 64 / NG
//     keys: 16 at d256, 8 at d512), the lane's 8-key n-tiles in order, the quad butterfly, then the groups 0 .. NG - 1
//     in order (a warpgroup writes its groups' partials apart);
//   - max, the masks, exp, bf16(p), the fold and the final division are the same code (attention_tile.cuh).
// Shared memory: Q and WKS stages of K, each [DQK/64][64 rows][128 B], WVS stages of V [DV/64][64 rows][128 B], with
// the 16-byte pieces of a row's 128 bytes XOR-swizzled by row % 8 (wgmma's 128-byte swizzle; a loader warp copies
// whole rows, whole lines both sides: the unswizzled core-matrix layout split every copy into 32-byte requests and ran
// at 316 us), P as [64 rows][144 B] (ldmatrix), row maxima [2][64], row sum partials [NG][64], per position lo, hi,
// seq, and the 2 (WKS + WVS) mbarriers: d256 175,424 bytes, d512 209,200 (layers/attention.py attention_smem(D, 4,
// wg=True)); the base must be 1024-byte aligned.
#include "pdl.cuh"
#include "attention_tile.cuh"
#include "wgmma.cuh"

#define WROWS 64                                // query rows per CTA (one wgmma M)
#define WNT 256                                 // threads: 2 warpgroups
#define WDV 256                                 // output columns per CTA: 128 a compute warpgroup
#define WATOM (WROWS * 128)                     // bytes of 64 d values of a K / V / Q tile: 64 rows x 128 B
#define WPROW (2 * CHUNK + 16)                  // bytes per P row
#define WVS 2                                   // V stages
#define WLT 128                                 // loader threads: warpgroup 2, after the 2 compute warpgroups
#define WREG_LOAD 56                            // registers a thread (setmaxnreg): the loader gives, the compute takes
#define WREG_COMPUTE 224

// The tile's shape by head_dim D: K stages, key groups of the row sum, shared-memory layout.
template <int D> struct WgCfg {
    static_assert(D == 256 || D == 512, "the wgmma tile: head_dim 256 or 512");
    static constexpr int WKS = D == 256 ? 2 : 1;                 // K stages
    static constexpr int NG = D / 64;                            // key groups of the row sum (the mma.sync tile's warps)
    static constexpr int NH = D / WDV;                           // CTAs a tile (output column halves)
    static constexpr int QTILE = D / 64 * WATOM, VTILE = WDV / 64 * WATOM;
    static constexpr int KS = QTILE, VS = KS + WKS * QTILE, PS = VS + WVS * VTILE;   // offsets in shared memory
    static constexpr int RMAX = PS + WROWS * WPROW, RSUM = RMAX + 2 * WROWS * 4, POS = RSUM + NG * WROWS * 4;
    static constexpr int BARS = POS + 3 * WROWS * 4, SMEM = BARS + 2 * (WKS + WVS) * 8;
};
// mbarriers: K full [WKS], V full [WVS], K empty [WKS], V empty [WVS]
template <int WKS> __device__ __forceinline__ uint32_t wg_fk(uint32_t bars, int st) { return bars + 8 * st; }
template <int WKS> __device__ __forceinline__ uint32_t wg_fv(uint32_t bars, int st) { return bars + 8 * (WKS + st); }
template <int WKS> __device__ __forceinline__ uint32_t wg_ek(uint32_t bars, int st) {
    return bars + 8 * (WKS + WVS + st);
}
template <int WKS> __device__ __forceinline__ uint32_t wg_ev(uint32_t bars, int st) {
    return bars + 8 * (2 * WKS + WVS + st);
}

// x, opaque to the optimizer (not hoisted out of a loop)
__device__ __forceinline__ uint32_t opaque_u32(uint32_t x) {
    asm volatile("" : "+r"(x));
    return x;
}

// piece i of a 64-row tile of PPR 16-byte pieces a row: row i / PPR, piece i % PPR, stored at [piece / 8][row][128 B]
// with the 8 pieces of a row's 128 bytes XOR-swizzled by row % 8 (the wgmma 128-byte swizzle of a 1024-byte aligned
// atom of 8 rows)
template <int PPR> __device__ __forceinline__ uint32_t wg_dst(int i) {
    const int row = i / PPR, pc = i % PPR;
    return (pc >> 3) * WATOM + row * 128 + (((pc & 7) ^ (row & 7)) << 4);
}

// One chunk's rows of PPR pieces (K: D / 8, V: WDV / 8) into the stage at shared address sd: loader thread lt copies
// piece pc = lt % PPR of rows w + RS it (w = lt / PPR, RS = WLT / PPR rows a step), i.e. row w + RS r of the chunk's
// KV block b = it / (16 / RS), r = it % (16 / RS), from blk[b] (its block number: read once a chunk, shared by K and
// V; -1: no key of the block in range, not read); in the stage at wg_dst<PPR>(lt + WLT it) = dst0[it % (8 / RS)] +
// RS 128 (it - it % (8 / RS)) (row w + RS it's swizzle term is (w + RS it) % 8, which repeats every 8 / RS steps;
// dst0: wg_dst_table). col: the byte offset of the row's first copied column; rb: bytes a pool row. Keys outside
// [kmin, kmax] are zeros, not read; a chunk whole in range copies without a predicate (the test outside the loops:
// inside, ptxas predicated both forms of every piece).
template <int PPR> struct WgPieces {
    static constexpr int RS = WLT / PPR, SPB = KV_BLOCK / RS, NS = 8 / RS;   // rows a step, steps a block, swizzles
    static_assert(WLT % PPR == 0 && KV_BLOCK % RS == 0 && 8 % RS == 0, "the loader's piece map");
};
template <int PPR> __device__ __forceinline__ void wg_dst_table(uint32_t (&dst0)[WgPieces<PPR>::NS]) {
    const int lt = threadIdx.x - WNT;
#pragma unroll
    for (int h = 0; h < WgPieces<PPR>::NS; h++) dst0[h] = wg_dst<PPR>(lt + WLT * h);
}
template <int PPR>
__device__ __forceinline__ void wg_chunk(uint32_t sd, const uint32_t (&dst0)[WgPieces<PPR>::NS],
                                         const __nv_bfloat16* __restrict__ pool, size_t col, size_t rb,
                                         const int (&blk)[CHUNK / KV_BLOCK], int c, int kmin, int kmax) {
    constexpr int RS = WgPieces<PPR>::RS, SPB = WgPieces<PPR>::SPB, NS = WgPieces<PPR>::NS;
    const int lt = threadIdx.x - WNT, w = lt / PPR, pc = lt % PPR;
    const uint8_t* src = reinterpret_cast<const uint8_t*>(pool);
    const size_t piece = col + 16 * pc;
    auto dst = [&](int it) { return sd + dst0[it % NS] + RS * 128 * (it - it % NS); };
    if (c * CHUNK >= kmin && c * CHUNK + CHUNK - 1 <= kmax) {
#pragma unroll
        for (int b = 0; b < CHUNK / KV_BLOCK; b++) {
            const uint8_t* p = src + ((size_t)blk[b] * KV_BLOCK + w) * rb + piece;
#pragma unroll
            for (int r = 0; r < SPB; r++, p += RS * rb) cp_async16(dst(b * SPB + r), p, true);
        }
    } else {
        const int lo = kmin - (c * CHUNK + w), hi = kmax - (c * CHUNK + w);   // row w + k is in range: lo <= k <= hi
#pragma unroll
        for (int b = 0; b < CHUNK / KV_BLOCK; b++) {
            const uint8_t* p = src + (blk[b] >= 0 ? ((size_t)blk[b] * KV_BLOCK + w) * rb + piece : 0);
#pragma unroll
            for (int r = 0; r < SPB; r++, p += RS * rb) {
                const bool ok = b * KV_BLOCK + RS * r >= lo && b * KV_BLOCK + RS * r <= hi;
                cp_async16(dst(b * SPB + r), ok ? p : src, ok);
            }
        }
    }
    cp_async_commit();
}

// The loader warps: Q once, then every chunk's K into stage m % WKS and its V into stage m % WVS (m counts the
// tile's chunks over its passes), each once the compute warps have freed it (empty: K after S, V after P.V), handed
// over (full) once landed and fenced for the tensor cores. K and V are separate cp.async groups, K first, so that a
// chunk's S can start while its V is still on the way: chunk m's K is handed over once V(m) is issued, V(m) once
// K(m + 1) is (the groups land in order).
template <int D>
__device__ __forceinline__ void wg_load(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_pool,
                                        const __nv_bfloat16* __restrict__ v_pool, const int* __restrict__ block_tables,
                                        int max_blocks, int row0, int lr0, int Hq, int Hkv, int G, int RP,
                                        const int* p_lo, const int* p_hi, const int* p_seq, uint8_t* Qs, uint8_t* Ks,
                                        uint8_t* Vs, uint32_t bars) {
    using C = WgCfg<D>;
    constexpr int WKS = C::WKS, QPPR = D / 8;
    const int lt = threadIdx.x - WNT, kvh = blockIdx.y;
    const size_t HD = (size_t)Hkv * D;
#pragma unroll 4
    for (int it = 0; it < WROWS * QPPR / WLT; it++) {         // Q: row m = position pi * G + hl; unused rows 0
        const int idx = lt + it * WLT, m = idx / QPPR, pc = idx % QPPR, pi = m / G;
        const bool ok = m < RP * G && p_seq[pi] >= 0;
        const __nv_bfloat16* src = ok ? q + ((size_t)(row0 + lr0 + pi) * Hq + kvh * G + m % G) * D + 8 * pc : q;
        cp_async16(Qs + wg_dst<QPPR>(idx), src, ok);
    }
    const size_t rb = 2 * HD, kcol = 2 * (size_t)kvh * D, vcol = kcol + 2 * (size_t)blockIdx.z * WDV;
    const uint32_t ks = smem_u32(Ks), vs = smem_u32(Vs);
    uint32_t kdst[WgPieces<D / 8>::NS], vdst[WgPieces<WDV / 8>::NS];
    wg_dst_table<D / 8>(kdst);
    wg_dst_table<WDV / 8>(vdst);
    uint32_t m = 0;
    unsigned long long done = 0;
    int seq, kmin, kmax;
    while (next_pass(done, p_seq, p_lo, p_hi, RP, seq, kmin, kmax)) {
        const int* __restrict__ bt = block_tables + (size_t)seq * max_blocks;
        for (int c = kmin / CHUNK; c <= kmax / CHUNK; c++, m++) {
            int blk[CHUNK / KV_BLOCK];                          // the chunk's block numbers (-1: none in range)
#pragma unroll
            for (int b = 0; b < CHUNK / KV_BLOCK; b++) {
                const int k0 = c * CHUNK + b * KV_BLOCK;
                blk[b] = k0 + KV_BLOCK - 1 >= kmin && k0 <= kmax ? bt[k0 / KV_BLOCK] : -1;
            }
            if (m >= WKS) mbar_wait(wg_ek<WKS>(bars, m % WKS), ((m / WKS) & 1) ^ 1);
            wg_chunk<D / 8>(ks + (m % WKS) * C::QTILE, kdst, k_pool, kcol, rb, blk, c, kmin, kmax);
            if (m > 0) {                                        // V(m - 1) landed (K(m) may not have)
                cp_async_wait<1>();
                fence_proxy_async();
                mbar_arrive(wg_fv<WKS>(bars, (m - 1) % WVS));
            }
            if (m >= WVS) mbar_wait(wg_ev<WKS>(bars, m % WVS), ((m / WVS) & 1) ^ 1);
            wg_chunk<WDV / 8>(vs + (m % WVS) * C::VTILE, vdst, v_pool, vcol, rb, blk, c, kmin, kmax);
            cp_async_wait<1>();                                 // K(m) (and Q) landed (V(m) may not have)
            fence_proxy_async();
            mbar_arrive(wg_fk<WKS>(bars, m % WKS));
        }
    }
    cp_async_wait<0>();                                         // the last V (or Q alone, when the tile has no chunk)
    fence_proxy_async();
    if (m > 0) mbar_arrive(wg_fv<WKS>(bars, (m - 1) % WVS));
}

// The lane's 8 output pairs of one 64-column unit of a row (pair(n) = columns 8n + 2 qd, + 1 as bf16x2 bits; the
// quad's 4 lanes hold the row's 64) stored in x16_bf16's slot order (slots.cuh), so that o_proj's `_ss` launch takes
// the output as its X without an x16_bf16 copy (the `_slots` kernels; layers.attention.attention_gpu out_slots). In
// that order 32-byte sector j = 2a + hf of the unit is columns 4 hf .. 4 hf + 3 of blocks a, a + 2, a + 4, a + 6:
// the pairs of lanes 2 hf and 2 hf + 1, which trade two words so that each stores 16 bytes of it (a 4-byte store
// per pair, each at its slot, wrote 8-byte pieces: the d256 kernel 3.82 -> 4.04 ms a 2,048-token prefill). Every
// lane of the warp calls it (shuffles); on: whether this lane's row is stored.
template <class Pair>
__device__ __forceinline__ void store_unit_slots(__nv_bfloat16* unit, int qd, bool on, Pair pair) {
    const int hf = qd >> 1, p = qd & 1;
#pragma unroll
    for (int a = 0; a < 2; a++) {               // lane p stores words 4p .. 4p + 3 of the sector's 8
        const uint32_t w0 = pair(a), w2 = pair(a + 2), w4 = pair(a + 4), w6 = pair(a + 6);
        const uint32_t r0 = __shfl_xor_sync(0xffffffffu, p ? w0 : w4, 1);
        const uint32_t r1 = __shfl_xor_sync(0xffffffffu, p ? w2 : w6, 1);
        const uint4 v = p ? make_uint4(r0, w4, r1, w6) : make_uint4(w0, r0, w2, r1);
        if (on) *reinterpret_cast<uint4*>(unit + 16 * (2 * a + hf) + 8 * p) = v;
    }
}
__device__ __forceinline__ uint32_t bf162_bits(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }

template <int D, bool SLOTS> __device__ __forceinline__ void wg_tile(ATTN_ARGS) {
    using C = WgCfg<D>;
    constexpr int WKS = C::WKS, NG = C::NG;
    extern __shared__ __align__(1024) uint8_t smem[];          // (the swizzle needs 1024-byte aligned atoms)
    uint8_t* Qs = smem;                                        // [D/64][64 rows][128 B], swizzled (wg_dst)
    uint8_t* Ks = smem + C::KS;                                // WKS stages, the same layout
    uint8_t* Vs = smem + C::VS;                                // WVS stages, [WDV/64][64 rows][128 B]
    uint8_t* Ps = smem + C::PS;                                // [64 rows][WPROW]
    float* red_max = reinterpret_cast<float*>(smem + C::RMAX); // [2 warpgroups][64 rows]
    float* red_sum = reinterpret_cast<float*>(smem + C::RSUM); // [NG key groups][64 rows]
    int* p_lo = reinterpret_cast<int*>(smem + C::POS);         // [64] per position of the tile
    int* p_hi = p_lo + WROWS;
    int* p_seq = p_hi + WROWS;                                 // -1: past the launch's rows
    const uint32_t bars = smem_u32(smem + C::BARS);            // wg_fk .. wg_ev (8 bytes each)

    if (threadIdx.x == 0 && (smem_u32(smem) & 1023)) __trap();   // loudly: the swizzle would read other bytes
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int j = warp >> 2, w = warp & 3, g = lane >> 2, qd = lane & 3;
    const int G = Hq / Hkv, kvh = blockIdx.y, RP = WROWS / G;
    const int lr0 = (int)(gridDim.x - 1 - blockIdx.x) * RP;   // the last tiles (the most chunks) first
    const float NEG = -__int_as_float(0x7f800000);

    if (tid < RP) tile_position(tid, lr0, row0, nrows, rows_seq, rows_pos, spans, n_spans, window, sliding, p_lo, p_hi,
                                p_seq);
    if (tid < WKS) {
        mbar_init(wg_fk<WKS>(bars, tid), WLT);                 // full: the loader's threads
        mbar_init(wg_ek<WKS>(bars, tid), WNT / 32);            // empty: the 8 compute warps
    }
    if (tid < WVS) {
        mbar_init(wg_fv<WKS>(bars, tid), WLT);
        mbar_init(wg_ev<WKS>(bars, tid), WNT / 32);
    }
    __syncthreads();
    if (tid >= WNT) {
        regs_dec<WREG_LOAD>();
        wg_load<D>(q, k_pool, v_pool, block_tables, max_blocks, row0, lr0, Hq, Hkv, G, RP, p_lo, p_hi, p_seq, Qs, Ks,
                   Vs, bars);
        return;
    }

    regs_inc<WREG_COMPUTE>();
    int rpi[2], rh[2];                                         // this lane's rows 16 w + g (+ 8)
    bool rok[2];
#pragma unroll
    for (int rr = 0; rr < 2; rr++) tile_row(16 * w + g + 8 * rr, RP, G, kvh, p_seq, rok[rr], rpi[rr], rh[rr]);
    float M[2] = {NEG, NEG}, L[2] = {0.f, 0.f};
    float A[64];                                               // A[4n + i]: row (+ 8 if i >= 2), column
                                                               // 128 j + 8n + 2qd + (i & 1) of the CTA's WDV
#pragma unroll
    for (int i = 0; i < 64; i++) A[i] = 0.f;
    const uint32_t ks_base = smem_u32(Ks), vs_base = smem_u32(Vs), qs_addr = smem_u32(Qs);

    uint32_t m = 0;
    unsigned long long done = 0;
    int seq, kmin, kmax;
    while (next_pass(done, p_seq, p_lo, p_hi, RP, seq, kmin, kmax)) {
        bool ract[2];
        int rlo[2], rhi[2];
        pass_rows(rok, rpi, seq, p_seq, p_lo, p_hi, ract, rlo, rhi);
        const int cb = kmin / CHUNK, ce = kmax / CHUNK;
        float s[16], sn[16];
        // S of chunk m into t (K stage m % WKS, once landed): rows 0..63 x keys 32 j + 8n + 2qd (+1), n = 0..3; D / 16
        // steps of 16 d, committed as one group.
        auto issue_s = [&](float (&t)[16], uint32_t mm) {
            mbar_wait(wg_fk<WKS>(bars, mm % WKS), (mm / WKS) & 1);     // K (and Q) landed
            // (one K stage: the bases pass an empty asm each time, else they are loop-invariant and ptxas kept every
            // step's descriptors live across the loop, 2 x 64 registers at d512, and spilled)
            const uint32_t qa = WKS == 1 ? opaque_u32(qs_addr) : qs_addr;
            const uint32_t ka = ks_base + (mm % WKS) * C::QTILE + 32 * j * 128;
            const uint32_t kb = WKS == 1 ? opaque_u32(ka) : ka;
#pragma unroll
            for (int i = 0; i < 16; i++) t[i] = 0.f;
            wg_fence();
            fence_acc(t);
            const uint64_t da = sw_desc(qa, 16, 1024), db = sw_desc(kb, 16, 1024);
#pragma unroll
            for (int ks = 0; ks < D / 16; ks++)
                wgmma_ss<32>(t, desc_step(da, (ks >> 2) * WATOM + (ks & 3) * 32),
                             desc_step(db, (ks >> 2) * WATOM + (ks & 3) * 32));
            wg_commit();
            fence_acc(t);
        };
        issue_s(s, m);
        for (int c = cb; c <= ce; c++, m++) {
            const uint32_t vs_addr = vs_base + (m % WVS) * C::VTILE;
            wg_wait<0>();                                       // S(c) done (nothing else is pending)
            fence_acc(s);
            if (lane == 0) mbar_arrive(wg_ek<WKS>(bars, m % WKS));   // this warp is done with K stage m % WKS
            if (WKS > 1 && c < ce) issue_s(sn, m + 1);          // S(c + 1) now (2 K stages; 1: after P.V below)

            // mask (select) and row max over this warpgroup's 32 keys
            float mx[2] = {NEG, NEG};
#pragma unroll
            for (int n = 0; n < 4; n++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int rr = i >> 1, jj = c * CHUNK + 32 * j + 8 * n + 2 * qd + (i & 1);
                    const bool v = ract[rr] && jj >= rlo[rr] && jj <= rhi[rr];
                    s[4 * n + i] = v ? s[4 * n + i] : NEG;
                    mx[rr] = fmaxf(mx[rr], s[4 * n + i]);
                }
#pragma unroll
            for (int rr = 0; rr < 2; rr++) {
                mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(0xffffffffu, mx[rr], 1));
                mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(0xffffffffu, mx[rr], 2));
            }
            if (qd == 0) {
                red_max[j * WROWS + 16 * w + g] = mx[0];
                red_max[j * WROWS + 16 * w + g + 8] = mx[1];
            }
            bar_sync<1, WNT>();                                 // both warpgroups' maxima visible

            // --- m = max of the two; p = bf16(exp(s - m)) -> Ps; l partials per key group of NG: the lane's 8-key
            //     n-tiles of the group in order, then the quad butterfly ---
            float mrow[2];
#pragma unroll
            for (int rr = 0; rr < 2; rr++)
                mrow[rr] = fmaxf(red_max[16 * w + g + 8 * rr], red_max[WROWS + 16 * w + g + 8 * rr]);
            {
                constexpr int TPG = 8 / NG;                     // the lane's n-tiles a group (of its 4): 2 or 1
                uint8_t* pw = Ps + (16 * w + g) * WPROW + 2 * (32 * j + 2 * qd);
#pragma unroll
                for (int rr = 0; rr < 2; rr++) {
                    const float ms = mrow[rr] == NEG ? 0.f : mrow[rr];
                    float lsum[4 / TPG];
#pragma unroll
                    for (int h = 0; h < 4 / TPG; h++) lsum[h] = 0.f;
#pragma unroll
                    for (int n = 0; n < 4; n++) {
                        const float p0 = exp_fixed(__fsub_rn(s[4 * n + 2 * rr], ms));
                        const float p1 = exp_fixed(__fsub_rn(s[4 * n + 2 * rr + 1], ms));
                        const __nv_bfloat162 pb = __floats2bfloat162_rn(p0, p1);
                        *reinterpret_cast<__nv_bfloat162*>(pw + rr * 8 * WPROW + 16 * n) = pb;
                        const float2 pf = __bfloat1622float2(pb);
                        lsum[n / TPG] = __fadd_rn(lsum[n / TPG], __fadd_rn(pf.x, pf.y));
                    }
#pragma unroll
                    for (int h = 0; h < 4 / TPG; h++) {
                        lsum[h] = __fadd_rn(lsum[h], __shfl_xor_sync(0xffffffffu, lsum[h], 1));
                        lsum[h] = __fadd_rn(lsum[h], __shfl_xor_sync(0xffffffffu, lsum[h], 2));
                        if (qd == 0) red_sum[(NG / 2 * j + h) * WROWS + 16 * w + g + 8 * rr] = lsum[h];
                    }
                }
            }
            bar_sync<2, WNT>();                                 // P and the sums visible
            float lrow[2];
#pragma unroll
            for (int rr = 0; rr < 2; rr++) {
                const int r = 16 * w + g + 8 * rr;
                float v = red_sum[r];
#pragma unroll
                for (int h = 1; h < NG; h++) v = __fadd_rn(v, red_sum[h * WROWS + r]);
                lrow[rr] = v;
            }

            // --- acc = P V: rows 0..63 x columns 128 j + 8n + 2qd (+1), n = 0..15; 4 steps of 16 keys ---
            float o[64];
#pragma unroll
            for (int i = 0; i < 64; i++) o[i] = 0.f;
            {
                const uint8_t* pa = Ps + (16 * w + (lane & 15)) * WPROW + 16 * (lane >> 4);
                uint32_t a[CHUNK / 16][4];
#pragma unroll
                for (int ks = 0; ks < CHUNK / 16; ks++) ldsm_x4(a[ks], pa + 32 * ks);
                mbar_wait(wg_fv<WKS>(bars, m % WVS), (m / WVS) & 1);     // V landed
                wg_fence();
                fence_acc(o);
                const uint64_t dv = sw_desc(vs_addr + 2 * j * WATOM, WATOM, 1024);
#pragma unroll
                for (int ks = 0; ks < CHUNK / 16; ks++) wgmma_n<128, 1>(o, a[ks], desc_step(dv, 16 * ks * 128));
                wg_commit();
                fence_acc(o);
            }
            if (WKS == 1 && c < ce) issue_s(sn, m + 1);         // 1 K stage: S(c + 1) beside P.V(c) (waited for
            wg_wait<0>();                                       // here: a wgmma still in flight across the loop's
            fence_acc(o);                                       // back edge made ptxas serialize them all, C7511)
            fence_acc(sn);                                      // P.V(c) done, and S(c + 1)
            if (lane == 0) mbar_arrive(wg_ev<WKS>(bars, m % WVS));   // this warp is done with V stage m % WVS
#pragma unroll
            for (int rr = 0; rr < 2; rr++) {                    // fold into the running state
                if (!(ract[rr] && c >= rlo[rr] / CHUNK && c <= rhi[rr] / CHUNK)) continue;
                const FoldW fw = fold_weights(M[rr], L[rr], mrow[rr], lrow[rr]);
#pragma unroll
                for (int n = 0; n < 16; n++) {
                    A[4 * n + 2 * rr] = fold_acc(A[4 * n + 2 * rr], o[4 * n + 2 * rr], fw);
                    A[4 * n + 2 * rr + 1] = fold_acc(A[4 * n + 2 * rr + 1], o[4 * n + 2 * rr + 1], fw);
                }
            }
#pragma unroll
            for (int i = 0; i < 16; i++) s[i] = sn[i];          // S(c + 1) (unused after the pass's last chunk)
        }
    }

#pragma unroll
    for (int rr = 0; rr < 2; rr++) {                            // out = A / L (NaN: more chunks than max_slots)
        if (SLOTS) {                                            // every lane: store_unit_slots shuffles
            const int pi = rpi[rr];                             // 0 where !rok: a valid index
            const bool bad = p_hi[pi] / CHUNK - p_lo[pi] / CHUNK + 1 > max_slots;
            __nv_bfloat16* op = out + ((size_t)(row0 + lr0 + pi) * Hq + rh[rr]) * D + WDV * blockIdx.z + 128 * j;
#pragma unroll
            for (int u = 0; u < 2; u++)                         // the two 64-column units
                store_unit_slots(op + 64 * u, qd, rok[rr], [&](int n) {
                    const int i = 4 * (8 * u + n) + 2 * rr;
                    return bf162_bits(out_pair(A[i], A[i + 1], L[rr], bad));
                });
            continue;
        }
        if (!rok[rr]) continue;
        const int pi = rpi[rr];
        const bool bad = p_hi[pi] / CHUNK - p_lo[pi] / CHUNK + 1 > max_slots;
        __nv_bfloat16* op = out + ((size_t)(row0 + lr0 + pi) * Hq + rh[rr]) * D + WDV * blockIdx.z + 128 * j + 2 * qd;
#pragma unroll
        for (int n = 0; n < 16; n++) {
            *reinterpret_cast<__nv_bfloat162*>(op + 8 * n) =
                out_pair(A[4 * n + 2 * rr], A[4 * n + 2 * rr + 1], L[rr], bad);
        }
    }
}

// attn_fused_wg_bf16_d{D}: grid (ceil(nrows / (64 / G)), Hkv, D / 256), block WNT + WLT (384), dynamic smem
// WgCfg<D>::SMEM; attn_fused_bf16_d{D}'s arguments. `_slots`: out's rows in x16_bf16's slot order (store_unit_slots).
#define ATTN_WG(NAME, D, SLOTS)                                                                                 \
    extern "C" __global__ void __launch_bounds__(WNT + WLT, 1) NAME(ATTN_ARGS) {                                \
        pdl_entry();                                                                                            \
        wg_tile<D, SLOTS>(ATTN_PASS);                                                                           \
    }
ATTN_WG(attn_fused_wg_bf16_d256, 256, false)
ATTN_WG(attn_fused_wg_bf16_d512, 512, false)
ATTN_WG(attn_fused_wg_bf16_d256_slots, 256, true)
ATTN_WG(attn_fused_wg_bf16_d512_slots, 512, true)
