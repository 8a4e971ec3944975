"""vision.py against transformers' Gemma4ImageProcessorPil (the reference), plus image error handling.

Reference call: Gemma4ImageProcessorPil()(images=Image.open(BytesIO(data)), max_soft_tokens=T, return_tensors="np")
i.e. the PIL object Pillow gives for the same bytes; outputs must be bit-identical.
"""
import io
import math
import struct
import time
import tracemalloc
import zlib

import numpy as np
import pytest
from PIL import Image, ImageFile, ImageOps

import vision

transformers_gemma4 = pytest.importorskip("transformers.models.gemma4.image_processing_pil_gemma4")
from transformers.image_transforms import convert_to_rgb  # noqa: E402

BUDGETS = (70, 140, 280, 560, 1120)


@pytest.fixture(scope="module")
def hf():
    return transformers_gemma4.Gemma4ImageProcessorPil()


# --- image makers: random pixels, fixed seeds, every mode the decoder must handle ---------------------

def _u8(rng, h, w, c=None):
    return rng.integers(0, 256, (h, w) if c is None else (h, w, c), dtype=np.uint8)


def _save(im, fmt, **kw):
    b = io.BytesIO()
    im.save(b, fmt, **kw)
    return b.getvalue()


def _pal(rng, h, w):
    im = Image.fromarray(_u8(rng, h, w), "P")
    im.putpalette(_u8(rng, 1, 768).tobytes())
    return im


def _gif_anim(rng, h, w):
    frames = [_pal(rng, h, w) for _ in range(3)]
    return _save(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)


def _i16(rng, h, w):
    # mostly <= 255 and some above: Pillow's I;16 -> RGB clips, both sides of the clip are exercised
    a = rng.integers(0, 400, (h, w)).astype(np.uint16)
    a[rng.random((h, w)) < 0.1] = 65535
    return Image.fromarray(a)


MAKERS = {
    "RGB.png": lambda r, h, w: _save(Image.fromarray(_u8(r, h, w, 3)), "PNG", compress_level=1),
    "RGB.jpg": lambda r, h, w: _save(Image.fromarray(_u8(r, h, w, 3)), "JPEG", quality=90),
    "RGBA.png": lambda r, h, w: _save(Image.fromarray(_u8(r, h, w, 4)), "PNG", compress_level=1),
    "RGB+trns.png": lambda r, h, w: _save(Image.fromarray(_u8(r, h, w, 3) & 0xF0), "PNG", transparency=(16, 32, 48)),
    "L.png": lambda r, h, w: _save(Image.fromarray(_u8(r, h, w)), "PNG", compress_level=1),
    "L.jpg": lambda r, h, w: _save(Image.fromarray(_u8(r, h, w)), "JPEG", quality=85),
    "LA.png": lambda r, h, w: _save(Image.fromarray(_u8(r, h, w, 2), "LA"), "PNG", compress_level=1),
    "1.png": lambda r, h, w: _save(Image.fromarray(_u8(r, h, w) > 127), "PNG"),
    "P.png": lambda r, h, w: _save(_pal(r, h, w), "PNG"),
    "P+trns-index.png": lambda r, h, w: _save(_pal(r, h, w), "PNG", transparency=7),
    "P+trns-alpha.png": lambda r, h, w: _save(_pal(r, h, w), "PNG", transparency=_u8(r, 1, 256).tobytes()),
    "CMYK.jpg": lambda r, h, w: _save(Image.fromarray(_u8(r, h, w, 4), "CMYK"), "JPEG", quality=90),
    "I16.png": lambda r, h, w: _save(_i16(r, h, w), "PNG"),
    "I16+trns.png": lambda r, h, w: _save(_i16(r, h, w), "PNG", transparency=100),
    "anim.gif": _gif_anim,
    "P+trns.gif": lambda r, h, w: _save(_pal(r, h, w), "GIF", transparency=3),
    "RGB-lossless.webp": lambda r, h, w: _save(Image.fromarray(_u8(r, h, w, 3)), "WEBP", lossless=True),
    "RGBA-lossless.webp": lambda r, h, w: _save(Image.fromarray(_u8(r, h, w, 4)), "WEBP", lossless=True),
    "RGB-lossy.webp": lambda r, h, w: _save(Image.fromarray(_u8(r, h, w, 3)), "WEBP", quality=80),
}
KINDS = list(MAKERS)


def _cases():
    rng = np.random.default_rng(20260)
    cases = []
    for i in range(len(KINDS) * len(BUDGETS) * 2):  # 19 kinds x 5 budgets, every pair twice (19, 5 coprime)
        area = math.exp(rng.uniform(0, math.log(320 * 240)))      # mostly small images, for speed
        aspect = math.exp(rng.uniform(-math.log(30), math.log(30)))  # up to 1:30 and 30:1
        w = max(1, round(math.sqrt(area * aspect)))
        h = max(1, round(math.sqrt(area / aspect)))
        cases.append((KINDS[i % len(KINDS)], w, h, BUDGETS[i % len(BUDGETS)]))
    # extremes and exact-fit sizes (no-resize path: (th, tw) == (H, W))
    cases += [("RGB.png", 1, 1, b) for b in BUDGETS]
    cases += [("RGBA.png", 1, 30, 70), ("L.png", 30, 1, 1120), ("RGB.png", 1, 4000, 280), ("LA.png", 4000, 1, 560)]
    cases += [("RGB.png", 3000, 100, 140), ("P.png", 100, 3000, 1120), ("RGB.png", 384, 384, 70),
              ("RGBA.png", 768, 768, 280), ("RGB.jpg", 1104, 1104, 560)]
    cases += [("RGB.jpg", 4000, 3000, 1120), ("RGB.jpg", 3000, 4000, 70), ("CMYK.jpg", 4000, 3000, 280),
              ("RGBA-lossless.webp", 1920, 1080, 560), ("anim.gif", 1200, 900, 1120)]
    return cases


CASES = _cases()


@pytest.mark.parametrize("kind,w,h,budget", CASES, ids=[f"{k}-{w}x{h}-{b}" for k, w, h, b in CASES])
def test_matches_transformers(hf, kind, w, h, budget):
    data = MAKERS[kind](np.random.default_rng(w * 7919 + h * 31 + budget), h, w)
    rgb = vision.decode(data, max_pixels=40_000_000)
    assert rgb.shape == (h, w, 3) and rgb.dtype == np.uint8
    assert np.array_equal(rgb, convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True))

    pre = vision.preprocess(rgb, budget)
    ref = hf(images=Image.open(io.BytesIO(data)), max_soft_tokens=budget, return_tensors="np")
    P = 9 * budget
    assert pre.pixel_values.shape == (P, 768) and pre.pixel_values.dtype == np.float32
    assert pre.position_ids.shape == (P, 2) and pre.position_ids.dtype == np.int64
    assert np.array_equal(pre.pixel_values, ref["pixel_values"][0])
    assert np.array_equal(pre.position_ids, ref["image_position_ids"][0])
    assert pre.num_soft_tokens == int(ref["num_soft_tokens_per_image"][0])
    th, tw = pre.size
    assert pre.num_patches == (th // 16) * (tw // 16) == 9 * pre.num_soft_tokens <= P
    assert pre.num_soft_tokens == vision.num_soft_tokens(h, w, budget)
    assert (pre.position_ids[pre.num_patches:] == -1).all() and not pre.pixel_values[pre.num_patches:].any()


def test_target_size_against_transformers_and_spec():
    ref = transformers_gemma4.get_aspect_ratio_preserving_size
    rng = np.random.default_rng(7)
    hs = np.concatenate([rng.integers(1, 5000, 4000), rng.integers(1, 60, 1000), [1, 1, 30, 4000, 16383]])
    ws = np.concatenate([rng.integers(1, 5000, 4000), rng.integers(1, 60, 1000), [1, 30, 1, 1, 1]])
    for h, w in zip(hs.tolist(), ws.tolist()):
        for b in BUDGETS:
            assert vision.target_size(h, w, b) == ref(h, w, patch_size=16, max_patches=9 * b, pooling_kernel_size=3)
    # worked examples of model.md §6.1
    assert vision.target_size(1024, 1024, 280) == (768, 768) and vision.num_soft_tokens(1024, 1024, 280) == 256
    assert vision.target_size(1024, 1024, 560) == (1104, 1104) and vision.num_soft_tokens(1024, 1024, 560) == 529
    assert vision.target_size(480, 640, 280) == (672, 912) and vision.num_soft_tokens(480, 640, 280) == 266
    assert vision.target_size(1080, 1920, 280) == (576, 1056) and vision.num_soft_tokens(1080, 1920, 280) == 264
    with pytest.raises(ValueError):
        vision.target_size(10, 10, 300)


def test_patch_layout_by_hand():
    """Spec §6.1 step 5/6, independent of transformers: no resize at 384x384 / 70 tokens."""
    img = _u8(np.random.default_rng(3), 384, 384, 3)
    pre = vision.preprocess(img, 70)
    assert pre.size == (384, 384) and pre.num_patches == 576 and pre.num_soft_tokens == 64
    for p, dy, dx, c in [(0, 0, 0, 0), (1, 3, 5, 2), (24, 15, 15, 1), (575, 7, 0, 2), (300, 9, 12, 0)]:
        row, col = divmod(p, 24)
        assert tuple(pre.position_ids[p]) == (col, row)
        want = np.float32(np.float64(img[row * 16 + dy, col * 16 + dx, c]) * (1 / 255))
        assert pre.pixel_values[p, (dy * 16 + dx) * 3 + c] == want


def test_exif_orientation_applied(hf):
    im = Image.fromarray(_u8(np.random.default_rng(5), 20, 40, 3))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 CW to display
    data = _save(im, "JPEG", exif=exif.tobytes())
    rgb = vision.decode(data, 10**6)
    assert rgb.shape == (40, 20, 3)
    upright = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    ref = hf(images=upright, max_soft_tokens=140, return_tensors="np")
    assert np.array_equal(vision.preprocess(rgb, 140).pixel_values, ref["pixel_values"][0])


def test_probe():
    data = MAKERS["RGBA.png"](np.random.default_rng(1), 30, 50)
    assert vision.probe(data, 1500) == ("PNG", 50, 30)
    assert vision.probe(MAKERS["anim.gif"](np.random.default_rng(1), 7, 9), 100)[0] == "GIF"
    with pytest.raises(vision.ImageError, match="too large"):
        vision.probe(data, 1499)


# --- errors ---------------------------------------------------------------------------------------

def _good(kind, h=64, w=80):
    return MAKERS[kind](np.random.default_rng(11), h, w)


@pytest.mark.parametrize("data,match", [
    (b"", "not a readable image"),
    (b"hello, not an image at all", "not a readable image"),
    (np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes(), "not a readable image"),
    (b"\x89PNG\r\n\x1a\n" + b"\x00" * 100, "not a readable image"),
    (_save(Image.new("RGB", (8, 8)), "BMP"), "unsupported image format BMP"),
    (_save(Image.new("RGB", (8, 8)), "TIFF"), "unsupported image format TIFF"),
])
def test_bad_bytes(data, match):
    with pytest.raises(vision.ImageError, match=match):
        vision.decode(data, 10**6)


@pytest.mark.parametrize("kind", ["RGB.png", "RGB.jpg", "L.jpg", "P.png", "P+trns.gif", "RGB-lossless.webp", "RGB-lossy.webp"])
@pytest.mark.parametrize("keep", [0.3, 0.8])
def test_truncated(kind, keep):
    data = _good(kind)
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False
    with pytest.raises(vision.ImageError, match="corrupt or truncated|not a readable"):
        vision.decode(data[: int(len(data) * keep)], 10**6)


def test_truncated_flag_guard(monkeypatch):
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(RuntimeError):
        vision.decode(_good("RGB.png"), 10**6)


def _png_bomb(side):
    """A valid side x side 1-bit PNG, ~50 KB: zeros compress ~1000:1."""
    def chunk(tag, body):
        return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", zlib.crc32(tag + body))
    z = zlib.compressobj(9)
    row = b"\x00" * (1 + (side + 7) // 8)
    idat = b"".join(z.compress(row * 1000) for _ in range(side // 1000)) + z.compress(row * (side % 1000)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


@pytest.mark.parametrize("side,max_pixels", [(8000, 40_000_000), (20000, 40_000_000), (20000, 10**9)])
def test_pixel_bomb_refused_without_decoding(monkeypatch, side, max_pixels):
    """8000^2 trips our header check; 20000^2 (400 MP) trips Pillow's own DecompressionBombError inside
    Image.open (> 2 * MAX_IMAGE_PIXELS) before ours even runs, whatever max_pixels says."""
    bomb = _png_bomb(side)
    assert len(bomb) < 200_000
    def no_load(self):
        raise AssertionError("pixels were decoded")
    monkeypatch.setattr(ImageFile.ImageFile, "load", no_load)
    tracemalloc.start()
    t = time.perf_counter()
    for fn in (vision.probe, vision.decode):
        with pytest.raises(vision.ImageError, match="too large") as e:
            fn(bomb, max_pixels)
        assert str(side * side) in str(e.value)
    elapsed = time.perf_counter() - t
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert elapsed < 0.5, elapsed
    assert peak < 2_000_000, peak  # decoding would allocate side^2 bytes (Pillow keeps mode "1" a byte a pixel)
