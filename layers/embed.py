"""The scaled token embedding and the tied head with the final soft-cap."""
import numpy as np
import ml_dtypes

from layers.norm import rmsnorm


def embed_scale(hidden, table_dtype):
    """sqrt(H) rounded to the embedding table's stored dtype, as transformers multiplies by a buffer cast to
    the weight dtype (53.0 for bf16 at H=2816, not 53.066)."""
    s = np.float32(hidden ** 0.5)
    cast = {"BF16": ml_dtypes.bfloat16, "F16": np.float16}.get(table_dtype)
    return np.float32(cast(s)) if cast else s


def embed(table, ids, scale):
    """table (V, H) float32; ids (T,) -> (T, H) float32."""
    return table[np.asarray(ids)] * scale


def head(h, norm_w, table, softcap, eps):
    """h (T, H) -> post-softcap logits (T, V) float32 through the final norm and the tied embedding."""
    z = rmsnorm(h, norm_w, eps) @ table.T
    if softcap:
        z = np.float32(softcap) * np.tanh(z / np.float32(softcap))
    return z
