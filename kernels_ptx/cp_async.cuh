// cp.async (global -> shared, past the registers): the one set of copy helpers every kernel file uses. A shared
// destination is a generic pointer or a shared-window address (smem_u32). Every form is asm volatile with a "memory"
// clobber, so the compiler keeps ordinary shared loads and stores on their side of a copy, a commit or a wait: the
// per-lane rings (linear.cu dec2_body's SR ring, moe.cu SRing) read back their own slots with no barrier between the
// wait and the read. A copy whose ok is false reads nothing and zero-fills its bytes (src is then any valid address).
#pragma once
#include <stdint.h>

__device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async16(void *dst, const void *src, bool ok) { cp_async16(smem_u32(dst), src, ok); }
__device__ __forceinline__ void cp_async8(uint32_t dst, const void *src, bool ok) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 8 : 0) : "memory");
}
__device__ __forceinline__ void cp_async8(void *dst, const void *src, bool ok) { cp_async8(smem_u32(dst), src, ok); }
// No source-size operand: every byte is read (the wgmma dense tiles' full units).
__device__ __forceinline__ void cp_async16_full(uint32_t dst, const void *src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async8_full(uint32_t dst, const void *src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(src) : "memory");
}
// 4 bytes (n of them read, the rest zero-filled), issued only where p: a predicate, not a branch.
__device__ __forceinline__ void cp_async4_if(uint32_t dst, const void *src, uint32_t n, bool p) {
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %3, 0;\n\t@p cp.async.ca.shared.global [%0], [%1], 4, %2;\n\t}\n"
                 ::"r"(dst), "l"(src), "r"(n), "r"((uint32_t)p) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Wait until at most N of this thread's committed groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
