"""Image decode and Gemma-4 preprocessing (Pillow + numpy), model.md §6.1.

bytes --probe--> (format, W, H) checked against the pixel cap from the header alone
      --decode--> (H, W, 3) uint8 RGB
      --preprocess--> patches (P, 768) f32 + position ids (P, 2) i64, P = 9 * soft_tokens

The reference is transformers' `Gemma4ImageProcessorPil` fed a PIL image (image_processing_pil_gemma4.py,
PilBackend.process_image -> image_transforms.convert_to_rgb / resize / rescale); we repeat its Pillow calls
in the same order so the output is bit-identical (test_span02.py, the vision tests). Differences from
the spec text / between transformers paths, all decided here:
- EXIF orientation is applied (like transformers' load_image, which every URL/path/base64 input goes
  through); a PIL image handed straight to the processor is not rotated. No-op without an orientation tag.
- Alpha is composited on white (convert_to_rgb, what the processor does to PIL inputs, and the spec);
  load_image instead calls .convert("RGB") first, which DROPS alpha and exposes the colour under
  transparent pixels. So transformers itself differs for a base64 RGBA PNG; we follow the processor.
- 16-bit grey (I;16) and 32-bit I/F images are converted by Pillow's convert("RGB"), which CLIPS to
  0..255 instead of scaling (a 16-bit PNG is mostly white). Kept, because the processor does the same.
"""
import io
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageFile, ImageOps

SOFT_TOKENS = (70, 140, 280, 560, 1120)  # budgets the vision tower was trained with
PATCH = 16                               # pixels per patch side
POOL = 3                                 # 3x3 patches pool into one soft token
# Pillow's JPEG opener also yields format "MPO" for the multi-picture JPEGs many cameras write (first frame used).
FORMATS = ("JPEG", "PNG", "WEBP", "GIF")
# 1/255 applied as transformers does it (uint8 -> float64 * (1/255) -> float32), tabulated once.
_RESCALE = (np.arange(256, dtype=np.float64) * (1 / 255)).astype(np.float32)  # (256,) f32


class ImageError(ValueError):
    """A client's image we refuse (unsupported, corrupt, too large); wire turns it into a 422."""


@dataclass(frozen=True)
class Preprocessed:
    pixel_values: np.ndarray  # (P, 768) f32 in [0, 1], row = (dy*16 + dx)*3 + c; rows >= num_patches are 0
    position_ids: np.ndarray  # (P, 2) i64, (x=col, y=row) of each patch; (-1, -1) on padding rows
    num_soft_tokens: int      # N = num_patches / 9, the <|image|> tokens this image takes in the prompt
    num_patches: int          # valid rows of pixel_values, row-major over the (th/16, tw/16) grid
    size: tuple               # (th, tw) pixels after resizing, both multiples of 48


# --- decode ---------------------------------------------------------------------------------------

def _open(data: bytes) -> Image.Image:
    """Parse the header only (Pillow is lazy); only our formats' parsers ever see the bytes."""
    try:
        return Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError as e:  # Pillow's own cap (2 * MAX_IMAGE_PIXELS) fired first
        raise ImageError(f"image too large: {e}") from None
    except Exception:
        pass
    try:  # not one of ours: name the format if Pillow knows it, for a useful message
        fmt = Image.open(io.BytesIO(data)).format
    except Exception:
        fmt = None
    if fmt is not None:
        raise ImageError(f"unsupported image format {fmt} (accepted: JPEG, PNG, WEBP, GIF)")
    raise ImageError("not a readable image (corrupt, empty or unknown format)")


def _check(im: Image.Image, max_pixels: int) -> tuple:
    w, h = im.size
    if w <= 0 or h <= 0:
        raise ImageError(f"image has an empty size {w}x{h}")
    if w * h > max_pixels:  # from the header: nothing has been decoded or allocated yet
        raise ImageError(f"image too large: {w}x{h} = {w * h} pixels, the limit is {max_pixels}")
    return im.format, w, h


def probe(data: bytes, max_pixels: int) -> tuple:
    """(format, width, height) from the header alone; ImageError if unsupported or over max_pixels."""
    with _open(data) as im:
        return _check(im, max_pixels)


def decode(data: bytes, max_pixels: int) -> np.ndarray:
    """Image bytes -> (H, W, 3) uint8 RGB, first frame, converted as the Gemma-4 processor converts."""
    # With this flag set Pillow pads a truncated file with grey instead of failing; it is a process-wide
    # global, so a server that finds it set has been misconfigured by someone: refuse to run rather than
    # silently feed half images to the model.
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        raise RuntimeError("PIL.ImageFile.LOAD_TRUNCATED_IMAGES must stay False")
    with _open(data) as im:
        fmt, w, h = _check(im, max_pixels)
        try:
            im.load()  # the real decode: truncated or corrupt data raises here, not later
            try:  # broken EXIF is metadata, not pixels: keep the image unrotated rather than refuse it
                ImageOps.exif_transpose(im, in_place=True)
            except Exception:
                pass
            # PilBackend.process_image -> image_transforms.convert_to_rgb, verbatim.
            if "A" in im.getbands() or im.info.get("transparency") is not None:
                rgba = im.convert("RGBA")
                white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
                rgb = Image.alpha_composite(white, rgba).convert("RGB")
            else:
                rgb = im.convert("RGB")
            out = np.asarray(rgb)  # (H, W, 3) uint8
        except ImageError:
            raise
        except Exception as e:  # Pillow raises OSError, SyntaxError, ValueError, EOFError, zlib.error, ...
            raise ImageError(f"corrupt or truncated {fmt} image ({w}x{h}): {e}") from None
    if out.dtype != np.uint8 or out.ndim != 3 or out.shape[2] != 3:
        raise ImageError(f"could not convert {fmt} image to 8-bit RGB (got {out.dtype} {out.shape})")
    return out


# --- preprocess -----------------------------------------------------------------------------------

def target_size(h: int, w: int, soft_tokens: int) -> tuple:
    """(th, tw): the largest multiple-of-48 size with the aspect ratio of (h, w) that fits 9*soft_tokens
    patches (up- or down-scaling). Same float arithmetic as get_aspect_ratio_preserving_size, so the
    floor() lands on the same side of every boundary."""
    if soft_tokens not in SOFT_TOKENS:
        raise ValueError(f"soft_tokens must be one of {SOFT_TOKENS}, got {soft_tokens}")
    max_patches = soft_tokens * POOL * POOL
    target_px = max_patches * PATCH**2
    factor = math.sqrt(target_px / (h * w))
    side = POOL * PATCH
    th = int(math.floor(factor * h / side)) * side
    tw = int(math.floor(factor * w / side)) * side
    # Very long images: the short side rounds to 0, so it gets one 48-px row and the long side the rest
    # of the budget. Both 0 cannot happen (th*tw would be < 48*48 while target_px >= 630*256).
    if th == 0:
        th, tw = side, min(int(math.floor(w / h)) * side, soft_tokens * side)
    elif tw == 0:
        th, tw = min(int(math.floor(h / w)) * side, soft_tokens * side), side
    assert th * tw <= target_px and th > 0 and tw > 0, (h, w, th, tw)
    return th, tw


def num_soft_tokens(h: int, w: int, soft_tokens: int) -> int:
    """Prompt length of an image, without touching pixels (for admission and the prompt layout)."""
    th, tw = target_size(h, w, soft_tokens)
    return (th // (POOL * PATCH)) * (tw // (POOL * PATCH))


def preprocess(rgb: np.ndarray, soft_tokens: int = 280) -> Preprocessed:
    """(H, W, 3) uint8 RGB -> Gemma-4 vision input for a budget of `soft_tokens` (§6.1 steps 2-7)."""
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"expected (H, W, 3) uint8, got {rgb.dtype} {rgb.shape}")
    h, w = rgb.shape[:2]
    th, tw = target_size(h, w, soft_tokens)
    if (th, tw) != (h, w):
        # PIL BICUBIC on the uint8 image, no reducing_gap, rounded back to uint8 (image_transforms.resize).
        rgb = np.asarray(Image.fromarray(rgb).resize((tw, th), Image.Resampling.BICUBIC))
    ph, pw = th // PATCH, tw // PATCH
    n = ph * pw
    max_patches = soft_tokens * POOL * POOL
    # (th, tw, 3) -> (ph, 16, pw, 16, 3) -> (ph, pw, 16, 16, 3): patches row-major, inside one patch
    # pixel-row-major with RGB innermost, as convert_image_to_patches does from CHW.
    patches = rgb.reshape(ph, PATCH, pw, PATCH, 3).transpose(0, 2, 1, 3, 4).reshape(n, PATCH * PATCH * 3)
    pixel_values = np.zeros((max_patches, PATCH * PATCH * 3), np.float32)  # (P, 768) f32
    pixel_values[:n] = _RESCALE[patches]
    position_ids = np.full((max_patches, 2), -1, np.int64)                  # (P, 2) i64
    position_ids[:n, 0] = np.tile(np.arange(pw), ph)    # x = column
    position_ids[:n, 1] = np.repeat(np.arange(ph), pw)  # y = row
    return Preprocessed(pixel_values, position_ids, n // (POOL * POOL), n, (th, tw))
