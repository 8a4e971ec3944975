"""RMSNorm as Gemma-4 computes it: fp32, weight used directly (not 1 + w)."""
import numpy as np


def rmsnorm(x, weight=None, eps=1e-6):
    """x (..., D) float32; weight (D,) float32 or None for the no-scale norms (v_norm, router, embedder)."""
    x = np.asarray(x, dtype=np.float32)
    y = x * np.power(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps), np.float32(-0.5))
    return y if weight is None else y * weight
