// Programmatic dependent launch (sm_90), shared by every kernel file. A kernel launched with the PDL attribute
// (gpu.launch(pdl=True)) may start while the previous kernel of its stream is still running:
//   pdl_trigger(): this CTA lets the next kernel launch (it launches once every CTA of ours has triggered or exited);
//   pdl_wait():    wait until the previous kernel has finished and its writes are visible. Nothing the previous
//                  kernels write may be read, and nothing written, before it; weights may be fetched before it.
//   pdl_entry():   both at once, first thing in a kernel: only the launch and the CTAs' start overlap.
// All three are no-ops in a launch without the attribute. Which launchers set it, and why (measured on the H200,
// 2026-11-30, one process, graphs recaptured per setting, median of 3 rounds):
//   - linear.cu's (the router's too, up to 16 tokens) and moe_down_combine_direct's: they fetch weights before
//     pdl_wait. Batch-1 step 2.915 ms with PDL on the linear launches only, 3.191 with it on every launch, 3.503
//     with none; batch 64 17.73 / 19.23 / 18.50 ms. With the (then separate) batch-1 router kernel and
//     moe_down_combine_direct too: 2.846 ms at batch 1.
//   - elementwise.cu's `_pre` norm chains (post_attn_norms_pre_bf16, post_ffn_norms[_pairs]_pre_bf16: T <= 16,
//     layers/norm.py NORMS_PRE_MAX_T): they fetch their weights, wait, and only then trigger, so the chain of
//     early grids stops at them. Batch 1 2539.7 -> 2508.9 us, batch 64 14612.0 -> 14785.5 (2026-11-30).
//   - not the others (elementwise.cu, attention.cu, the batch router and grouped MoE kernels): with the attribute
//     on every launch each kernel's trigger lets the next one launch and trigger in turn, so waiting grids pile up
//     on the SMs and hold what the kernels running beside them (the dense MLP's branch) need.
//   - and no launch on a branch (gpu.launch drops the attribute there): the dense MLP's down projection, resident
//     early beside its gate/up kernel, held the registers the experts' kernel on the main stream needed (per-CTA
//     timestamps, thirty-seventh session); batch-1 decode step 2.437 -> 2.345 ms, batch 16 7.030 -> 6.952.
#pragma once

__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_entry() {
    pdl_trigger();
    pdl_wait();
}
