"""Prompt steps replayed from recorded plans: a shape's steps after its second make the driver calls its second made.

An eager step (model_gpu.GpuModel.step for anything but a pure decode step) issues ~372 launches from Python. On the
H200's host a 512-token readout step's host part can be as long as its GPU part: 14.96 ms of host time (2.8 ms of it in
the driver's launch calls) in a 15.28-ms step, 0.32 ms blocked on the GPU (a 508-token step's kernels sum to
15.0 ms; BENCHMARKS.md, forty-ninth session). So a slower host lengthens that step one for one (the server
readouts' swings).

The launches of a step depend only on its shape: every sequence's token count, start, block-table length, argmax /
readout flags, the number of readout keys (recorded launch by launch, argument values included, with a stand-in
driver: the same shape with other tokens and block tables gives the same launches). Its data (tokens, positions,
tables, head rows, keys) comes through the step's input buffer, uploaded before the launches. So the driver calls a
step of a shape made can stand in for those of every later step of that shape.

A shape's first step runs eagerly; its second runs eagerly too while gpu.GPU.record_plan records its stream
operations (launches with their parameters, copies, the branches' event records and waits: gpu.Plan); every later
step of the shape replays them (gpu.GPU.replay_plan): the same driver calls in the same order, the same kernels with
the same arguments, so the same bytes, without the ~30 us of Python a launch that chose them. The recording copies
each launch's parameters (a few us of host time a launch), so a shape seen once costs nothing. Plans are kept in LRU
order, `keep` at most (SPAN02_STEP_PLANS, 0: every prompt step eager). A recording that made a call no plan can
replay (an allocation, an upload, a wait on the GPU) is our bug: it is not kept and counts in stats["void"], which
the tests check.

Measured (H200, fiftieth session, BENCHMARKS.md): a 512-token readout step replayed took 14.67 ms with a host part of
2.73, eager 14.92 with 13.48, recorded 14.96 with 14.73 (medians of 20); on that machine the step was GPU-bound
eagerly too, and the server's readouts with plans on and off did not differ beyond their spread. What the plans buy
is a host that no longer paces the steps of shapes that repeat: with 32 busy processes on the host's 16 cores, one
server's replayed readouts took 15.5-19.4 ms (one 26.0) against 21.5-27.3 for its eager ones.

The decode steps do not come here: each is one CUDA-graph replay of its batch bucket (decode_graphs.py). Prompt steps
as CUDA graphs were tried (forty-ninth session): a replayed 512-token step was ~0.8 ms faster than an eager one, but a
capture (a shape's second step, eager host time and the graph's launch one after the other) took its readout to ~32
ms, and the server's readouts were slower overall. A plan costs the step that records it only the copies of its
launches' parameters.
"""
from __future__ import annotations

import os
from collections import OrderedDict

STEP_PLANS = int(os.environ.get("SPAN02_STEP_PLANS", "64"))   # plans kept (LRU); 0: every prompt step eager
SEEN_MAX = 4096                                                 # shapes remembered as seen once


class StepPlans:
    """The prompt-step plans of one GPU (gpu.GPU `g`): run(key, body) queues body()'s work for a step of shape
    `key` (None: not plannable, eager), from a plan when one was recorded for the shape."""

    def __init__(self, g, keep=STEP_PLANS):
        self.g, self.keep = g, keep
        self.plans: OrderedDict = OrderedDict()      # key -> gpu.Plan, least recently used first
        self.seen: set = set()                       # keys whose first step ran (eagerly, unrecorded)
        self.stats = {"eager": 0, "recorded": 0, "replays": 0, "void": 0}

    def run(self, key, body):
        g = self.g
        if key is None or self.keep <= 0 or g.launch_hook is not None:    # (profiles time each launch: eager)
            self.stats["eager"] += 1
            return body()
        key = (key, g.pdl, g.branches)              # (settings a test or dev script may switch between steps)
        plan = self.plans.get(key)
        if plan is not None:
            self.plans.move_to_end(key)
            g.replay_plan(plan)
            self.stats["replays"] += 1
            return
        self.stats["eager"] += 1
        if key not in self.seen:
            if len(self.seen) >= SEEN_MAX:
                self.seen.clear()
            self.seen.add(key)
            return body()
        plan = g.record_plan(body)
        if plan.void is not None:
            self.stats["void"] += 1
            return
        self.plans[key] = plan
        self.stats["recorded"] += 1
        if len(self.plans) > self.keep:
            self.plans.popitem(last=False)

    def close(self):
        self.plans.clear()
        self.seen.clear()
