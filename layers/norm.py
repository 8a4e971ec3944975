"""RMSNorm as Gemma-4 computes it: weight used directly (not 1 + w); at least fp32."""
import numpy as np


def rmsnorm(x, weight=None, eps=1e-6):
    """x (..., D) float32/64 (kept); weight (D,) or None for the no-scale norms (v_norm, router, embedder)."""
    x = np.asarray(x)
    x = x if x.dtype == np.float64 else x.astype(np.float32)
    y = x * np.power(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps), np.float32(-0.5))
    return y if weight is None else y * weight
