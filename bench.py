"""The GPU benchmark (performance.md).

    python bench.py write DIR [--layers N]     a random span-02 checkpoint with the real 26B-A4B geometry
    python bench.py run [DIR]                  write it (if DIR has none), load it on the GPU, time the engine
                                               steps; the last line is one JSON object

So far `run` times the model's step directly (decode as CUDA-graph replays, prefill eager): decode at batch 1 / 16 / 64
with ~1k context, a 2k-token prefill, the load, the weights' GPU memory, and bytes per decode step against
the measured copy bandwidth. The server-level figures (readout_ms, decisions_s) and `--peer` are to come.

The checkpoint is in the span-02 format (checkpoint.md): per-expert NVFP4 experts (compressed-tensors),
per-channel FP8 attention and dense MLP, bf16 embeddings, norms, router and vision tower, sharded one
file per layer with an index, as transformers writes large checkpoints. Values are random but valid
(no NaN/Inf codes) and of realistic magnitude, drawn as raw bit patterns so that writing ~16 GB takes
about as long as the disk needs, not minutes of float math.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from checkpoint import save_safetensors, span02_quantization_config

FULL_TEXT = dict(vocab_size=262144, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=256, global_head_dim=512,
                 num_global_key_value_heads=2, sliding_window=1024, attention_k_eq_v=True, enable_moe_block=True,
                 num_experts=128, top_k_experts=8, moe_intermediate_size=704, final_logit_softcapping=30.0,
                 hidden_size_per_layer_input=0, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
                 max_position_embeddings=262144, use_bidirectional_attention="vision", tie_word_embeddings=True,
                 pad_token_id=0, bos_token_id=2, eos_token_id=[1, 106], model_type="gemma4_text",
                 rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                  "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                     "rope_theta": 1000000.0}})
FULL_VISION = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                   num_key_value_heads=16, head_dim=72, patch_size=16, pooling_kernel_size=3,
                   position_embedding_size=10240, standardize=True, use_clipped_linears=False, rms_norm_eps=1e-6,
                   hidden_activation="gelu_pytorch_tanh", model_type="gemma4_vision",
                   rope_parameters={"rope_type": "axial", "rope_theta": 100.0})


# --- random values as bit patterns ---------------------------------------------------------------------

def _bf16(rng, shape, exp_lo=0x75, exp_hi=0x7A):
    """bf16 with random sign and mantissa, exponent in [exp_lo, exp_hi): magnitudes 2^-10 .. 2^-5 by default."""
    n = int(np.prod(shape))
    bits = (rng.integers(0, 1 << 16, n, dtype=np.uint16) & np.uint16(0x807F)) | \
        (rng.integers(exp_lo, exp_hi, n, dtype=np.uint16) << np.uint16(7))
    import ml_dtypes
    return bits.view(ml_dtypes.bfloat16).reshape(shape)


def _near(rng, n, base):
    import ml_dtypes
    return (base * (1.0 + 0.1 * rng.standard_normal(n))).astype(ml_dtypes.bfloat16)


def _near_one(rng, n):
    return _near(rng, n, 1.0)


def _fp8(rng, n, k):
    """e4m3 weights with codes 0x20..0x4F (|w| in 2^-4 .. 2^2), random sign; per-channel bf16 scale ~k^-0.5/2."""
    import ml_dtypes
    codes = rng.integers(0x20, 0x50, (n, k), dtype=np.uint8) | (rng.integers(0, 2, (n, k), dtype=np.uint8) << 7)
    scale = np.full((n, 1), 0.5 * k ** -0.5, np.float32).astype(ml_dtypes.bfloat16)
    return codes.view(ml_dtypes.float8_e4m3fn), scale


def _nvfp4(rng, e_rows, k):
    """(packed (N, K/2) u8 any nibbles, block scales (N, K/16) e4m3 codes 0x30..0x3F, global scale (1,) f32)."""
    import ml_dtypes
    packed = rng.integers(0, 256, (e_rows, k // 2), dtype=np.uint8)
    scale = rng.integers(0x30, 0x40, (e_rows, k // 16), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    return packed, scale, np.array([6.0 * k ** 0.5], np.float32)   # |w| ~ e2m1 * ~0.5 / g


# --- the writer ------------------------------------------------------------------------------------------

def write_random_checkpoint(out_dir, layers=30, vision=True, seed=0, log=print):
    """Write the full-size random span-02 checkpoint (config.json, shards, index, and the demo's tokenizer so
    that the server can run on it). Returns the total bytes written."""
    os.makedirs(out_dir, exist_ok=True)
    text = dict(FULL_TEXT, num_hidden_layers=layers)
    types = ["full_attention" if (i + 1) % 6 == 0 or i == layers - 1 else "sliding_attention" for i in range(layers)]
    text["layer_types"] = types
    rng = np.random.default_rng(seed)
    p = "model.language_model."
    H, I, E, Ie, V = 2816, 2112, 128, 704, 262144
    index, total, t0 = {}, 0, time.time()

    def shard(name, tensors):
        nonlocal total
        save_safetensors(os.path.join(out_dir, name), tensors)
        for k in tensors:
            index[k] = name
        total += sum(a.nbytes for a in tensors.values())

    shard("model-embed.safetensors", {p + "embed_tokens.weight": _bf16(rng, (V, H), 0x77, 0x7A),
                                      p + "norm.weight": _near_one(rng, H)})
    for i, lt in enumerate(types):
        q, full, t = f"{p}layers.{i}.", lt == "full_attention", {}
        d, kv = (512, 2) if full else (256, 8)
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                  "pre_feedforward_layernorm_2"):
            t[f"{q}{n}.weight"] = _near_one(rng, H)
        dense = [("self_attn.q_proj", 16 * d, H), ("self_attn.k_proj", kv * d, H), ("self_attn.o_proj", H, 16 * d),
                 ("mlp.gate_proj", I, H), ("mlp.up_proj", I, H), ("mlp.down_proj", H, I)]
        if not full:
            dense.append(("self_attn.v_proj", kv * d, H))
        for name, n, k in dense:
            t[f"{q}{name}.weight"], t[f"{q}{name}.weight_scale"] = _fp8(rng, n, k)
        # q/k norm weights ~0.25: attention scores of std ~sqrt(d) * 0.25^2 ~ 1, a soft attention, so that the
        # bf16 engine can be compared with the reference on this model (with ~1 every softmax is one-hot and chaotic)
        t[q + "self_attn.q_norm.weight"], t[q + "self_attn.k_norm.weight"] = _near(rng, d, 0.25), _near(rng, d, 0.25)
        t[q + "router.proj.weight"] = _bf16(rng, (E, H), 0x78, 0x7B)
        t[q + "router.scale"], t[q + "router.per_expert_scale"] = _near_one(rng, H), _near_one(rng, E)
        t[q + "layer_scalar"] = np.array([0.8], np.float32).astype(_near_one(rng, 1).dtype)
        for e in range(E):
            g = None
            for name, n, k in (("gate_proj", Ie, H), ("up_proj", Ie, H), ("down_proj", H, Ie)):
                packed, scale, gs = _nvfp4(rng, n, k)
                if name == "up_proj":
                    gs = g                                    # gate and up share one global scale
                g = gs
                t[f"{q}experts.{e}.{name}.weight_packed"] = packed
                t[f"{q}experts.{e}.{name}.weight_scale"] = scale
                t[f"{q}experts.{e}.{name}.weight_global_scale"] = gs
        shard(f"model-layer{i:02d}.safetensors", t)
        log(f"layer {i}: {total / 2**30:.2f} GiB written, {time.time() - t0:.1f} s")
    cfg = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "text_config": text,
           "vision_config": FULL_VISION if vision else None, "audio_config": None, "image_token_id": 258880,
           "boi_token_id": 255999, "eoi_token_id": 258882, "video_token_id": 258884, "audio_token_id": 258881,
           "tie_word_embeddings": True, "quantization_config": span02_quantization_config(p)}
    if vision:
        v, t, Hv, Iv = "model.vision_tower.", {}, 1152, 4304
        t[v + "patch_embedder.input_proj.weight"] = _bf16(rng, (Hv, 768))
        t[v + "patch_embedder.position_embedding_table"] = _bf16(rng, (2, 10240, Hv))
        t[v + "std_bias"], t[v + "std_scale"] = _bf16(rng, (Hv,)), _near_one(rng, Hv)
        for i in range(27):
            q = f"{v}encoder.layers.{i}."
            for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                      "post_feedforward_layernorm"):
                t[f"{q}{n}.weight"] = _near_one(rng, Hv)
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                t[f"{q}self_attn.{n}.linear.weight"] = _bf16(rng, (Hv, Hv))
            t[q + "self_attn.q_norm.weight"], t[q + "self_attn.k_norm.weight"] = _near_one(rng, 72), _near_one(rng, 72)
            t[q + "mlp.gate_proj.linear.weight"] = _bf16(rng, (Iv, Hv))
            t[q + "mlp.up_proj.linear.weight"] = _bf16(rng, (Iv, Hv))
            t[q + "mlp.down_proj.linear.weight"] = _bf16(rng, (Hv, Iv))
        t["model.embed_vision.embedding_projection.weight"] = _bf16(rng, (H, Hv))
        shard("model-vision.safetensors", t)
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(index.items()))}, f, indent=1)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    # the demo's tokenizer (512 ids, every special token by name): enough for a random model to serve requests
    import shutil
    demo = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(demo, name), os.path.join(out_dir, name))
    log(f"wrote {total / 2**30:.2f} GiB in {time.time() - t0:.1f} s to {out_dir}")
    return total


# --- timing the engine's step ----------------------------------------------------------------------------

def decode_bytes(cfg, context):
    """Bytes one batch-1 decode step must read: every dense FP8 weight, 8 experts per layer (NVFP4 + scales),
    routers, norms, the bf16 tied head, and the KV of `context` positions."""
    t, total = cfg.text, 0
    H, I, E, k, Ie = t.hidden, t.intermediate, t.experts, t.top_k, t.expert_intermediate
    expert = 3 * Ie * H // 2 + 3 * Ie * H // 16 + 12
    for g in t.layers:
        qkvo = H * t.heads * g.head_dim * 2 + H * g.kv_heads * g.head_dim * (1 if g.k_eq_v else 2)
        total += qkvo + 3 * H * I + k * expert + E * H * 2 + 9 * H * 2
        total += 2 * g.kv_heads * g.head_dim * 2 * (min(context, t.window) if g.sliding else context)
    return total + t.vocab * H * 2


def copy_bandwidth(g, nbytes=2 << 30):
    """Device-to-device copy GB/s (bytes read + written), the ceiling of memory-bound kernels."""
    a, b = g.empty((nbytes,), np.uint8), g.empty((nbytes,), np.uint8)
    g.copy(b, a)
    g.sync()
    e0, e1 = g.event(), g.event()
    g.record(e0)
    for _ in range(10):
        g.copy(b, a)
    g.record(e1)
    ms = g.elapsed_ms(e0, e1) / 10
    g.free(a)
    g.free(b)
    return 2 * nbytes / ms / 1e6


def time_steps(m, batch, context, steps, rng):
    """Prefill `batch` sequences of `context` tokens, then time `steps` greedy decode steps of all of them."""
    from model import SeqStep
    nb = -(-(context + steps + 1) // 16)
    tables = [tuple(range(j * nb, (j + 1) * nb)) for j in range(batch)]
    per = max(1, m.max_rows // context)
    for a in range(0, batch, per):
        m.step([SeqStep(tuple(int(x) for x in rng.integers(3, m.cfg.text.vocab, context)), 0, tables[j])
                for j in range(a, min(batch, a + per))])
    last = [int(x) for x in rng.integers(3, m.cfg.text.vocab, batch)]
    times = []
    for s in range(steps):
        t0 = time.perf_counter()
        outs = m.step([SeqStep((last[j],), context + s, tables[j], argmax=True) for j in range(batch)])
        times.append(time.perf_counter() - t0)
        last = [o.argmax for o in outs]
    return float(np.median(times[2:]))


def decide(m, ckpt_dir, stem_tokens=512):
    """One question with a ~512-token stem through the engine (no HTTP), serial, tau 0.8, cap 16: the answer
    exists, and the first readout's time (the trace's readout stage: question start to readout)."""
    from config import EngineConfig, PolicyConfig
    from engine import Engine
    from policy import Question, Request
    from prompt import Prompter
    pr = Prompter(ckpt_dir)
    words = "the ship left the harbour at noon with grain for the islands and the office logged it".split()
    context = " ".join(words[i % len(words)] for i in range(stem_tokens))
    while len(pr.stem("", context, [], "Which ship?", ["a", "b", "c", "d"], []).tokens) > stem_tokens:
        context = context[: int(len(context) * 0.95)]
    cfg = EngineConfig(model_dir=ckpt_dir, max_len=2304, max_batch=64, serial=True,
                       policy=PolicyConfig(tau=0.8, cap=16))
    eng = Engine(m, pr, cfg)
    eng.start()
    try:
        t0 = time.perf_counter()
        res = eng.submit(Request(id="bench", context=context, policy=cfg.policy, questions=[
            Question(id="q", text="Which ship?", choices=["a", "b", "c", "d"])])).result(timeout=300)
        wall = time.perf_counter() - t0
    finally:
        eng.stop(drain_timeout=5)
    a = res["answers"][0]
    return {"decision": f"{a['answer']} {a['stop']} {a['reasoning_tokens']} tokens",
            "readout_ms_engine": a["trace"][0]["ms"], "decision_wall_ms": round(wall * 1e3, 1),
            "decision_prompt_tokens": res["usage"]["prompt_tokens"]}


def run(ckpt_dir, log=print):
    import model as model_mod
    from config import load_model_config
    if not os.path.exists(os.path.join(ckpt_dir, "config.json")):
        t0 = time.time()
        write_random_checkpoint(ckpt_dir, vision=False, log=lambda *a: None)
        log(f"checkpoint written in {time.time() - t0:.1f} s")
    cfg = load_model_config(ckpt_dir)
    t0 = time.time()
    m = model_mod.load(ckpt_dir, device="gpu", kv_tokens=64 * 1152, max_len=2304, max_rows=2048, max_seqs=64)
    load_s = time.time() - t0
    g = m.g
    bw = copy_bandwidth(g)
    rng = np.random.default_rng(0)
    r = {"weights_gib": round(m.weight_bytes / 2 ** 30, 3), "load_model_s": round(load_s, 1),
         "copy_gbs": round(bw, 0)}
    for b in (1, 16, 64):
        dt = time_steps(m, b, 1024, 12, rng)
        r[f"decode_b{b}"] = round(b / dt, 1)
        r[f"step_ms_b{b}"] = round(dt * 1e3, 3)
    nbytes = decode_bytes(cfg, 1024)
    r["bytes_per_step_b1"] = nbytes
    r["mbu_b1"] = round(nbytes / (r["step_ms_b1"] / 1e3) / (bw * 1e9), 4)
    from model import SeqStep
    ids = tuple(int(x) for x in rng.integers(3, cfg.text.vocab, 2048))
    tab = tuple(range(128))                                 # the decode sequences are done: reuse blocks
    m.step([SeqStep(ids, 0, tab, argmax=True)])
    t0 = time.perf_counter()
    for _ in range(3):
        m.step([SeqStep(ids, 0, tab, argmax=True)])
    r["prefill_2k"] = round(3 * 2048 / (time.perf_counter() - t0), 0)
    r["launches_per_decode_step"] = m.stats["launches_per_decode_step"]
    r["host_syncs_per_decode_step"] = m.stats["host_syncs_per_decode_step"]
    r.update(decide(m, ckpt_dir))
    for k, v in r.items():
        log(f"{k:>20}: {v}")
    print(json.dumps(r))
    return r


def main(argv=None):
    ap = argparse.ArgumentParser(prog="bench.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="write the full-size random span-02 checkpoint")
    w.add_argument("dir")
    w.add_argument("--layers", type=int, default=30)
    w.add_argument("--no-vision", action="store_true")
    r = sub.add_parser("run", help="load the full-size checkpoint on the GPU and time the engine's steps")
    r.add_argument("dir", nargs="?", default="/tmp/span02-full")
    ns = ap.parse_args(argv)
    if ns.cmd == "write":
        write_random_checkpoint(ns.dir, ns.layers, vision=not ns.no_vision)
    else:
        run(ns.dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
