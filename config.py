"""Frozen configuration: the model (from a Hugging Face config.json) and the engine (from the command line).

Both forms transformers writes are read: the nested `Gemma4ForConditionalGeneration` config (text_config,
vision_config) and the text-only `Gemma4ForCausalLM` one. Full-attention layers get their geometry from
`per_layer_config` (transformers >= 5.2x) or from `global_head_dim` / `num_global_key_value_heads` (the
released 26B config.json). Everything is validated once, here.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field


class ConfigError(ValueError):
    pass


class CostTableError(ConfigError):
    """A --think-cost table the engine cannot use (span02 names its file)."""


def check_cost_table(t: dict, batch: int = 1) -> dict:
    """The think-cost table (policy.py: its format) well formed, and covering `batch`, the batch the engine prices a
    step at: beyond its last row a lookup takes that row, which would under-price the step."""
    ok = (isinstance(t, dict) and all(k in t for k in ("batch", "context", "ms"))
          and t["batch"] == sorted(t["batch"]) and t["context"] == sorted(t["context"])
          and len(t["ms"]) == len(t["batch"]) and all(len(r) == len(t["context"]) for r in t["ms"])
          and all(x > 0 for r in t["ms"] for x in r) and t["batch"] and t["context"])
    if not ok:
        raise CostTableError("think-cost table needs ascending 'batch' and 'context' lists and a positive "
                             "'ms' matrix of len(batch) rows by len(context) columns")
    if t["batch"][-1] < batch:
        raise CostTableError(f"its batches end at {t['batch'][-1]}, and the server steps up to {batch} sequences: "
                             f"make it with this --max-batch (span02.py calibrate), or serve with --max-batch "
                             f"{t['batch'][-1]}")
    return t


# --- model -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rope:
    kind: str          # "default" | "proportional"
    theta: float
    partial: float     # share of the head's frequency pairs that rotate (1.0 for "default")


@dataclass(frozen=True)
class LayerGeometry:
    sliding: bool      # sliding-window layer (else full attention)
    head_dim: int      # D
    kv_heads: int      # Hkv
    k_eq_v: bool       # full layers of the 26B: no v_proj, V = v_norm(k_proj(x))
    rope: Rope


@dataclass(frozen=True)
class TextConfig:
    vocab: int
    hidden: int
    intermediate: int              # dense MLP width
    layers: tuple[LayerGeometry, ...]
    heads: int                     # query heads, every layer
    window: int                    # sliding window W: a query at i sees keys i-W+1 .. i
    eps: float
    softcap: float | None          # final logit soft-cap
    experts: int                   # 0 when the model has no MoE block
    top_k: int
    expert_intermediate: int
    bos: int
    pad: int
    eos: tuple[int, ...]
    bidirectional_vision: bool     # image blocks attend bidirectionally on sliding layers

    @property
    def n_layers(self):
        return len(self.layers)


@dataclass(frozen=True)
class VisionConfig:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    head_dim: int
    patch: int
    pool: int                      # pooling kernel (3: 3x3 patches -> one soft token)
    pos_table: int                 # rows of the 2-D position embedding table
    rope_theta: float
    standardize: bool
    eps: float


@dataclass(frozen=True)
class ModelConfig:
    text: TextConfig
    vision: VisionConfig | None
    image_token: int | None        # <|image|>
    boi_token: int | None          # <|image>
    eoi_token: int | None          # <image|>
    quantization: dict | None      # config.json's quantization_config, as written (informational)
    architecture: str


def _rope(params: dict | None, layer_type: str) -> Rope:
    defaults = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1_000_000.0}}
    p = (params or defaults).get(layer_type) or defaults[layer_type]
    kind = p.get("rope_type", "default")
    if kind not in ("default", "proportional"):
        raise ConfigError(f"rope_type {kind!r} for {layer_type} is not supported (default, proportional)")
    if p.get("factor", 1.0) != 1.0:
        raise ConfigError(f"rope scaling factor {p['factor']} for {layer_type} is not supported")
    partial = float(p.get("partial_rotary_factor", 1.0)) if kind == "proportional" else 1.0
    return Rope(kind, float(p["rope_theta"]), partial)


def text_config(d: dict) -> TextConfig:
    def need(key):
        if key not in d:
            raise ConfigError(f"config.json text config lacks {key!r}")
        return d[key]

    n = need("num_hidden_layers")
    types = d.get("layer_types") or ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                     for i in range(n)]
    if len(types) != n:
        raise ConfigError(f"layer_types has {len(types)} entries for {n} layers")
    if d.get("hidden_size_per_layer_input"):
        raise ConfigError("per-layer input embeddings (hidden_size_per_layer_input > 0) are not supported")
    if d.get("num_kv_shared_layers"):
        raise ConfigError("KV-shared layers (num_kv_shared_layers > 0) are not supported")
    if d.get("use_bidirectional_attention") == "all":
        raise ConfigError("use_bidirectional_attention='all' is not supported (a decoder must be causal)")
    if d.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ConfigError(f"hidden_activation {d['hidden_activation']!r} is not supported")
    per_layer = {int(k): v for k, v in (d.get("per_layer_config") or {}).items()}
    k_eq_v = bool(d.get("attention_k_eq_v", False))
    layers = []
    for i, t in enumerate(types):
        if t not in ("sliding_attention", "full_attention"):
            raise ConfigError(f"layer {i}: unknown layer type {t!r}")
        sliding = t == "sliding_attention"
        hd, kv = need("head_dim"), need("num_key_value_heads")
        if not sliding:
            hd = d.get("global_head_dim") or hd
            kv = d.get("num_global_key_value_heads") or kv if k_eq_v else kv
        hd = per_layer.get(i, {}).get("head_dim", hd)
        kv = per_layer.get(i, {}).get("num_key_value_heads", kv)
        layers.append(LayerGeometry(sliding, hd, kv, k_eq_v and not sliding, _rope(d.get("rope_parameters"), t)))
    heads = need("num_attention_heads")
    for i, g in enumerate(layers):
        if heads % g.kv_heads:
            raise ConfigError(f"layer {i}: {heads} query heads do not divide into {g.kv_heads} kv heads")
        if g.head_dim % 2:
            raise ConfigError(f"layer {i}: head_dim {g.head_dim} is odd")
    moe = bool(d.get("enable_moe_block", False))
    eos = d.get("eos_token_id", 1)
    return TextConfig(
        vocab=need("vocab_size"), hidden=need("hidden_size"), intermediate=need("intermediate_size"),
        layers=tuple(layers), heads=heads, window=int(d.get("sliding_window", 512)),
        eps=float(d.get("rms_norm_eps", 1e-6)), softcap=d.get("final_logit_softcapping"),
        experts=int(d["num_experts"]) if moe else 0, top_k=int(d["top_k_experts"]) if moe else 0,
        expert_intermediate=int(d["moe_intermediate_size"]) if moe else 0,
        bos=int(d.get("bos_token_id", 2)), pad=int(d.get("pad_token_id", 0) or 0),
        eos=tuple(eos) if isinstance(eos, list) else (int(eos),),
        bidirectional_vision=d.get("use_bidirectional_attention") == "vision")


def vision_config(d: dict) -> VisionConfig:
    if d.get("use_clipped_linears"):
        raise ConfigError("vision use_clipped_linears=true is not supported")
    if d.get("num_key_value_heads", d["num_attention_heads"]) != d["num_attention_heads"]:
        raise ConfigError("vision towers with grouped kv heads are not supported")
    return VisionConfig(
        hidden=d["hidden_size"], intermediate=d["intermediate_size"], layers=d["num_hidden_layers"],
        heads=d["num_attention_heads"], head_dim=d.get("head_dim", 64),   # transformers' class default
        patch=d.get("patch_size", 16), pool=d.get("pooling_kernel_size", 3),
        pos_table=d.get("position_embedding_size", 10240),
        rope_theta=float((d.get("rope_parameters") or {}).get("rope_theta", 100.0)),
        standardize=bool(d.get("standardize", False)), eps=float(d.get("rms_norm_eps", 1e-6)))


def model_config(d: dict) -> ModelConfig:
    arch = (d.get("architectures") or ["?"])[0]
    nested = "text_config" in d
    vision = d.get("vision_config") if nested else None
    return ModelConfig(
        text=text_config(d["text_config"] if nested else d),
        vision=vision_config(vision) if vision else None,
        image_token=d.get("image_token_id") if nested else None,
        boi_token=d.get("boi_token_id") if nested else None,
        eoi_token=d.get("eoi_token_id") if nested else None,
        quantization=d.get("quantization_config") or (d.get("text_config") or {}).get("quantization_config"),
        architecture=arch)


def load_model_config(model_dir: str) -> ModelConfig:
    path = os.path.join(model_dir, "config.json")
    if os.path.exists(model_dir) and not os.path.isdir(model_dir):
        raise ConfigError(f"{model_dir} is a file: a model directory holds config.json and *.safetensors")
    try:
        with open(path) as f:
            d = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path} not found: a model directory holds config.json and *.safetensors") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    except OSError as e:                                     # unreadable: permissions, a directory named config.json
        raise ConfigError(f"{path}: {e.strerror or e}") from None
    try:
        return model_config(d)
    except KeyError as e:
        raise ConfigError(f"{path}: missing field {e}") from None


# --- engine ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PolicyConfig:
    tau: float = 0.8               # the gate: stop at the first readout when max(p) >= tau
    cap: int = 1024                # most thought tokens a question may spend
    think_ms: float = 0.0          # modelled-time budget, 0 = off (needs think_cost)
    budget_ms: float = 0.0         # wall-clock budget from arrival, 0 = off
    blend_closed: float = 1.0      # weight of the second readout when the thought closed itself
    blend_truncated: float = 0.5   # ... when it was cut (cap, budget, deadline)


KV_DTYPES = ("bf16", "fp8")        # what the KV cache keeps (layers.attention.kv_round)


def check_kv_dtype(kv_dtype):
    """The models' check of their kv_dtype (model.Model, model_gpu.GpuModel): ConfigError unless one of KV_DTYPES."""
    if kv_dtype not in KV_DTYPES:
        raise ConfigError(f"kv dtype {kv_dtype!r}: one of {', '.join(KV_DTYPES)}")


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str
    device: str = "auto"           # auto | cpu | gpu
    max_len: int = 8192            # longest sequence (stem + thought) in tokens
    kv_tokens: int = 0             # KV pool size in tokens; 0 = sized at load (model.load: GPU memory / CPU 16,384)
    kv_dtype: str = "bf16"         # what the KV cache keeps: bf16 | fp8 (layers.attention.kv_round; half the bytes)
    max_batch: int = 512           # most sequences in one step (each decode step a graph: decode_graphs.py)
    prefill_chunk: int = 512       # most prompt tokens of one sequence per step
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    think_cost: dict | None = None  # the cost table of `span02.py calibrate` (policy.md)
    deadline_ms: float = 0.0       # default deadline, 0 = none
    image_soft_tokens: int = 280   # soft-token budget per image: 70, 140, 280, 560, 1120
    serial: bool = False
    prefix_cache: bool = True
    quantize: bool = False         # quantize a bf16 checkpoint at load (NVFP4 experts, FP8 dense)
    spec_draft: str | None = None
    spec_max_branches: int = 1
    max_queue: int = 256
    max_questions: int = 64
    max_images: int = 16
    max_body_bytes: int = 32 << 20
    max_decoded_bytes: int = 64 << 20
    max_image_pixels: int = 40_000_000
    max_connections: int = 512
    read_timeout_s: float = 30.0
    max_header_bytes: int = 16 << 10

    def __post_init__(self):
        p = self.policy
        checks = [
            (self.device in ("auto", "cpu", "gpu"), f"device must be auto, cpu or gpu, not {self.device!r}"),
            (self.max_len >= 64, "max-len must be at least 64"),
            (self.kv_tokens >= 0, "kv-tokens must be >= 0 (0: sized at load)"),
            (self.kv_dtype in KV_DTYPES, f"kv-dtype must be {' or '.join(KV_DTYPES)}, not {self.kv_dtype!r}"),
            (self.max_batch >= 1, "max-batch must be at least 1"),
            (self.prefill_chunk >= 16, "prefill chunk must be at least 16"),
            (0.0 <= p.tau, "tau must be >= 0"),
            (p.cap >= 0, "cap must be >= 0"),
            (p.think_ms >= 0 and p.budget_ms >= 0, "think-ms and budget-ms must be >= 0"),
            (p.think_ms == 0 or self.think_cost is not None, "think-ms needs a --think-cost table"),
            (0.0 <= p.blend_closed <= 1.0 and 0.0 <= p.blend_truncated <= 1.0, "blend weights lie in [0, 1]"),
            (self.deadline_ms >= 0, "deadline-ms must be >= 0"),
            (self.image_soft_tokens in (70, 140, 280, 560, 1120),
             "image-soft-tokens must be one of 70, 140, 280, 560, 1120"),
            (self.spec_max_branches >= 1, "spec-max-branches must be >= 1"),
            (self.max_queue >= 1 and self.max_connections >= 1, "max-queue and max-connections must be >= 1"),
            (self.max_body_bytes > 0 and self.max_decoded_bytes > 0 and self.max_image_pixels > 0,
             "size limits must be positive"),
            (self.max_questions >= 1, "max-questions must be at least 1"),
            (self.max_images >= 0, "max-images must be >= 0"),
            (all(math.isfinite(v) for v in (p.tau, p.think_ms, p.budget_ms, self.deadline_ms, self.read_timeout_s)),
             "tau, think-ms, budget-ms, deadline-ms and read-timeout must be finite numbers"),
            (self.read_timeout_s > 0, "read-timeout must be above 0 seconds"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)
        if self.think_cost is not None:
            check_cost_table(self.think_cost, self.think_batch)

    @property
    def think_batch(self) -> int:
        """The batch a thought's cost is looked up at (policy.md): 1 under --serial, else max_batch."""
        return 1 if self.serial else self.max_batch

    def replace(self, **kw) -> "EngineConfig":
        return dataclasses.replace(self, **kw)
