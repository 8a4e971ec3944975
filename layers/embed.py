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


# --- GPU ---
import gpu  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)

HEAD_CHUNK = 2048                                         # logits per pass-1 block: CHUNK in elementwise.cu


def embed_gpu(g, table, ids, out, scale):
    """out (T, H) bf16 = table (V, H) bf16 [ids (T,) int32] * scale (the bf16-rounded sqrt(H) as a float)."""
    (V, H), (T,) = table.shape, ids.shape
    assert table.dtype == out.dtype == BF16 and ids.dtype == np.int32 and out.shape == (T, H), (table, ids, out)
    vec = 8 if H % 8 == 0 and table.ptr % 16 == 0 and out.ptr % 16 == 0 else 1   # same bytes either way
    f = g.module("elementwise").function("embed_bf16")
    g.launch(f, grid=(T, 1, 1), block=(256, 1, 1), args=[out, table, ids, T, H, V, float(scale), vec])


def softcap_gpu(g, logits, cap):
    """logits = cap * tanh(logits / cap) in place, fp32, any shape."""
    assert logits.dtype == np.float32, logits
    n = logits.size
    f = g.module("elementwise").function("softcap_f32")
    g.launch(f, grid=(max(1, -(-n // 256)), 1, 1), block=(256, 1, 1), args=[logits, gpu.i64(n), float(cap)])


def head_work_bytes(T, V):
    """Bytes of the `work` buffer argmax_gpu / readout_gpu need: two (T, ceil(V / HEAD_CHUNK)) 4-byte planes."""
    return 2 * T * -(-V // HEAD_CHUNK) * 4


def _head_pass1(g, name, logits, work):
    T, V = logits.shape
    assert logits.dtype == np.float32 and work.nbytes >= head_work_bytes(T, V) and T <= 65535, (logits, work)
    C = -(-V // HEAD_CHUNK)
    g.launch(g.module("elementwise").function(name), grid=(C, T, 1), block=(256, 1, 1), args=[logits, work, T, V])
    return T, V, C


def argmax_gpu(g, logits, out, work):
    """out (T,) int32 = argmax of each row of logits (T, V) fp32 (numpy's: first max, NaN wins)."""
    T, V, C = _head_pass1(g, "argmax_partial_f32", logits, work)
    assert out.dtype == np.int32 and out.shape == (T,), out
    g.launch(g.module("elementwise").function("argmax_final_f32"), grid=(T, 1, 1), block=(32, 1, 1),
             args=[work, out, T, C])


def readout_gpu(g, logits, keys, lse, keys_out, work):
    """For each row of logits (T, V) fp32: lse (T,) fp32 = logsumexp over V, keys_out (T, K) fp32 = the logits
    at keys (K,) int32 (the option-key token ids). The host takes softmax(keys_out) and
    mass = sum exp(keys_out - lse)."""
    T, V, C = _head_pass1(g, "lse_partial_f32", logits, work)
    (K,) = keys.shape
    assert keys.dtype == np.int32 and lse.dtype == keys_out.dtype == np.float32, (keys, lse, keys_out)
    assert lse.shape == (T,) and keys_out.shape == (T, K), (lse, keys_out)
    g.launch(g.module("elementwise").function("readout_final_f32"), grid=(T, 1, 1), block=(32, 1, 1),
             args=[work, logits, keys, lse, keys_out, T, V, C, K])
