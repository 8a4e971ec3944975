"""The decoder stack: weights by checkpoint name, the paged KV cache, and one batched step.

A step takes an explicit description of each sequence's work (new tokens, their first position, the KV
block table, what it wants back) and runs prefill chunks and decode rows of many sequences together.
Prefill, chunked prefill and token-by-token decode are the same code: a sequence's keys always come
from the paged cache, so a chunk sees exactly the keys a full prefill would.

The CPU backend (numpy) is the reference the GPU is tested against: weights are dequantized exactly to
float32 and the activations are carried in float64, so that the reference's own rounding (~1e-12) is far
below anything it is used to judge, and a sequence's numbers do not depend on how its work was chunked or
batched (BLAS picks its kernels by matrix shape; in float32 that alone moved logits by ~1e-5).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from checkpoint import Checkpoint, quantize_checkpoint
from config import ConfigError, ModelConfig, check_kv_dtype, load_model_config
from layers import attention, embed, moe
from layers.attention import BLOCK
from layers.mlp import gated_mlp
from layers.norm import rmsnorm
from layers.vision_tower import encode_image, load_vision


# --- the step interface (shared by both backends, the scheduler and the tests) ------------------------

@dataclass(frozen=True)
class ImageRows:
    start: int                     # position of the first <|image|> row of this image in the sequence
    embeds: np.ndarray             # (n, H) float32 soft tokens that replace the rows start..start+n-1


@dataclass(slots=True)             # not frozen, like SeqOut, Work and Next: a frozen dataclass's __init__ sets
class SeqStep:                     # each field through object.__setattr__ (~1 us a record, four records a row a
                                   # step: ~0.3 ms of engine time a batch-64 step, BENCHMARKS.md). Never mutated.
    """One sequence's rows in a step. SeqSteps of one step may share blocks: each sees the KV the others write at
    its earlier positions in the same step, in any order (both backends write every row's K/V before any row
    attends), so the engine runs a stem's last chunk and the readout probe after it in one step."""
    tokens: tuple[int, ...]        # new token ids, at positions start .. start+len-1
    start: int                     # the cache already holds positions 0 .. start-1 of this sequence
    blocks: tuple[int, ...]        # KV block table covering positions 0 .. start+len-1
    readout: tuple[int, ...] = ()  # key token ids: return their logits and the logsumexp at the last row
    argmax: bool = False           # return the greedy next token (lowest id on a tie) at the last row
    logits: bool = False           # return the full logits of every new row (tools and tests)
    images: tuple[ImageRows, ...] = ()  # whole image blocks inside this chunk (never split across chunks)


@dataclass(slots=True)             # not frozen: see SeqStep
class SeqOut:
    argmax: int | None = None
    key_logits: tuple[float, ...] | None = None
    logsumexp: float | None = None
    logits: np.ndarray | None = None   # (len(tokens), V) float32


CPU_KV_TOKENS = 16384           # the CPU model's KV pool when load() is asked to size it (kv_tokens=0)


# --- weights -----------------------------------------------------------------------------------------

_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
          "post_feedforward_layernorm", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
          "pre_feedforward_layernorm_2")


def load_layer(ck, prefix, cfg, geo):
    """One decoder layer's weights, float32, keyed by checkpoint name relative to the layer."""
    H, D, Hq, Hkv = cfg.hidden, geo.head_dim, cfg.heads, geo.kv_heads
    w = {f"{n}": ck.tensor(f"{prefix}{n}.weight", (H,)) for n in _NORMS[:4]}
    w["self_attn.q_proj"] = ck.linear(f"{prefix}self_attn.q_proj", (Hq * D, H))
    w["self_attn.k_proj"] = ck.linear(f"{prefix}self_attn.k_proj", (Hkv * D, H))
    if not geo.k_eq_v:
        w["self_attn.v_proj"] = ck.linear(f"{prefix}self_attn.v_proj", (Hkv * D, H))
    w["self_attn.o_proj"] = ck.linear(f"{prefix}self_attn.o_proj", (H, Hq * D))
    w["self_attn.q_norm"] = ck.tensor(f"{prefix}self_attn.q_norm.weight", (D,))
    w["self_attn.k_norm"] = ck.tensor(f"{prefix}self_attn.k_norm.weight", (D,))
    for n, shape in (("gate_proj", (cfg.intermediate, H)), ("up_proj", (cfg.intermediate, H)),
                     ("down_proj", (H, cfg.intermediate))):
        w[f"mlp.{n}"] = ck.linear(f"{prefix}mlp.{n}", shape)
    w["layer_scalar"] = ck.tensor(f"{prefix}layer_scalar", (1,))
    if cfg.experts:
        for n in _NORMS[4:]:
            w[n] = ck.tensor(f"{prefix}{n}.weight", (H,))
        w["router.proj"] = ck.tensor(f"{prefix}router.proj.weight", (cfg.experts, H))
        w["router.scale"] = ck.tensor(f"{prefix}router.scale", (H,))
        w["router.per_expert_scale"] = ck.tensor(f"{prefix}router.per_expert_scale", (cfg.experts,))
        w["experts.gate_up_proj"], w["experts.down_proj"] = ck.experts(
            prefix, cfg.experts, H, cfg.expert_intermediate)
    return w


# --- the model ---------------------------------------------------------------------------------------

class StepTools:
    """What both backends offer on top of `step`."""

    def logits(self, token_ids, chunk=None, images=()) -> np.ndarray:
        """Post-softcap logits of every position of one sequence, computed in chunks of `chunk` tokens (None:
        one prefill). Uses blocks 0.. of the KV pool: for tools and tests, not while serving."""
        ids, V = [int(t) for t in token_ids], self.cfg.text.vocab
        if not ids:
            raise ValueError("no token ids: logits needs at least one")
        bad = next((t for t in ids if not 0 <= t < V), None)       # numpy would wrap a negative id, the GPU read past
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary (0 .. {V - 1})")
        if chunk is not None and chunk < 1:
            raise ValueError(f"chunk {chunk}: at least 1 token (None: one prefill)")
        need = math.ceil(len(ids) / BLOCK)
        if need > self.num_blocks:
            raise ValueError(f"{len(ids)} tokens need {need} KV blocks; the pool has {self.num_blocks}")
        table, chunk, out = tuple(range(need)), chunk or len(ids), []
        for a in range(0, len(ids), chunk):
            ims = tuple(im for im in images if a <= im.start < a + chunk)
            out.append(self.step([SeqStep(tuple(ids[a:a + chunk]), a, table, logits=True, images=ims)])[0].logits)
        return np.concatenate(out)


class Model(StepTools):
    """A loaded model with its KV pools. `step` is the engine's entry; `logits` is for tools and tests."""

    def __init__(self, cfg: ModelConfig, ck, kv_tokens=1 << 16, name="model", kv_dtype="bf16"):
        t = cfg.text
        check_kv_dtype(kv_dtype)
        self.cfg, self.name, self.device, self.kv_dtype = cfg, name, "cpu", kv_dtype
        p = ck.text_prefix
        self.embed_table = ck.tensor(f"{p}embed_tokens.weight", (t.vocab, t.hidden))    # (V, H) f32
        self.embed_scale = embed.embed_scale(t.hidden, ck.dtype(f"{p}embed_tokens.weight"))
        self.final_norm = ck.tensor(f"{p}norm.weight", (t.hidden,))
        self.layers = [load_layer(ck, f"{p}layers.{i}.", t, g) for i, g in enumerate(t.layers)]
        self.inv_freq = [attention.rope_inv_freq(g.rope, g.head_dim) for g in t.layers]
        self.num_blocks = max(1, math.ceil(kv_tokens / BLOCK))
        # per layer: K and V pools (blocks, 16, Hkv, D) float32 (kv_dtype "fp8": values rounded as attention.kv_round)
        self.k_pool = [np.zeros((self.num_blocks, BLOCK, g.kv_heads, g.head_dim), np.float32) for g in t.layers]
        self.v_pool = [np.zeros_like(k) for k in self.k_pool]
        self.vision = load_vision(ck, cfg.vision, t.hidden) if cfg.vision and ck.vision_prefix else None

    def encode_image(self, pre) -> np.ndarray:
        """A preprocessed image (vision.Preprocessed) -> its (N, H) float32 soft tokens."""
        if self.vision is None:
            raise ValueError("this model has no vision tower")
        return encode_image(self.vision, self.cfg.vision, pre.pixel_values, pre.position_ids, pre.num_soft_tokens)

    # The step: every sequence's new rows go through each layer together; attention is per sequence.
    def step(self, seqs: list[SeqStep]) -> list[SeqOut]:
        t = self.cfg.text
        lens = [len(s.tokens) for s in seqs]
        pos = np.concatenate([np.arange(s.start, s.start + n) for s, n in zip(seqs, lens)])
        x = embed.embed(self.embed_table, np.concatenate([np.asarray(s.tokens, np.int64) for s in seqs]),
                        self.embed_scale).astype(np.float64)                         # (T, H) f64
        offsets = np.cumsum([0] + lens)
        for s, o in zip(seqs, offsets):
            for im in s.images:                    # soft tokens replace the <|image|> rows, unscaled
                r = o + im.start - s.start
                x[r:r + len(im.embeds)] = im.embeds
        for i, (w, g) in enumerate(zip(self.layers, t.layers)):
            x = self._layer(i, w, g, x, pos, seqs, offsets)
        outs = []
        for s, o, n in zip(seqs, offsets, lens):
            rows = x[o:o + n] if s.logits else x[o + n - 1:o + n]
            if not (s.logits or s.readout or s.argmax):
                outs.append(SeqOut())
                continue
            z = embed.head(rows, self.final_norm, self.embed_table, t.softcap, t.eps)    # (rows, V)
            last = z[-1].astype(np.float64)
            m = last.max()
            lse = float(m + np.log(np.exp(last - m).sum()))
            outs.append(SeqOut(argmax=int(np.argmax(last)) if s.argmax else None,
                               key_logits=tuple(float(last[k]) for k in s.readout) if s.readout else None,
                               logsumexp=lse if s.readout else None,
                               logits=z.astype(np.float32) if s.logits else None))
        return outs

    def _layer(self, i, w, g, x, pos, seqs, offsets):
        eps = self.cfg.text.eps
        q, k, v = attention.project_qkv(rmsnorm(x, w["input_layernorm"], eps), w, g, eps)
        q = attention.rope_apply(q, pos, self.inv_freq[i])
        k = attention.rope_apply(k, pos, self.inv_freq[i])
        out = np.empty((x.shape[0], q.shape[1] * q.shape[2]), np.float64)
        for s, o in zip(seqs, offsets):            # every row's K/V first, as on the GPU (SeqStep)
            n = len(s.tokens)
            attention.scatter(self.k_pool[i], s.blocks, pos[o:o + n], attention.kv_round(k[o:o + n], self.kv_dtype))
            attention.scatter(self.v_pool[i], s.blocks, pos[o:o + n], attention.kv_round(v[o:o + n], self.kv_dtype))
        for s, o in zip(seqs, offsets):
            n, stop = len(s.tokens), s.start + len(s.tokens)
            first = max(0, s.start - self.cfg.text.window + 1) if g.sliding else 0
            keys = attention.gather(self.k_pool[i], s.blocks, first, stop)
            vals = attention.gather(self.v_pool[i], s.blocks, first, stop)
            spans = tuple((im.start, len(im.embeds)) for im in s.images) if self.cfg.text.bidirectional_vision else ()
            allowed = attention.mask(pos[o:o + n], np.arange(first, stop), g.sliding, self.cfg.text.window, spans)
            out[o:o + n] = attention.attend(q[o:o + n], keys, vals, allowed)
        h = x + rmsnorm(out @ w["self_attn.o_proj"].T, w["post_attention_layernorm"], eps)
        m = gated_mlp(rmsnorm(h, w["pre_feedforward_layernorm"], eps),
                      w["mlp.gate_proj"], w["mlp.up_proj"], w["mlp.down_proj"])
        if self.cfg.text.experts:
            weights, idx = moe.route(h, w, self.cfg.text.top_k, eps)
            e = moe.experts(rmsnorm(h, w["pre_feedforward_layernorm_2"], eps), weights, idx,
                            w["experts.gate_up_proj"], w["experts.down_proj"])
            m = rmsnorm(m, w["post_feedforward_layernorm_1"], eps) + rmsnorm(e, w["post_feedforward_layernorm_2"], eps)
        return (h + rmsnorm(m, w["post_feedforward_layernorm"], eps)) * w["layer_scalar"]


def load(model_dir, device="cpu", kv_tokens=1 << 14, quantize=False, kv_dtype="bf16", **gpu_kw):
    """Load a model directory (config.json, safetensors) on a backend: "cpu" (the numpy reference), "gpu"
    (model_gpu.GpuModel), or "auto" (the GPU when there is one). kv_tokens: KV pool positions; 0 sizes it from the
    GPU's free memory (model_gpu.auto_kv_tokens, at most gpu_kw's kv_cap) or, on the CPU, CPU_KV_TOKENS.
    kv_dtype: what the KV cache keeps, "bf16" or "fp8" (config.KV_DTYPES, layers.attention.kv_round)."""
    import gpu
    if device == "auto":
        device = "gpu" if gpu.available() else "cpu"
    if device == "gpu" and not gpu.available():
        raise ConfigError("--device gpu: no CUDA GPU or driver found")
    cfg = load_model_config(model_dir)
    ck = Checkpoint(model_dir)
    if quantize:
        ck = quantize_checkpoint(ck)
    name = model_dir.rstrip("/").split("/")[-1]
    if device == "gpu":
        if cfg.text.experts and ck.has(f"{ck.text_prefix}layers.0.experts.gate_up_proj"):
            raise ConfigError("the GPU backend runs MoE experts in NVFP4: this checkpoint's experts are "
                              "unquantized; load it with --quantize (NVFP4 experts, FP8 dense layers at load)")
        from model_gpu import GpuModel
        return GpuModel(cfg, ck, kv_tokens=kv_tokens, name=name, kv_dtype=kv_dtype, **gpu_kw)
    return Model(cfg, ck, kv_tokens=kv_tokens or CPU_KV_TOKENS, name=name, kv_dtype=kv_dtype)
