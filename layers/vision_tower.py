"""The image tower: patches of one image -> soft tokens in the text model's width (model.md §6.2-6.3).

    pixel_values (P, 768) f32, position_ids (P, 2) (x=col, y=row; (-1, -1) = padding)
      -> patch embed -> L encoder layers (bidirectional, axial 2-D RoPE) -> 3x3 mean pool * sqrt(Hv)
      -> standardize -> embed_vision (no-scale RMSNorm, projection) -> (N, H) f32

The reference is transformers' Gemma4VisionModel + Gemma4MultimodalEmbedder, called as
Gemma4Model.get_image_features does (test_span02.py, the vision tests). Weights are float32, activations
float64, like the text reference in model.py.

Padding rows are dropped up front, which is exact: they are masked as keys, zeroed before pooling, and
what they compute as queries is never read. So a caller may pass the padded (9T, 768) processor output or
just its valid rows. Where spec and transformers differ (transformers wins), the comment says so.
"""
import math

import numpy as np

from config import Rope, VisionConfig
from layers.attention import attend, rope_apply, rope_inv_freq
from layers.mlp import gated_mlp
from layers.norm import rmsnorm

PROJ = "embed_vision.embedding_projection.weight"   # key of the projector (its name below `model.`)
_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
_ATTN_ELEMS = 1 << 23                                # most score entries (heads * rows * keys) at once: 64 MB f64


# --- weights -----------------------------------------------------------------------------------------

def load_vision(ck, cfg: VisionConfig, text_hidden, prefix="model.vision_tower.", proj_prefix="model.") -> dict:
    """float32 weights keyed by checkpoint name relative to `prefix` (the projector: PROJ, relative to
    `proj_prefix`). The ClippableLinear wrapper puts `.linear` in every encoder linear's name."""
    Hv, D, I = cfg.hidden, cfg.head_dim, cfg.intermediate
    if D % 4:
        # axial RoPE splits the head into 2 halves of rotate_half pairs; transformers' split breaks otherwise
        raise ValueError(f"vision head_dim {D} must be a multiple of 4")
    w = {"patch_embedder.input_proj.weight": ck.linear(f"{prefix}patch_embedder.input_proj", (Hv, 3 * cfg.patch ** 2)),
         "patch_embedder.position_embedding_table":                                    # (2, pos_table, Hv): x, y
             ck.tensor(f"{prefix}patch_embedder.position_embedding_table", (2, cfg.pos_table, Hv))}
    if cfg.standardize:
        w["std_bias"] = ck.tensor(f"{prefix}std_bias", (Hv,))
        w["std_scale"] = ck.tensor(f"{prefix}std_scale", (Hv,))
    # k/v: config.py has no vision kv-head count (transformers' num_key_value_heads); the 26B has kv = q heads,
    # and a checkpoint with fewer kv heads fails the shape check here instead of computing garbage.
    linears = {"self_attn.q_proj": (cfg.heads * D, Hv), "self_attn.k_proj": (cfg.heads * D, Hv),
               "self_attn.v_proj": (cfg.heads * D, Hv), "self_attn.o_proj": (Hv, cfg.heads * D),
               "mlp.gate_proj": (I, Hv), "mlp.up_proj": (I, Hv), "mlp.down_proj": (Hv, I)}
    for i in range(cfg.layers):
        p = f"encoder.layers.{i}."
        for n, shape in linears.items():
            w[f"{p}{n}.linear.weight"] = ck.linear(f"{prefix}{p}{n}.linear", shape)
        for n in ("self_attn.q_norm", "self_attn.k_norm"):
            w[f"{p}{n}.weight"] = ck.tensor(f"{prefix}{p}{n}.weight", (D,))
        for n in _NORMS:
            w[f"{p}{n}.weight"] = ck.tensor(f"{prefix}{p}{n}.weight", (Hv,))
    w[PROJ] = ck.linear(f"{proj_prefix}{PROJ[:-len('.weight')]}", (text_hidden, Hv))     # (H, Hv)
    return w


# --- the tower ---------------------------------------------------------------------------------------

def rope_2d(x, xy, inv_freq):
    """x (T, heads, D): channels [0, D/2) rotate by the column x, [D/2, D) by the row y, each half NeoX-style
    (pairs i, i + D/4) with the same (D/4,) frequencies. transformers builds cos as cat[fx, fx, fy, fy] and
    splits the head in two (apply_multidimensional_rope); it calls the halves "h" and "w" but index 0 is x."""
    h = x.shape[-1] // 2
    return np.concatenate([rope_apply(x[..., :h], xy[:, 0], inv_freq),
                           rope_apply(x[..., h:], xy[:, 1], inv_freq)], axis=-1)


def _attention(x, w, p, cfg, xy, inv_freq):
    """x (T, Hv) normed -> (T, heads*D). q/k: RMSNorm with weight then 2-D RoPE; v: no-scale norm, no RoPE.
    Scaling 1.0 (the q/k norms set the scale). Every valid patch sees every valid patch (bidirectional)."""
    T, D, eps = x.shape[0], cfg.head_dim, cfg.eps
    proj = lambda n: (x @ w[f"{p}self_attn.{n}_proj.linear.weight"].T).reshape(T, -1, D)  # (T, heads, D)
    q = rmsnorm(proj("q"), w[f"{p}self_attn.q_norm.weight"], eps)
    k = rmsnorm(proj("k"), w[f"{p}self_attn.k_norm.weight"], eps)
    v = rmsnorm(proj("v"), None, eps)
    q, k = rope_2d(q, xy, inv_freq), rope_2d(k, xy, inv_freq)          # (T, heads, D) f64
    # query chunks bound the (heads, rows, T) score array: 9 * 1120 patches would need 13 GB at once
    rows = max(1, _ATTN_ELEMS // (q.shape[1] * T))
    return np.concatenate([attend(q[a:a + rows], k, v, np.ones((len(q[a:a + rows]), T), bool))
                           for a in range(0, T, rows)])


def _layer(h, w, i, cfg, xy, inv_freq):
    """One encoder layer (sandwich norms like the text layers; no layer_scalar, no MoE)."""
    p, eps = f"encoder.layers.{i}.", cfg.eps
    a = _attention(rmsnorm(h, w[f"{p}input_layernorm.weight"], eps), w, p, cfg, xy, inv_freq)
    h = h + rmsnorm(a @ w[f"{p}self_attn.o_proj.linear.weight"].T, w[f"{p}post_attention_layernorm.weight"], eps)
    m = gated_mlp(rmsnorm(h, w[f"{p}pre_feedforward_layernorm.weight"], eps), w[f"{p}mlp.gate_proj.linear.weight"],
                  w[f"{p}mlp.up_proj.linear.weight"], w[f"{p}mlp.down_proj.linear.weight"])
    return h + rmsnorm(m, w[f"{p}post_feedforward_layernorm.weight"], eps)


def pool(h, xy, k, hidden):
    """h (T, Hv) valid patches -> (N, Hv): the mean of each k x k block, times sqrt(Hv), row-major over the
    pooled grid. As Gemma4VisionPooler._avg_pool_by_positions: block of (x, y) = x//k + (max_x+1)//k * (y//k),
    every patch weighs 1/k^2 (a fixed divisor, not 1/count), and a pooled row counts iff a patch falls in it.
    (transformers also counts row 0 when padding exists, since padding is clamped to (0, 0); every processor
    output has a valid patch there, so dropping padding changes nothing.) Spec: "sum/9"; transformers sums
    patch/9 in fp32 -- equal up to rounding. The bf16 rounding of the mean (spec) is a no-op in fp32/f64."""
    x, y = xy[:, 0], xy[:, 1]
    idx = x // k + ((x.max() + 1) // k) * (y // k)                     # (T,) pooled row of each patch
    out = np.zeros((idx.max() + 1, h.shape[1]), np.float64)
    np.add.at(out, idx, h / (k * k))
    return out[np.bincount(idx) > 0] * math.sqrt(hidden)               # (N, Hv); python hidden**0.5 in HF


def encode_image(w, cfg: VisionConfig, pixel_values, position_ids, num_soft_tokens) -> np.ndarray:
    """pixel_values (P, 3*patch^2) f32 in [0, 1]; position_ids (P, 2) int (x, y), (-1, -1) on padding rows;
    num_soft_tokens N (the processor's count, checked) -> (N, H) f32 soft tokens for the <|image|> rows."""
    pos = np.asarray(position_ids, np.int64)
    valid = ~(pos == -1).all(axis=-1)                # transformers: padding iff both coordinates are -1
    xy = pos[valid]                                   # (T, 2)
    if len(xy) == 0 or xy.min() < 0 or xy.max() >= cfg.pos_table:
        raise ValueError(f"patch positions must lie in [0, {cfg.pos_table}) (and one patch at least)")
    p = np.asarray(pixel_values, np.float32)[valid].astype(np.float64)  # (T, 768)

    # patch embed: pixels to [-1, 1], project, add the x and y rows of the position table
    tab = w["patch_embedder.position_embedding_table"]                  # (2, pos_table, Hv) f32
    h = (2.0 * (p - 0.5)) @ w["patch_embedder.input_proj.weight"].T + (tab[0][xy[:, 0]] + tab[1][xy[:, 1]])

    # axial RoPE frequencies: (D/4,) f32, 1 / theta^(2i / (D/2)) -- the text "default" rope on a D/2 head
    inv_freq = rope_inv_freq(Rope("default", cfg.rope_theta, 1.0), cfg.head_dim // 2)
    for i in range(cfg.layers):
        h = _layer(h, w, i, cfg, xy, inv_freq)                          # (T, Hv) f64

    s = pool(h, xy, cfg.pool, cfg.hidden)                               # (N, Hv)
    if len(s) != num_soft_tokens:
        raise ValueError(f"{len(xy)} patches pool to {len(s)} soft tokens, expected {num_soft_tokens}")
    if cfg.standardize:                                                 # fp32 in HF (then cast to bf16)
        s = (s - w["std_bias"]) * w["std_scale"]
    # embed_vision: no-scale RMSNorm with the vision eps, then the projection; no sqrt(H) scaling (§4)
    return (rmsnorm(s, None, cfg.eps) @ w[PROJ].T).astype(np.float32)  # (N, H)
