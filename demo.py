"""The built-in tiny demo model: a deterministic random Gemma-4 in the span-02 checkpoint format.

Small enough to run fast on a CPU, with every structural feature of the real model: sliding and full
layers (k = v, proportional RoPE, other head geometry), a window shorter than a typical prompt, MoE with
8 experts top-2, per-expert NVFP4 experts, per-channel FP8 dense layers, bf16 embeddings, norms, router
and vision tower, a tokenizer with Gemma-4's special tokens by name. `make_demo` writes the same bytes
on every run and machine (a test checks the committed copy against a fresh one).
"""
import json
import os

import ml_dtypes
import numpy as np

from checkpoint import quantize_span02, save_safetensors, span02_quantization_config
from prompt import make_demo_tokenizer

DEMO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo")
SEED = 20261130

# head dims 64 / 128: the smallest the GPU attention kernels take (they exist for 64, 128, 256 and 512)
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, global_head_dim=128, num_global_key_value_heads=1,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                         "full_attention"],
            sliding_window=32, attention_k_eq_v=True, enable_moe_block=True, num_experts=8, top_k_experts=2,
            moe_intermediate_size=32, final_logit_softcapping=30.0, hidden_size_per_layer_input=0,
            rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072,
            use_bidirectional_attention="vision", tie_word_embeddings=True, pad_token_id=0,
            bos_token_id=2, model_type="gemma4_text",
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                "rope_theta": 1000000.0}})
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=2, head_dim=16, patch_size=16, pooling_kernel_size=3,
              position_embedding_size=10240, standardize=True, use_clipped_linears=False, rms_norm_eps=1e-6,
              hidden_activation="gelu_pytorch_tanh", model_type="gemma4_vision",
              rope_parameters={"rope_type": "axial", "rope_theta": 100.0})


def demo_tensors(text, vision, vocab, rng):
    """A bf16-valued Gemma-4 state dict (float32 arrays) with transformers' names. Norm weights, scales and
    layer scalars are drawn around 1 so that no op is the identity."""
    H, I, D, Dg = text["hidden_size"], text["intermediate_size"], text["head_dim"], text["global_head_dim"]
    E, Ie, nh = text["num_experts"], text["moe_intermediate_size"], text["num_attention_heads"]
    t = {}

    def lin(name, n, k, std=None):
        t[name] = rng.standard_normal((n, k), np.float32) * np.float32(std or k ** -0.5)

    def ones(name, n, spread=0.2, base=1.0):
        t[name] = (base + spread * rng.standard_normal(n)).astype(np.float32)

    p = "model.language_model."
    t[p + "embed_tokens.weight"] = rng.standard_normal((vocab, H), np.float32) * np.float32(0.05)
    ones(p + "norm.weight", H)
    for i, lt in enumerate(text["layer_types"]):
        q = f"{p}layers.{i}."
        full = lt == "full_attention"
        d, kv = (Dg, text["num_global_key_value_heads"]) if full else (D, text["num_key_value_heads"])
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                  "pre_feedforward_layernorm_2"):
            ones(f"{q}{n}.weight", H)
        lin(q + "self_attn.q_proj.weight", nh * d, H)
        lin(q + "self_attn.k_proj.weight", kv * d, H)
        if not full:
            lin(q + "self_attn.v_proj.weight", kv * d, H)
        lin(q + "self_attn.o_proj.weight", H, nh * d)
        # q/k norm weights ~0.3: scores q.k of std ~sqrt(d) * 0.3^2 (< 1), a soft attention. With weights ~1
        # (std ~sqrt(d)) every softmax is nearly one-hot and bf16 rounding alone flips it: the model would be
        # chaotic, and no bf16 engine could be compared with the reference on it.
        ones(q + "self_attn.q_norm.weight", d, 0.05, 0.3)
        ones(q + "self_attn.k_norm.weight", d, 0.05, 0.3)
        lin(q + "mlp.gate_proj.weight", I, H)
        lin(q + "mlp.up_proj.weight", I, H)
        lin(q + "mlp.down_proj.weight", H, I)
        lin(q + "router.proj.weight", E, H, std=1.0)
        ones(q + "router.scale", H)
        ones(q + "router.per_expert_scale", E)
        t[q + "experts.gate_up_proj"] = rng.standard_normal((E, 2 * Ie, H), np.float32) * np.float32(H ** -0.5)
        t[q + "experts.down_proj"] = rng.standard_normal((E, H, Ie), np.float32) * np.float32(Ie ** -0.5)
        t[q + "layer_scalar"] = np.array([0.5 + rng.random()], np.float32)
    if vision:
        v, Hv, Iv = "model.vision_tower.", vision["hidden_size"], vision["intermediate_size"]
        lin(v + "patch_embedder.input_proj.weight", Hv, 3 * vision["patch_size"] ** 2)
        t[v + "patch_embedder.position_embedding_table"] = rng.standard_normal(
            (2, vision["position_embedding_size"], Hv), np.float32) * np.float32(0.1)
        t[v + "std_bias"] = (0.1 * rng.standard_normal(Hv)).astype(np.float32)
        ones(v + "std_scale", Hv)
        hd = vision["head_dim"] * vision["num_attention_heads"]
        for i in range(vision["num_hidden_layers"]):
            q = f"{v}encoder.layers.{i}."
            for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                      "post_feedforward_layernorm"):
                ones(f"{q}{n}.weight", Hv)
            for n in ("q_proj", "k_proj", "v_proj"):
                lin(f"{q}self_attn.{n}.linear.weight", hd, Hv)
            lin(f"{q}self_attn.o_proj.linear.weight", Hv, hd)
            ones(f"{q}self_attn.q_norm.weight", vision["head_dim"])
            ones(f"{q}self_attn.k_norm.weight", vision["head_dim"])
            lin(f"{q}mlp.gate_proj.linear.weight", Iv, Hv)
            lin(f"{q}mlp.up_proj.linear.weight", Iv, Hv)
            lin(f"{q}mlp.down_proj.linear.weight", Hv, Iv)
        lin("model.embed_vision.embedding_projection.weight", H, Hv)
    # the real release is bf16: round every value to bf16 before quantizing, as a real export would be
    return {k: a.astype(ml_dtypes.bfloat16).astype(np.float32) for k, a in sorted(t.items())}


def make_demo(out_dir=DEMO_DIR, vision=True):
    """Write the demo model directory: config.json, model.safetensors, tokenizer.json, tokenizer_config.json."""
    os.makedirs(out_dir, exist_ok=True)
    vocab = make_demo_tokenizer(out_dir)
    with open(os.path.join(out_dir, "tokenizer.json")) as f:
        ids = {t["content"]: t["id"] for t in json.load(f)["added_tokens"]}
    text = dict(TEXT, vocab_size=vocab, eos_token_id=[ids["<eos>"], ids["<turn|>"]])
    cfg = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
           "text_config": text, "vision_config": VISION if vision else None, "audio_config": None,
           "image_token_id": ids["<|image|>"], "boi_token_id": ids["<|image>"], "eoi_token_id": ids["<image|>"],
           "video_token_id": ids["<|video|>"], "audio_token_id": ids["<|audio|>"], "tie_word_embeddings": True,
           "quantization_config": span02_quantization_config("model.language_model.")}
    tensors = demo_tensors(text, VISION if vision else None, vocab, np.random.default_rng(SEED))
    save_safetensors(os.path.join(out_dir, "model.safetensors"),
                     quantize_span02(tensors, "model.language_model."))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    return out_dir
