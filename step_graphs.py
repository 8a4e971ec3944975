"""Prompt steps as CUDA-graph replays: OFF by default (SPAN02_STEP_GRAPHS=N keeps up to N graphs).

An eager step (model_gpu.GpuModel.step for anything but a pure decode step) issues ~372 launches from Python. On the
H200's host a 512-token readout step's host part is as long as its GPU part: 14.96 ms of host time (2.8 ms of it in
the driver's launch calls) in a 15.28-ms step, 0.32 ms blocked on the GPU (a 508-token step's kernels sum to
15.0 ms; BENCHMARKS.md, forty-ninth session). So a slower host lengthens that step one for one (the server
readouts' swings).

The launches of a step depend only on its shape: every sequence's token count, start, block-table length, argmax /
readout flags, the number of readout keys (recorded launch by launch, argument values included, with a stand-in
driver: the same shape with other tokens and block tables gives the same launches). Its data (tokens, positions,
tables, head rows, keys) comes through the step's input buffer, uploaded before the launches. So a graph captured for
a shape can stand in for the launches of every later step of that shape: one graph launch instead of ~372.

The first step of a shape runs eagerly (it also loads the modules and sets the kernels' attributes, so that nothing
but launches happens in a capture); the second is captured, then replayed; later ones replay. Shapes are kept in LRU
order, `keep` at most. A capture that fails or allocates device memory is our bug: RuntimeError.

Measured (H200, forty-ninth session): the GPU tests (test_gpu_step_graphs_*) pass. With 8 graphs the engine's
replayed 512-token readouts took 15.2-15.3 ms against ~16.1 eager, but the server's readouts were slower (HTTP medians
16.85 and 17.15 ms against 15.96): each capture took its readout to ~32 ms, 4 of 15. So it stays off.
"""
from __future__ import annotations

import os
from collections import OrderedDict

STEP_GRAPHS = int(os.environ.get("SPAN02_STEP_GRAPHS", "0"))   # graphs kept (LRU); 0: every prompt step eager
SEEN_MAX = 4096                                                   # shapes remembered as seen once


class StepGraphs:
    """The prompt-step graphs of one GPU (gpu.GPU `g`): run(key, body) launches body()'s work for a step of shape
    `key` (None: not graphable, eager)."""

    def __init__(self, g, keep=STEP_GRAPHS):
        self.g, self.keep = g, keep
        self.graphs: OrderedDict = OrderedDict()     # key -> gpu.Graph, least recently used first
        self.seen: set = set()                       # keys whose first step ran eagerly
        self.stats = {"eager": 0, "captures": 0, "replays": 0}

    def run(self, key, body):
        if key is None or self.keep <= 0:
            self.stats["eager"] += 1
            return body()
        graph = self.graphs.get(key)
        if graph is not None:
            self.graphs.move_to_end(key)
        elif key in self.seen:
            graph = self._capture(key, body)
        else:
            if len(self.seen) >= SEEN_MAX:
                self.seen.clear()
            self.seen.add(key)
            self.stats["eager"] += 1
            return body()
        graph.replay()
        self.stats["replays"] += 1

    def _capture(self, key, body):
        g = self.g
        graph = self.graphs[key] = g.capture(body, f"prompt-step graph capture of shape {key!r}")
        self.stats["captures"] += 1
        if len(self.graphs) > self.keep:
            g.sync()                                 # the evicted graph's last replay has run
            self.graphs.popitem(last=False)[1].close()
        return graph

    def close(self):
        for graph in self.graphs.values():
            graph.close()
        self.graphs.clear()
        self.seen.clear()
