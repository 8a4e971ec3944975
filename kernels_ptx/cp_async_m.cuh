// cp.async with "memory" clobbers, for the per-lane shared rings (linear.cu dec2_body's SR ring, moe.cu SRing): no
// barrier separates a lane's own slot reads from its wait and refill there, so the compiler must not move those
// ordinary loads across the asm. A copy with ok false reads nothing and zero-fills its bytes.
#pragma once

__device__ __forceinline__ void cp_async16_m(void *smem, const void *gmem, bool ok) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(gmem), "r"(ok ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async8_m(void *smem, const void *gmem, bool ok) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(d), "l"(gmem), "r"(ok ? 8 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit_m() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int NPEND> __device__ __forceinline__ void cp_async_wait_m() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(NPEND) : "memory");
}
