# --- the numpy reference against transformers ----------------------------------------------------------
import filecmp
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import span02
from model import SeqStep

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

HERE = os.path.dirname(os.path.abspath(__file__))

# Three random geometries: they differ in head dims, GQA ratios, k=v, window, experts, layer pattern.
HF_CONFIGS = [
    dict(vocab_size=320, hidden_size=64, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
         num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, sliding_window=8,
         layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
         attention_k_eq_v=True, enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=24,
         final_logit_softcapping=30.0),
    dict(vocab_size=257, hidden_size=48, intermediate_size=40, num_hidden_layers=3, num_attention_heads=6,
         num_key_value_heads=3, head_dim=8, global_head_dim=16, num_global_key_value_heads=2, sliding_window=5,
         layer_types=["sliding_attention", "full_attention", "full_attention"],
         attention_k_eq_v=True, enable_moe_block=True, num_experts=6, top_k_experts=3, moe_intermediate_size=16,
         final_logit_softcapping=20.0),
    dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
         num_key_value_heads=4, head_dim=8, global_head_dim=8, sliding_window=6,
         layer_types=["sliding_attention", "sliding_attention", "full_attention"],
         attention_k_eq_v=False, enable_moe_block=False, final_logit_softcapping=None),
]


def _randomize(m, seed):
    """Non-trivial weights: norms, router scales, per-expert scales and layer scalars away from 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n or "scale" in n:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
        for n, b in m.named_buffers():
            if n.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))


def _hf_model(i, conditional, path):
    from transformers import (Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration,
                              Gemma4TextConfig, Gemma4VisionConfig)
    text = Gemma4TextConfig(hidden_size_per_layer_input=0, **HF_CONFIGS[i])
    if conditional:
        vision = Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=2, head_dim=8, position_embedding_size=32)
        m = Gemma4ForConditionalGeneration(Gemma4Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                                        audio_config=None))
    else:
        m = Gemma4ForCausalLM(text)
    _randomize(m.eval(), seed=100 + i)
    m.save_pretrained(path)
    return m


@pytest.mark.parametrize("i,conditional", [(0, False), (1, False), (2, False), (0, True), (1, True)])
def test_reference_matches_transformers(tmp_path, i, conditional):
    hf = _hf_model(i, conditional, tmp_path)
    rng = np.random.default_rng(i)
    ids = rng.integers(3, HF_CONFIGS[i]["vocab_size"], 5 * HF_CONFIGS[i]["sliding_window"] + 3)
    with torch.no_grad():
        theirs = hf(torch.tensor(ids)[None]).logits[0].float().numpy()
    ours = span02.load(str(tmp_path)).logits(ids)
    err = np.abs(ours - theirs).max() / np.abs(theirs).max()
    print(f"config {i} conditional={conditional}: max rel error {err:.2e}")
    assert ours.shape == theirs.shape and err < 1e-4


def test_chunked_prefill_and_decode_match_one_prefill():
    m = span02.load()
    ids = np.random.default_rng(7).integers(3, m.cfg.text.vocab, 3 * m.cfg.text.window + 5)
    full = m.logits(ids)
    scale = np.abs(full).max()
    for chunk in (1, 5, m.cfg.text.window - 1, m.cfg.text.window + 3):
        err = np.abs(m.logits(ids, chunk=chunk) - full).max() / scale
        print(f"chunk {chunk}: max rel error {err:.2e}")
        assert err < 1e-5


def test_batched_step_matches_alone():
    """Rows of other sequences in the same step (prefill and decode mixed) change nothing."""
    m = span02.load()
    rng = np.random.default_rng(3)
    a, b = rng.integers(3, m.cfg.text.vocab, 70), rng.integers(3, m.cfg.text.vocab, 41)
    alone = m.logits(a)
    ta, tb = tuple(range(0, 5)), tuple(range(5, 9))       # disjoint block tables
    m.step([SeqStep(tuple(int(t) for t in b[:40]), 0, tb)])
    out = m.step([SeqStep(tuple(int(t) for t in a), 0, ta, logits=True),
                  SeqStep((int(b[40]),), 40, tb, argmax=True)])[0].logits
    assert np.abs(out - alone).max() <= 1e-6 * np.abs(alone).max()


def _dequantized_state_dict(ck, cfg):
    """Every tensor the quantized demo holds, dequantized by our loader, under transformers' names."""
    t, sd = cfg.text, {}
    p = ck.text_prefix
    for name in sorted(ck.names):
        if not name.startswith(p + "layers.") or ".experts." in name:
            continue
        mod, _, leaf = name.rpartition(".")
        if leaf in ("weight", "weight_packed") and (name.endswith("_proj.weight") or leaf == "weight_packed"):
            sd[mod + ".weight"] = ck.linear(mod, ck.shape_of_linear(mod))
        elif leaf not in ("weight_scale", "weight_global_scale", "input_global_scale", "input_scale"):
            sd[name] = ck.tensor(name)
    for i in range(t.n_layers):
        gu, dn = ck.experts(f"{p}layers.{i}.", t.experts, t.hidden, t.expert_intermediate)
        sd[f"{p}layers.{i}.experts.gate_up_proj"], sd[f"{p}layers.{i}.experts.down_proj"] = gu, dn
    for name in ck.names:
        if not name.startswith(p + "layers."):
            sd[name] = ck.tensor(name)
    return {k: torch.from_numpy(np.ascontiguousarray(v, np.float32)) for k, v in sd.items()}


def test_quantized_demo_matches_transformers_on_dequantized_weights():
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration
    from checkpoint import Checkpoint
    from config import load_model_config
    ck, cfg = Checkpoint(span02.DEMO_DIR), load_model_config(span02.DEMO_DIR)
    with open(os.path.join(span02.DEMO_DIR, "config.json")) as f:
        d = json.load(f)
    hf = Gemma4ForConditionalGeneration(Gemma4Config(text_config=d["text_config"], vision_config=d["vision_config"],
                                                     audio_config=None)).eval().float()
    missing, unexpected = hf.load_state_dict(_dequantized_state_dict(ck, cfg), strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    ids = np.random.default_rng(11).integers(3, cfg.text.vocab, 2 * cfg.text.window + 9)
    with torch.no_grad():
        theirs = hf(torch.tensor(ids)[None]).logits[0].float().numpy()
    ours = span02.load().logits(ids)
    err = np.abs(ours - theirs).max() / np.abs(theirs).max()
    print(f"quantized demo: max rel error {err:.2e}")
    assert err < 1e-4


def test_make_demo_reproduces_the_committed_demo(tmp_path):
    from demo import make_demo
    make_demo(str(tmp_path))
    files = sorted(os.listdir(span02.DEMO_DIR))
    assert files == sorted(os.listdir(tmp_path))
    match, mismatch, errors = filecmp.cmpfiles(span02.DEMO_DIR, tmp_path, files, shallow=False)
    assert not mismatch and not errors, (mismatch, errors)


def test_help_works():
    for args in (["--help"], ["serve", "--help"], ["make-demo", "--help"], ["calibrate", "--help"]):
        r = subprocess.run([sys.executable, os.path.join(HERE, "span02.py"), *args], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0 and "usage" in r.stdout, r.stderr
    r = subprocess.run([sys.executable, os.path.join(HERE, "span02.py"), "--max-len", "1"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "max-len" in r.stderr


def test_multimodal_logits_match_transformers(tmp_path):
    """One and two images with text around them: soft tokens replace the <|image|> rows, and on sliding layers
    each image block attends bidirectionally (transformers given mm_token_type_ids)."""
    from PIL import Image
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4TextConfig, Gemma4VisionConfig
    from model import ImageRows
    import vision
    text = Gemma4TextConfig(hidden_size_per_layer_input=0, use_bidirectional_attention="vision",
                            **dict(HF_CONFIGS[0], sliding_window=24))
    vcfg = Gemma4VisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                              num_key_value_heads=2, head_dim=16, position_embedding_size=64, standardize=True)
    cfg = Gemma4Config(text_config=text.to_dict(), vision_config=vcfg.to_dict(), audio_config=None,
                       image_token_id=300, boi_token_id=301, eoi_token_id=302)
    hf = Gemma4ForConditionalGeneration(cfg).eval()
    _randomize(hf, seed=5)
    hf.save_pretrained(tmp_path)
    hf.set_experts_implementation("eager")   # grouped_mm has no float64
    hf.double()       # the oracle in float64: fp32 transformers alone drifts ~1e-4 over a 141-token image prompt
    ours = span02.load(str(tmp_path))
    rng = np.random.default_rng(5)
    pres = [vision.preprocess(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), 70) for h, w in ((100, 160), (90, 60))]
    for n_images in (1, 2):
        ids, rows, pixel, pos = list(rng.integers(3, 300, 7)), [], [], []
        for p in pres[:n_images]:
            ids.append(301)
            rows.append(ImageRows(len(ids), ours.encode_image(p)))
            ids += [300] * p.num_soft_tokens + [302] + list(rng.integers(3, 300, 5))
            pixel.append(p.pixel_values)
            pos.append(p.position_ids)
        ids = np.array(ids)
        with torch.no_grad():
            theirs = hf(input_ids=torch.tensor(ids)[None], pixel_values=torch.tensor(np.stack(pixel)).double(),
                        image_position_ids=torch.tensor(np.stack(pos)),
                        mm_token_type_ids=torch.tensor((ids == 300).astype(np.int64))[None]).logits[0].numpy()
        mine = ours.logits(ids, images=tuple(rows))
        err = np.abs(mine - theirs).max() / np.abs(theirs).max()
        # the bidirectional image blocks matter: the same rows with a purely causal mask are far off
        if n_images == 2:
            causal = ours.logits(ids, images=tuple(ImageRows(r.start + 10 ** 6, r.embeds) for r in rows)[:0])
            assert np.abs(causal - theirs).max() / np.abs(theirs).max() > 1e-2
        print(f"{n_images} image(s), {len(ids)} tokens: max rel error {err:.2e}")
        assert err < 1e-4
