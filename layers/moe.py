"""The MoE block of a Gemma-4 layer: router (no-scale norm, scale, softmax over all experts, top-k,
renormalise, per-expert scale) and gated-GELU experts combined by their weights."""
import numpy as np

from layers.mlp import gelu_tanh
from layers.norm import rmsnorm


def route(h, w, top_k, eps):
    """h (T, H) raw residual -> weights (T, k) float32, experts (T, k) int (descending probability)."""
    r = rmsnorm(h, None, eps) * w["router.scale"] * np.float32(h.shape[-1] ** -0.5)
    logits = r @ w["router.proj"].T                                          # (T, E)
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    idx = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]                  # ties: lower expert first
    top = np.take_along_axis(p, idx, axis=-1)
    top = top / top.sum(axis=-1, keepdims=True)
    return top * w["router.per_expert_scale"][idx], idx


def experts(y, weights, idx, gate_up, down):
    """y (T, H) normed input; gate_up (E, 2I, H) rows [gate; up]; down (E, H, I) -> (T, H).
    Experts are visited in index order and each token's contributions added in that order."""
    out = np.zeros_like(y)
    inter = down.shape[-1]
    for e in np.unique(idx):
        tok, slot = np.nonzero(idx == e)
        gu = y[tok] @ gate_up[e].T                                           # (n, 2I)
        o = (gelu_tanh(gu[:, :inter]) * gu[:, inter:]) @ down[e].T
        np.add.at(out, tok, o * weights[tok, slot, None])
    return out
