"""The GPU benchmark (performance.md): every figure in one run, the last line one JSON object.

    python bench.py write DIR [--layers N]       a random span-02 checkpoint with the real 26B-A4B geometry
    python bench.py run [DIR] [--peer] [--requests N] [--cap N] [--skip-model] [--skip-server] ...
                                                 write it (if DIR has none), then measure, part by part:

1. model (this process, GPU; this file): the model's step timed directly (decode as CUDA-graph replays, prefill
   eager): decode_b1 / b16 / b64, b128 and b256 (the server's largest batch) (+ step_ms_b*) with ~1k context,
   prefill_2k (and prefill_2k_sustained: see time_prefill; prefill_2k_eager: the same with no step plan, every step's
   launches from Python), weights_gib (and w16_kept_gib, the part of it that is bf16 copies), load_model_s (model
   construction only), copy_gbs, bytes_per_step_b1 and mbu_b1, launches / host syncs per decode step, five
   decisions through one engine without HTTP (readout_ms_engine: their median, and each; decision_wall_ms), and,
   when the backend has `profile_decode(B)` / `profile_prefill(T)`, the per-kernel tables kernels_b1 / kernels_b64
   / kernels_prefill_2048 / kernels_prefill_508 (the readout's step: a 507-token stem and its probe row) (+
   kernel_sum_ms_*). The model is closed before the next part.
2. server (bench_server.py): real HTTP against `span02.py serve` subprocesses on DIR: load_s (process start to the
   first /health 200), readout_ms (one question, 512-token stem, --serial, tau 0: arrival to first readout on the
   server's clock) with readout_stage_ms and readout_wall_ms beside it (and, from /metrics, readout_steps,
   readout_step_ms and readout_step_host_ms: the readouts' steps and the host's own part of them; per request
   readout_steps_ms_each, readout_steps_host_ms_each and readout_replays_each), and the standard workload
   (--requests N of 4 questions, tau 0.8, cap --cap, default serving mode): decisions_s, decisions_p50_ms,
   decisions_p99_ms and what was run (decisions_requests, decisions_questions, decisions_errors, decisions_stops,
   ...).
3. --peer (bench_peer.py, a subprocess: torch and transformers never enter this process): the step figures through
   transformers bf16 (sdpa, grouped_mm) as peer_*, and ratio_* = ours / peer for each figure both have.

A part that fails is recorded under "errors" (the others still run, exit status 1); "part_s" has each part's
seconds. At full size on the H200 (2026-12-01, BENCHMARKS.md thirty-second session, call 7) a run took: checkpoint
write ~45 s (first run only), model 36 s (with the kernel tables), server 66 s at --requests 256 (two server starts
~11 s each, the workload 42 s: 1,024 questions x 256 thought tokens), peer 35 s.

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

from checkpoint import CheckpointError, save_safetensors, span02_quantization_config, unfit_output_dir
from config import KV_DTYPES

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

def layer_types(layers):
    """Gemma-4 26B-A4B's attention pattern: every sixth layer full, and the last; the others sliding."""
    return ["full_attention" if (i + 1) % 6 == 0 or i == layers - 1 else "sliding_attention" for i in range(layers)]


BENCH_MARK = ".span02-bench-checkpoint"    # the writer's mark in its directory (write_random_checkpoint)


def write_random_checkpoint(out_dir, layers=30, vision=True, seed=0, log=print):
    """Write the full-size random span-02 checkpoint (config.json, shards, index, and the demo's tokenizer so
    that the server can run on it). Returns the total bytes written. Only into a new or empty directory, or one this
    writer marked (BENCH_MARK, written first, so an interrupted write can be redone): a model's files elsewhere
    would be overwritten with random ones (CheckpointError)."""
    if why := unfit_output_dir(out_dir, BENCH_MARK):
        raise CheckpointError(f"{out_dir}: {why}" + (" and not a checkpoint of bench.py" if why == "not empty" else "")
                              + "; the random checkpoint goes to a new or empty directory")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, BENCH_MARK), "w") as f:
        f.write("a random full-size span-02 checkpoint of bench.py write_random_checkpoint: not a model\n")
    text = dict(FULL_TEXT, num_hidden_layers=layers)
    text["layer_types"] = types = layer_types(layers)
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

def decode_bytes(cfg, context, kv_dtype="bf16"):
    """Bytes one batch-1 decode step must read: every dense FP8 weight, 8 experts per layer (NVFP4 + scales),
    routers, norms, the bf16 tied head, and the KV of `context` positions (2 bytes a value, 1 with kv_dtype fp8)."""
    kv_bytes = 1 if kv_dtype == "fp8" else 2
    t, total = cfg.text, 0
    H, I, E, k, Ie = t.hidden, t.intermediate, t.experts, t.top_k, t.expert_intermediate
    expert = 3 * Ie * H // 2 + 3 * Ie * H // 16 + 12
    for g in t.layers:
        qkvo = H * t.heads * g.head_dim * 2 + H * g.kv_heads * g.head_dim * (1 if g.k_eq_v else 2)
        total += qkvo + 3 * H * I + k * expert + E * H * 2 + 9 * H * 2
        total += 2 * g.kv_heads * g.head_dim * kv_bytes * (min(context, t.window) if g.sliding else context)
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


PREFILL_IDLE_S, PREFILL_REPS = 0.25, 5    # prefill_2k: single prompts, each after this much idle time


def time_prefill(m, ids, tab, reps=PREFILL_REPS, idle=PREFILL_IDLE_S, sleep=None):
    """Seconds of one prefill step of the prompt `ids` (argmax on its last row) over the blocks `tab`, after one
    warm-up step: (the median of `reps` single prompts, each after `idle` s with nothing running: one prompt's
    prefill on a GPU not busy with others, performance.md's prefill_2k; the mean of 3 steps back to back, the
    sustained rate). They differ on the H200 by its power cap: back to back its SM clock falls from 1,980 MHz to
    1,575 .. 1,905 ("SW Power Cap" active at ~700 W; BENCHMARKS.md thirtieth session)."""
    from model import SeqStep
    step = lambda: m.step([SeqStep(ids, 0, tab, argmax=True)])
    step()
    t0 = time.perf_counter()
    for _ in range(3):
        step()
    sustained = (time.perf_counter() - t0) / 3
    single = []
    for _ in range(reps):
        (sleep or time.sleep)(idle)
        t0 = time.perf_counter()
        step()
        single.append(time.perf_counter() - t0)
    return float(np.median(single)), sustained


def decide(m, ckpt_dir, stem_tokens=512, repeats=5):
    """`repeats` questions with ~512-token stems through one engine (no HTTP), serial, one at a time, tau 0.8, cap
    16: the answers exist, and the first readout's time (the trace's readout stage: question start to readout),
    median and each. The stems are the server readout's (bench_server.readout_stem_request): each context differs
    from its first word on, so no question reuses another's KV."""
    from bench_server import readout_stem_request
    from config import EngineConfig, PolicyConfig
    from engine import Engine
    from policy import Question, Request
    from prompt import Prompter
    pr = Prompter(ckpt_dir)
    cfg = EngineConfig(model_dir=ckpt_dir, max_len=2304, max_batch=64, serial=True,
                       policy=PolicyConfig(tau=0.8, cap=16))
    eng = Engine(m, pr, cfg)
    eng.start()
    rows = []
    try:
        for i in range(repeats):
            body = readout_stem_request(pr, stem_tokens, i)
            q = body["questions"][0]
            t0 = time.perf_counter()
            res = eng.submit(Request(id=f"bench-{i}", context=body["context"], policy=cfg.policy, questions=[
                Question(id="q", text=q["text"], choices=q["choices"])])).result(timeout=300)
            rows.append((res, time.perf_counter() - t0))
    finally:
        eng.stop(drain_timeout=5)
    a, ms = rows[0][0]["answers"][0], [r["answers"][0]["trace"][0]["ms"] for r, _ in rows]
    return {"decision": f"{a['answer']} {a['stop']} {a['reasoning_tokens']} tokens",
            "readout_ms_engine": round(float(np.median(ms)), 2), "readout_ms_engine_each": ms,
            "decision_wall_ms": round(float(np.median([w for _, w in rows])) * 1e3, 1),
            "decision_prompt_tokens": rows[0][0]["usage"]["prompt_tokens"]}


def model_figures(ckpt_dir, profile=True, kv_dtype="bf16", log=print):
    """The step-level figures, in this process, with the model loaded on the GPU (closed before returning, so the
    server and the peer that follow have the GPU to themselves)."""
    import model as model_mod
    from config import load_model_config
    cfg = load_model_config(ckpt_dir)
    t0 = time.time()
    m = model_mod.load(ckpt_dir, device="gpu", kv_tokens=256 * 1152, max_len=2304, max_rows=2048, max_seqs=256,
                       kv_dtype=kv_dtype)
    load_s = time.time() - t0
    try:
        g = m.g
        bw = copy_bandwidth(g)
        rng = np.random.default_rng(0)
        r = {"weights_gib": round(m.weight_bytes / 2 ** 30, 3),       # incl. the prefill's kept bf16 copies:
             "w16_kept_gib": round(getattr(m, "w16_kept", 0) / 2 ** 30, 3),   # model_gpu.W16_KEEP_BYTES
             "load_model_s": round(load_s, 1), "copy_gbs": round(bw, 0)}

        def decode(b):
            dt = time_steps(m, b, 1024, 12, rng)
            r[f"decode_b{b}"] = round(b / dt, 1)
            r[f"step_ms_b{b}"] = round(dt * 1e3, 3)
            log(f"decode b{b}: {b / dt:.1f} tok/s ({dt * 1e3:.2f} ms/step)")

        for b in (1, 16, 64):
            decode(b)
        nbytes = decode_bytes(cfg, 1024, kv_dtype)
        r["bytes_per_step_b1"] = nbytes
        r["mbu_b1"] = round(nbytes / (r["step_ms_b1"] / 1e3) / (bw * 1e9), 4)
        ids = tuple(int(x) for x in rng.integers(3, cfg.text.vocab, 2048))
        tab = tuple(range(128))                             # the decode sequences are done: reuse blocks
        single, sustained = time_prefill(m, ids, tab)
        r["prefill_2k"], r["prefill_2k_sustained"] = round(2048 / single, 0), round(2048 / sustained, 0)
        log(f"prefill 2k: {r['prefill_2k']:.0f} tok/s one prompt at a time ({r['prefill_2k_sustained']:.0f} back to "
            f"back)")
        if getattr(m, "step_plans", None) is not None:      # the same prompt with no plan: every step eager
            keep, m.step_plans.keep = m.step_plans.keep, 0
            try:
                r["prefill_2k_eager"] = round(2048 / time_prefill(m, ids, tab)[0], 0)
            finally:
                m.step_plans.keep = keep
            log(f"prefill 2k with every step eager (no step plan): {r['prefill_2k_eager']:.0f} tok/s")
        # b128 and b256 last, so that prefill_2k follows the same work as before b128 was added. Run before it
        # (thirty-second session), b128's ~3 s at full power preceded prefill_2k figures of 49,725 / 49,698 tok/s,
        # against 50,051 / 50,216 in a process that ran no decode before (the same machine, another call).
        decode(128)
        decode(256)
        r["launches_per_decode_step"] = m.stats["launches_per_decode_step"]
        r["host_syncs_per_decode_step"] = m.stats["host_syncs_per_decode_step"]
        r.update(decide(m, ckpt_dir))
        if getattr(m, "step_plans", None) is not None:
            r["step_plans"] = dict(m.step_plans.stats, keep=m.step_plans.keep)
        if profile:
            r.update(kernel_figures(m, log=log))
    finally:
        m.close()
    return r


# --- per-kernel table (model_gpu.profile_decode, when the backend has it) ------------------------------------

def kernel_table(rows):
    """Aggregate profile rows [{kernel, us, bytes, flops}] by kernel name: [{kernel, count, us, share, gbs, tflops,
    bytes, flops}], largest total first; share = of the sum of all kernels; gbs = bytes / time (tflops = flops /
    time) where every launch of the kernel declared its bytes (flops), else None."""
    total = sum(float(x["us"]) for x in rows) or 1.0
    agg = {}
    for x in rows:
        a = agg.setdefault(x["kernel"], {"kernel": x["kernel"], "count": 0, "us": 0.0, "bytes": 0, "flops": 0})
        a["count"] += 1
        a["us"] += float(x["us"])
        for key in ("bytes", "flops"):
            a[key] = None if a[key] is None or x.get(key) is None else a[key] + int(x[key])
    out = []
    for a in sorted(agg.values(), key=lambda a: -a["us"]):
        gbs = a["bytes"] / a["us"] / 1e3 if a["bytes"] and a["us"] > 0 else None
        tflops = a["flops"] / a["us"] / 1e6 if a["flops"] and a["us"] > 0 else None
        out.append({"kernel": a["kernel"], "count": a["count"], "us": round(a["us"], 2),
                    "share": round(a["us"] / total, 4), "gbs": None if gbs is None else round(gbs, 1),
                    "tflops": None if tflops is None else round(tflops, 1), "bytes": a["bytes"], "flops": a["flops"]})
    return out


def format_kernel_table(table, title):
    lines = [title, f"{'kernel':<36} {'count':>6} {'total us':>10} {'share':>7} {'GB/s':>8} {'TFLOP/s':>8}"]
    for a in table:
        gbs = "-" if a["gbs"] is None else f"{a['gbs']:.0f}"
        tf = "-" if a.get("tflops") is None else f"{a['tflops']:.1f}"
        lines.append(f"{a['kernel'][:36]:<36} {a['count']:>6} {a['us']:>10.1f} {100 * a['share']:>6.1f}% {gbs:>8} "
                     f"{tf:>8}")
    lines.append(f"{'sum':<36} {sum(a['count'] for a in table):>6} {sum(a['us'] for a in table):>10.1f}")
    return "\n".join(lines)


def kernel_figures(m, batches=(1, 64), prefill=(2048, 508), log=print):
    """kernels_b{B} / kernels_prefill_{T} (kernel_table) and kernel_sum_ms_b{B} / kernel_sum_ms_prefill_{T} for
    each decode batch B and prefill length T, if the model has `profile_decode` / `profile_prefill`; an error
    there is reported in the result (kernels_error), never fatal."""
    if not hasattr(m, "profile_decode"):
        return {}
    r = {}
    runs = [(f"b{b}", f"one decode step at batch {b} (profile_decode)", lambda b=b: m.profile_decode(b))
            for b in batches]
    runs += [(f"prefill_{t}", f"one {t}-token prefill (profile_prefill)", lambda t=t: m.profile_prefill(t))
             for t in (prefill if hasattr(m, "profile_prefill") else ())]
    for key, title, call in runs:
        try:
            table = kernel_table(call())
        except Exception as e:                          # noqa: BLE001 - a diagnostic, not a figure
            r["kernels_error"] = f"{title}: {type(e).__name__}: {e}"
            log(r["kernels_error"])
            continue
        r[f"kernels_{key}"] = table
        r[f"kernel_sum_ms_{key}"] = round(sum(a["us"] for a in table) / 1e3, 3)
        log(format_kernel_table(table, f"kernels of {title}:"))
    return r


# --- the peer (subprocess) and the comparison ------------------------------------------------------------------

PEER_FIGURES = ("decode_b1", "decode_b16", "decode_b64", "prefill_2k", "weights_gib")


def peer_figures(ckpt_dir, args=(), timeout=480.0, log=print):
    """Run bench_peer.py on `ckpt_dir` in a subprocess (torch and transformers stay out of this process; the
    peer's GPU memory is gone when it exits): its JSON (last stdout line) with every key prefixed `peer_`."""
    import subprocess
    from bench_server import _die_with_parent
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [sys.executable, os.path.join(here, "bench_peer.py"), ckpt_dir, *args]
    log(f"peer: {' '.join(cmd)}")
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True, timeout=timeout, cwd=here,
                           preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the peer did not finish within {timeout:.0f} s") from None
    lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"the peer exited with {p.returncode}; stdout tail: {p.stdout[-1000:]!r}")
    return {f"peer_{k}": v for k, v in json.loads(lines[-1]).items()}


def compare(r):
    """ratio_{figure} = ours / peer for every figure both columns have (tok/s: higher is better for us;
    weights_gib: lower is better). Returns (ratios, printable table)."""
    ratios, lines = {}, [f"{'figure':<14} {'ours':>12} {'peer':>12} {'ours/peer':>10}"]
    for k in PEER_FIGURES:
        ours, peer = r.get(k), r.get(f"peer_{k}")
        ratio = round(ours / peer, 3) if isinstance(ours, (int, float)) and isinstance(peer, (int, float)) and peer \
            else None
        if ratio is not None:
            ratios[f"ratio_{k}"] = ratio
        lines.append(f"{k:<14} {'-' if ours is None else ours:>12} {'-' if peer is None else peer:>12} "
                     f"{'-' if ratio is None else ratio:>10}")
    return ratios, "\n".join(lines)


# --- everything ---------------------------------------------------------------------------------------------

def run(ckpt_dir, peer=False, model=True, server=True, profile=True, device="gpu", requests=128, cap=256,
        readout_repeats=5, server_kv_tokens=0, peer_args=(), peer_timeout=480.0, kv_dtype="bf16", log=print):
    """Every figure of performance.md, part by part: the model's steps in this process (then closed), the
    server figures through HTTP (bench_server), the peer (bench_peer, subprocess). A part that fails is recorded
    under "errors" and the others still run; the last line printed is one JSON object with everything. kv_dtype:
    the KV cache of our model and server (the figures of record: bf16, the default; the peer always bf16)."""
    if not os.path.exists(os.path.join(ckpt_dir, "config.json")):
        t0 = time.time()
        write_random_checkpoint(ckpt_dir, vision=False, log=lambda *a: None)
        log(f"checkpoint written in {time.time() - t0:.1f} s")
    r, errors, times = {"checkpoint": os.path.abspath(ckpt_dir), "kv_dtype": kv_dtype}, {}, {}

    def part(name, fn):
        t0 = time.time()
        log(f"--- {name} ---")
        try:
            r.update(fn())
        except Exception as e:                          # noqa: BLE001 - recorded, reported in the JSON
            import traceback
            traceback.print_exc()
            errors[name] = f"{type(e).__name__}: {e}"[:2000]
            log(f"{name} FAILED: {errors[name]}")
        times[name] = round(time.time() - t0, 1)

    if model:
        part("model", lambda: model_figures(ckpt_dir, profile=profile, kv_dtype=kv_dtype, log=log))
    if server:
        import bench_server
        part("server", lambda: bench_server.server_figures(
            ckpt_dir, device=device, requests=requests, cap=cap, readout_repeats=readout_repeats,
            kv_tokens=server_kv_tokens, extra_args=("--kv-dtype", kv_dtype), log=log))
    if peer:
        part("peer", lambda: peer_figures(ckpt_dir, peer_args, peer_timeout, log=log))
        ratios, table = compare(r)
        r.update(ratios)
        log(table)
    r["part_s"] = times
    if errors:
        r["errors"] = errors
    for k, v in r.items():
        if not k.startswith("kernels_"):
            log(f"{k:>28}: {v}")
    print(json.dumps(r), flush=True)
    return r


def main(argv=None):
    ap = argparse.ArgumentParser(prog="bench.py", description=__doc__.split("\n\n")[0],
                                 epilog="Commands: write, run (see `bench.py run --help`).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="write the full-size random span-02 checkpoint")
    w.add_argument("dir")
    w.add_argument("--layers", type=int, default=30)
    w.add_argument("--no-vision", action="store_true")
    r = sub.add_parser("run", help="every figure of performance.md; the last line is one JSON object",
                       description="Write the checkpoint if DIR has none, then: the step figures in this process "
                                   "(GPU), the server figures through HTTP against `span02.py serve`, and with "
                                   "--peer the transformers column. The last line printed is one JSON object.")
    r.add_argument("dir", nargs="?", default="/tmp/span02-full")
    r.add_argument("--peer", action="store_true", help="also the peer column through transformers (bench_peer.py)")
    r.add_argument("--requests", type=int, default=128,
                   help="standard workload size in requests of 4 questions (performance.md: 256; default "
                        "%(default)s, ~2 minutes at today's speed)")
    r.add_argument("--cap", type=int, default=256, help="workload thought cap (default %(default)s)")
    r.add_argument("--readout-repeats", type=int, default=5, help="readout requests timed (default %(default)s)")
    r.add_argument("--server-kv-tokens", type=int, default=0,
                   help="--kv-tokens of the benchmarked server (default 0: the server's own default, sized from "
                        "the GPU's free memory; the runs before 2026-12-01's thirty-third session passed 65536)")
    r.add_argument("--device", default="gpu", choices=["gpu", "cpu", "auto"],
                   help="--device of the benchmarked server (default %(default)s; cpu for tests)")
    r.add_argument("--skip-model", action="store_true", help="skip the in-process step figures")
    r.add_argument("--skip-server", action="store_true", help="skip the server figures (load_s, readout, decisions)")
    r.add_argument("--no-profile", action="store_true", help="skip the per-kernel tables (profile_decode)")
    r.add_argument("--peer-args", default="", help="extra arguments for bench_peer.py, one string "
                                                   "(e.g. '--device cpu --context 64' for tests)")
    r.add_argument("--peer-timeout", type=float, default=480.0, help="seconds (default %(default)s)")
    r.add_argument("--kv-dtype", default="bf16", choices=KV_DTYPES,
                   help="KV cache of our model and server (default %(default)s: the figures of record)")
    ns = ap.parse_args(argv)
    try:
        if ns.cmd == "write":
            write_random_checkpoint(ns.dir, ns.layers, vision=not ns.no_vision)
            return 0
        import shlex
        res = run(ns.dir, peer=ns.peer, model=not ns.skip_model, server=not ns.skip_server,
                  profile=not ns.no_profile, device=ns.device, requests=ns.requests, cap=ns.cap,
                  readout_repeats=ns.readout_repeats,
                  server_kv_tokens=ns.server_kv_tokens, peer_args=shlex.split(ns.peer_args),
                  peer_timeout=ns.peer_timeout, kv_dtype=ns.kv_dtype)
    except CheckpointError as e:
        print(f"bench.py: {e}", file=sys.stderr)
        return 2
    return 1 if res.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
