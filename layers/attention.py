"""Attention of one decoder layer over the paged KV cache: q/k/v norms, RoPE (default and proportional),
GQA, the exact sliding-window mask and, on sliding layers, bidirectional attention inside image blocks.

KV layout (the GPU uses the same): per layer K and V pools of shape (blocks, 16, Hkv, D); position p of a
sequence lives in block `table[p // 16]`, slot `p % 16`.
"""
import numpy as np

from layers.norm import rmsnorm

BLOCK = 16  # positions per KV block


def rope_inv_freq(rope, head_dim):
    """(D/2,) float32 per-pair frequencies. "proportional" rotates only the first partial*D/2 pairs, with
    the full head_dim as denominator; the rest get frequency 0 (cos 1, sin 0: they pass through)."""
    n_rot = int(rope.partial * head_dim // 2) if rope.kind == "proportional" else head_dim // 2
    f = 1.0 / (rope.theta ** (np.arange(0, 2 * n_rot, 2, dtype=np.float64).astype(np.float32) / head_dim))
    return np.concatenate([f.astype(np.float32), np.zeros(head_dim // 2 - n_rot, np.float32)])


def rope_apply(x, positions, inv_freq):
    """x (T, heads, D) float32 rotated NeoX-style (pairs i, i + D/2) by angle position * f_i (angle in fp32)."""
    ang = positions.astype(np.float32)[:, None] * inv_freq[None, :]          # (T, D/2) fp32, as transformers
    cos = np.cos(ang.astype(np.float64)).astype(np.float32)[:, None, :]
    sin = np.sin(ang.astype(np.float64)).astype(np.float32)[:, None, :]
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def mask(q_pos, k_pos, sliding, window, image_spans=()):
    """(Tq, Tk) bool, True where query q may see key k. Full: k <= q. Sliding: q - W < k <= q, and inside one
    image block (start, n) every row sees every row (bidirectional), still within the window."""
    q, k = q_pos[:, None], k_pos[None, :]
    allowed = k <= q
    if sliding:
        for s, n in image_spans:
            allowed |= (q >= s) & (q < s + n) & (k >= s) & (k < s + n)
        allowed &= k > q - window
    return allowed


def project_qkv(x, w, geo, eps):
    """x (T, H) normed input -> q (T, Hq, D), k (T, Hkv, D), v (T, Hkv, D), before RoPE."""
    T, D = x.shape[0], geo.head_dim
    q = rmsnorm((x @ w["self_attn.q_proj"].T).reshape(T, -1, D), w["self_attn.q_norm"], eps)
    kraw = (x @ w["self_attn.k_proj"].T).reshape(T, -1, D)
    vraw = kraw if geo.k_eq_v else (x @ w["self_attn.v_proj"].T).reshape(T, -1, D)
    return q, rmsnorm(kraw, w["self_attn.k_norm"], eps), rmsnorm(vraw, None, eps)


def attend(q, keys, values, allowed):
    """q (Tq, Hq, D); keys/values (Tk, Hkv, D); allowed (Tq, Tk) -> (Tq, Hq*D). Scaling 1.0, softmax fp32."""
    Tq, Hq, D = q.shape
    group = Hq // keys.shape[1]
    kk = np.repeat(keys, group, axis=1)                                      # (Tk, Hq, D)
    vv = np.repeat(values, group, axis=1)
    s = np.einsum("qhd,khd->hqk", q, kk)                                     # (Hq, Tq, Tk)
    s = np.where(allowed[None], s, -np.inf)
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, vv).reshape(Tq, Hq * D)


def gather(pool, table, start, stop):
    """Rows of positions start..stop-1 of one sequence from a paged pool (blocks, 16, Hkv, D)."""
    pos = np.arange(start, stop)
    return pool[np.asarray(table)[pos // BLOCK], pos % BLOCK]


def scatter(pool, table, positions, rows):
    pool[np.asarray(table)[positions // BLOCK], positions % BLOCK] = rows
