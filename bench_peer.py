"""The peer column of performance.md: the same step-level figures through Hugging Face transformers.

    python bench_peer.py DIR [--device cuda] [--context 1024] [--steps 12]   the last stdout line is one JSON object

Builds `Gemma4ForCausalLM` from DIR's config.json (its text_config: the same geometry as the checkpoint bench.py
wrote), in bf16, directly on the device (constructed under `torch.device(...)` with bf16 as the default dtype, so
the weights never exist on the host and transformers' own init runs as a few device kernels, seconds for ~47 GiB),
with attention "sdpa" and experts "grouped_mm" (what performance.md's peer column names; the transformers
default is kept where a version cannot choose it). The weights' values are transformers' init (normal(0, 0.02),
norms and scales at 1): finite, and irrelevant to the speed of dense bf16 kernels.

Figures (same definitions as ours): decode_b1 / b16 / b64 = B / median step time of greedy single-token forwards
with the KV cache (`past_key_values`) after a prefill of `context` random tokens per sequence (chunked to bound
activation memory; logits of the last position only); prefill_2k = 2,048 tokens / time of one forward of a fresh
2,048-token prompt (cache on, last logits only), the median of 5 after one warm-up, each after 0.25 s idle (bench.py
time_prefill's protocol); weights_gib =
torch.cuda.memory_allocated() after the build (parameter bytes on the CPU).

torch and transformers are imported here only, and only when the peer runs (`bench.py run --peer` starts this
file as a subprocess after our own figures, so the two never hold the GPU at once).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

FIGURES = ("decode_b1", "decode_b16", "decode_b64", "prefill_2k", "weights_gib")
DROP = ("model_type", "architectures", "quantization_config", "transformers_version", "torch_dtype", "dtype")


def text_config_dict(model_dir):
    """The text_config of DIR/config.json (or the whole file when it is a text-only config), ready for
    Gemma4TextConfig(**...): bookkeeping keys dropped, no per-layer input embeddings unless the config has them."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    text = dict(cfg.get("text_config") or cfg)
    for k in DROP:
        text.pop(k, None)
    text.setdefault("hidden_size_per_layer_input", 0)
    return text


def hf_config(model_dir):
    from transformers import Gemma4TextConfig
    return Gemma4TextConfig(**text_config_dict(model_dir))


def build(model_dir, device="cuda", dtype=None, attn="sdpa", experts="grouped_mm", log=print):
    """Gemma4ForCausalLM of DIR's config on `device`, in `dtype` (default bf16), values from transformers' init.
    Returns (model, info dict: build_s, attn, experts, versions)."""
    import torch
    import transformers
    from transformers import Gemma4ForCausalLM
    dtype = dtype or torch.bfloat16
    cfg = hf_config(model_dir)
    t0 = time.time()
    kw = {"dtype": dtype, "attn_implementation": attn}
    with torch.device(device):
        try:
            model = Gemma4ForCausalLM._from_config(cfg, experts_implementation=experts, **kw)
        except (TypeError, ValueError) as e:             # a version that cannot choose: its default
            log(f"peer: experts_implementation={experts!r} refused ({e}); the default is used")
            model = Gemma4ForCausalLM._from_config(cfg, **kw)
    if getattr(model.config, "_experts_implementation", experts) != experts and \
            hasattr(model, "set_experts_implementation"):
        try:
            model.set_experts_implementation(experts)
        except Exception as e:                           # noqa: BLE001 - keep the version's default
            log(f"peer: set_experts_implementation({experts!r}) failed ({e}); the default is used")
    model.eval()
    if device != "cpu" and str(device).startswith("cuda"):
        torch.cuda.synchronize()
    info = {"build_s": round(time.time() - t0, 2), "attn": getattr(model.config, "_attn_implementation", None),
            "experts": getattr(model.config, "_experts_implementation", None),
            "transformers": transformers.__version__, "torch": torch.__version__,
            "params_gib": round(sum(p.numel() * p.element_size() for p in model.parameters()) / 2 ** 30, 3)}
    return model, info


def _sync(device):
    import torch
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _prefill(model, ids, chunk_tokens):
    """Feed ids [B, T] through the model in chunks of <= chunk_tokens rows (B * chunk), cache kept; returns the
    last output (its past_key_values and last-position logits)."""
    B, T = ids.shape
    step = max(16, chunk_tokens // B)
    out, past = None, None
    for a in range(0, T, step):
        out = model(input_ids=ids[:, a:a + step], past_key_values=past, use_cache=True, logits_to_keep=1)
        past = out.past_key_values
    return out


def decode_step_time(model, batch, context, steps, vocab, device, chunk_tokens=16384, seed=0):
    """Median seconds of one greedy decode step of `batch` sequences after a `context`-token prefill."""
    import torch
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, context), generator=g).to(device)
    with torch.inference_mode():
        out = _prefill(model, ids, chunk_tokens)
        past = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        times = []
        for _ in range(steps):
            _sync(device)
            t0 = time.perf_counter()
            out = model(input_ids=nxt, past_key_values=past, use_cache=True, logits_to_keep=1)
            past = out.past_key_values
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            _sync(device)
            times.append(time.perf_counter() - t0)
        finite = bool(torch.isfinite(out.logits).all())
    del past, out
    times = sorted(times[2:] if len(times) > 4 else times)
    return times[len(times) // 2], finite


def prefill_time(model, tokens, vocab, device, reps=5, idle=0.25):
    """Median seconds of one forward of a fresh `tokens`-token prompt (cache on, last logits) over `reps`, each after
    `idle` s with the GPU idle, after a warm-up (bench.py time_prefill's single prompts)."""
    import torch
    ids = torch.randint(3, vocab, (1, tokens), generator=torch.Generator().manual_seed(1)).to(device)
    times = []
    with torch.inference_mode():
        for i in range(reps + 1):
            _sync(device)
            if i:
                time.sleep(idle)
            t0 = time.perf_counter()
            model(input_ids=ids, use_cache=True, logits_to_keep=1)
            _sync(device)
            if i:
                times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def peer_figures(model_dir, device="cuda", context=1024, steps=12, batches=(1, 16, 64), prefill_tokens=2048,
                 dtype=None, log=print):
    """Every peer figure in one dict (keys as ours: decode_b*, step_ms_b*, prefill_2k, weights_gib; plus build
    info and `finite`: whether the last decode logits were all finite). Frees the device memory at the end."""
    import gc
    import torch
    cuda = str(device).startswith("cuda")
    if cuda:
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
    model, r = build(model_dir, device, dtype, log=log)
    log(f"peer: built in {r['build_s']} s ({r['params_gib']} GiB of parameters, attn {r['attn']}, "
        f"experts {r['experts']}, transformers {r['transformers']}, torch {r['torch']})")
    r["weights_gib"] = round((torch.cuda.memory_allocated() - base) / 2 ** 30, 3) if cuda else r["params_gib"]
    vocab = model.config.vocab_size
    finite = True
    try:
        for b in batches:
            dt, ok = decode_step_time(model, b, context, steps, vocab, device)
            finite &= ok
            r[f"decode_b{b}"], r[f"step_ms_b{b}"] = round(b / dt, 1), round(dt * 1e3, 3)
            log(f"peer: decode b{b}: {b / dt:.1f} tok/s ({dt * 1e3:.2f} ms/step)")
            if cuda:
                torch.cuda.empty_cache()
        dt = prefill_time(model, prefill_tokens, vocab, device)
        r["prefill_2k" if prefill_tokens == 2048 else f"prefill_{prefill_tokens}"] = round(prefill_tokens / dt, 0)
        log(f"peer: prefill {prefill_tokens}: {prefill_tokens / dt:.0f} tok/s")
        if cuda:
            r["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 2)
    finally:
        del model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    r["finite"] = finite
    r["context"] = context
    return r


def main(argv=None):
    ap = argparse.ArgumentParser(prog="bench_peer.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="model directory with config.json (the checkpoint bench.py wrote)")
    ap.add_argument("--device", default="cuda", help="torch device (default %(default)s)")
    ap.add_argument("--context", type=int, default=1024, help="decode context in tokens (default %(default)s)")
    ap.add_argument("--steps", type=int, default=12, help="decode steps timed per batch (default %(default)s)")
    ap.add_argument("--batches", default="1,16,64", help="decode batch sizes (default %(default)s)")
    ap.add_argument("--prefill", type=int, default=2048, help="prefill prompt tokens (default %(default)s)")
    ns = ap.parse_args(argv)

    def log(*a):
        print(*a, file=sys.stderr, flush=True)
    r = peer_figures(ns.dir, ns.device, ns.context, ns.steps, tuple(int(b) for b in ns.batches.split(",")),
                     ns.prefill, log=log)
    print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
