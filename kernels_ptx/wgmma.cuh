// Hopper warpgroup MMA (wgmma, sm_90a) pieces shared by linear_sm90a.cu and moe_sm90a.cu: the fences, commit and
// wait, and m64nNk16 bf16 -> fp32 with A (64 x 16) from registers and B (16 x N) from shared memory at a descriptor;
// the shared-memory barriers (mbarrier), named barriers and register reallocation of warp-specialized kernels.
#pragma once
#include <stdint.h>

__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// mbarrier at shared-window address `bar`: init with the arrival count of a phase; arrive (release); wait until the
// phase of parity `parity` has completed (acquire; a fresh barrier counts its phase "before 0", parity 1, as done).
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    asm volatile(
        "{\n.reg .pred p;\nMBAR_WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra MBAR_WAIT;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
// Named barrier `id` (1..15; 0 is __syncthreads) over `n` threads: sync waits, arrive does not.
template <int ID, int N> __device__ __forceinline__ void bar_sync() {
    asm volatile("bar.sync %0, %1;\n" ::"n"(ID), "n"(N) : "memory");
}
template <int ID, int N> __device__ __forceinline__ void bar_arrive() {
    asm volatile("bar.arrive %0, %1;\n" ::"n"(ID), "n"(N) : "memory");
}
// Per-thread register budget of the calling warpgroup (multiple of 8): the producer gives registers back, the
// consumers take them.
template <int R> __device__ __forceinline__ void regs_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
}
template <int R> __device__ __forceinline__ void regs_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
}

// stmatrix of 4 / 2 transposed 8 x 8 b16 matrices to shared-window addresses (lanes 8 i .. 8 i + 7 give matrix i's 8
// line addresses; register i is matrix i's fragment, as an mma / wgmma D fragment packed to bf16x2): the epilogues
// that put a tile's outputs token-major into shared memory (linear_sm90a.cu ws_store_tile, moe_sm90a.cu's down).
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t a, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(a), "r"(r0),
                 "r"(r1), "r"(r2), "r"(r3) : "memory");
}
__device__ __forceinline__ void stmatrix_x2_trans(uint32_t a, uint32_t r0, uint32_t r1) {
    asm volatile("stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [%0], {%1, %2};\n" ::"r"(a), "r"(r0), "r"(r1)
                 : "memory");
}
// 16 bytes from a shared-window address (the same epilogues read their lines back).
__device__ __forceinline__ uint4 lds128(uint32_t a) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
    return v;
}

// The compiler must not move reads or writes of the accumulators across a wgmma issue / wait.
template <int R> __device__ __forceinline__ void fence_acc(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// d (64 x N tile of the warpgroup, fp32, N / 2 per thread) += A (64 x 16, registers) * B (16 x N, shared at desc).
// Defined for N = 8, 16, .., 64 (the expert kernels run a tile's tokens rounded up to 8) and 128. Lane l of warp w
// of the warpgroup holds d[4n + i] = row 16 w + l / 4 (+ 8 for i >= 2), column 8n + 2 (l % 4) + (i & 1), whatever N.
// TB = 1 (N = 128 only): B is MN-major (transposed) in shared memory: the attention's V, N (d) contiguous per key.
// One macro line per N: inline-asm operand lists are literal, so each names its N / 2 accumulators (%0 ..), then A's
// four registers and the descriptor that follow them.
template <int N, int TB = 0>
__device__ __forceinline__ void wgmma_n(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc);
#define WG_D4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define WGMMA_BF16_TB(N, TB, D_REGS, A_DESC, ...)                                                                      \
    template <> __device__ __forceinline__ void wgmma_n<N, TB>(float (&d)[N / 2], const uint32_t (&a)[4],              \
                                                               uint64_t desc) {                                        \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                                        \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 {" D_REGS "}, " A_DESC                  \
                     ", p, 1, 1, " #TB ";\n}\n"                                                                        \
                     : __VA_ARGS__                                                                                     \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));                                         \
    }
#define WGMMA_BF16(N, ...) WGMMA_BF16_TB(N, 0, __VA_ARGS__)
WGMMA_BF16(8, "%0,%1,%2,%3", "{%4,%5,%6,%7}, %8", WG_D4(0))
WGMMA_BF16(16, "%0,%1,%2,%3,%4,%5,%6,%7", "{%8,%9,%10,%11}, %12", WG_D4(0), WG_D4(4))
WGMMA_BF16(24, "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11", "{%12,%13,%14,%15}, %16", WG_D4(0), WG_D4(4), WG_D4(8))
WGMMA_BF16(32, "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15", "{%16,%17,%18,%19}, %20", WG_D4(0), WG_D4(4),
               WG_D4(8), WG_D4(12))
WGMMA_BF16(40, "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19", "{%20,%21,%22,%23}, %24",
               WG_D4(0), WG_D4(4), WG_D4(8), WG_D4(12), WG_D4(16))
WGMMA_BF16(48, "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23",
               "{%24,%25,%26,%27}, %28", WG_D4(0), WG_D4(4), WG_D4(8), WG_D4(12), WG_D4(16), WG_D4(20))
WGMMA_BF16(56, "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,"
               "%26,%27", "{%28,%29,%30,%31}, %32", WG_D4(0), WG_D4(4), WG_D4(8), WG_D4(12), WG_D4(16), WG_D4(20),
               WG_D4(24))
WGMMA_BF16(64, "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,"
               "%26,%27,%28,%29,%30,%31", "{%32,%33,%34,%35}, %36", WG_D4(0), WG_D4(4), WG_D4(8), WG_D4(12),
               WG_D4(16), WG_D4(20), WG_D4(24), WG_D4(28))
#define WG_D128 /* the 64 accumulators of an N = 128 wgmma */                                                      \
    "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,"  \
    "%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,"        \
    "%56,%57,%58,%59,%60,%61,%62,%63"
#define WG_N128 /* N = 128's operands, for both B layouts */                                                        \
    WG_D128, "{%64,%65,%66,%67}, %68", WG_D4(0), WG_D4(4), WG_D4(8), WG_D4(12), WG_D4(16), WG_D4(20), WG_D4(24),         \
        WG_D4(28), WG_D4(32), WG_D4(36), WG_D4(40), WG_D4(44), WG_D4(48), WG_D4(52), WG_D4(56), WG_D4(60)
// wgmma shared-memory matrix descriptor, 128-byte swizzle (layout type 1): start address, leading / stride byte
// offsets (16-byte units). K-major operands (attention_sm90a.cu's Q and K, linear_sm90a.cu's bf16 W copy): stride
// 1024 (the next 8 rows), leading unused (16); a k step of 16 starts 32 bytes on inside a 64-wide atom. V (MN-major,
// transposed B): leading WATOM (the next 64 columns), stride 1024 (the next 8 keys); the other assignment gave other
// bytes (H200, 2026-11-30). The atoms must be 1024-byte aligned.
__device__ __forceinline__ uint64_t sw_desc(uint32_t addr, uint32_t lead, uint32_t stride) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(lead >> 4) << 16) | ((uint64_t)(stride >> 4) << 32) |
           (1ull << 62);
}

// desc moved on by `bytes` (a multiple of 16): a shared-window address is below 2^18, so the address field (bits
// 0..13, 16-byte units) takes the offset without a carry into the other fields; one add instead of sw_desc's five
// instructions where a loop issues a descriptor a step (moe_sm90a.cu's b_desc_step does the same for its B).
__device__ __forceinline__ uint64_t desc_step(uint64_t desc, uint32_t bytes) {
    return (desc & 0xFFFFFFFF00000000ull) | (uint32_t)((uint32_t)desc + (bytes >> 4));
}

// d (64 x N, fp32, N / 2 per thread, wgmma_n's layout) += A (64 x 16, shared at desc_a) * B (16 x N, shared at
// desc_b), both K-major: the attention's S = Q K^T (N = 32, 128-byte swizzled), linear_sm90a.cu's `_ss` tile (128: A =
// the bf16 W copy, B = the X copy, both swizzled) and `_wb` tiles (64, 128: no swizzle, x_desc).
template <int N> __device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b);
#define WGMMA_SS(N, D_REGS, DESCS, ...)                                                                                \
    template <> __device__ __forceinline__ void wgmma_ss<N>(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b) {    \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                                        \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 {" D_REGS "}, " DESCS                   \
                     ", p, 1, 1, 0, 0;\n}\n"                                                                           \
                     : __VA_ARGS__                                                                                     \
                     : "l"(desc_a), "l"(desc_b));                                                                      \
    }
WGMMA_SS(32, "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15", "%16, %17", WG_D4(0), WG_D4(4), WG_D4(8),
         WG_D4(12))
WGMMA_SS(64, "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,"
             "%28,%29,%30,%31",
         "%32, %33", WG_D4(0), WG_D4(4), WG_D4(8), WG_D4(12), WG_D4(16), WG_D4(20), WG_D4(24), WG_D4(28))
WGMMA_SS(128, WG_D128, "%64, %65", WG_D4(0), WG_D4(4), WG_D4(8), WG_D4(12), WG_D4(16), WG_D4(20), WG_D4(24),
         WG_D4(28), WG_D4(32), WG_D4(36), WG_D4(40), WG_D4(44), WG_D4(48), WG_D4(52), WG_D4(56), WG_D4(60))
#undef WGMMA_SS
#define WGMMA_TB1(N, ...) WGMMA_BF16_TB(N, 1, __VA_ARGS__)
WGMMA_BF16(128, WG_N128)
WGMMA_TB1(128, WG_N128)
#undef WGMMA_BF16
#undef WGMMA_BF16_TB
#undef WGMMA_TB1
#undef WG_N128
#undef WG_D128
#undef WG_D4
