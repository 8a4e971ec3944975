"""Weight-only linear layers on the GPU: y (T, N) = x (T, K) @ W (N, K)^T, x bf16, fp32 accumulation, y bf16
(f32 for the tied head). W stays in its checkpoint format: FP8 e4m3 with a per-tensor / per-channel /
128x128-block f32 scale, or bf16. Kernels: kernels_ptx/linear.cu, one family for every T, so a row's output
bytes do not depend on T or on the other rows of the batch (see the header there for the fixed K order).
The numpy reference is checkpoint.dequantize(raw) in float64 against bf16-rounded x (tests_parts/test_gpu_linear.py).
"""
from dataclasses import dataclass

import numpy as np

import gpu
from checkpoint import BF16, fp8_granularity

F32 = np.dtype(np.float32)
ROWS, THREADS = 16, 256                 # decode family: N rows per CTA, threads per CTA (8 K-slice warps)
P_ROWS, P_TOK = 64, 32                  # prefill tile (`_p` kernels): N rows x tokens per CTA
P_SMEM = {'bf16': 55296, 'fp8': 34816}  # prefill dynamic smem bytes (4 stages, linear.cu PrefillSmem)
PREFILL_MIN_T = 65                      # T from which the `_p` tile runs (same bits; None = decode family always)


# --- GPU ---

@dataclass(frozen=True, eq=False)
class GpuLinear:
    """One Linear on the device. format: 'fp8_channel' | 'fp8_tensor' | 'fp8_block' | 'bf16'."""
    format: str
    N: int
    K: int
    w: gpu.DeviceArray                  # fp8: (N, K) uint8 (e4m3 bytes); bf16: (N, K) bf16
    s: gpu.DeviceArray = None           # f32: (1,) tensor | (N,) channel | (ceil(N/128), ceil(K/128)) block | None


def upload_linear(g, raw):
    """checkpoint.LinearRaw -> GpuLinear. FP8 scales (bf16 or f32 in the checkpoint) become f32; f32/f16
    weights are rounded to bf16 (the kernels take bf16). NVFP4 modules belong to the MoE kernels."""
    n, k = raw.shape
    if k % 16:
        raise ValueError(f'linear {raw.shape}: K must be a multiple of 16')
    if raw.format in ('bf16', 'f32', 'f16'):
        return GpuLinear('bf16', n, k, g.upload(np.asarray(raw.weight).astype(BF16).reshape(n, k)))
    if raw.format.startswith('fp8'):
        fmt = fp8_granularity(np.shape(raw.scale), n, k)
        s = np.asarray(raw.scale).astype(F32)
        s = s.reshape({'fp8_tensor': (1,), 'fp8_channel': (n,), 'fp8_block': (-(-n // 128), -(-k // 128))}[fmt])
        w8 = np.ascontiguousarray(raw.weight).view(np.uint8).reshape(n, k)
        return GpuLinear(fmt, n, k, g.upload(w8), g.upload(s))
    raise ValueError(f'linear {raw.shape}: format {raw.format} has no dense GPU kernel')


def _nt_suffix(t):
    """Decode family: tokens per CTA (8, 16, 32 or 64) for T rows: fewer idle mma columns and registers at small T. Only
    the grouping of outputs into CTAs changes with it, never any output's arithmetic."""
    return next(c for c in (8, 16, 32) if t <= c) if t <= 32 else 64


def _launch(g, kernel, w_ptr, s, s_arg, x, out, n, k):
    t, args = x.shape[0], [w_ptr, s, s_arg, x, out, x.shape[0], n, k]
    if PREFILL_MIN_T is not None and t >= PREFILL_MIN_T:
        f = g.module('linear').function(f'{kernel}_p')
        g.launch(f, grid=(-(-n // P_ROWS), -(-t // P_TOK), 1), block=(THREADS, 1, 1), args=args,
                 shared=P_SMEM['bf16' if kernel.startswith('gemm_bf16') else 'fp8'])
    else:
        nt = _nt_suffix(t)
        f = g.module('linear').function(f'{kernel}_t{nt}')
        g.launch(f, grid=(-(-n // ROWS), -(-t // nt), 1), block=(THREADS, 1, 1), args=args)


def _check_x(x, k):
    if x.dtype != BF16 or len(x.shape) != 2 or x.shape[1] != k or x.ptr % 16:
        raise ValueError(f'x {x.shape} {x.dtype} at {x.ptr:#x}: expected (T, {k}) bf16, 16-byte aligned')


def linear_gpu(g, x, w, out):
    """x (T, K) bf16, w GpuLinear, out (T, N) bf16 (or f32 for bf16 weights) -> out."""
    _check_x(x, w.K)
    t = x.shape[0]
    f32 = out.dtype == F32
    if out.shape != (t, w.N) or out.dtype not in (BF16, F32) or (f32 and w.format != 'bf16'):
        raise ValueError(f'out {out.shape} {out.dtype}: expected ({t}, {w.N}) bf16 (f32 only for bf16 weights)')
    if t == 0:
        return out
    if w.format == 'bf16':
        _launch(g, 'gemm_bf16_f32' if f32 else 'gemm_bf16_bf16', w.w, None, 0, x, out, w.N, w.K)
    elif w.format == 'fp8_block':
        _launch(g, 'gemm_fp8blk_bf16', w.w, w.s, -(-w.K // 128), x, out, w.N, w.K)
    else:
        _launch(g, 'gemm_fp8_bf16', w.w, w.s, int(w.format == 'fp8_channel'), x, out, w.N, w.K)
    return out


def head_gpu(g, x, table, out_f32):
    """Tied head logits: x (T, H) bf16 @ table (V, H) bf16 ^T -> out_f32 (T, V) f32 (no norm, no soft-cap)."""
    v, h = table.shape
    _check_x(x, h)
    if table.dtype != BF16 or h % 16:
        raise ValueError(f'table {table.shape} {table.dtype}: expected (V, H) bf16, H % 16 == 0')
    if out_f32.shape != (x.shape[0], v) or out_f32.dtype != F32:
        raise ValueError(f'out {out_f32.shape} {out_f32.dtype}: expected ({x.shape[0]}, {v}) f32')
    if x.shape[0]:
        _launch(g, 'gemm_bf16_f32', table, None, 0, x, out_f32, v, h)
    return out_f32
