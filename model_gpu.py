"""The GPU backend: model.Model's step on the device, through the kernels of kernels_ptx/.

Same interface as the CPU reference (SeqStep in, SeqOut out, `.logits`, `.num_blocks`, `.encode_image`), so
the scheduler, policy and server run unchanged on it. bf16 activations, weights in their checkpoint format
(FP8 dense layers, NVFP4 experts, bf16 embeddings / norms / router), fp32 accumulation and softmax.

Memory: everything is allocated at load: weights, the paged KV pools (per layer (blocks, 16, Hkv, D) bf16, or e4m3
with kv_dtype "fp8" (layers.attention.kv_round), the layout of the CPU reference), and one workspace sized for
`max_rows` rows per step; a step only takes views of it. Every kernel computes a row from that row's inputs alone
in a fixed order, so a sequence's numbers do not depend on the other sequences of the step or on how its prefill
was chunked.

Prefill (and any step that is not pure decode) runs eagerly: Python launches per layer; a shape's second such step
is recorded as its plan, which its later steps replay without the Python (step_plans.py). A pure decode step
(every sequence 1 token, no images, no full logits) is ONE CUDA-graph replay of its batch bucket, captured at load
(decode_graphs.py, this class's mixin). The vision tower still runs on the CPU (numpy).

The last layer of an eager step runs only the rows the head reads (`prune_last`): every row's K/V is written (the
next steps attend to it), then the rows whose last-layer output nothing reads are dropped before attention. A
readout or argmax sequence keeps its last row, a `logits` one all its rows, any other (a prompt chunk the head
does not read) none. The kept rows go through the same kernels with the same inputs, so their bytes are those of
the whole step; a 2,048-token prompt skips ~1/30 of its step.

An eager step's attention runs by its plan (layers.attention.attention_plan, _attention): the decode rows of a step
that also holds prompt chunks take the split path (the decode graphs' kernels), the chunks the fused tile; with e4m3
pools on sm_90 the fused runs first copy their sequences' blocks to bf16 (kv_widen_gpu, into self.kv_wide) so that
the wgmma tile, which reads bf16 only, attends them. Each path gives a row the same bytes (attention.cu's header).
"""
from __future__ import annotations

import dataclasses
import itertools
import math

import ml_dtypes
import numpy as np

import gpu
from layers import attention, embed, linear
from layers.attention import ATTN_FUSED_WG, BLOCK, attention_gpu, attention_plan, kv_widen_gpu, qkv_prep_gpu
from layers.embed import argmax_gpu, embed_gpu, head_work_bytes, readout_gpu, softcap_gpu
from layers.linear import head_gpu, linear_gpu, linear_multi_gpu, mlp_gpu, upload_linear, x_slots_ok
from layers.moe import (moe_gpu, moe_workspace, post_attn_router_gpu, post_attn_router_ok, router_gpu,
                        upload_experts, x_perm_ok as moe_x_perm_ok)
from layers.norm import post_attn_norms_gpu, post_ffn_norms_gpu, rmsnorm_gpu
from layers.vision_tower import encode_image, load_vision
from config import ConfigError, check_kv_dtype
from decode_graphs import DECODE_BUCKETS, DECODE_ROWS, MAX_KEYS_OUT, DecodeGraphs, decode_buckets, decode_max_keys
from model import SeqOut, StepTools
from step_plans import StepPlans

BF16 = np.dtype(ml_dtypes.bfloat16)
KV_POOL_DTYPES = {"bf16": BF16, "fp8": np.dtype(ml_dtypes.float8_e4m3fn)}   # by kv_dtype (config.KV_DTYPES)
# Bytes of split-attention scratch (attention_work_bytes): the largest decode graph's rows in one group, within
# these bounds (512 rows at max_len 8192 take 2.02 GiB); attention_gpu runs the rows of a larger step in groups.
ATTN_WORK, ATTN_WORK_MAX = 256 << 20, 3 << 30
PA_SPARE = 8                   # rows of each of _layer's 3 spare outputs (>= layers.moe.PA_ROUTER_MAX_T)
MAX_ROWS = 2048                # rows a step by default (the server asks for more when its prefill chunk needs them)
MAX_IMAGES = 64                # images of one sequence in one eager step (the spans of attention's vision blocks)
# kv_tokens=0: the KV pool takes KV_AUTO_FRACTION of the device memory still free once the weights, the workspaces
# and the vision tower are in, less KV_AUTO_RESERVE (the decode graphs, the driver, other kernels' scratch), as
# whole blocks, at most kv_cap positions (the engine: max_batch x max_len) and at least KV_AUTO_MIN (auto_kv_tokens).
KV_AUTO_FRACTION, KV_AUTO_RESERVE, KV_AUTO_MIN = 0.9, 2 << 30, 4096
# Bytes of bf16 weight copies kept for the `_ss` prefill launches (layers.linear cache_w16: whole launches, the
# o_proj ones first, then q+k+v, layer by layer), so that those launches make no copy of their own (and take `_ss`
# from layers.linear.W16_KEPT_MIN_T tokens, not W16_MIN_T). They count as weight memory (the full-size model: 14.94
# GiB of weights + 0.97 GiB kept = 15.90, under performance.md's 16). 0: none kept.
W16_KEEP_BYTES = 1 << 30
# fp8 KV pools on sm_90: bytes of the bf16 copies of a step's blocks that its fused (prompt) attention reads through
# the wgmma tile (layers.attention.attention_plan, kv_widen_gpu), K and V together; at least one longest sequence's.
KV_WIDE_BYTES = 256 << 20


def kv_position_bytes(cfg, kv_dtype="bf16"):
    """Device bytes of one KV position: K and V of every layer (2 bytes a value in bf16, 1 in fp8; the pools keep both
    even where K = V)."""
    return sum(2 * geo.kv_heads * geo.head_dim * KV_POOL_DTYPES[kv_dtype].itemsize for geo in cfg.text.layers)


def auto_kv_tokens(cfg, free_bytes, cap, kv_dtype="bf16"):
    """The KV pool's positions for kv_tokens=0 (see KV_AUTO_FRACTION): whole blocks, at most cap. Raises ConfigError
    (a clear message, no traceback from span02.py) when fewer than KV_AUTO_MIN (or cap) positions fit."""
    room = int(free_bytes * KV_AUTO_FRACTION) - KV_AUTO_RESERVE
    n = min(max(room, 0) // kv_position_bytes(cfg, kv_dtype), cap) // BLOCK * BLOCK
    least = max(min(KV_AUTO_MIN, cap) // BLOCK * BLOCK, BLOCK)
    if n < least:
        raise ConfigError(f"{free_bytes / 2**30:.1f} GiB of device memory free after the weights: room for {n} KV "
                          f"positions, fewer than {least}; free memory or pass --kv-tokens")
    return n


def attention_work_bytes(t, max_blocks, rows):
    """Bytes of float32 scratch for the split attention of `rows` decode rows (at most the largest decode bucket) in
    one group: each row's partials (layers.attention.split_row_floats) at its layer type's decode key bound
    (decode_graphs.decode_max_keys), within [ATTN_WORK, ATTN_WORK_MAX]. With max_len 8192 a
    row of a global layer (16 heads, D = 512) takes 4.2 MB: 256 MB held 63 rows, so a batch-256 step ran those
    layers in 5 groups (439 launches a step in place of 399). In one group (H200, 1k context, 4 alternating rounds,
    the same output bytes) b64 / 128 / 192 steps took 13.339 / 19.625 / 25.356 -> 13.235 / 19.383 / 25.031 ms, faster
    in every round; b256 30.375 -> 30.154, faster in two rounds of four (BENCHMARKS.md, fifty-second session)."""
    rows = max(1, min(rows, max(DECODE_BUCKETS)))
    per_row = 4 * max(attention.split_row_floats(t.heads, decode_max_keys(t, geo, max_blocks), geo.head_dim)
                      for geo in t.layers)
    return min(ATTN_WORK_MAX, max(ATTN_WORK, rows * per_row + 16))


class GpuModel(DecodeGraphs, StepTools):
    def __init__(self, cfg, ck, kv_tokens=1 << 14, max_rows=MAX_ROWS, max_seqs=256, max_len=8192, name="model",
                 graphs=True, kv_cap=None, decode_rows=DECODE_ROWS, kv_dtype="bf16"):
        t = cfg.text
        check_kv_dtype(kv_dtype)
        self.cfg, self.name, self.device, self.kv_dtype = cfg, name, "gpu", kv_dtype
        self.prune_last, self.pruned_steps = True, 0    # the last layer on the head's rows only (module docstring)
        self.g = g = gpu.GPU()
        self.max_rows, self.max_seqs = max_rows, max_seqs
        self.buckets = decode_buckets(decode_rows, min(max_seqs, max_rows))   # the decode graphs' (graphs=True)
        self.max_blocks = math.ceil(max_len / BLOCK)
        p = ck.text_prefix

        def bf(name, shape):
            return g.upload(ck.tensor(name, shape).astype(BF16))

        self.embed_table = bf(f"{p}embed_tokens.weight", (t.vocab, t.hidden))          # (V, H) bf16
        self.embed_scale = float(embed.embed_scale(t.hidden, ck.dtype(f"{p}embed_tokens.weight")))
        self.final_norm = bf(f"{p}norm.weight", (t.hidden,))
        self.layers = []
        for i, geo in enumerate(t.layers):
            q, H, D = f"{p}layers.{i}.", t.hidden, geo.head_dim
            w = {n: bf(f"{q}{n}.weight", (H,)) for n in (
                "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                "pre_feedforward_layernorm_2")}
            for n, shape in (("self_attn.q_proj", (t.heads * D, H)), ("self_attn.k_proj", (geo.kv_heads * D, H)),
                             ("self_attn.o_proj", (H, t.heads * D)), ("mlp.gate_proj", (t.intermediate, H)),
                             ("mlp.up_proj", (t.intermediate, H)), ("mlp.down_proj", (H, t.intermediate))) + (
                    () if geo.k_eq_v else (("self_attn.v_proj", (geo.kv_heads * D, H)),)):
                w[n] = upload_linear(g, ck.linear_raw(q + n, shape))
            w["self_attn.q_norm"] = bf(f"{q}self_attn.q_norm.weight", (D,))
            w["self_attn.k_norm"] = bf(f"{q}self_attn.k_norm.weight", (D,))
            w["inv_freq"] = g.upload(attention.rope_inv_freq(geo.rope, D))
            w["layer_scalar"] = float(ck.tensor(f"{q}layer_scalar", (1,))[0])
            w["experts"] = upload_experts(g, ck, q, t.experts, H, t.expert_intermediate)
            self.layers.append(w)
        self.w16_kept = 0
        if linear.W16_MIN_T is not None and max_rows >= linear.W16_MIN_T:   # long prompts run `_ss`: keep copies
            self.w16_kept = linear.cache_w16(g, [[w["self_attn.o_proj"]] for w in self.layers] + [
                self._qkv(i) for i in range(len(self.layers))], W16_KEEP_BYTES)
        self.weight_bytes = g.allocated_bytes
        self._workspace()
        self.vision = load_vision(ck, cfg.vision, t.hidden) if cfg.vision and ck.vision_prefix else None
        if kv_tokens <= 0:
            kv_tokens = auto_kv_tokens(cfg, g.mem_free(), kv_cap or max_seqs * max_len, kv_dtype)
        # per layer: K and V pools (blocks, 16, Hkv, D) bf16 / e4m3. With graphs the last block is the decode pad
        # rows' scratch block: the users (scheduler) see num_blocks = one fewer.
        pool_blocks = max(2 if graphs else 1, math.ceil(kv_tokens / BLOCK))
        self.num_blocks = pool_blocks - 1 if graphs else pool_blocks
        self.scratch_block = pool_blocks - 1 if graphs else None
        kv = KV_POOL_DTYPES[kv_dtype]
        self.k_pool = [g.empty((pool_blocks, BLOCK, geo.kv_heads, geo.head_dim), kv) for geo in t.layers]
        self.v_pool = [g.empty((pool_blocks, BLOCK, geo.kv_heads, geo.head_dim), kv) for geo in t.layers]
        self.decode_graphs, self.graph_launches, self._dec = {}, {}, {}    # per bucket B: Graph, launches, buffers
        self.decode_graph_steps = 0                                        # steps served by a replay
        self.step_plans = StepPlans(g)                                     # prompt steps' (step_plans.py)
        self.stats = {"launches_per_decode_step": {}, "host_syncs_per_decode_step": 1}
        if graphs:
            self.capture_decode_graphs()

    def _workspace(self):
        g, t, R, S = self.g, self.cfg.text, self.max_rows, self.max_seqs
        Dq = max(t.heads * geo.head_dim for geo in t.layers)
        Dkv = max(geo.kv_heads * geo.head_dim for geo in t.layers)
        H, I = t.hidden, t.intermediate
        self.ws = {n: g.empty((R, w), BF16) for n, w in (
            ("x", H), ("xn", H), ("h", H), ("a", H), ("m", H), ("e_in", H), ("e", H), ("r", H),
            ("q_in", Dq), ("k_in", Dkv), ("v_in", Dkv), ("q", Dq), ("attn", Dq), ("act", I))}
        # fp8 pools and the wgmma prompt tile: bf16 copies of the blocks a step's fused attention reads (K, V; each
        # layer's view of them is (wide_cap, 16, Hkv, D)), and their tables and block lists among the step's inputs
        wide = [geo for geo in t.layers if geo.head_dim in (ATTN_FUSED_WG or {})]
        self.wide_cap, self.kv_wide = 0, None
        if self.kv_dtype == "fp8" and wide and g.capability == (9, 0):
            per = max(2 * BLOCK * geo.kv_heads * geo.head_dim for geo in wide)     # bytes of a bf16 block
            self.wide_cap = max(self.max_blocks, KV_WIDE_BYTES // 2 // per)
            self.kv_wide = [g.empty((self.wide_cap * per,), np.uint8) for _ in range(2)]
        n_in = 3 * R + S * self.max_blocks + S * MAX_IMAGES * 2 + 4 * S + MAX_KEYS_OUT   # _step_inputs' words
        n_in += 2 * 2 * 2 * S * self.max_blocks if self.wide_cap else 0    # 2 plans' tab (2, S, mb) and src lists
        self.ws.update(inp=g.empty((n_in,), np.int32),
                       weights=g.empty((R, t.top_k), np.float32), idx=g.empty((R, t.top_k), np.int32),
                       attn_work=g.empty((attention_work_bytes(t, self.max_blocks, max(self.buckets)) // 4,),
                                         np.float32),
                       sel=g.empty((S,), np.int32), z=g.empty((S, H), BF16),
                       zn=g.empty((S, H), BF16),
                       spare=g.empty((3 * PA_SPARE, H), BF16),       # _layer's fused router launch: unread rows
                       logits=g.empty((S, t.vocab), np.float32), am=g.empty((S,), np.int32),
                       lse=g.empty((S,), np.float32), keys=g.empty((MAX_KEYS_OUT,), np.int32),
                       keys_out=g.empty((S, MAX_KEYS_OUT), np.float32),
                       head_work=g.empty((head_work_bytes(S, t.vocab) // 4,), np.float32))
        self.inp_host, self.inp_copied = g.host_empty((n_in,), np.int32), g.event()   # ws["inp"]'s pinned source
        self._views = {}                                                            # _v's
        self.moe_ws = moe_workspace(g, R, t.experts, t.top_k, H, t.expert_intermediate)
        if linear.W16_MIN_T is not None and R >= linear.W16_MIN_T:    # the `_ss` launches' bf16 weight copies
            attn = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
            linear.reserve_w16(g, [grp for w in self.layers for grp in (
                [w[n] for n in attn if n in w], [w["self_attn.o_proj"]], [w["mlp.gate_proj"], w["mlp.up_proj"]],
                [w["mlp.down_proj"]])], R)

    def _v(self, name, *shape, dtype=BF16):
        """A view of the first rows of a workspace buffer, shaped for this step: made once per shape and kept (the
        workspace never moves and nothing changes a view), since a step asks for ~17 a layer."""
        key = (name, shape, dtype)
        v = self._views.get(key)
        if v is None:
            if len(self._views) >= 4096:
                self._views.clear()
            v = self._views[key] = self.g.view(self.ws[name], 0, shape, dtype)
        return v

    @property
    def gpu_wait_s(self):
        """Host seconds spent blocked on the GPU so far (gpu.GPU.wait_s): what a step adds to it is the part of
        its wall time the GPU set; the rest was the host's (the engine's step_gpu_wait_ms)."""
        return self.g.wait_s

    def encode_image(self, pre) -> np.ndarray:
        if self.vision is None:
            raise ValueError("this model has no vision tower")
        return encode_image(self.vision, self.cfg.vision, pre.pixel_values, pre.position_ids, pre.num_soft_tokens)

    # --- the step ------------------------------------------------------------------------------------------
    def step(self, seqs):
        g, t = self.g, self.cfg.text
        g.bind()                                   # the engine steps from its own thread
        B = self._decode_bucket(seqs)
        if B is not None:
            return self._decode_step(B, seqs)
        lens = [len(s.tokens) for s in seqs]
        T, S = sum(lens), len(seqs)
        if T > self.max_rows or S > self.max_seqs:
            raise ValueError(f"step of {T} rows / {S} sequences: the workspace holds {self.max_rows} / {self.max_seqs}")
        mb = max(len(s.blocks) for s in seqs)
        if mb > self.max_blocks:
            raise ValueError(f"a sequence of {mb} blocks: the longest is {self.max_blocks}")
        n_img = max(len(s.images) for s in seqs)
        if n_img > MAX_IMAGES:
            raise ValueError(f"a sequence of {n_img} images in one step: at most {MAX_IMAGES}")
        offsets = list(itertools.accumulate(lens, initial=0))
        keep = self._keep_rows(seqs, offsets, lens)
        last = [j for j, s in enumerate(seqs) if (s.readout or s.argmax) and not s.logits]   # the head's rows
        rows = list(range(len(last))) if keep is not None else [offsets[j] + lens[j] - 1 for j in last]
        keys = sorted({k for j in last for k in seqs[j].readout})
        if len(keys) > MAX_KEYS_OUT:
            raise ValueError(f"a step of {len(keys)} distinct readout keys: at most {MAX_KEYS_OUT}")
        plans, extra = self._attn_plans(seqs, lens, keep)
        ids, pos, rows_seq, tab, sp, keep_v, sel, kd, ext = self._step_inputs(seqs, lens, offsets, mb, max(n_img, 1),
                                                                              keep, rows, keys, extra)
        plans = self._plans_on_device(plans, ext)

        def launches():                            # everything of the step between its upload and its downloads
            x = self._v("x", T, t.hidden)
            embed_gpu(g, self.embed_table, ids, x, self.embed_scale)
            for s, o in zip(seqs, offsets):
                for im in s.images:                # soft tokens replace the <|image|> rows, unscaled, as bf16
                    r = o + im.start - s.start
                    g.upload(np.asarray(im.embeds, np.float32).astype(BF16),
                             out=g.view(self.ws["x"], r * t.hidden * 2, (len(im.embeds), t.hidden), BF16))
            self._stack(T, pos, rows_seq, tab, sp, keep_v, plans)
            if last:
                self._head_run(sel, kd if keys else None, len(last), len(keys))
        shape = None if n_img or any(s.logits for s in seqs) else (   # step_plans' key: what the launches hang on
            tuple((n, s.start, len(s.blocks), bool(s.argmax), bool(s.readout)) for s, n in zip(seqs, lens)),
            len(keys), keep is not None)
        self.step_plans.run(shape, launches)
        self.pruned_steps += keep is not None
        outs = [SeqOut() for _ in seqs]
        if last:
            res = self._head_read(len(last), keys)
            for r, j in enumerate(last):
                outs[j] = self._out(seqs[j], res, r)
        for j, s in enumerate(seqs):               # full logits: a sequence at a time, eagerly
            if s.logits:
                lrows = list(range(int(offsets[j]), int(offsets[j] + lens[j])))
                chunks = [self._head_rows(lrows[a:a + self.max_seqs], s.readout, full=True)
                          for a in range(0, len(lrows), self.max_seqs)]
                last_row = self._out(s, chunks[-1], (len(lrows) - 1) % self.max_seqs)
                outs[j] = dataclasses.replace(last_row, logits=np.concatenate([c["logits"] for c in chunks]))
        return outs

    def _step_inputs(self, seqs, lens, offsets, mb, n_spans, keep=None, head_rows=(), head_keys=(), extra=()):
        """An eager step's int32 inputs in one upload: written into the pinned staging array (after its last copy
        has run), copied at once to ws["inp"], returned as views of it: ids (T), pos (T), rows_seq (T), tables
        (S, mb), spans (S, n_spans, 2) (image start, rows), keep (3, R) (_keep_rows; None when every row goes
        on), the head's rows and readout keys, and a list of views of the `extra` int32 arrays (the attention
        plans' tables: _attn_plans). One copy in place of eight: on an idle GPU each of a step's first submissions
        costs ~0.1 ms, whatever it is (BENCHMARKS.md, thirty-first session); and a step's plan (step_plans) finds
        all its data in place."""
        g, T, S = self.g, offsets[-1], len(seqs)
        shapes = [(T,), (T,), (T,), (S, mb), (S, n_spans, 2)] + ([] if keep is None else [keep.shape]) + [
            (len(head_rows),), (len(head_keys),)] + [a.shape for a in extra]
        ends = list(itertools.accumulate((math.prod(sh) for sh in shapes), initial=0))
        g.wait(self.inp_copied)
        h = self.inp_host
        arrays = [h[a:b].reshape(sh) for a, b, sh in zip(ends, ends[1:], shapes)]
        ids, pos, rows_seq, tab, sp, *kept, sel, kd = arrays[:len(arrays) - len(extra)]
        sel[:], kd[:] = head_rows, head_keys
        for dst, a in zip(arrays[len(arrays) - len(extra):], extra):
            dst[...] = a
        tab[:], sp[:] = 0, 0
        for j, (s, o, n) in enumerate(zip(seqs, offsets, lens)):
            ids[o:o + n] = s.tokens
            pos[o:o + n] = np.arange(s.start, s.start + n, dtype=np.int32)
            rows_seq[o:o + n] = j
            tab[j, :len(s.blocks)] = s.blocks
            for k, im in enumerate(s.images):
                sp[j, k] = (im.start, len(im.embeds))
        if keep is not None:
            kept[0][:] = keep
        g.upload(h[:ends[-1]], out=g.view(self.ws["inp"], 0, (ends[-1],), np.int32))
        g.record(self.inp_copied)
        views = [g.view(self.ws["inp"], 4 * a, sh, np.int32) for a, sh in zip(ends, shapes)]
        views, ext = views[:len(views) - len(extra)], views[len(views) - len(extra):]
        return views[:5] + ([None] if keep is None else views[5:6]) + views[-2:] + [ext]

    def _keep_rows(self, seqs, offsets, lens):
        """The rows the last layer keeps (prune_last): the last row of each readout / argmax sequence, in sequence
        order, as row | pos | rows_seq (3, R) int32; None when every row is kept (a `logits` sequence, or no row
        to drop)."""
        if not self.prune_last or any(s.logits for s in seqs):
            return None
        rows = [(offsets[j] + lens[j] - 1, s.start + lens[j] - 1, j)
                for j, s in enumerate(seqs) if s.readout or s.argmax]
        if len(rows) == offsets[-1]:
            return None
        return np.asarray(rows, np.int32).reshape(len(rows), 3).T

    def _stack(self, T, pos, rows_seq, tab, spans, keep, plans):
        """The decoder layers of an eager step over its T rows, the last one keeping `keep`'s rows (_keep_rows);
        plans: its attention's (_attn_plans, on the device)."""
        self._first_norm(T)
        last, xn_slots = len(self.layers) - 1, False
        for i, (w, geo) in enumerate(zip(self.layers, self.cfg.text.layers)):
            xn_slots = self._layer(i, w, geo, T, pos, rows_seq, tab, spans, keep=keep if i == last else None,
                                   xn_slots=xn_slots, plans=plans)

    def _attn_plans(self, seqs, lens, keep):
        """An eager step's attention plans (layers.attention.attention_plan) for all its rows and for the last
        layer's kept rows (None without keep), as (runs, tab, src) on the host, and the int32 arrays that go up
        with the step's inputs (each plan with bf16 copies (self.wide_cap): its two tables tab[0], tab[1] and its
        src lists)."""
        t = self.cfg.text
        starts, tables = [s.start for s in seqs], [s.blocks for s in seqs]
        plans = [attention_plan(lens, starts, tables, t.window, self.wide_cap)]
        if keep is not None:
            n_rows = np.bincount(keep[2], minlength=len(seqs))
            plans.append(attention_plan(n_rows, starts, tables, t.window, self.wide_cap))
        extra = [a for _, tab, src in plans if tab is not None for a in (*tab, *src)]
        return plans, extra

    @staticmethod
    def _plans_on_device(plans, views):
        """_attn_plans' plans with their tables and src lists as the uploaded views (in that order), each a pair (0 full
        layers, 1 sliding); (all, kept or None)."""
        out, views = [], list(views)
        for runs, tab, src in plans:
            if tab is not None:
                tab, src = views[0:2], views[2:4]
                del views[:4]
            out.append((runs, tab, src))
        return out[0], out[1] if len(out) > 1 else None

    def _first_norm(self, T):
        """xn = layer 0's input_layernorm(x); every later layer's comes fused at the end of the one before."""
        t = self.cfg.text
        rmsnorm_gpu(self.g, self._v("x", T, t.hidden), self.layers[0]["input_layernorm"], self._v("xn", T, t.hidden),
                    t.eps)

    def _layer(self, i, w, geo, T, pos, rows_seq, tab, spans, max_keys=None, keep=None, xn_slots=False,
               decode=False, plans=None):
        """One decoder layer over the step's T rows. keep (3, R) int32 (row | pos | rows_seq, _keep_rows): after
        every row's K/V is written, only those R rows go on (moved to rows 0 .. R-1). xn_slots: xn comes in
        x16_bf16's slot order (the layer before wrote it so: layers.linear.x_slots_ok). decode: every row is its
        own sequence's one new position (the decode graphs), so attention takes its split path at any T (the same
        bytes as the fused one). plans (an eager step's: _attn_plans, on the device): its attention's runs over
        all rows and over the kept rows. Returns whether this layer left the next one's xn in the slot order."""
        g, t, eps = self.g, self.cfg.text, self.cfg.text.eps
        H, D, Hq, Hkv, I = t.hidden, geo.head_dim, t.heads, geo.kv_heads, t.intermediate
        xn = self._v("xn", T, H)                                 # xn = input_layernorm(x) here
        q_in, k_in = self._v("q_in", T, Hq * D), self._v("k_in", T, Hkv * D)
        v_in = None if geo.k_eq_v else self._v("v_in", T, Hkv * D)
        linear_multi_gpu(g, xn, self._qkv(i), [q_in, k_in] + ([] if v_in is None else [v_in]), x_slots=xn_slots)
        q = self._v("q", T, Hq, D)
        qkv_prep_gpu(g, q_in, k_in, v_in, w["self_attn.q_norm"], w["self_attn.k_norm"], w["inv_freq"], pos, eps,
                     q, None, None, kv=(self.k_pool[i], self.v_pool[i], rows_seq, tab))
        if keep is not None:
            T, pos, rows_seq = self._move_kept(keep, T, Hq * D)
            if T == 0:
                return False
            q = self._v("q", T, Hq, D)
        x, xn, h = self._v("x", T, H), self._v("xn", T, H), self._v("h", T, H)
        attn = self._v("attn", T, Hq * D)
        o_in = x_slots_ok(g, T, [w["self_attn.o_proj"]])          # attn straight to o_proj's `_ss`
        sp = spans if t.bidirectional_vision else None
        if plans is None:
            o_in = attention_gpu(g, q, self.k_pool[i], self.v_pool[i], rows_seq, pos, tab, sp, t.window, geo.sliding,
                                 attn, max_keys=max_keys, work=self.ws["attn_work"], out_slots=o_in,
                                 split=True if decode else None)
        else:
            o_in = self._attention(i, geo, q, rows_seq, pos, tab, sp, attn, o_in, plans[keep is not None])
        a = linear_gpu(g, attn, w["self_attn.o_proj"], self._v("a", T, H), x_slots=o_in)
        e_in, e = self._v("e_in", T, H), self._v("e", T, H)
        r = self._v("r", T, H)                                   # the MoE router's input row
        mlp_in = x_slots_ok(g, T, (w["mlp.gate_proj"], w["mlp.up_proj"]), gelu=True)   # xn straight to `_ss`
        e_perm = moe_x_perm_ok(g, T, w["experts"], t.top_k)                          # e_in straight to the experts
        weights = g.view(self.ws["weights"], 0, (T, t.top_k), np.float32)
        idx = g.view(self.ws["idx"], 0, (T, t.top_k), np.int32)
        norm_w = (w["post_attention_layernorm"], w["pre_feedforward_layernorm"], w["pre_feedforward_layernorm_2"])
        # The dense MLP (reads xn, writes act and m) and the router + experts (read h, r, e_in; write weights, idx,
        # the MoE workspace and e) are independent: the MLP runs on a branch beside them, joined before the
        # norms that add the two. Same kernels, same bits; only their overlap changes (gpu.branch; the branch's
        # launches are plain, not PDL, so that no grid of it waits on SMs the experts need: gpu.launch). The MLP's
        # prompt launches use the GPU's one `_ss` scratch (layers.linear), so no dense launch may join the main
        # stream's side of this window. Where the router can make its own input rows (layers.moe.post_attn_router_ok:
        # batch 1), the norm chain runs twice from a and x, both right after o_proj: on the branch for the MLP's xn,
        # and in the router's launch for h and e_in (each writes the rest to spare rows; the same bytes).
        fused = T <= PA_SPARE and post_attn_router_ok(a, (x, h, xn, e_in, self.ws["spare"]) + norm_w, w["experts"],
                                                      t.top_k)
        spare = [g.view(self.ws["spare"], j * PA_SPARE * H * 2, (T, H), BF16) for j in range(3)] if fused else None
        act = self._v("act", T, I)
        if not fused:
            mlp_in, e_perm = post_attn_norms_gpu(g, a, x, *norm_w, h, xn, e_in, eps,            # h = x + norm(a)
                                                 router=(r, w["experts"]["router_scale"], H ** -0.5), xn_slots=mlp_in,
                                                 e_perm=e_perm)
        with g.branch():                                         # act = bf16(gelu(gate)) * up, then m = down(act)
            if fused:
                mlp_in = post_attn_norms_gpu(g, a, x, *norm_w, spare[0], xn, spare[1], eps, xn_slots=mlp_in)[0]
            m = mlp_gpu(g, xn, w["mlp.gate_proj"], w["mlp.up_proj"], w["mlp.down_proj"], act, self._v("m", T, H),
                        x_slots=mlp_in)
        if fused:
            e_perm = post_attn_router_gpu(g, a, x, *norm_w, h, spare[2], e_in, eps, w["experts"], weights, idx,
                                          self.moe_ws, t.top_k, e_perm=e_perm)[1]
        else:
            router_gpu(g, h, w["experts"], weights, idx, self.moe_ws, t.top_k, eps, r=r)
        e = moe_gpu(g, e_in, h, weights, idx, w["experts"], e, self.moe_ws, combine=False,   # its combine: below
                    x_perm=e_perm)
        g.join()
        # x = (h + norm(norm(m) + norm(e))) * layer_scalar, and the next layer's xn = input_layernorm(x)
        nxt = self.layers[i + 1]["input_layernorm"] if i + 1 < len(self.layers) else None
        qkv_in = nxt is not None and x_slots_ok(g, T, self._qkv(i + 1))          # the next xn straight to `_ss`
        return post_ffn_norms_gpu(g, m, e, h, w["post_feedforward_layernorm_1"], w["post_feedforward_layernorm_2"],
                                  w["post_feedforward_layernorm"], w["layer_scalar"], x, eps, w_next=nxt, xn=xn,
                                  xn_slots=qkv_in)

    def _attention(self, i, geo, q, rows_seq, pos, tab, spans, out, out_slots, plan):
        """Layer i's attention of an eager step by its plan's runs (layers.attention.attention_plan): split runs and
        fused ones, the latter over bf16 copies of their blocks where the plan has them and this layer's tile is the
        wgmma one (kv_widen_gpu into self.kv_wide, then the tile with the plan's tables). Returns whether out went
        out in the slot order (out_slots: only when every run is fused)."""
        g, t = self.g, self.cfg.text
        runs, wtab, wsrc = plan
        slots = out_slots and not any(r.split for r in runs)
        got = set()
        for r in runs:
            pools, tables = (self.k_pool[i], self.v_pool[i]), tab
            if r.wide is not None and geo.head_dim in ATTN_FUSED_WG:
                k = int(bool(geo.sliding))
                off, n = r.wide[k]
                pools = self._wide_views(geo)
                kv_widen_gpu(g, self.k_pool[i], self.v_pool[i], (gpu.ptr(wsrc[k].ptr + 4 * off), n), *pools)
                tables = wtab[k]
            got.add(attention_gpu(g, q, *pools, rows_seq, pos, tables, spans, t.window, geo.sliding, out,
                                  work=self.ws["attn_work"], out_slots=slots, split=r.split, rows=(r.r0, r.r1)))
        if len(got) > 1:
            raise AssertionError(f"layer {i}: runs wrote out in different orders ({got})")
        return got.pop() if got else False

    def _wide_views(self, geo):
        """self.kv_wide as bf16 pools of geo's block shape (made once a geometry)."""
        key = ("kv_wide", geo.kv_heads, geo.head_dim)
        v = self._views.get(key)
        if v is None:
            shape = (self.kv_wide[0].nbytes // (2 * BLOCK * geo.kv_heads * geo.head_dim), BLOCK, geo.kv_heads,
                     geo.head_dim)
            v = self._views[key] = [self.g.view(a, 0, shape, BF16) for a in self.kv_wide]
        return v

    def _qkv(self, i):
        """Layer i's q / k (/ v) projections, in linear_multi_gpu's order (full k = v layers have no v_proj)."""
        w = self.layers[i]
        return [w["self_attn." + n] for n in ["q_proj", "k_proj"] + ([] if self.cfg.text.layers[i].k_eq_v
                                                                    else ["v_proj"])]

    def _move_kept(self, keep, T, width):
        """Rows keep[0] of q (T, width) and x (T, H) to rows 0 .. R-1 (gathered through q_in and a, free here:
        the source rows may be destinations); returns R and the kept rows' pos and rows_seq."""
        g, H = self.g, self.cfg.text.hidden
        R = keep.shape[1]
        rows = g.view(keep, 0, (R,), np.int32)
        for src, tmp, n in (("q", "q_in", width), ("x", "a", H)) if R else ():
            embed_gpu(g, self._v(src, T, n), rows, self._v(tmp, R, n), 1.0)         # x * 1.0 is exact
            g.copy(self._v(src, R, n), self._v(tmp, R, n))
        return R, g.view(keep, 4 * R, (R,), np.int32), g.view(keep, 8 * R, (R,), np.int32)

    def _head_launches(self, x, logits, am, keys=None, lse=None, keys_out=None):
        """Final norm, tied head, soft-cap, argmax and (with keys) the readout over the rows x (R, H): the
        launches the eager head and the decode graph share."""
        g, t = self.g, self.cfg.text
        zn = self._v("zn", x.shape[0], t.hidden)
        rmsnorm_gpu(g, x, self.final_norm, zn, t.eps)
        head_gpu(g, zn, self.embed_table, logits)
        if t.softcap:
            softcap_gpu(g, logits, t.softcap)
        argmax_gpu(g, logits, am, self.ws["head_work"])
        if keys is not None:
            readout_gpu(g, logits, keys, lse, keys_out, self.ws["head_work"])

    def _head_bufs(self, R, nk):
        """The head's outputs for R rows and nk readout keys: logits (R, vocab), argmax, lse and key logits."""
        f32 = np.float32
        lse, ko = (self._v("lse", R, dtype=f32), self._v("keys_out", R, nk, dtype=f32)) if nk else (None, None)
        return self._v("logits", R, self.cfg.text.vocab, dtype=f32), self._v("am", R, dtype=np.int32), lse, ko

    def _head_run(self, sel, kd, R, nk):
        """The head's launches on the R rows of ws["x"] that sel (int32, on the device) names, reading out the nk
        keys kd (None: none)."""
        z = self._v("z", R, self.cfg.text.hidden)
        embed_gpu(self.g, self.ws["x"], sel, z, 1.0)              # gather the rows (x * 1.0 is exact)
        logits, am, lse, ko = self._head_bufs(R, nk)
        self._head_launches(z, logits, am, kd, lse, ko)

    def _head_read(self, R, keys, full=False):
        """What _head_run left for R rows and `keys`: {"keys", "argmax", "lse", "keys_out", "logits" (full)}."""
        g = self.g
        logits, am, lse, ko = self._head_bufs(R, len(keys))
        res = {"keys": list(keys), "argmax": g.download(am)}
        if keys:
            res["lse"], res["keys_out"] = g.download(lse), g.download(ko)
        if full:
            res["logits"] = g.download(logits)
        return res

    def _head_rows(self, rows, keys, full=False):
        """The head on `rows` of ws["x"] (uploaded here), run and read: a `logits` sequence's chunks."""
        g, R = self.g, len(rows)
        sel = g.upload(np.asarray(rows, np.int32), out=self._v("sel", R, dtype=np.int32))
        kd = g.upload(np.asarray(keys, np.int32), out=self._v("keys", len(keys), dtype=np.int32)) if keys else None
        self._head_run(sel, kd, R, len(keys))
        return self._head_read(R, keys, full)

    @staticmethod
    def _out(s, res, r):
        col = {k: c for c, k in enumerate(res["keys"])}
        return SeqOut(argmax=int(res["argmax"][r]) if s.argmax else None,
                      key_logits=tuple(float(res["keys_out"][r, col[k]]) for k in s.readout) if s.readout else None,
                      logsumexp=float(res["lse"][r]) if s.readout else None)

    def profile_decode(self, B, context=1024, reps=3):
        """Per-kernel device times of bucket B's decode step with every sequence at `context` positions: the decode
        body captured once more with an event recorded after every launch, replayed `reps` times (the last one
        counts). Returns [{"kernel", "us", "bytes"}] in launch order (bytes: what the launcher declared it must
        move, or None). For bench.py: it WRITES the KV of position `context` in blocks 0 .. B * ceil((context + 1) / 16)
- 1 (the pools otherwise hold whatever they hold: timing only), so run it on an idle model; needs
        B * ceil((context + 1) / 16) <= num_blocks. The events add ~1 us per kernel to the sum."""
        from model import SeqStep
        g, d = self.g, self._dec[B]
        g.bind()
        nb = -(-(context + 1) // BLOCK)
        if B * nb > self.num_blocks or nb > self.max_blocks:
            raise ValueError(f"profile_decode: {B} sequences of {context} positions do not fit the KV pool")
        rng = np.random.default_rng(0)
        seqs = [SeqStep((int(rng.integers(3, self.cfg.text.vocab)),), context, tuple(range(j * nb, (j + 1) * nb)),
                        argmax=True) for j in range(B)]
        self._decode_inputs(d, seqs, [])
        return self._profile(lambda: self._decode_body(B, d), reps)

    def profile_prefill(self, T, reps=3):
        """Per-kernel device times of one sequence's T-token prefill (the layer stack, the last layer on the last
        row as an argmax step runs it (prune_last); embedding and head left out), as profile_decode gives them: one
        eager step first (it uploads the inputs), then the layers captured with an event after every launch. Writes
        the KV of blocks 0 .. ceil(T / 16) - 1: run it on an idle model."""
        from model import SeqStep
        g = self.g
        g.bind()
        nb = -(-T // BLOCK)
        if nb > min(self.num_blocks, self.max_blocks) or T > self.max_rows:
            raise ValueError(f"profile_prefill: {T} tokens do not fit the KV pool or the workspace")
        ids = tuple(int(x) for x in np.random.default_rng(0).integers(3, self.cfg.text.vocab, T))
        seq = SeqStep(ids, 0, tuple(range(nb)), argmax=True)
        self.step([seq])
        keep = self._keep_rows([seq], [0, T], [T])
        plans, extra = self._attn_plans([seq], [T], keep)
        _, pos, rows_seq, tab, sp, keep, _, _, ext = self._step_inputs([seq], [T], [0, T], nb, 1, keep, extra=extra)
        plans = self._plans_on_device(plans, ext)
        return self._profile(lambda: self._stack(T, pos, rows_seq, tab, sp, keep, plans), reps)

    def _profile(self, body, reps):
        """[{"kernel", "us", "bytes", "flops"}] of the launches body() makes: captured into a graph with an event
        recorded after every launch, replayed `reps` times (the last one counts). Branches are off here (every
        launch on the one stream), so each interval is one kernel's."""
        g = self.g
        marks = []                                   # (event, kernel, bytes, flops) after each launch

        def hook(name, grid, block, nbytes, flops):
            ev = g.event()
            g.record(ev, external=True)
            marks.append((ev, name, nbytes, flops))
        start = g.event()
        branches, g.branches = g.branches, False
        g.capture_begin()
        try:
            g.record(start, external=True)
            g.launch_hook = hook
            body()
        finally:
            g.launch_hook, g.branches = None, branches
            graph = g.capture_end()
        try:
            for _ in range(reps):
                graph.replay()
            g.sync()
            out, prev = [], start
            for ev, name, nbytes, flops in marks:
                out.append({"kernel": name, "us": g.elapsed_ms(prev, ev) * 1e3, "bytes": nbytes, "flops": flops})
                prev = ev
        finally:
            graph.close()
            for ev in [start] + [m[0] for m in marks]:
                ev.close()
        return out

    def close(self):
        """Destroy the decode graphs and free every device buffer and pinned host array (the GPU object is closed).
        The arrays over pinned memory are dropped first, so that a step after close fails in Python instead of
        touching freed memory."""
        for graph in self.decode_graphs.values():
            graph.close()
        self.decode_graphs.clear()
        self.step_plans.close()
        self._dec.clear()
        self.inp_host = None
        self.g.close()
