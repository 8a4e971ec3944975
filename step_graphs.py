"""Prompt steps as CUDA-graph replays: OFF by default (SPAN02_STEP_GRAPHS=N keeps up to N graphs).

An eager step (model_gpu.GpuModel.step for anything but a pure decode step) issues ~363 launches from Python, several
ms of host time; a 512-token readout step takes ~15 ms on the GPU, so a host running at about half speed would make
that step wait on its launches (a candidate cause of the server readouts' swings, not established: BENCHMARKS.md,
forty-eighth session). The launches of a step depend only on its shape: every
sequence's token count, start, block-table length, argmax / readout flags, the number of readout keys (recorded
launch by launch, argument values included, with a stand-in driver: the same shape with other tokens and block
tables gives the same launches). Its data (tokens, positions, tables, head rows, keys) comes through the step's input
buffer, uploaded before the launches. So a graph captured for a shape can stand in for the launches of every later
step of that shape: one graph launch instead of ~363.

The first step of a shape runs eagerly (it also loads the modules and sets the kernels' attributes, so that nothing
but launches happens in a capture); the second is captured, then replayed; later ones replay. Shapes are kept in LRU
order, `keep` at most. A capture that fails or allocates device memory is our bug: RuntimeError.

Not yet run on the GPU (forty-eighth session: written after the session's device time was spent). Until the GPU
tests (test_gpu_step_graphs_*) and a readout A/B have run, it stays off.
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
