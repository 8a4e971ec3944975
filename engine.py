"""The engine thread: requests in, one batched model step at a time, answers out.

    submit(request) -> Future          (any thread; wire's HTTP loop)
    engine thread:  intake -> stems (prompter) -> scheduler (EDF, prefix cache) -> model.step
                    -> QuestionPolicy.advance per finished row -> resolve futures

An exception inside model.step or our own bookkeeping is our bug: it is logged with the request ids,
those requests fail with 500 `internal`, and the engine keeps serving the others.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import queue
import random
import statistics
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from config import ConfigError
from model import ImageRows, SeqOut, SeqStep
from policy import THOUGHT_MODES, QuestionPolicy, Request, thought_limit
from prompt import PromptError
from scheduler import BLOCK, Scheduler, Seq, TooLarge
from vision import ImageError

log = logging.getLogger("span02.engine")


class EngineError(Exception):
    def __init__(self, status: int, type: str, message: str, field: str | None = None, retry_after=None):
        super().__init__(message)
        self.status, self.type, self.message, self.field, self.retry_after = status, type, message, field, retry_after


STEP_MS_LE = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)   # step_ms / step_gpu_wait_ms buckets


class Histogram:
    """Prometheus-style: `le` upper bounds (+Inf implied), cumulative counts, sum, count."""

    def __init__(self, le):
        self.le, self.counts, self.sum, self.count = tuple(le), [0] * len(le), 0.0, 0

    def observe(self, x):
        for i, b in enumerate(self.le):
            if x <= b:
                self.counts[i] += 1
        self.sum += x
        self.count += 1

    def snapshot(self):
        return {"le": list(self.le), "counts": list(self.counts), "sum": self.sum, "count": self.count}


def _internal(job):
    return EngineError(500, "internal", f"internal error (logged with request id {job.req.id!r})")


def _late():
    return EngineError(503, "deadline_exceeded", "the deadline passed before the request could start")


@dataclass(eq=False)                 # identity: jobs are dict keys and list items
class _Job:
    req: Request
    future: concurrent.futures.Future
    pols: list = field(default_factory=list)     # QuestionPolicy per question
    seqs: list = field(default_factory=list)
    left: int = 0
    started: bool = False
    over: bool = False                           # answered or failed: ignore its remaining rows
    images: int = 0


def _check_model_limits(model, cfg):
    """A model with a fixed workspace (the GPU's: block tables of max_blocks, max_rows a step) must hold the engine's
    longest sequence and a whole prefill chunk with its probe row: else such steps would fail at run time."""
    blocks, rows = getattr(model, "max_blocks", None), getattr(model, "max_rows", None)
    if blocks is not None and cfg.max_len > blocks * BLOCK:
        raise ConfigError(f"max-len {cfg.max_len}: the model's block tables hold {blocks * BLOCK} positions "
                          f"(load it with max_len={cfg.max_len})")
    if rows is not None and cfg.prefill_chunk + 1 > rows:
        raise ConfigError(f"prefill chunk {cfg.prefill_chunk}: the model steps at most {rows} rows, a chunk and its "
                          f"probe row (load it with max_rows={cfg.prefill_chunk + 1})")


class Engine:
    def __init__(self, model, prompter, cfg, encode_image=None, clock=time.monotonic):
        self.model, self.prompter, self.cfg, self.encode_image, self.clock = model, prompter, cfg, encode_image, clock
        _check_model_limits(model, cfg)
        self.sched = Scheduler(model.num_blocks, cfg.max_batch, cfg.prefill_chunk,
                               prefix_cache=cfg.prefix_cache, serial=cfg.serial,
                               max_rows=getattr(model, "max_rows", None), max_seqs=getattr(model, "max_seqs", None))
        self.inbox: queue.Queue = queue.Queue()
        self.jobs: list[_Job] = []
        self.lock = threading.Lock()
        self.n_waiting = 0                          # submitted, not started (guarded by lock)
        self.stopping = self.halt = False
        self.gone: deque = deque()                  # futures their client cancelled (wire), from done-callbacks
        self.thread = None
        self.m = {"answers": Counter(), "requests": Counter(), "prompt_tokens": 0, "cached_tokens": 0,
                  "reasoning_tokens": 0, "images": 0, "steps": 0,
                  "step_ms": Histogram(STEP_MS_LE), "step_gpu_wait_ms": Histogram(STEP_MS_LE),
                  "batch": Histogram((1, 2, 4, 8, 16, 32, 64, 128, 256, 512))}
        self.gauges = {"running": 0, "running_seqs": 0, "blocks_used": 0, "hit_tokens": 0, "lookup_tokens": 0}

    # --- the public side (any thread) -------------------------------------------------------------
    def start(self):
        self.thread = threading.Thread(target=self._run, name="span02-engine", daemon=True)
        self.thread.start()

    def stop(self, drain_timeout: float = 30.0):
        """Refuse new requests, let those in flight finish for up to drain_timeout s, fail the rest (503)."""
        self.stopping = True
        end = time.monotonic() + drain_timeout
        while self.thread and self.thread.is_alive() and time.monotonic() < end \
                and (self.jobs or not self.inbox.empty()):
            time.sleep(0.01)
        self.halt = True
        if self.thread:
            self.thread.join()

    def submit(self, req: Request) -> concurrent.futures.Future:
        fut = concurrent.futures.Future()
        with self.lock:
            if self.stopping:
                fut.set_exception(EngineError(503, "unavailable", "the server is shutting down"))
            elif self.n_waiting >= self.cfg.max_queue:
                fut.set_exception(EngineError(429, "overloaded", f"{self.n_waiting} requests are waiting; "
                                              "retry later", retry_after=1))
            else:
                self.n_waiting += 1
                fut.add_done_callback(self._done)
                self.inbox.put(_Job(req, fut))
        return fut

    def _done(self, fut):
        """A future's done-callback (the thread that finished it): cancelled ones go to the engine thread, which
        drops their requests at its next tick."""
        if fut.cancelled():
            self.gone.append(fut)

    def health(self) -> dict:
        g, n = self.gauges, self.model.num_blocks
        return {"model": self.model.name, "device": self.model.device,
                "queue": {"waiting": self.n_waiting, "running": g["running"]},
                "kv": {"used": g["blocks_used"] / n, "capacity_tokens": n * BLOCK, "dtype": self.model.kv_dtype}}

    def metrics_snapshot(self) -> dict:
        """{"answers": {stop: n}, "requests": {"ok" | "<status>": n}, "prompt_tokens": n, "cached_tokens": n,
        "reasoning_tokens": n, "images": n, "steps": n (counters); "queue_waiting", "running_requests",
        "running_seqs", "kv_used" (share of blocks), "kv_capacity_tokens", "prefix_cache_hit_ratio"
        (gauges); "step_ms", "batch" (rows per step) and, on a GPU model, "step_gpu_wait_ms" (the part of each
        step the host spent blocked on the GPU; step_ms less it is the host's own part): histograms {"le": [...],
        "counts": cumulative [...] per le (+Inf = count), "sum": f, "count": n}; on a GPU model also
        "prompt_step_replays" (counter: prompt steps replayed from the plan of their shape, step_plans.py)."""
        with self.lock:
            m, g = self.m, self.gauges
            return {"answers": dict(m["answers"]), "requests": dict(m["requests"]),
                    **{k: m[k] for k in ("prompt_tokens", "cached_tokens", "reasoning_tokens", "images", "steps")},
                    "queue_waiting": self.n_waiting, "running_requests": g["running"],
                    "running_seqs": g["running_seqs"], "kv_used": g["blocks_used"] / self.model.num_blocks,
                    "kv_capacity_tokens": self.model.num_blocks * BLOCK,
                    "prefix_cache_hit_ratio": g["hit_tokens"] / g["lookup_tokens"] if g["lookup_tokens"] else 0.0,
                    "step_ms": m["step_ms"].snapshot(), "batch": m["batch"].snapshot(),
                    **({"step_gpu_wait_ms": m["step_gpu_wait_ms"].snapshot()}
                       if hasattr(self.model, "gpu_wait_s") else {}),
                    **({"prompt_step_replays": self.model.step_plans.stats["replays"]}
                       if hasattr(self.model, "step_plans") else {})}

    # --- the engine thread -------------------------------------------------------------------------
    def _run(self):
        while not self.halt:
            try:
                self._tick()
            except Exception:              # our bug outside a step: fail what is in flight, keep serving
                log.exception("engine loop failed; failing requests %s", [j.req.id for j in self.jobs])
                for job in list(self.jobs):
                    self._fail(job, _internal(job))
        for job in list(self.jobs):
            self._fail(job, EngineError(503, "unavailable", "the server shut down before the answer was ready"))
        while not self.inbox.empty():
            self._fail(self.inbox.get(), EngineError(503, "unavailable", "the server shut down"))

    def _tick(self):
        busy = bool(self.sched.running or self.sched.waiting)
        self._intake(wait=0.0 if busy else 0.02)
        self._expire()
        works = self.sched.schedule()
        if works:
            self._step(works)
        elif busy:
            time.sleep(0.001)
        self._gauges()

    def _intake(self, wait):
        try:
            job = self.inbox.get(timeout=wait) if wait else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._accept(job)
            try:
                job = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _accept(self, job):
        req, cfg, pr = job.req, self.cfg, self.prompter
        if job.future.cancelled():
            return self._fail(job, EngineError(499, "cancelled", "the client went away"))
        try:
            if req.thought not in THOUGHT_MODES:
                raise EngineError(422, "invalid_request", "policy.thought must be auto, never or always",
                                  field="policy.thought")
            seen = {}                      # id(image) -> embeds: wire hands a reused asset over once
            enc = lambda ims: [seen[id(im)] if id(im) in seen else seen.setdefault(id(im), self._encode(im))
                               for im in ims]
            shared = enc(req.images)
            job.images = len(req.images) + sum(len(q.images) for q in req.questions)
            batch = cfg.think_batch
            for qi, q in enumerate(req.questions):
                embeds = shared + enc(q.images)
                stem = pr.stem(req.system, req.context, [len(e) for e in shared], q.text, q.choices,
                               [len(e) for e in embeds[len(shared):]])
                L = len(stem.tokens)
                if L + 1 > cfg.max_len:
                    raise EngineError(413, "too_large", f"question {q.id!r} has a {L}-token prompt; "
                                      f"the limit is {cfg.max_len - 1}", field=f"questions[{qi}]")
                limit = 0 if req.thought == "never" else thought_limit(req.policy, cfg.think_cost, batch, L)
                limit = max(0, min(limit, cfg.max_len - L - 1))
                ims = [(st, n, hashlib.blake2b(e.tobytes(), digest_size=16).digest())
                       for (st, n), e in zip(stem.image_spans, embeds)]
                pol = QuestionPolicy(q, req, stem.keys, limit, pr.channel_close, pr.eos_ids, pr.decode)
                job.pols.append(pol)
                seq, first = Seq(stem.tokens, L + limit + 1, ims, tag=(job, pol, embeds)), pol.first()
                self.sched.extend(seq, first.feed, first.probe, pol.keys if first.readout else (), first.argmax)
                job.seqs.append(seq)
            job.left = len(job.seqs)
            self.sched.add(job.seqs, req.deadline, req.arrival, tag=job)
        except EngineError as e:
            return self._fail(job, e)
        except TooLarge as e:
            return self._fail(job, EngineError(413, "too_large", str(e)))
        except (PromptError, ImageError) as e:        # the client's input
            return self._fail(job, EngineError(422, "invalid_request", str(e)))
        except Exception:
            log.exception("request %s: building prompts failed", req.id)
            return self._fail(job, _internal(job))
        self.jobs.append(job)

    def _encode(self, image):
        if self.encode_image is None:
            raise EngineError(422, "invalid_request", "this model takes no images", field="images")
        return self.encode_image(image)

    def _expire(self):
        """Drop requests whose client left (wire cancels the future: _done queues it); 503 those whose deadline
        passed while they waited. (Asking every job's future whether it was cancelled took ~0.18 ms with 256
        requests in, every step of the standard workload: BENCHMARKS.md, eleventh session.)"""
        if self.gone:
            gone = set()
            while self.gone:
                gone.add(self.gone.popleft())
            for job in [j for j in self.jobs if j.future in gone]:
                self._fail(job, EngineError(499, "cancelled", "the client went away"))
        now = self.clock()
        for job in list(self.jobs):
            if not job.started and job.req.deadline is not None and now >= job.req.deadline:
                self._fail(job, _late())

    def _step(self, works):
        now = self.clock()
        for w in works:
            job, pol, _ = w.seq.tag
            if not job.started:            # the exact check: the deadline may pass between sweep and step
                if job.req.deadline is not None and now >= job.req.deadline:
                    self._fail(job, _late())
                    continue
                job.started = True
                with self.lock:
                    self.n_waiting -= 1
            pol.start(now)
        works = [w for w in works if not w.seq.tag[0].over]
        if not works:
            return
        wait0 = getattr(self.model, "gpu_wait_s", None)
        try:
            outs = self._model_step(works)
        except Exception:
            bad = {id(w.seq.tag[0]): w.seq.tag[0] for w in works}
            log.exception("model step failed; requests %s", [j.req.id for j in bad.values()])
            for job in bad.values():
                self._fail(job, _internal(job))
            return
        done = self.clock()
        with self.lock:
            self.m["steps"] += 1
            self.m["step_ms"].observe((done - now) * 1000.0)
            if wait0 is not None:                  # a GPU model: the part of the step the host sat waiting on it
                self.m["step_gpu_wait_ms"].observe((self.model.gpu_wait_s - wait0) * 1000.0)
            self.m["batch"].observe(len(works))
        self.sched.complete(works)
        for w, out in zip(works, outs):
            job, pol, _ = w.seq.tag
            if not w.final or job.over:
                continue
            try:
                nxt = pol.advance(out, done)
                if nxt is not None:
                    self.sched.extend(w.seq, nxt.feed, nxt.probe, pol.keys if nxt.readout else (), nxt.argmax)
                    continue
                self.sched.finish(w.seq)
                job.left -= 1
                if job.left == 0:
                    self._resolve(job, done)
            except Exception:
                log.exception("request %s: policy failed", job.req.id)
                self._fail(job, _internal(job))

    def _model_step(self, works):
        """One model step for the works, one SeqOut each. A work that wants the greedy token of its last kept row
        and key logits after probe rows (the stem's last chunk, then `<channel|>`) goes in as two SeqSteps of
        the same sequence, the probe second: it reads the KV the first writes in the same step (model.SeqStep)."""
        steps = []
        for w in works:
            ims = tuple(ImageRows(w.seq.images[i][0], w.seq.tag[2][i]) for i in w.images) if w.images else ()
            if w.split:
                steps.append(SeqStep(w.tokens[:w.keep], w.start, w.blocks, argmax=True, images=ims))
                steps.append(SeqStep(w.tokens[w.keep:], w.start + w.keep, w.blocks, readout=w.readout))
            else:
                steps.append(SeqStep(w.tokens, w.start, w.blocks, readout=w.readout, argmax=w.argmax, images=ims))
        outs = self.model.step(steps)
        if len(outs) != len(steps):
            raise RuntimeError(f"model.step returned {len(outs)} outputs for {len(steps)} sequences")
        it, merged = iter(outs), []
        for w in works:
            o = next(it)
            if w.split:
                r = next(it)
                o = SeqOut(argmax=o.argmax, key_logits=r.key_logits, logsumexp=r.logsumexp)
            merged.append(o)
        return merged

    def _resolve(self, job, now):
        answers = [p.answer() for p in job.pols]
        usage = {"prompt_tokens": sum(s.prompt_len for s in job.seqs),
                 "cached_tokens": sum(s.cached for s in job.seqs),
                 "reasoning_tokens": sum(a["reasoning_tokens"] for a in answers), "images": job.images}
        self.jobs.remove(job)
        job.over = True
        self._gauges()                     # before the client can see the answer and ask /health
        with self.lock:
            self.m["requests"]["ok"] += 1
            for a in answers:
                self.m["answers"][a["stop"]] += 1
            for k, v in usage.items():
                self.m[k] += v
        try:
            job.future.set_result({"id": job.req.id, "model": self.model.name, "answers": answers, "usage": usage,
                                   "ms": round((now - job.req.arrival) * 1000.0, 2)})
        except concurrent.futures.InvalidStateError:      # the client left (wire cancelled the future)
            pass

    def _fail(self, job, err):
        job.over = True
        self.sched.cancel(job)
        if job in self.jobs:
            self.jobs.remove(job)
        self._gauges()
        with self.lock:
            if not job.started:
                job.started = True
                self.n_waiting -= 1
            self.m["requests"][str(err.status)] += 1
        try:
            job.future.set_exception(err)
        except concurrent.futures.InvalidStateError:      # cancelled or already answered
            pass

    def _gauges(self):
        st = self.sched.stats()
        with self.lock:
            self.gauges = {"running": sum(1 for j in self.jobs if j.started), "running_seqs": st["running_seqs"],
                           "blocks_used": st["blocks_used"], "hit_tokens": st["hit_tokens"],
                           "lookup_tokens": st["lookup_tokens"]}


# --- calibrate: the think_ms cost table -------------------------------------------------------------

def calibrate(model, cfg, repeats: int = 3, seed: int = 0) -> dict:
    """Decode-step milliseconds per (batch, context) on this model: the table of policy.thought_limit.
    Rows use random tokens and share one block table (the KV content does not change the time); the
    KV pool is scribbled on, so run it before serving, never during."""
    rng = random.Random(seed)
    fits = model.num_blocks * BLOCK
    batches = sorted({b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if b < cfg.max_batch} | {cfg.max_batch})
    contexts = sorted({c for c in (256, 1024, 4096, 16384, 65536) if c < min(cfg.max_len, fits)}
                      | {min(cfg.max_len, fits)})
    ms = []
    for b in batches:
        row = []
        for c in contexts:
            table = tuple(range(-(-c // BLOCK)))
            times = []
            for r in range(repeats + 1):               # the first run warms up
                steps = [SeqStep((rng.randrange(model.cfg.text.vocab),), c - 1, table, argmax=True)
                         for _ in range(b)]
                t = time.perf_counter()
                model.step(steps)
                times.append((time.perf_counter() - t) * 1000.0)
            row.append(round(statistics.median(times[1:]), 4))
        ms.append(row)
        log.info("calibrate: batch %d of %d: %s ms at contexts %s", b, batches[-1], row, contexts)
    return {"device": model.device, "model": model.name, "batch": batches, "context": contexts, "ms": ms}
