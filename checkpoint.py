"""Checkpoint reading and writing: safetensors (mmap), per-module format detection, NVFP4/FP8 in numpy.

Formats (checkpoint.md): a Linear weight W is (N=out, K=in) row-major. NVFP4 packs two e2m1 codes per byte
(column 2j in the low nibble, 2j+1 in the high one) with one e4m3 scale per 16 columns and a per-tensor f32
scalar: a divisor for compressed-tensors (CT, weight_global_scale = 2688/amax), a multiplier for ModelOpt
(weight_scale_2 = amax/2688). FP8 is e4m3fn times a multiplier per tensor, per row or per 128x128 block.
The quantizers reproduce llm-compressor + compressed-tensors 0.20 bit for bit, including their rounding
order (which differs from the textbook formula, see the comments), so `--quantize` at load gives the same
bytes as a producer-written span-02 directory.
"""
import json
import os
import re
from dataclasses import dataclass
from functools import cached_property

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)
FLOATS = ('BF16', 'F32', 'F16')
DTYPES = {k: np.dtype(v) for k, v in dict(
    F64=np.float64, F32=np.float32, F16=np.float16, BF16=BF16, F8_E4M3=E4M3, F8_E5M2=ml_dtypes.float8_e5m2,
    I64=np.int64, I32=np.int32, I16=np.int16, I8=np.int8, U64=np.uint64, U32=np.uint32, U16=np.uint16,
    U8=np.uint8, BOOL=np.bool_).items()}                    # safetensors dtype string -> numpy / ml_dtypes dtype
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class CheckpointError(ValueError):
    """A tensor is missing, mis-shaped or of an unknown format; the message names it."""


def _f32(a):
    return np.asarray(a).astype(np.float32)


# --- number formats -------------------------------------------------------------------------------------

E2M1_VALUES = np.arange(16, dtype=np.uint8).view(E2M1).astype(np.float32)  # (16,) f32: code -> value (8 = -0.0)


def e2m1_decode(codes):
    return E2M1_VALUES[np.asarray(codes) & 0xF]


def e2m1_encode(x):
    """f32 -> e2m1 codes uint8 (0..15): round to nearest even, saturate at +-6 (ml_dtypes does both)."""
    return np.asarray(x, np.float32).astype(E2M1).view(np.uint8) & 0xF


def e2m1_pack(codes):
    """(..., K) codes -> (..., K/2) uint8; even column in the low nibble (ModelOpt and CT agree)."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def e2m1_unpack(packed):
    """(..., K/2) uint8 -> (..., K) codes uint8."""
    p = np.asarray(packed, np.uint8)
    return np.stack([p & 0xF, p >> 4], -1).reshape(*p.shape[:-1], 2 * p.shape[-1])


def e4m3_decode(b):
    """uint8 bytes (or e4m3 values) -> f32; 0x7F/0xFF stay NaN."""
    b = np.asarray(b)
    return (b.view(E4M3) if b.dtype == np.uint8 else b).astype(np.float32)


def e4m3_encode(x):
    """f32 -> e4m3fn (ml_dtypes dtype), round to nearest even. ml_dtypes does not saturate (500 -> NaN),
    so clamp to +-448 first, as the producers do; NaN stays NaN."""
    return np.clip(np.asarray(x, np.float32), -448.0, 448.0).astype(E4M3)


# --- dequantization (exact numpy references) ------------------------------------------------------------

def nvfp4_dequant(packed, scale, global_scale, modelopt=False):
    """packed (N, K/2) u8, scale (N, K/16) e4m3, global_scale ()/(1,) f32 -> (N, K) f32.
    CT: e2m1 * scale / global_scale (divisor); ModelOpt: e2m1 * scale * weight_scale_2 (multiplier).
    e2m1 x e4m3 is exact (in f32, bf16 and f16); only the per-tensor step rounds."""
    n, k2 = packed.shape
    qs = e2m1_decode(e2m1_unpack(packed)).reshape(n, k2 // 8, 16) * e4m3_decode(scale)[..., None]
    g = _f32(global_scale).reshape(())
    return (qs * g if modelopt else qs / g).reshape(n, 2 * k2)


def fp8_granularity(scale_shape, n, k):
    """'fp8_tensor' | 'fp8_channel' | 'fp8_block' from the scale's shape, or None if it fits none."""
    s, nb = tuple(scale_shape), (-(-n // 128), -(-k // 128))
    if int(np.prod(s)) == 1:
        return 'fp8_tensor'
    if s in ((n, 1), (n,)):                                   # CT [N,1] / ModelOpt [N]
        return 'fp8_channel'
    if s in (nb, (nb[0], 1, nb[1], 1)):                       # CT, DeepSeek [N/128,K/128]; ModelOpt [N/128,1,K/128,1]
        return 'fp8_block'
    return None


def fp8_dequant(w8, scale):
    """w8 (N, K) e4m3 times a multiplier scale (bf16 or f32 as stored) -> (N, K) f32."""
    n, k = w8.shape
    w, s = e4m3_decode(w8), _f32(scale)
    kind = fp8_granularity(s.shape, n, k)
    if kind == 'fp8_tensor':
        return w * s.reshape(())
    if kind == 'fp8_channel':
        return w * s.reshape(n, 1)
    if kind == 'fp8_block':
        s = s.reshape(-(-n // 128), -(-k // 128))
        return w * np.repeat(np.repeat(s, 128, 0), 128, 1)[:n, :k]
    raise CheckpointError(f'fp8 weight {(n, k)}: scale shape {s.shape} is not per-tensor, per-channel or 128x128')


# --- quantizers (bit-exact with llm-compressor / compressed-tensors 0.20) --------------------------------

def _calc_dtype(w):
    # the observer computes min/max and amax/qmax in the weight's own dtype (bf16 for Gemma), not in f32
    return w.dtype if w.dtype in (BF16, np.dtype(np.float16)) else np.dtype(np.float32)


def nvfp4_global_scale(*ws):
    """(1,) f32 global scale g = 2688 / amax over all ws (CT generate_gparam; amax clamped to f32 tiny,
    NaN/Inf -> 1). Passing gate and up gives their shared scale, the minimum g, as llm-compressor fuses.
    CT writes `2688 / tensor`, which torch evaluates as reciprocal(amax) * 2688: two roundings, kept here."""
    amax = np.max([np.max(np.abs(_f32(w))) for w in ws]).astype(np.float32)
    with np.errstate(all='ignore'):
        g = (np.float32(1) / np.maximum(amax, np.finfo(np.float32).tiny)) * np.float32(2688.0)
    return np.array([g if np.isfinite(g) else 1.0], np.float32)


def quantize_nvfp4(w, global_scale=None):
    """w (N, K) bf16/f32 -> (packed (N, K/2) u8, scale (N, K/16) e4m3, global_scale (1,) f32), CT layout.
    Follows the package where it differs from checkpoint.md's formula:
      s_b = e4m3(clamp(g * dt(amax_b / 6), <=448)), amax_b/6 rounded in the weight dtype dt (calculate_qparams);
      a scale that is 0 after rounding (zero block or underflow) becomes 0.125 (its fp8 eps), as the spec says;
      q = rne_e2m1(clamp(w / f32(s_b / g), +-6)): CT divides by s/g, not multiplies by g/s;
      an exactly +-0 quotient gets code 0 (torch.sign(-0.) is 0), a negative one that rounds to 0 gets 8."""
    w = np.asarray(w)
    n, k = w.shape
    if k % 16:
        raise ValueError(f'NVFP4 needs K divisible by 16, got weight shape {w.shape}')
    x = _f32(w).reshape(n, k // 16, 16)                                        # (N, K/16, 16) f32
    g = nvfp4_global_scale(x) if global_scale is None else np.asarray(global_scale, np.float32).reshape(1)
    d = (np.max(np.abs(x), -1) / np.float32(6)).astype(_calc_dtype(w)).astype(np.float32)
    s = e4m3_decode(e4m3_encode(g[0] * d))                                     # (N, K/16) f32, e4m3 values
    s[s == 0] = 0.125
    q = np.clip(x / (s / g[0])[..., None], -6.0, 6.0)
    codes = e2m1_encode(q)
    codes[q == 0] = 0
    return e2m1_pack(codes.reshape(n, k)), s.astype(E4M3), g


def quantize_fp8_channel(w):
    """w (N, K) bf16/f32 -> (w8 (N, K) e4m3, scale (N, 1) in w's dtype), as CT float-quantized channel:
    s = dt(amax_row / 448) (0 -> eps of dt: 2^-7 for bf16); q = e4m3(clamp(dt(w / s) + 0, +-448)):
    the division is rounded to the weight dtype first (torch bf16 op), then the zero point (0) is
    added, which turns -0.0 into +0.0, then the cast to e4m3 rounds again (double rounding, as CT)."""
    w = np.asarray(w)
    dt = _calc_dtype(w)
    x = _f32(w)                                                                # (N, K) f32
    s = (np.max(np.abs(x), 1, keepdims=True) / np.float32(448)).astype(dt).astype(np.float32)
    s[s == 0] = ml_dtypes.finfo(dt).eps
    q = (x / s).astype(dt).astype(np.float32) + np.float32(0)
    return e4m3_encode(q), s.astype(dt)


# --- reading --------------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class LinearRaw:
    """One Linear's stored arrays, untouched, for the GPU backend."""
    format: str                 # see Tensors.format
    shape: tuple                # (N, K) logical
    weight: np.ndarray          # bf16/f32/f16 (N, K) | fp8 (N, K) e4m3 | nvfp4 (N, K/2) u8 packed
    scale: np.ndarray = None    # nvfp4 (N, K/16) e4m3 | fp8 (1,)/() tensor, (N,1)/(N,) channel, 2-D/4-D blocks
    global_scale: np.ndarray = None  # nvfp4_ct: (1,) f32 DIVISOR; nvfp4_modelopt: ()/(1,) f32 MULTIPLIER
    input_scale: np.ndarray = None   # input_global_scale / input_scale if stored (unused: weight-only on sm_90)


def dequantize(raw):
    """LinearRaw -> (N, K) f32."""
    if raw.format in ('bf16', 'f32', 'f16'):
        return _f32(raw.weight)
    if raw.format.startswith('nvfp4'):
        return nvfp4_dequant(raw.weight, raw.scale, raw.global_scale, raw.format == 'nvfp4_modelopt')
    return fp8_dequant(raw.weight, raw.scale)


class Tensors:
    """Read API over name -> (dtype string, shape); subclasses provide raw(name)."""

    def __init__(self, index):
        self._index = index                          # {name: (safetensors dtype str, shape tuple)}
        self.names = set(index)
        self._mods = {}                              # {module: {suffix}}, module = name up to the last '.'
        for name in index:
            m, _, s = name.rpartition('.')
            self._mods.setdefault(m, set()).add(s)

    def has(self, name):
        return name in self._index

    def shape(self, name):
        return self._entry(name)[1]

    def dtype(self, name):
        return self._entry(name)[0]

    def _entry(self, name):
        if name not in self._index:
            raise CheckpointError(f'missing tensor {name}')
        return self._index[name]

    def _get(self, name, shape=None):
        if name not in self._index:
            raise CheckpointError(f'missing tensor {name} (expected shape {shape})')
        found = self._index[name][1]
        if shape is not None and found != tuple(shape):
            raise CheckpointError(f'tensor {name}: expected shape {tuple(shape)}, found {found}')
        return self.raw(name)

    @cached_property
    def text_prefix(self):
        for p in ('model.language_model.', 'model.', ''):
            if p + 'embed_tokens.weight' in self._index:
                return p
        raise CheckpointError('no embed_tokens.weight under model.language_model., model. or the root')

    @cached_property
    def vision_prefix(self):
        return 'model.vision_tower.' if any(n.startswith('model.vision_tower.') for n in self.names) else None

    def format(self, module):
        """'bf16' | 'f32' | 'f16' | 'nvfp4_ct' | 'nvfp4_modelopt' | 'fp8_tensor' | 'fp8_channel' | 'fp8_block',
        from the tensors present (checkpoint.md section 0)."""
        t = self._mods.get(module, set())
        w = self._index.get(module + '.weight', (None,))[0]
        if {'weight_packed', 'weight_scale', 'weight_global_scale'} <= t:
            return 'nvfp4_ct'
        if w == 'U8' and {'weight_scale', 'weight_scale_2'} <= t:
            return 'nvfp4_modelopt'
        if w == 'F8_E4M3' and 'weight_scale_inv' in t:
            return 'fp8_block'                                            # DeepSeek: a multiplier, despite the name
        if w == 'F8_E4M3' and 'weight_scale' in t and len(self.shape(module + '.weight')) == 2:
            kind = fp8_granularity(self.shape(module + '.weight_scale'), *self.shape(module + '.weight'))
            if kind:
                return kind
        if w in FLOATS and not t & {'weight_packed', 'weight_scale', 'weight_scale_2', 'weight_scale_inv'}:
            return w.lower()
        if not t:
            raise CheckpointError(f'missing tensor {module}.weight')
        found = {s: self._index[f'{module}.{s}'] for s in sorted(t)}           # suffix -> (dtype, shape)
        raise CheckpointError(f'module {module}: unknown tensor set {found}')

    def linear_raw(self, module, shape=None):
        if module not in self._mods:
            raise CheckpointError(f'missing tensor {module}.weight (expected shape {shape}; no {module}.* at all)')
        fmt = self.format(module)
        m = module + '.'
        if fmt.startswith('nvfp4'):
            ct = fmt == 'nvfp4_ct'
            wname = m + ('weight_packed' if ct else 'weight')
            n, k = shape if shape is not None else (self.shape(wname)[0], 2 * self.shape(wname)[1])
            w = self._get(wname, (n, k // 2))
            s = self._get(m + 'weight_scale', (n, k // 16))
            gname = m + ('weight_global_scale' if ct else 'weight_scale_2')
            g = self._get(gname)
            if g.size != 1:
                raise CheckpointError(f'tensor {gname}: expected one value, found shape {g.shape}')
            inp = m + ('input_global_scale' if ct else 'input_scale')
        else:
            w = self._get(m + 'weight', shape)
            n, k = w.shape
            g = s = None
            if fmt.startswith('fp8'):
                s = self._get(m + ('weight_scale_inv' if self.has(m + 'weight_scale_inv') else 'weight_scale'))
            inp = m + 'input_scale'
        return LinearRaw(fmt, (n, k), w, s, g, self.raw(inp) if self.has(inp) else None)

    def shape_of_linear(self, module):
        """Logical (N, K) of a Linear module, whatever its format."""
        return self.linear_raw(module).shape

    def linear(self, module, shape=None):
        """Dequantized weight (N, K) f32 of a Linear module, shape-checked."""
        return dequantize(self.linear_raw(module, shape))

    def tensor(self, name, shape=None):
        """A plain tensor (norm, router, embedding, layer_scalar) as f32, shape-checked."""
        a = self._get(name, shape)
        if self.dtype(name) not in FLOATS + ('F64',):
            raise CheckpointError(f'tensor {name}: dtype {self.dtype(name)} is not a plain float tensor')
        return _f32(a)

    def experts(self, layer_prefix, n_experts, hidden, inter):
        """-> (gate_up (E, 2I, H) f32, down (E, H, I) f32), gate rows first (transformers' fused layout),
        from fused 3-D bf16/f32 tensors or per-expert 2-D Linears (experts.{e}. or moe.experts.{e}.)."""
        p = layer_prefix if layer_prefix.endswith('.') else layer_prefix + '.'
        e_, h, i = n_experts, hidden, inter
        if self.has(p + 'experts.gate_up_proj'):
            return (self.tensor(p + 'experts.gate_up_proj', (e_, 2 * i, h)),
                    self.tensor(p + 'experts.down_proj', (e_, h, i)))
        base = next((b for b in (p + 'experts.', p + 'moe.experts.') if b + '0.gate_proj' in self._mods), None)
        if base is None:
            raise CheckpointError(f'missing tensor {p}experts.gate_up_proj (nor per-expert {p}experts.0.gate_proj.*)')
        gate_up = np.empty((e_, 2 * i, h), np.float32)                  # (E, 2I, H) f32
        down = np.empty((e_, h, i), np.float32)                         # (E, H, I) f32
        for e in range(e_):
            gate_up[e, :i] = self.linear(f'{base}{e}.gate_proj', (i, h))
            gate_up[e, i:] = self.linear(f'{base}{e}.up_proj', (i, h))
            down[e] = self.linear(f'{base}{e}.down_proj', (h, i))
        return gate_up, down

    def quantized_view(self):
        """The span-02 quantization of this (bf16) checkpoint, same API (what --quantize loads)."""
        return quantize_checkpoint(self)


class Checkpoint(Tensors):
    """A HF model directory: model.safetensors or model.safetensors.index.json shards, memory-mapped.
    The header is parsed here (8-byte LE length, JSON, then data at 8 + length + data_offsets), because
    safetensors' numpy backend cannot return F8_E4M3 (it looks for np.float8_e4m3fn)."""

    def __init__(self, model_dir):
        self.path = str(model_dir)
        idx = os.path.join(self.path, 'model.safetensors.index.json')
        if os.path.exists(idx):
            with open(idx) as f:
                weight_map = json.load(f)['weight_map']
            files = sorted(set(weight_map.values()))
        else:
            weight_map = None
            files = ['model.safetensors'] if os.path.exists(os.path.join(self.path, 'model.safetensors')) or \
                not os.path.isdir(self.path) else sorted(f for f in os.listdir(self.path) if f.endswith('.safetensors'))
            if not files:
                raise CheckpointError(f'no *.safetensors in {self.path}')
        self._loc, self._mm, index = {}, {}, {}
        for fn in files:
            path = os.path.join(self.path, fn)
            if not os.path.exists(path):
                raise CheckpointError(f'missing file {path}')
            size = os.path.getsize(path)
            with open(path, 'rb') as f:
                n = int.from_bytes(f.read(8), 'little')
                if not 2 <= n <= size - 8:
                    raise CheckpointError(f'{path}: not a safetensors file (a header of {n} bytes in {size})')
                try:
                    header = json.loads(f.read(n))
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise CheckpointError(f'{path}: not a safetensors file (its header: {e})') from None
            header.pop('__metadata__', None)
            self._mm[fn] = np.memmap(path, np.uint8, 'r')
            for name, e in header.items():
                dt, shape, (a, b) = DTYPES.get(e['dtype']), tuple(e['shape']), e['data_offsets']
                if dt is None or b - a != int(np.prod(shape)) * dt.itemsize:
                    raise CheckpointError(f'tensor {name} in {fn}: bad dtype {e["dtype"]} or size for {shape}')
                if 8 + n + b > size:
                    raise CheckpointError(f'{path}: truncated ({size} bytes; tensor {name} ends at {8 + n + b})')
                index[name] = (e['dtype'], shape)
                self._loc[name] = (fn, 8 + n + a, 8 + n + b)
        if weight_map is not None:
            missing = sorted(k for k in weight_map if k not in index)
            if missing:
                raise CheckpointError(f'index names tensors missing from the shards: {missing[:5]}')
        super().__init__(index)

    def raw(self, name):
        """Memory-mapped array in its stored dtype (BF16 -> ml_dtypes.bfloat16, F8_E4M3 -> float8_e4m3fn)."""
        dt, shape = self._entry(name)
        fn, a, b = self._loc[name]
        return self._mm[fn][a:b].view(DTYPES[dt]).reshape(shape)


class InMemoryCheckpoint(Tensors):
    """The same API over a dict name -> np.ndarray (e.g. quantize_span02's output)."""

    def __init__(self, tensors):
        self._t = {k: np.asarray(v) for k, v in tensors.items()}
        super().__init__({k: (DTYPE_NAMES[v.dtype], v.shape) for k, v in self._t.items()})

    def raw(self, name):
        self._entry(name)
        return self._t[name]


# --- writing: the span-02 layout ------------------------------------------------------------------------

def unfit_output_dir(path, mark=None):
    """Why `path` may not take a model directory written afresh, or None when it may: "a file", or "not empty"
    for a directory with files and without the writer's `mark` file (an existing model's would be overwritten)."""
    if not os.path.exists(path):
        return None
    if not os.path.isdir(path):
        return "a file"
    return "not empty" if os.listdir(path) and not (mark and os.path.exists(os.path.join(path, mark))) else None


def save_safetensors(path, tensors, metadata=None):
    """Deterministic safetensors file (safetensors sorts by dtype alignment, then name); ml_dtypes arrays
    are written as BF16 / F8_E4M3. save_file reads each array's memory as is, so make it C-contiguous."""
    from safetensors.numpy import save_file
    arrays = {}
    for k, v in tensors.items():
        v = np.asarray(v)
        arrays[k] = v if v.flags.c_contiguous else v.copy(order='C')
    save_file(arrays, str(path), metadata=metadata or {'format': 'pt'})


def _to_bf16(a):
    return a if a.dtype == BF16 else _f32(a).astype(BF16)


def _put_nvfp4(out, module, w, g):
    if w.shape[1] % 16:
        raise ValueError(f'{module}: K={w.shape[1]} is not divisible by 16, cannot store NVFP4')
    out[module + '.weight_packed'], out[module + '.weight_scale'], out[module + '.weight_global_scale'] = \
        quantize_nvfp4(w, g)


def quantize_span02(tensors, text_prefix):
    """bf16 Gemma-4 state dict -> span-02 layout. Experts -> per-expert 2-D NVFP4 CT (gate and up of one
    expert share a global scale); attention q/k/v/o and dense mlp gate/up/down -> FP8 per channel
    (weight F8_E4M3, weight_scale (N,1) BF16); everything else -> bf16 unchanged. Inputs are cast to bf16
    first, so the result is what llm-compressor gives on the bf16 model. Already quantized modules pass."""
    tp = re.escape(text_prefix)
    fused = re.compile(tp + r'layers\.\d+\.experts\.(gate_up_proj|down_proj)')
    unfused = re.compile(tp + r'(layers\.\d+\.(?:moe\.)?experts\.\d+\.)(gate|up|down)_proj\.weight')
    fp8 = re.compile(tp + r'layers\.\d+\.(self_attn\.[qkvo]|mlp\.(gate|up|down))_proj\.weight')
    scales = ('weight_packed', 'weight_scale', 'weight_scale_2', 'weight_scale_inv', 'weight_global_scale',
              'input_scale', 'input_global_scale')
    quantized = {n.rpartition('.')[0] for n in tensors if n.rpartition('.')[2] in scales}
    out = {}
    for name in sorted(tensors):
        a = np.asarray(tensors[name])
        if a.dtype not in (BF16, np.float32, np.float16) or name.rpartition('.')[0] in quantized:
            out[name] = a
        elif m := fused.fullmatch(name):
            base = name.rpartition('.')[0]                          # '...layers.L.experts'
            if m.group(1) == 'gate_up_proj':                        # (E, 2I, H): rows [:I] gate, [I:] up
                i = a.shape[1] // 2
                for e in range(a.shape[0]):
                    gate, up = _to_bf16(a[e, :i]), _to_bf16(a[e, i:])
                    g = nvfp4_global_scale(gate, up)
                    _put_nvfp4(out, f'{base}.{e}.gate_proj', gate, g)
                    _put_nvfp4(out, f'{base}.{e}.up_proj', up, g)
            else:                                                   # (E, H, I)
                for e in range(a.shape[0]):
                    _put_nvfp4(out, f'{base}.{e}.down_proj', _to_bf16(a[e]), None)
        elif m := unfused.fullmatch(name):
            sib = {'gate': 'up', 'up': 'gate'}.get(m.group(2))
            peers = [_to_bf16(a)] + ([_to_bf16(np.asarray(tensors[f'{text_prefix}{m.group(1)}{sib}_proj.weight']))]
                                     if sib else [])
            _put_nvfp4(out, name[:-len('.weight')], peers[0], nvfp4_global_scale(*peers))
        elif fp8.fullmatch(name):
            out[name], out[name[:-len('weight')] + 'weight_scale'] = quantize_fp8_channel(_to_bf16(a))
        else:
            out[name] = _to_bf16(a)
    return out


def quantize_checkpoint(ckpt):
    """--quantize: span-02 quantization of a loaded checkpoint, as an InMemoryCheckpoint (bf16 tensors that
    stay bf16 remain memory-mapped views)."""
    return InMemoryCheckpoint(quantize_span02({n: ckpt.raw(n) for n in ckpt.names}, ckpt.text_prefix))


def span02_quantization_config(text_prefix):
    """config.json quantization_config (CT mixed-precision): group_0 FP8 channel weights with dynamic
    per-token activations (preset FP8_DYNAMIC), group_1 NVFP4 experts, weights only (preset NVFP4A16:
    no input_global_scale is written, and sm_90 runs NVFP4 as W4A16 anyway)."""
    tp = re.escape(text_prefix)
    fp8_w = {'num_bits': 8, 'type': 'float', 'symmetric': True, 'group_size': None, 'strategy': 'channel',
             'dynamic': False}
    fp8_a = {'num_bits': 8, 'type': 'float', 'symmetric': True, 'group_size': None, 'strategy': 'token',
             'dynamic': True}
    fp4_w = {'num_bits': 4, 'type': 'float', 'symmetric': True, 'group_size': 16, 'strategy': 'tensor_group',
             'dynamic': False, 'scale_dtype': 'torch.float8_e4m3fn'}
    return {
        'quant_method': 'compressed-tensors', 'format': 'mixed-precision', 'quantization_status': 'compressed',
        'config_groups': {
            'group_0': {'targets': [f're:{tp}layers\\.\\d+\\.self_attn\\.(q|k|v|o)_proj$',
                                    f're:{tp}layers\\.\\d+\\.mlp\\.(gate|up|down)_proj$'],
                        'weights': fp8_w, 'input_activations': fp8_a, 'output_activations': None,
                        'format': 'float-quantized'},
            'group_1': {'targets': [f're:{tp}layers\\.\\d+\\.(moe\\.)?experts\\.\\d+\\.(gate|up|down)_proj$'],
                        'weights': fp4_w, 'input_activations': None, 'output_activations': None,
                        'format': 'nvfp4-pack-quantized'}},
        'ignore': ['lm_head', 're:.*embed.*', 're:.*router', 're:.*vision_tower.*'],
        'kv_cache_scheme': None, 'sparsity_config': {}, 'version': '0.20.0'}
