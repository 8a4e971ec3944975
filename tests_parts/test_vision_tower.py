"""layers/vision_tower.py against transformers: Gemma4Model.get_image_features (vision tower + embed_vision) of
tiny random Gemma4ForConditionalGeneration models, fp32, inputs from transformers' own Gemma4ImageProcessorPil.

Weights go through save_pretrained and are read back by name through a checkpoint object (checkpoint.py's
Checkpoint when it exists, else the small safetensors stand-in below), as the engine loads them.
"""
import json
import os
import time

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

from config import vision_config
from layers import vision_tower

transformers = pytest.importorskip("transformers")
from transformers import Gemma4Config, Gemma4ForConditionalGeneration  # noqa: E402
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil  # noqa: E402

try:
    from checkpoint import Checkpoint
except ImportError:
    Checkpoint = None


class _SafetensorsCheckpoint:
    """Stand-in for checkpoint.Checkpoint: float32 tensors by name from a directory's *.safetensors."""

    def __init__(self, path):
        self.files = {}
        for f in sorted(os.listdir(path)):
            if f.endswith(".safetensors"):
                with safe_open(os.path.join(path, f), "pt") as s:
                    self.files.update({k: os.path.join(path, f) for k in s.keys()})

    def tensor(self, name, shape):
        with safe_open(self.files[name], "pt") as s:
            t = s.get_tensor(name).float().numpy()
        assert t.shape == tuple(shape), f"{name}: {t.shape} != {tuple(shape)}"
        return t

    def linear(self, module, shape):
        return self.tensor(f"{module}.weight", shape)


TEXT = dict(vocab_size=512, hidden_size=40, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, global_head_dim=16, layer_types=["full_attention"],
            hidden_size_per_layer_input=0, num_kv_shared_layers=0, enable_moe_block=False)
VISION = {  # two tiny towers: head_dim 16 / 24 (axial halves 8 / 12), standardize on / off
    "h32_std": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=2, head_dim=16, position_embedding_size=64, standardize=True),
    "h48_nostd": dict(hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=24, position_embedding_size=64, standardize=False,
                      rope_parameters={"rope_type": "axial", "rope_theta": 37.0}),
}
SIZES = ((150, 200), (333, 97), (64, 64))   # (H, W): landscape-ish, tall, small square (upscaled)


def _randomize_vision(model, seed):
    """Fresh random values for every tower/projector tensor: linears ~ N(0, 1/fan_in) so attention is far from
    uniform, norms and std_scale 1 + noise, position table and std_bias noise (their inits are 1 / 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.model.vision_tower.state_dict(keep_vars=True).items()) + \
                [("embedding_projection.weight", model.model.embed_vision.embedding_projection.weight)]:
            r = torch.randn(t.shape, generator=g)
            if "norm" in name or name == "std_scale":
                t.copy_(1.0 + 0.3 * r)
            elif t.ndim == 2:
                t.copy_(r / t.shape[1] ** 0.5)
            else:
                t.copy_(0.5 * r)


@pytest.fixture(scope="module", params=sorted(VISION))
def tiny_vision(request, tmp_path_factory):
    cfg = Gemma4Config(text_config=TEXT, vision_config=VISION[request.param], audio_config=None)
    model = Gemma4ForConditionalGeneration(cfg).eval()
    model.config._attn_implementation = "eager"
    model.config.vision_config._attn_implementation = "eager"
    _randomize_vision(model, seed=len(request.param))
    path = str(tmp_path_factory.mktemp(request.param))
    model.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        d = json.load(f)
    ck = (Checkpoint or _SafetensorsCheckpoint)(path)
    vcfg = vision_config(d["vision_config"])
    return model, vcfg, vision_tower.load_vision(ck, vcfg, d["text_config"]["hidden_size"])


@pytest.mark.parametrize("budget", (70, 140))
def test_soft_tokens_match_transformers(tiny_vision, budget):
    model, vcfg, w = tiny_vision
    rng = np.random.default_rng(budget)
    images = [Image.fromarray(rng.integers(0, 256, (h, wd, 3), dtype=np.uint8)) for h, wd in SIZES]
    batch = Gemma4ImageProcessorPil()(images=images, max_soft_tokens=budget, return_tensors="pt")
    with torch.no_grad():
        theirs = model.model.get_image_features(batch["pixel_values"], batch["image_position_ids"]).pooler_output
    for i, n in enumerate(batch["num_soft_tokens_per_image"].tolist()):
        t0 = time.perf_counter()
        ours = vision_tower.encode_image(w, vcfg, batch["pixel_values"][i].numpy(),
                                         batch["image_position_ids"][i].numpy(), n)
        ref = theirs[i].numpy()
        err = np.abs(ours - ref).max() / np.abs(ref).max()
        print(f"image {SIZES[i]} budget {budget}: {n} soft tokens, rel err {err:.2e}, "
              f"{time.perf_counter() - t0:.3f}s")
        assert ours.shape == ref.shape and ours.dtype == np.float32
        assert err < 1e-4


def test_padding_rows_are_irrelevant(tiny_vision):
    """The padded processor output and only its valid rows give the same tokens; a wrong count is refused."""
    _, vcfg, w = tiny_vision
    img = Image.fromarray(np.random.default_rng(1).integers(0, 256, (100, 180, 3), dtype=np.uint8))
    b = Gemma4ImageProcessorPil()(images=img, max_soft_tokens=70, return_tensors="np")
    pv, pos, n = b["pixel_values"][0], b["image_position_ids"][0], int(b["num_soft_tokens_per_image"][0])
    keep = (pos != -1).any(-1)
    assert not keep.all()
    full = vision_tower.encode_image(w, vcfg, pv, pos, n)
    np.testing.assert_array_equal(full, vision_tower.encode_image(w, vcfg, pv[keep], pos[keep], n))
    with pytest.raises(ValueError):
        vision_tower.encode_image(w, vcfg, pv, pos, n + 1)
