"""The gated GELU MLP (dense "shared expert" of each layer, and the vision tower's MLP)."""
import numpy as np

_C = np.float32(np.sqrt(2.0 / np.pi))


def gelu_tanh(x):
    """GELU, tanh approximation (gelu_pytorch_tanh), float32."""
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(_C * (x + np.float32(0.044715) * x * x * x)))


def gated_mlp(x, gate, up, down):
    """x (T, H); gate, up (I, H); down (H, I), all float32 -> (T, H)."""
    return (gelu_tanh(x @ gate.T) * (x @ up.T)) @ down.T


# --- GPU ---
def gelu_mul_gpu(g, gate, up, out):
    """out = bf16(bf16(gelu_tanh(gate)) * up), all (T, I) bf16 (kernel gelu_mul_bf16 in elementwise.cu)."""
    import gpu
    assert gate.shape == up.shape == out.shape and gate.dtype == up.dtype == out.dtype, (gate, up, out)
    n = int(np.prod(gate.shape))
    if n:
        g.launch(g.module("elementwise").function("gelu_mul_bf16"), grid=(-(-n // 256), 1, 1), block=(256, 1, 1),
                 args=[out, gate, up, gpu.i64(n)])


def gate_up_gelu_gpu(g, x, w_gate, w_up, act):
    """act = gelu_mul(bf16(x @ gate^T), bf16(x @ up^T)) in ONE launch, byte for byte linear_gpu(gate),
    linear_gpu(up), gelu_mul_gpu (kernels gelu_* in linear.cu; see layers.linear.gate_up_gelu_gpu)."""
    from layers.linear import gate_up_gelu_gpu as fused
    return fused(g, x, w_gate, w_up, act)
