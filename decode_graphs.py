"""Decode as one CUDA-graph replay per batch bucket: model_gpu.GpuModel's pure decode steps (its mixin).

A pure decode step (every sequence 1 token, no images, no full logits) is ONE CUDA-graph replay (performance.md): the
batch is padded to a bucket B in DECODE_BUCKETS; the graph of each bucket is captured at load over fixed buffers
(inputs, workspace views of B rows, block tables of max_blocks columns, MAX_KEYS_OUT readout keys), so a decode step
is one HtoD upload of its inputs, one graph launch and one DtoH download (the only host sync), and allocates nothing.
Pad rows are dummy sequences at position 0 of a reserved scratch KV block (the pool's last block, hidden from
`num_blocks`); every kernel computes a row from that row's inputs alone, so they cannot touch the real rows, and the
replay gives the eager step's bytes. The graph body is the eager step's own launchers (GpuModel._layer,
_head_launches) over the bucket's buffers.
"""
from __future__ import annotations

import numpy as np

from layers.attention import BLOCK
from layers.embed import embed_gpu
from model import SeqOut

# batch sizes that can have a decode graph: a model captures those up to the first that holds its decode_rows
# (decode_buckets), within max_seqs and max_rows; larger steps run eagerly
DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352, 384, 416, 448, 480, 512)
DECODE_ROWS = 256              # the rows a model's graphs hold by default (the server passes its --max-batch)
PAD_TOKEN = 0                  # token id of the decode pad rows (any valid id: their outputs are ignored)
MAX_KEYS_OUT = 26              # option keys A..Z


def decode_buckets(decode_rows, cap):
    """The buckets a model captures: those of DECODE_BUCKETS up to the first that holds decode_rows rows (every
    decode step of at most decode_rows sequences replays a graph), none above cap (its max_seqs, max_rows)."""
    top = next((b for b in DECODE_BUCKETS if b >= decode_rows), DECODE_BUCKETS[-1])
    return tuple(b for b in DECODE_BUCKETS if b <= min(top, cap))


def decode_max_keys(t, geo, max_blocks):
    """The key bound a decode step's attention runs a layer with (fixed per layer type, so a graph serves every
    step): the window on sliding layers, else the whole max_blocks-wide table (the launcher's default)."""
    return min(t.window, max_blocks * BLOCK) if geo.sliding else max_blocks * BLOCK


class DecodeGraphs:
    """GpuModel's decode graphs: made by capture_decode_graphs at load (decode_graphs, _dec, graph_launches,
    stats), used by step through _decode_bucket / _decode_step."""

    def _decode_bucket(self, seqs):
        """The bucket B of a pure decode step (every sequence 1 token, no images, no full logits, a table within
        max_blocks, at most MAX_KEYS_OUT distinct readout keys) that has a graph; else None (eager step)."""
        if not self.decode_graphs or not seqs:
            return None
        for s in seqs:
            if len(s.tokens) != 1 or s.images or s.logits or len(s.blocks) > self.max_blocks:
                return None
        B = next((b for b in self.decode_graphs if b >= len(seqs)), None)    # buckets ascending
        if B is None or len({k for s in seqs for k in s.readout}) > MAX_KEYS_OUT:
            return None
        return B

    def _decode_buffers(self, B):
        """Fixed device buffers of bucket B, each with a pinned host mirror: `inp` int32 = ids (B) | pos (B) |
        rows_seq (B) | tables (B, max_blocks) | keys (MAX_KEYS_OUT), uploaded in one copy per step; `out` 4-byte
        words = argmax (B) int32 | lse (B) f32 | keys_out (B, MAX_KEYS_OUT) f32, downloaded in one copy per step."""
        g, mb, K = self.g, self.max_blocks, MAX_KEYS_OUT
        n_in = 3 * B + B * mb + K
        inp, out = g.empty((n_in,), np.int32), g.empty((B * (2 + K),), np.float32)
        host_in, host_out = g.host_empty(n_in, np.int32), g.host_empty(B * (2 + K), np.float32)   # pinned
        host_in[:], host_out[:] = 0, 0
        d = dict(inp=inp, out=out, host_in=host_in, host_out=host_out,
                 ids=g.view(inp, 0, (B,), np.int32), pos=g.view(inp, 4 * B, (B,), np.int32),
                 rows_seq=g.view(inp, 8 * B, (B,), np.int32), tables=g.view(inp, 12 * B, (B, mb), np.int32),
                 keys=g.view(inp, 4 * (3 * B + B * mb), (K,), np.int32),
                 am=g.view(out, 0, (B,), np.int32), lse=g.view(out, 4 * B, (B,), np.float32),
                 keys_out=g.view(out, 8 * B, (B, K), np.float32),
                 h_ids=host_in[:B], h_pos=host_in[B:2 * B], h_tables=host_in[3 * B:3 * B + B * mb].reshape(B, mb),
                 h_keys=host_in[3 * B + B * mb:])
        host_in[2 * B:3 * B] = np.arange(B, dtype=np.int32)   # rows_seq: row j is sequence j (constant)
        d["rows"] = [None] * B                                 # what each table row holds (_decode_inputs)
        return d

    def _decode_inputs(self, d, seqs, keys):
        """Fill bucket buffers' host mirror: real rows first, then pad rows (PAD_TOKEN at position 0 of the scratch
        block); keys padded with a repeated valid key. One upload. A table row is rewritten only when its blocks
        differ from those it holds (d["rows"][j]: the tuple row j was last written from; a pad row is the scratch
        block alone): a decode row's table grows by one block every 16 steps, and converting every row's list to
        int32 every step cost ~0.18 ms a batch-64 step (BENCHMARKS.md, eleventh session)."""
        S = len(seqs)
        self.g.wait(self.inp_copied)                            # the last upload from the pinned mirrors has run
        d["h_ids"][:S] = [s.tokens[0] for s in seqs]
        d["h_ids"][S:] = PAD_TOKEN
        d["h_pos"][:S] = [s.start for s in seqs]
        d["h_pos"][S:] = 0
        tab, rows, pad = d["h_tables"], d["rows"], (self.scratch_block,)
        for j in range(len(rows)):
            want = pad if j >= S else seqs[j].blocks if type(seqs[j].blocks) is tuple else tuple(seqs[j].blocks)
            if rows[j] != want:
                tab[j] = 0
                tab[j, :len(want)] = want
                rows[j] = want
        d["h_keys"][:len(keys)] = keys
        d["h_keys"][len(keys):] = keys[0] if keys else PAD_TOKEN
        self.g.upload(d["host_in"], out=d["inp"])
        self.g.record(self.inp_copied)

    def _decode_body(self, B, d):
        """The decode step of B rows over the bucket's fixed buffers: what the graph captures. The same
        launchers and arguments as the eager step; every grid depends on B only; the head runs on all B rows."""
        g, t = self.g, self.cfg.text
        x = self._v("x", B, t.hidden)
        embed_gpu(g, self.embed_table, d["ids"], x, self.embed_scale)
        self._first_norm(B)
        for i, (w, geo) in enumerate(zip(self.layers, t.layers)):
            # spans None: decode rows carry no image block (the eager step passes all-unused spans: same key
            # ranges); max_keys fixed per layer type (the launcher's default for a max_blocks-wide table)
            self._layer(i, w, geo, B, d["pos"], d["rows_seq"], d["tables"], None,
                        max_keys=decode_max_keys(t, geo, self.max_blocks), decode=True)
        logits = self._v("logits", B, t.vocab, dtype=np.float32)  # all B rows: the eager gather is exact
        self._head_launches(x, logits, d["am"], d["keys"], d["lse"], d["keys_out"])

    def capture_decode_graphs(self):
        """Capture one decode graph per bucket of self.buckets (decode_buckets; after weights, pools and workspace):
        per bucket, allocate its buffers, run the body once eagerly on pad rows (loads the modules, sets the
        kernels' shared-memory attributes: no driver set-up call is left for the capture), capture it, replay it
        once. Records graph_launches[B] and stats."""
        g = self.g
        g.bind()
        for B in self.buckets:
            d = self._decode_buffers(B)
            self._decode_inputs(d, [], [])
            self._decode_body(B, d)                            # warm-up, eager
            g.sync()
            graph = g.capture(lambda: self._decode_body(B, d),
                              f"decode graph capture, bucket {B} (graphs=False loads the eager step)")
            graph.replay()
            g.sync()
            self._dec[B], self.decode_graphs[B], self.graph_launches[B] = d, graph, graph.launches
        self.stats = {"launches_per_decode_step": dict(self.graph_launches), "host_syncs_per_decode_step": 1}

    def _decode_step(self, B, seqs):
        """Upload the inputs (async), replay bucket B's graph, download argmax / lse / key logits in one copy."""
        d = self._dec[B]
        keys = sorted({k for s in seqs for k in s.readout})
        self._decode_inputs(d, seqs, keys)
        self.decode_graphs[B].replay()
        out = self.g.download(d["out"], out=d["host_out"])      # the step's only host sync
        self.decode_graph_steps += 1
        K = MAX_KEYS_OUT
        res = {"keys": keys, "argmax": out[:B].view(np.int32), "lse": out[B:2 * B],
               "keys_out": out[2 * B:].reshape(B, K)}
        return [self._out(s, res, j) if (s.readout or s.argmax) else SeqOut() for j, s in enumerate(seqs)]
