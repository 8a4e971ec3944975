"""checkpoint.py: number formats, NVFP4/FP8 against compressed-tensors' own code, ModelOpt formulas, the
loader against transformers-written checkpoints, and the span-02 writer / --quantize path."""
import json
import os
import sys

import ml_dtypes
import numpy as np
import pytest
import torch


import checkpoint as ck  # noqa: E402
from compressed_tensors.compressors import FloatQuantizationCompressor, NVFP4PackedCompressor  # noqa: E402
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam  # noqa: E402
from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4  # noqa: E402
from compressed_tensors.utils.match import match_name  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import Gemma4ForCausalLM, Gemma4TextConfig  # noqa: E402

BF16 = ml_dtypes.bfloat16
TP = 'model.language_model.'


def to_np(t):
    """torch tensor -> numpy in the same storage dtype (bf16 -> ml_dtypes.bfloat16, fp8 -> float8_e4m3fn)."""
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BF16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return t.numpy()


def to_torch(a):
    a = np.ascontiguousarray(a)
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    if a.dtype == ml_dtypes.float8_e4m3fn:
        return torch.from_numpy(a.view(np.uint8)).view(torch.float8_e4m3fn)
    return torch.from_numpy(a)


def u8(a):
    return np.ascontiguousarray(np.asarray(a)).view(np.uint8)


# --- compressed-tensors oracles: llm-compressor's observer (min/max in the weight dtype, fused absmax in f32)
# feeding CT's calculate_qparams / generate_gparam, then CT's own compressors.

def ct_nvfp4(w, global_scale=None):
    scheme = QuantizationScheme(targets=['Linear'], **PRESET_SCHEMES['NVFP4'])
    obs = w.unflatten(-1, (-1, 16)).unsqueeze(0)                       # (1, N, K/16, 16), flatten_for_calibration
    mn, mx = torch.amin(obs, dim=(0, -1)), torch.amax(obs, dim=(0, -1))
    if global_scale is None:
        absmax = torch.max(torch.max(torch.tensor(0.0), -mn.min()), mx.max())
        global_scale = generate_gparam(-absmax.reshape(1), absmax.reshape(1))
    scale, zp = calculate_qparams(mn, mx, scheme.weights, global_scale=global_scale)
    sd = {'weight': w, 'weight_scale': scale.to(w.dtype), 'weight_global_scale': global_scale, 'weight_zero_point': zp}
    return NVFP4PackedCompressor.compress(sd, scheme), scheme


def ct_fp8_channel(w):
    scheme = QuantizationScheme(targets=['Linear'], **PRESET_SCHEMES['FP8_DYNAMIC'])
    obs = w.unsqueeze(-2).unsqueeze(0)                                 # (1, N, 1, K)
    scale, zp = calculate_qparams(torch.amin(obs, dim=(0, -1)), torch.amax(obs, dim=(0, -1)), scheme.weights)
    sd = {'weight': w, 'weight_scale': scale.to(w.dtype), 'weight_zero_point': zp}
    return FloatQuantizationCompressor.compress(sd, scheme)


def nasty_nvfp4_weight(seed, dtype):
    """(64, 256) weight whose tensor amax is 42 -> g = 64, with tie, saturation, zero and underflow blocks."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((64, 256)) * np.exp(rng.standard_normal((64, 1)) * 1.5)).astype(np.float32)
    w = np.clip(w, -40, 40)
    w[0, 0] = 42.0                                   # global amax: s = e4m3(64 * 7) = 448, w/eff = 6 exactly
    w[0, 1] = -41.5
    w[1, 0:16] = np.array([6, .25, .75, 1.25, 1.75, 2.5, 3.5, 5, -.25, -.75, -2.5, -5, .5, -6, 3, -0.], np.float32) / 64
    w[2, 0:16] = 0.0                                 # all-zero block -> scale 0.125
    w[2, 16:32] = -0.0                               # negative zeros -> code 0 (CT's torch.sign(-0.) = 0)
    w[3, 0:16] = rng.standard_normal(16) * 1e-5      # scale underflows to 0 -> 0.125; negatives -> code 8
    w[4, 16:32] = rng.standard_normal(16) * 1e-30    # tiny values (normal in bf16 and f32)
    w[5, 32:48] = 42.0 * np.sign(rng.standard_normal(16))  # block at +-6 * scale
    return w.astype(dtype)


# --- number formats -------------------------------------------------------------------------------------

def test_e2m1_all_codes_and_packing():
    c = np.arange(16)
    e, m = (c >> 1) & 3, c & 1
    ref = np.where(e == 0, 0.5 * m, 2.0 ** (e - 1) * (1 + m / 2)) * np.where(c & 8, -1, 1)
    np.testing.assert_array_equal(ck.e2m1_decode(c.astype(np.uint8)), ref.astype(np.float32))
    assert np.signbit(ck.e2m1_decode(np.uint8(8)))
    enc = ck.e2m1_encode(ref)
    np.testing.assert_array_equal(enc, c)            # -0.0 -> 8 in the bare encoder
    np.testing.assert_array_equal(ck.e2m1_encode([7.0, -100, np.inf]), [7, 15, 7])
    codes = np.random.default_rng(0).integers(0, 16, (5, 32)).astype(np.uint8)
    p = ck.e2m1_pack(codes)
    assert p.shape == (5, 16) and p[0, 0] == codes[0, 0] | codes[0, 1] << 4   # low nibble = even column
    np.testing.assert_array_equal(ck.e2m1_unpack(p), codes)
    # RNE at every midpoint and random values == CT's cast_to_fp4 + pack (its sign rule aside: x != 0 here)
    grid = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], np.float32)
    x = np.concatenate([(grid[1:] + grid[:-1]) / 2, grid, np.random.default_rng(1).uniform(-7, 7, 4000)])
    x = np.concatenate([x, -x])[None, :].astype(np.float32)
    x = x[:, x[0] != 0]
    x = x[:, :x.shape[1] // 2 * 2]
    ref = pack_fp4_to_uint8(cast_to_fp4(torch.from_numpy(np.clip(x, -6, 6)).clone())).numpy()
    np.testing.assert_array_equal(ck.e2m1_pack(ck.e2m1_encode(x)), ref)


def test_e4m3_all_codes_and_rounding():
    c = np.arange(256)
    e, m = (c >> 3) & 15, c & 7
    ref = np.where(e == 0, m / 8 * 2.0 ** -6, 2.0 ** (e - 7) * (1 + m / 8)) * np.where(c & 128, -1, 1)
    got = ck.e4m3_decode(c.astype(np.uint8))
    nan = (c & 127) == 127
    assert np.isnan(got[nan]).all() and not np.isnan(got[~nan]).any()
    np.testing.assert_array_equal(got[~nan], ref[~nan].astype(np.float32))
    assert got[0x7E] == 448 and got[1] == 2.0 ** -9 and got[8] == 2.0 ** -6
    np.testing.assert_array_equal(u8(ck.e4m3_encode(got[~nan])), c[~nan])
    np.testing.assert_array_equal(u8(ck.e4m3_encode([464, 500, np.inf, -1e9])), [0x7E, 0x7E, 0x7E, 0xFE])
    assert np.isnan(ck.e4m3_encode([np.nan]).astype(np.float32)).all()
    # midpoints between neighbours and random magnitudes: ml_dtypes RNE == torch's cast (what CT uses)
    pos = np.sort(got[:127])
    rng = np.random.default_rng(2)
    x = np.concatenate([(pos[1:] + pos[:-1]) / 2, np.exp(rng.uniform(-9, 6.2, 20000)), [447.9, 448, 2.0 ** -10]])
    x = np.concatenate([x, -x]).astype(np.float32)
    ref = torch.from_numpy(x).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(u8(ck.e4m3_encode(x)), ref)


# --- quantizers against compressed-tensors ---------------------------------------------------------------

@pytest.mark.parametrize('dtype', [BF16, np.float32])
@pytest.mark.parametrize('seed', [0, 1])
def test_nvfp4_matches_compressed_tensors(dtype, seed):
    w = nasty_nvfp4_weight(seed, dtype)
    if seed == 1:                                    # a second, uncontrolled global scale
        w = (w.astype(np.float32) * np.float32(0.0137)).astype(dtype)
    packed, scale, g = ck.quantize_nvfp4(w)
    sd, scheme = ct_nvfp4(to_torch(w))
    assert packed.shape == (64, 128) and scale.shape == (64, 16) and g.shape == (1,) and g.dtype == np.float32
    np.testing.assert_array_equal(g, sd['weight_global_scale'].numpy())
    np.testing.assert_array_equal(u8(scale), sd['weight_scale'].view(torch.uint8).numpy())
    np.testing.assert_array_equal(packed, sd['weight_packed'].numpy())
    if seed == 0:
        assert g[0] == 64 and scale.astype(np.float32)[0, 0] == 448 and scale.astype(np.float32)[2, 0] == 0.125
        assert (ck.e2m1_unpack(packed)[2, 16:32] == 0).all() and (ck.e2m1_unpack(packed)[3] >= 8).any()
        assert scale.astype(np.float32)[3, 0] == 0.125 and (ck.e2m1_unpack(packed)[5, 32:48] & 7 == 7).all()
    # decode: ours (q*s)/g in f32 vs CT's dequantize q*(s/g), and CT's bf16 decompress
    ours = ck.nvfp4_dequant(packed, scale, g)
    dec = NVFP4PackedCompressor.decompress(sd, scheme)['weight']
    assert dec.dtype == torch.bfloat16
    np.testing.assert_allclose(ours, dec.float().numpy(), rtol=2.0 ** -8, atol=0)
    same = ours.astype(BF16).astype(np.float32) == dec.float().numpy()
    assert same.mean() > 0.999, same.mean()
    # and the quantization error is bounded by one e2m1 step of the block (<= 1 x s/g; clamping at 6 adds more
    # only where the fp8 scale rounded down: allow 2 steps there)
    eff = scale.astype(np.float32) / g[0]
    err = np.abs(ours - w.astype(np.float32)).reshape(64, 16, 16).max(-1)
    assert (err <= 2 * eff).all()


def test_nvfp4_shared_global_scale_matches_compressed_tensors():
    rng = np.random.default_rng(3)
    gate = (rng.standard_normal((32, 64)) * 0.02).astype(BF16)
    up = (rng.standard_normal((32, 64)) * 0.05).astype(BF16)
    g = ck.nvfp4_global_scale(gate, up)
    assert g[0] == min(ck.nvfp4_global_scale(gate)[0], ck.nvfp4_global_scale(up)[0])
    absmax = torch.max(torch.tensor(0.0), torch.max(to_torch(gate).abs().max(), to_torch(up).abs().max()))
    g_ct = generate_gparam(-absmax.reshape(1), absmax.reshape(1))
    np.testing.assert_array_equal(g, g_ct.numpy())
    for w in (gate, up):
        packed, scale, g2 = ck.quantize_nvfp4(w, g)
        sd, _ = ct_nvfp4(to_torch(w), g_ct)
        assert g2[0] == g[0]
        np.testing.assert_array_equal(u8(scale), sd['weight_scale'].view(torch.uint8).numpy())
        np.testing.assert_array_equal(packed, sd['weight_packed'].numpy())
    assert ck.nvfp4_global_scale(np.zeros((2, 16), np.float32))[0] == 1.0      # inf -> 1, as generate_gparam


@pytest.mark.parametrize('dtype', [BF16, np.float32])
def test_fp8_channel_matches_compressed_tensors(dtype):
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((48, 80)) * np.exp(rng.standard_normal((48, 1)) * 3)).astype(np.float32)
    w[0] = 0.0                                      # zero row -> scale eps of the dtype
    w[1, :40] = -0.0                                # -0.0 -> +0 code (CT adds its zero point)
    w[2] = rng.standard_normal(80) * 1e-30          # tiny
    w[3, 0], w[3, 1:] = 1e30, rng.standard_normal(79)  # huge outlier: the rest flushes to 0 / subnormals
    w[4] = rng.standard_normal(80) * 1e-3
    w[4, 5] = -448 * 1e-3 * 1.0001                  # near the e4m3 top
    w = w.astype(dtype)
    w8, s = ck.quantize_fp8_channel(w)
    sd = ct_fp8_channel(to_torch(w))
    assert w8.dtype == ml_dtypes.float8_e4m3fn and s.dtype == np.dtype(dtype) and s.shape == (48, 1)
    assert sd['weight'].dtype == torch.float8_e4m3fn and 'weight_zero_point' not in sd
    np.testing.assert_array_equal(u8(s), u8(to_np(sd['weight_scale'])))
    np.testing.assert_array_equal(u8(w8), sd['weight'].view(torch.uint8).numpy())
    assert s.astype(np.float32)[0, 0] == ml_dtypes.finfo(dtype).eps and (u8(w8)[1, :40] == 0).all()
    np.testing.assert_allclose(ck.fp8_dequant(w8, s)[5:], w.astype(np.float32)[5:],
                               atol=0, rtol=2.0 ** -3.9)   # e4m3 has 3 mantissa bits (+ bf16 double rounding)


# --- ModelOpt formulas, implemented independently from the spec text with torch ------------------------

def torch_e2m1_rne(x):
    a = x.abs()
    idx = ((a > .25).int() + (a >= .75).int() + (a > 1.25).int() + (a >= 1.75).int() + (a > 2.5).int()
           + (a >= 3.5).int() + (a > 5).int())
    return (idx | ((x < 0).int() << 3)).to(torch.uint8)


def torch_e2m1_value(c):
    c = c.long()
    e, m = (c >> 1) & 3, (c & 1).float()
    v = torch.where(e == 0, 0.5 * m, 2.0 ** (e - 1).float() * (1 + m / 2))
    return torch.where((c & 8) != 0, -v, v)


def modelopt_nvfp4(w):
    """ModelOpt NVFP4 per checkpoint.md: wsf2 = amax/2688, s_b = fp8(amax_b / (6 wsf2)) (zero block -> 1),
    q = rne(W / (s_b wsf2)); packed q[..., 1::2] << 4 | q[..., 0::2]."""
    n, k = w.shape
    wsf2 = w.abs().max() / 2688
    wb = w.reshape(n, k // 16, 16)
    s = (wb.abs().amax(-1) / (6 * wsf2)).clamp(max=448).to(torch.float8_e4m3fn)
    s = torch.where(s.float() == 0, torch.ones_like(s.float()), s.float()).to(torch.float8_e4m3fn)
    q = torch_e2m1_rne((wb / (s.float() * wsf2)[..., None]).clamp(-6, 6)).reshape(n, k)
    return (q[:, 1::2] << 4) | q[:, 0::2], s, wsf2


@pytest.mark.parametrize('scalar_shape', [(), (1,)])
def test_modelopt_nvfp4_decode(scalar_shape):
    torch.manual_seed(5)
    w = torch.randn(40, 96) * torch.exp(torch.randn(40, 1))
    w[3, :16] = 0
    packed, s, wsf2 = modelopt_nvfp4(w)
    q = torch.stack([packed & 15, packed >> 4], -1).reshape(40, 96)
    ref = (torch_e2m1_value(q).reshape(40, 6, 16) * s.float()[..., None] * wsf2).reshape(40, 96)
    tensors = {'m.weight': to_np(packed), 'm.weight_scale': to_np(s),
               'm.weight_scale_2': wsf2.reshape(scalar_shape).numpy(), 'm.input_scale': np.float32(0.5).reshape(())}
    c = ck.InMemoryCheckpoint(tensors)
    assert c.format('m') == 'nvfp4_modelopt'
    raw = c.linear_raw('m', (40, 96))
    assert raw.global_scale.shape == scalar_shape and raw.input_scale == 0.5
    np.testing.assert_array_equal(c.linear('m', (40, 96)), ref.numpy())
    # the same bytes as CT (global = 1/wsf2) decode to the same weights up to the per-tensor rounding
    ct_t = {'m.weight_packed': to_np(packed), 'm.weight_scale': to_np(s),
            'm.weight_global_scale': (1 / wsf2).reshape(1).numpy()}
    np.testing.assert_allclose(ck.InMemoryCheckpoint(ct_t).linear('m'), ref.numpy(), rtol=3e-7)


@pytest.mark.parametrize('case', ['ct_tensor', 'modelopt_tensor', 'ct_channel', 'modelopt_channel', 'ct_block',
                                  'modelopt_block', 'deepseek_block'])
def test_fp8_decode(case):
    torch.manual_seed(6)
    n, k = (256, 384) if case == 'modelopt_block' else (200, 300)
    w8 = (torch.randn(n, k) * 30).clamp(-448, 448).to(torch.float8_e4m3fn)
    nb, kb = -(-n // 128), -(-k // 128)
    sdt = torch.bfloat16 if case.startswith('ct') else torch.float32
    s = {'ct_tensor': torch.rand(1), 'modelopt_tensor': torch.rand(()), 'ct_channel': torch.rand(n, 1),
         'modelopt_channel': torch.rand(n), 'ct_block': torch.rand(nb, kb), 'deepseek_block': torch.rand(nb, kb),
         'modelopt_block': torch.rand(nb, 1, kb, 1)}[case].to(sdt) + 0.01
    s2 = s.float().reshape(nb, kb) if 'block' in case else s.float().reshape(-1, 1) if 'channel' in case else s.float()
    full = s2.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k] if 'block' in case else s2
    ref = w8.float() * full
    name = 'm.weight_scale_inv' if case == 'deepseek_block' else 'm.weight_scale'
    c = ck.InMemoryCheckpoint({'m.weight': to_np(w8), name: to_np(s)})
    assert c.format('m') == 'fp8_' + case.split('_')[1]
    np.testing.assert_array_equal(c.linear('m', (n, k)), ref.numpy())


# --- loader against transformers-written checkpoints ----------------------------------------------------

H, I_DENSE, E, I_MOE = 64, 48, 8, 32


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
    """A bf16 Gemma4ForCausalLM with random weights (norms too), saved whole and sharded."""
    cfg = Gemma4TextConfig(vocab_size=300, hidden_size=H, intermediate_size=I_DENSE, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                           num_global_key_value_heads=1, sliding_window=8,
                           layer_types=['sliding_attention', 'sliding_attention', 'full_attention'],
                           final_logit_softcapping=30.0, hidden_size_per_layer_input=0, attention_k_eq_v=True,
                           enable_moe_block=True, num_experts=E, top_k_experts=2, moe_intermediate_size=I_MOE)
    torch.manual_seed(7)
    model = Gemma4ForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for v in model.state_dict().values():
            v.normal_(0, 0.5)
    d = tmp_path_factory.mktemp('tiny')
    model.save_pretrained(d / 'whole')
    model.save_pretrained(d / 'sharded', max_shard_size='20KB')
    sd = {k: v.clone() for k, v in model.state_dict().items() if k != 'lm_head.weight'}
    return d, sd


def check_reads_back(c, sd):
    assert c.text_prefix == 'model.' and c.vision_prefix is None and c.names == set(sd)
    for name, t in sd.items():
        assert c.dtype(name) == 'BF16' and c.shape(name) == tuple(t.shape)
        ref = t.float().numpy()
        if name.endswith('_proj.weight'):
            assert c.format(name[:-7]) == 'bf16'
            np.testing.assert_array_equal(c.linear(name[:-7], t.shape), ref)
        elif 'experts' not in name:
            np.testing.assert_array_equal(c.tensor(name, t.shape), ref)
        np.testing.assert_array_equal(u8(c.raw(name)), u8(to_np(t)))
        assert isinstance(c.raw(name), np.memmap) and c.raw(name).dtype == BF16
    for L in range(3):
        gu, dn = c.experts(f'model.layers.{L}', E, H, I_MOE)
        np.testing.assert_array_equal(gu, sd[f'model.layers.{L}.experts.gate_up_proj'].float().numpy())
        np.testing.assert_array_equal(dn, sd[f'model.layers.{L}.experts.down_proj'].float().numpy())


def test_loader_reads_transformers_checkpoint(tiny):
    d, sd = tiny
    c = ck.Checkpoint(d / 'whole')
    check_reads_back(c, sd)
    assert not c.has('model.layers.2.self_attn.v_proj.weight')             # attention_k_eq_v on the full layer
    with pytest.raises(ck.CheckpointError, match=r'model\.layers\.2\.self_attn\.v_proj'):
        c.linear('model.layers.2.self_attn.v_proj', (32, H))


def test_loader_reads_sharded_checkpoint(tiny):
    d, sd = tiny
    index = json.loads((d / 'sharded' / 'model.safetensors.index.json').read_text())
    assert len(set(index['weight_map'].values())) > 1
    check_reads_back(ck.Checkpoint(d / 'sharded'), sd)


def test_loader_errors_name_the_tensor(tiny, tmp_path):
    _, sd = tiny
    t = {k: to_np(v) for k, v in sd.items()}
    del t['model.layers.1.mlp.up_proj.weight']
    t['model.layers.0.self_attn.q_proj.weight'] = t['model.layers.0.self_attn.q_proj.weight'][:, :32].copy()
    t['model.layers.0.input_layernorm.weight'] = t['model.layers.0.input_layernorm.weight'][:10].copy()
    t['model.layers.2.mlp.gate_proj.weight_scale'] = np.ones((I_DENSE, 1), np.float32)   # bf16 + scale: unknown
    ck.save_safetensors(tmp_path / 'model.safetensors', t)
    c = ck.Checkpoint(tmp_path)
    with pytest.raises(ck.CheckpointError, match=r'model\.layers\.1\.mlp\.up_proj\.weight'):
        c.linear('model.layers.1.mlp.up_proj', (I_DENSE, H))
    with pytest.raises(ck.CheckpointError,
                       match=r'layers\.0\.self_attn\.q_proj\.weight: expected shape \(64, 64\), found \(64, 32\)'):
        c.linear('model.layers.0.self_attn.q_proj', (64, H))
    with pytest.raises(ck.CheckpointError, match=r'input_layernorm\.weight: expected shape \(64,\), found \(10,\)'):
        c.tensor('model.layers.0.input_layernorm.weight', (H,))
    with pytest.raises(ValueError, match=r'module model\.layers\.2\.mlp\.gate_proj: unknown tensor set.*weight_scale'):
        c.format('model.layers.2.mlp.gate_proj')
    with pytest.raises(ck.CheckpointError, match=r'gate_up_proj: expected shape \(8, 32, 64\), found \(8, 64, 64\)'):
        c.experts('model.layers.0.', E, H, 16)
    with pytest.raises(ck.CheckpointError, match=r'missing tensor model\.layers\.0\.nothing'):
        c.tensor('model.layers.0.nothing')


def test_per_expert_formats_and_spellings_read_like_fused(tiny):
    _, sd = tiny
    gu = to_np(sd['model.layers.0.experts.gate_up_proj'])               # (E, 2I, H) bf16
    dn = to_np(sd['model.layers.0.experts.down_proj'])                  # (E, H, I) bf16
    ct_t, mo_t, expect = {}, {}, []
    for e in range(E):
        g = ck.nvfp4_global_scale(gu[e, :I_MOE], gu[e, I_MOE:])
        parts = {'gate_proj': (gu[e, :I_MOE], g), 'up_proj': (gu[e, I_MOE:], g), 'down_proj': (dn[e], None)}
        deq = {}
        for proj, (w, gs) in parts.items():
            packed, s, gs = ck.quantize_nvfp4(w, gs)
            deq[proj] = ck.nvfp4_dequant(packed, s, gs)
            if e == 0:                                                    # expert 0 stays bf16: formats may mix
                ct_t[f'model.layers.0.experts.0.{proj}.weight'] = w
                deq[proj] = w.astype(np.float32)
            else:
                p = f'model.layers.0.experts.{e}.{proj}.'
                ct_t.update({p + 'weight_packed': packed, p + 'weight_scale': s, p + 'weight_global_scale': gs})
            p = f'model.layers.0.moe.experts.{e}.{proj}.'                # ModelOpt spelling and format
            mo_t.update({p + 'weight': packed, p + 'weight_scale': s, p + 'weight_scale_2': (1 / gs[0]).reshape(())})
        expect.append(deq)
    gu_ct, dn_ct = ck.InMemoryCheckpoint(ct_t).experts('model.layers.0.', E, H, I_MOE)
    gu_mo, dn_mo = ck.InMemoryCheckpoint(mo_t).experts('model.layers.0', E, H, I_MOE)
    for e in range(E):
        np.testing.assert_array_equal(gu_ct[e], np.concatenate([expect[e]['gate_proj'], expect[e]['up_proj']]))
        np.testing.assert_array_equal(dn_ct[e], expect[e]['down_proj'])
    np.testing.assert_allclose(gu_mo[1:], gu_ct[1:], rtol=3e-7)
    np.testing.assert_allclose(dn_mo[1:], dn_ct[1:], rtol=3e-7)
    ref = gu.astype(np.float32)
    err = np.abs(gu_ct - ref).reshape(E, 2 * I_MOE, H // 16, 16).max(-1)
    bound = np.abs(ref).reshape(E, 2 * I_MOE, H // 16, 16).max(-1) / 6 * 1.6   # one e2m1 step, fp8 scale rounding
    assert (err <= bound + 1e-6).all() and err.max() > 0


# --- the span-02 writer and --quantize -----------------------------------------------------------------

def span02_source(sd):
    """The tiny model's state dict under Gemma4ForConditionalGeneration names, plus a few vision tensors."""
    rng = np.random.default_rng(8)
    t = {TP + k[len('model.'):]: to_np(v) for k, v in sd.items()}
    t['model.vision_tower.encoder.layers.0.self_attn.q_proj.linear.weight'] = rng.standard_normal((32, 32)).astype(BF16)
    t['model.vision_tower.std_scale'] = rng.standard_normal(32).astype(BF16)
    t['model.embed_vision.embedding_projection.weight'] = rng.standard_normal((H, 32)).astype(BF16)
    return t


def test_quantize_span02_writes_and_reads_back(tiny, tmp_path):
    _, sd = tiny
    src = span02_source(sd)
    q = ck.quantize_span02(src, TP)
    ck.save_safetensors(tmp_path / 'model.safetensors', q)
    (tmp_path / 'config.json').write_text(json.dumps({'quantization_config': ck.span02_quantization_config(TP)}))
    c = ck.Checkpoint(tmp_path)
    assert c.text_prefix == TP and c.vision_prefix == 'model.vision_tower.'
    assert not any(n.endswith(('gate_up_proj', 'experts.down_proj')) for n in c.names)
    for L in range(3):
        p = f'{TP}layers.{L}.'
        projs = ['self_attn.q_proj', 'self_attn.k_proj', 'self_attn.o_proj', 'mlp.gate_proj', 'mlp.up_proj',
                 'mlp.down_proj'] + (['self_attn.v_proj'] if L < 2 else [])
        for m in projs:
            w = src[p + m + '.weight']
            assert c.format(p + m) == 'fp8_channel' and c.shape_of_linear(p + m) == w.shape
            assert c.dtype(p + m + '.weight') == 'F8_E4M3' and c.dtype(p + m + '.weight_scale') == 'BF16'
            assert c.shape(p + m + '.weight_scale') == (w.shape[0], 1)
            np.testing.assert_array_equal(c.linear(p + m, w.shape), ck.fp8_dequant(*ck.quantize_fp8_channel(w)))
        for e in range(E):
            x = f'{p}experts.{e}.'
            assert {c.format(x + j) for j in ('gate_proj', 'up_proj', 'down_proj')} == {'nvfp4_ct'}
            assert c.shape_of_linear(x + 'down_proj') == (H, I_MOE)
            assert c.dtype(x + 'gate_proj.weight_packed') == 'U8' and c.dtype(x + 'gate_proj.weight_scale') == 'F8_E4M3'
            gu = src[p + 'experts.gate_up_proj'][e]
            np.testing.assert_array_equal(c.raw(x + 'gate_proj.weight_global_scale'),
                                          ck.nvfp4_global_scale(gu[:I_MOE], gu[I_MOE:]))
            np.testing.assert_array_equal(c.raw(x + 'up_proj.weight_global_scale'),
                                          c.raw(x + 'gate_proj.weight_global_scale'))
        gu, dn = c.experts(p, E, H, I_MOE)
        for e in range(E):
            w = src[p + 'experts.gate_up_proj'][e]
            g = ck.nvfp4_global_scale(w[:I_MOE], w[I_MOE:])
            np.testing.assert_array_equal(gu[e, :I_MOE], ck.nvfp4_dequant(*ck.quantize_nvfp4(w[:I_MOE], g)))
            np.testing.assert_array_equal(gu[e, I_MOE:], ck.nvfp4_dequant(*ck.quantize_nvfp4(w[I_MOE:], g)))
            np.testing.assert_array_equal(dn[e], ck.nvfp4_dequant(*ck.quantize_nvfp4(src[p + 'experts.down_proj'][e])))
        assert c.format(p + 'router.proj') == 'bf16'
    for name, a in src.items():
        if not (name.endswith('_proj.weight') and name.startswith(TP)) and 'experts' not in name:
            assert c.dtype(name) == 'BF16'
            np.testing.assert_array_equal(u8(c.raw(name)), u8(a))
    again = ck.quantize_span02(q, TP)                                    # quantized modules pass unchanged
    assert again.keys() == q.keys()
    assert all(again[k].dtype == q[k].dtype and (u8(again[k]) == u8(q[k])).all() for k in q)
    # the config is valid compressed-tensors, and its targets/ignore pick exactly the quantized modules
    qc = ck.span02_quantization_config(TP)
    QuantizationConfig.model_validate(qc)
    g0, g1 = qc['config_groups']['group_0'], qc['config_groups']['group_1']
    assert QuantizationArgs.model_validate(g0['weights']) == PRESET_SCHEMES['FP8_DYNAMIC']['weights']
    fp8_dynamic = PRESET_SCHEMES['FP8_DYNAMIC']
    assert QuantizationArgs.model_validate(g0['input_activations']) == fp8_dynamic['input_activations']
    assert QuantizationArgs.model_validate(g1['weights']) == PRESET_SCHEMES['NVFP4A16']['weights']
    modules = {n.rpartition('.')[0] for n in c.names}
    for m in modules:
        fmt = c.format(m) if c.has(m + '.weight') or c.has(m + '.weight_packed') else None
        in0 = any(match_name(m, t) for t in g0['targets'])
        in1 = any(match_name(m, t) for t in g1['targets'])
        ignored = any(match_name(m, t) for t in qc['ignore'])
        assert (in0, in1) == (fmt == 'fp8_channel', fmt == 'nvfp4_ct'), m
        assert not (ignored and (in0 or in1)), m
    assert any(match_name(f'{TP}layers.0.router', t) for t in qc['ignore'])
    assert any(match_name('model.vision_tower.encoder.layers.0.self_attn.q_proj', t) for t in qc['ignore'])


def test_quantize_span02_unfused_bf16_experts_match_fused(tiny):
    _, sd = tiny
    gu, dn = to_np(sd['model.layers.1.experts.gate_up_proj']), to_np(sd['model.layers.1.experts.down_proj'])
    fused = ck.quantize_span02({TP + 'layers.1.experts.gate_up_proj': gu, TP + 'layers.1.experts.down_proj': dn}, TP)
    for spelling in ('experts.', 'moe.experts.'):
        src = {}
        for e in range(E):
            p = f'{TP}layers.1.{spelling}{e}.'
            src.update({p + 'gate_proj.weight': gu[e, :I_MOE], p + 'up_proj.weight': gu[e, I_MOE:],
                        p + 'down_proj.weight': dn[e]})
        q = ck.quantize_span02(src, TP)
        assert len(q) == len(fused) == 9 * E
        for name, a in fused.items():
            b = q[name.replace('.experts.', '.' + spelling)]
            assert a.dtype == b.dtype and (u8(a) == u8(b)).all(), name
        targets = ck.span02_quantization_config(TP)['config_groups']['group_1']['targets']
        assert all(any(match_name(n.rpartition('.')[0], t) for t in targets) for n in q)


def test_quantize_checkpoint_is_byte_identical_to_writer(tiny, tmp_path):
    d, sd = tiny
    src = {k: to_np(v) for k, v in sd.items()}
    q = ck.quantize_span02(src, 'model.')
    view = ck.Checkpoint(d / 'whole').quantized_view()
    assert view.names == set(q) and view.text_prefix == 'model.'
    for name, a in q.items():
        assert view.dtype(name) == ck.DTYPE_NAMES[a.dtype] and view.shape(name) == a.shape
        np.testing.assert_array_equal(u8(view.raw(name)), u8(a), err_msg=name)
    ck.save_safetensors(tmp_path / 'model.safetensors', q)
    disk = ck.Checkpoint(tmp_path)
    for m in ('model.layers.0.self_attn.q_proj', 'model.layers.1.experts.3.up_proj', 'model.layers.2.mlp.down_proj'):
        assert view.format(m) == disk.format(m)
        np.testing.assert_array_equal(view.linear(m), disk.linear(m))
    np.testing.assert_array_equal(view.experts('model.layers.2', E, H, I_MOE)[1],
                                  disk.experts('model.layers.2', E, H, I_MOE)[1])
    # f32 input quantizes exactly like its bf16 cast (the writer casts first)
    f32 = {k: v.astype(np.float32) for k, v in src.items()}
    q32 = ck.quantize_span02(f32, 'model.')
    assert all(q32[k].dtype == q[k].dtype and (u8(q32[k]) == u8(q[k])).all() for k in q)


def test_save_safetensors_dtypes_and_determinism(tmp_path):
    rng = np.random.default_rng(9)
    t = {'b': rng.standard_normal((3, 5)).astype(BF16), 'a.f8': ck.e4m3_encode(rng.standard_normal((4, 6))),
         'c': rng.integers(0, 255, (7,)).astype(np.uint8), 'z': np.asarray(np.float32(2.5)),
         'tr': rng.standard_normal((5, 3)).astype(np.float32).T}
    ck.save_safetensors(tmp_path / 'x.safetensors', t)
    ck.save_safetensors(tmp_path / 'y.safetensors', dict(reversed(list(t.items()))))
    raw = (tmp_path / 'x.safetensors').read_bytes()
    assert raw == (tmp_path / 'y.safetensors').read_bytes()
    n = int.from_bytes(raw[:8], 'little')
    assert (8 + n) % 8 == 0
    header = json.loads(raw[8:8 + n])
    assert {k: v['dtype'] for k, v in header.items() if k != '__metadata__'} == \
        {'b': 'BF16', 'a.f8': 'F8_E4M3', 'c': 'U8', 'z': 'F32', 'tr': 'F32'}
    back = load_file(tmp_path / 'x.safetensors')
    for k, v in t.items():
        np.testing.assert_array_equal(u8(to_np(back[k])), u8(v), err_msg=k)
    c = ck.InMemoryCheckpoint(t)
    os.rename(tmp_path / 'x.safetensors', tmp_path / 'model.safetensors')
    d = ck.Checkpoint(tmp_path)
    for k in t:
        assert d.dtype(k) == c.dtype(k) and d.shape(k) == c.shape(k)
        np.testing.assert_array_equal(u8(d.raw(k)), u8(t[k]))
