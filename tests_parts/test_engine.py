"""Engine, scheduler and policy on a tiny random model (CPU, seconds): allocator and prefix-cache
invariants, the policy's stops and blends, determinism across serving modes, admission and errors."""
import math
import sys
import tempfile
import threading
import time

import zlib

import numpy as np
import pytest

import config
import model as model_mod
import prompt
from config import EngineConfig, PolicyConfig
from engine import Engine, EngineError, calibrate
from policy import Question, Request, check_cost_table, r9
from scheduler import BLOCK, Scheduler, Seq, TooLarge

# --- a tiny random model ------------------------------------------------------------------------------

ENGINE_TEXT = dict(vocab_size=prompt.DEMO_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"], head_dim=16,
            num_key_value_heads=1, num_attention_heads=2, sliding_window=8, rms_norm_eps=1e-6,
            final_logit_softcapping=30.0, enable_moe_block=True, num_experts=4, top_k_experts=2,
            moe_intermediate_size=16, bos_token_id=2, eos_token_id=1, pad_token_id=0)


class RandomCheckpoint:
    """Checkpoint-shaped source of seeded random float32 weights, keyed by tensor name."""
    text_prefix = "model.language_model."

    def __init__(self, seed=0):
        self.seed = seed

    def _rng(self, name):
        return np.random.default_rng([self.seed, zlib.crc32(name.encode())])

    def tensor(self, name, shape):
        if name.endswith(("layer_scalar", "router.scale", "per_expert_scale")):
            return np.ones(shape, np.float32)
        if name.endswith("norm.weight"):
            return (1 + 0.1 * self._rng(name).standard_normal(shape)).astype(np.float32)
        return (0.3 * self._rng(name).standard_normal(shape)).astype(np.float32)   # embeddings: mild logits

    def linear(self, module, shape):
        return (self._rng(module).standard_normal(shape) / math.sqrt(shape[1])).astype(np.float32)

    def experts(self, prefix, E, H, I):
        r = self._rng(prefix + "experts")
        return ((r.standard_normal((E, 2 * I, H)) / math.sqrt(H)).astype(np.float32),
                (r.standard_normal((E, H, I)) / math.sqrt(I)).astype(np.float32))

    def dtype(self, name):
        return "F32"


def random_model(kv_tokens=4096, seed=0):
    cfg = config.model_config(dict(ENGINE_TEXT))
    return model_mod.Model(cfg, RandomCheckpoint(seed), kv_tokens=kv_tokens, name="tiny")


@pytest.fixture(scope="module")
def demo_prompter():
    d = tempfile.mkdtemp()
    prompt.make_demo_tokenizer(d)
    return prompt.Prompter(d)


ENGINE_CONTEXT = ("The light is red and the street is busy. People wait at the corner with their dogs, and a "
                  "blue bus stops to let some of them in. It has rained all day and the water runs in the gutter.")


def make_request(i, n_q=2, thought="auto", deadline=None, arrival=None, return_thought=True,
                 context=ENGINE_CONTEXT, **pol):
    qs = [Question(f"q{j}", f"Question {i}.{j}: what colour is the light?",
                   ["red", "green", "blue", "yes"][: 2 + (i + j) % 3]) for j in range(n_q)]
    return Request(f"r{i}", qs, PolicyConfig(**pol), system="Be careful.", context=context, thought=thought,
                   return_thought=return_thought, deadline=deadline,
                   arrival=time.monotonic() if arrival is None else arrival)


def serve_all(prompter, reqs, model=None, encode_image=None, **cfg):
    """Submit every request before the engine starts (so admission sees them all), return results."""
    cfg = {"max_len": 512, "max_batch": 16, "prefill_chunk": 32, **cfg}
    eng = Engine(model or random_model(), prompter, EngineConfig(model_dir="", **cfg), encode_image=encode_image)
    futs = [eng.submit(r) for r in reqs]
    eng.start()
    try:
        out = []
        for f in futs:
            try:
                out.append(f.result(timeout=60))
            except EngineError as e:
                out.append(e)
        return out
    finally:
        eng.stop(1.0)


class ModelProxy:
    """A model proxy: counts rows, may force <channel|> after k thought tokens, may raise."""

    def __init__(self, inner, close=None, after=None, stem_len=None):
        self.inner, self.close, self.after, self.stem_len = inner, close, after, stem_len
        self.rows, self.calls, self.boom = 0, [], False
        self.hold = threading.Event()                 # clear() parks the engine thread inside step
        self.hold.set()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def step(self, seqs):
        self.hold.wait()
        if self.boom:
            raise RuntimeError("boom")
        self.rows += sum(len(s.tokens) for s in seqs)
        self.calls.append(seqs)
        outs = self.inner.step(seqs)
        if self.after is None:
            return outs
        fix = []
        for s, o in zip(seqs, outs):   # the row at position stem_len + after - 1 predicts <channel|>
            last = s.start + len(s.tokens) - 1
            if s.argmax and last >= self.stem_len + self.after - 1:
                o = model_mod.SeqOut(argmax=self.close)
            fix.append(o)
        return fix


# --- scheduler ------------------------------------------------------------------------------------

def drive_scheduler(sched, on_final):
    """Run the scheduler without a model until every seq is done; on_final(seq) -> extend args or None."""
    for _ in range(10_000):
        works = sched.schedule()
        if not works:
            return
        sched.complete(works)
        check_pool(sched)
        for w in works:
            if w.final:
                nxt = on_final(w.seq)
                sched.finish(w.seq) if nxt is None else sched.extend(w.seq, *nxt)


def check_pool(sched):
    p = sched.pool
    held = [b for s in sched.running for b in s.blocks]
    assert all(p.ref[b] > 0 for b in held)
    assert not set(held) & set(p.free) and not set(held) & set(p.lru)
    assert len(set(p.free)) == len(p.free) and not set(p.free) & set(p.lru)
    for b in range(p.num_blocks):   # refcount = number of running seqs holding it
        assert p.ref[b] == sum(s.blocks.count(b) for s in sched.running)
    assert p.reserved == sum(s.reserve for s in sched.running) and p.available() >= 0


def test_prefix_cache_shares_and_evicts_lru():
    sched = Scheduler(num_blocks=12, max_batch=4, prefill_chunk=32)
    shared = list(range(100, 140))                       # 40 tokens: 2 full shareable blocks
    a, b = Seq(shared + [1, 2], 50), Seq(shared + [3, 4, 5], 50)
    sched.add([a, b], tag="g")
    drive_scheduler(sched, lambda s: None)              # prefill, then done
    assert a.cached == 0 and b.cached == 32              # b waited for a's blocks, then shared them
    assert len(sched.pool.lru) == 2 and sched.pool.used() == 0
    c = Seq(shared + [9], 50)
    sched.add([c], tag="h")
    sched.schedule()
    assert c.cached == 32 and sched.pool.ref[c.blocks[0]] == 1 and not sched.pool.lru
    check_pool(sched)
    big = Seq(list(range(300, 300 + 120)), 121)          # needs 8 blocks: 12 - 4 held by c -> fits
    sched.add([big], tag="i")
    sched.schedule()
    assert big.running and set(big.blocks).isdisjoint(c.blocks)   # never takes an in-use block
    check_pool(sched)
    more = Seq(list(range(500, 520)), 40)                # 3 blocks: none left until one finishes
    sched.add([more], tag="j")
    sched.schedule()
    assert not more.running
    with pytest.raises(TooLarge):
        sched.add([Seq([1] * 200, 201)], tag="k")


def test_lru_evicts_leaves_first_never_blocks_in_use():
    sched = Scheduler(num_blocks=4, max_batch=4, prefill_chunk=64)
    x = Seq(list(range(10, 59)), 49)                     # 3 full blocks + 1 token: the whole pool
    sched.add([x], tag=1)
    drive_scheduler(sched, lambda s: None)
    b0, b1, b2 = (sched.pool.trie[k] for k in sorted(sched.pool.trie, key=lambda k: k[1]))
    assert list(sched.pool.lru) == [b2, b1, b0]          # released leaf first: leaves are evicted first
    y = Seq(list(range(10, 26)) + [7] * 30, 46)          # shares block 0, needs 2 more: evicts one
    sched.add([y], tag=2)
    sched.schedule()
    assert y.cached == 16 and y.blocks[0] == b0 and list(sched.pool.lru) == [b1]
    assert b2 not in sched.pool.key and sched.pool.key[b1][0] == b0
    check_pool(sched)
    z = Seq(list(range(200, 210)), 16)                   # needs the last cached block: b1 goes
    sched.add([z], tag=3)
    sched.schedule()
    assert z.running and not sched.pool.lru and b1 not in sched.pool.key and b0 in sched.pool.key
    check_pool(sched)


def test_serial_and_edf_admission_order():
    def order(serial):
        sched = Scheduler(num_blocks=64, max_batch=1, prefill_chunk=64, serial=serial)
        for tag, dl, arr in (("late", 50.0, 0.0), ("none", None, 1.0), ("soon", 10.0, 2.0), ("soon2", 10.0, 3.0)):
            sched.add([Seq([5, 6, 7, tag.__hash__() % 100 + 20], 8, tag=tag)], deadline=dl, arrival=arr, tag=tag)
        seen = []
        drive_scheduler(sched, lambda s: seen.append(s.tag))
        return seen
    assert order(False) == ["soon", "soon2", "late", "none"]
    assert order(True) == ["late", "none", "soon", "soon2"]


def test_chunks_never_split_images():
    spans, sched = [], Scheduler(num_blocks=64, max_batch=2, prefill_chunk=16)
    sched.add([Seq(list(range(60)), 61, images=((5, 20, b"x"), (30, 4, b"y")))], tag=0)
    while (works := sched.schedule()):
        spans += [(w.start, w.start + w.keep, w.images) for w in works]
        sched.complete(works)
        for w in works:
            sched.finish(w.seq) if w.final else None
    assert spans == [(0, 5, ()), (5, 25, (0,)), (25, 30, ()), (30, 34, (1,)), (34, 48, ()), (48, 60, ())]


# --- policy through the engine ------------------------------------------------------------------

def stages_of(a):
    return [t["stage"] for t in a["trace"]]


def test_tau_zero_stops_at_gate_and_tau_above_one_thinks(demo_prompter):
    gated, = serve_all(demo_prompter, [make_request(0, n_q=3, tau=0.0)])
    assert all(a["stop"] == "gate" and a["reasoning_tokens"] == 0 and stages_of(a) == ["readout", "gate"]
               for a in gated["answers"])
    p = gated["answers"][0]["probabilities"]
    assert abs(sum(p) - 1) < 1e-8 and all(x == r9(x) for x in p)
    thought, = serve_all(demo_prompter, [make_request(0, n_q=3, tau=1.5, cap=5)])
    for a in thought["answers"]:
        assert stages_of(a) == ["readout", "gate", "thought", "readout", "blend"]
        assert a["stop"] in ("cap", "closed") and a["reasoning_tokens"] <= 5
        assert a["stop"] == "closed" or a["reasoning_tokens"] == 5
        assert a["index"] == max(range(len(a["probabilities"])), key=lambda i: (a["probabilities"][i], -i))
    assert thought["usage"]["reasoning_tokens"] == sum(a["reasoning_tokens"] for a in thought["answers"])


def test_never_always_and_blend(demo_prompter):
    never, = serve_all(demo_prompter, [make_request(1, thought="never", tau=2.0)])
    assert all(a["stop"] == "never" and stages_of(a) == ["readout", "gate"] for a in never["answers"])
    always, = serve_all(demo_prompter, [make_request(1, thought="always", tau=0.0, cap=3, blend_truncated=0.25)])
    for a, n in zip(always["answers"], never["answers"]):
        r1, g, th, r2, bl = a["trace"]
        assert g["passed"] and th["stop"] == "cap" and th["tokens"] == 3 and "text" in th
        assert r1["probabilities"] == n["trace"][0]["probabilities"]          # readout 1 = System One
        assert bl["w"] == 0.25 and a["probabilities"] == bl["probabilities"]
        assert bl["probabilities"] == [r9(0.25 * x + 0.75 * y)
                                       for x, y in zip(r2["probabilities"], r1["probabilities"])]


@pytest.mark.parametrize("k,eos", [(0, False), (2, False), (3, True)])
def test_closed_when_model_emits_channel_close(demo_prompter, k, eos):
    r = make_request(2, n_q=1, thought="always", cap=50, blend_closed=1.0)
    L = len(demo_prompter.stem(r.system, r.context, [], r.questions[0].text, r.questions[0].choices, []).tokens)
    end = demo_prompter.eos_ids[0] if eos else demo_prompter.channel_close      # an end of turn closes it too
    m = ModelProxy(random_model(), close=end, after=k, stem_len=L)
    out, = serve_all(demo_prompter, [r], model=m)
    a = out["answers"][0]
    assert a["stop"] == "closed" and a["reasoning_tokens"] == k
    assert a["probabilities"] == a["trace"][3]["probabilities"]               # w = 1: the second readout


def test_budget_and_deadline_stop_the_thought_but_not_the_readout(demo_prompter):
    r = make_request(6, n_q=1, thought="always", budget_ms=5000, arrival=time.monotonic() - 10)
    late, = serve_all(demo_prompter, [r])
    a = late["answers"][0]
    assert a["stop"] == "budget" and a["reasoning_tokens"] == 0 and stages_of(a)[-2:] == ["readout", "blend"]
    m = ModelProxy(random_model())
    shift = lambda: time.monotonic() + (100 if len(m.calls) >= 6 else 0)    # time jumps mid-thought
    eng = Engine(m, demo_prompter, EngineConfig(model_dir="", max_len=512, prefill_chunk=64), clock=shift)
    eng.start()
    try:
        r = make_request(6, n_q=1, thought="always", deadline=time.monotonic() + 50)
        a = eng.submit(r).result(30)["answers"][0]
    finally:
        eng.stop(5)
    assert a["stop"] == "deadline" and 0 < a["reasoning_tokens"] < 10 and stages_of(a)[-2:] == ["readout", "blend"]


def test_think_ms_turns_into_tokens(demo_prompter):
    cost = check_cost_table({"device": "x", "batch": [1, 16], "context": [64, 512], "ms": [[2.0, 3.0], [4.0, 5.0]]})
    r = make_request(3, n_q=1, thought="always", cap=100, think_ms=21.0)
    out, = serve_all(demo_prompter, [r], think_cost=cost, serial=True)
    a = out["answers"][0]
    assert a["stop"] == "closed" or a["reasoning_tokens"] == 7               # floor(21 / 3.0): batch 1, ctx <= 512


def test_same_answers_alone_batched_serial_and_uncached(demo_prompter):
    reqs = lambda: [make_request(i, n_q=3, tau=0.993, cap=6) for i in range(4)]   # tau splits gate / think here
    strip_ms = lambda res: [[(a["answer"], a["stop"], a["reasoning_tokens"], a["probabilities"],
                           [t.get("text") for t in a["trace"]]) for a in r["answers"]] for r in res]
    alone = [serve_all(demo_prompter, [r])[0] for r in reqs()]
    base = strip_ms(alone)
    assert {a["stop"] == "gate" for r in alone for a in r["answers"]} == {True, False}
    for kw in ({}, {"serial": True}, {"prefix_cache": False}, {"max_batch": 2, "prefill_chunk": 16},
               {"model": random_model(kv_tokens=400)}):          # 25 blocks: seqs wait, cached blocks evicted
        got = strip_ms(serve_all(demo_prompter, reqs(), **kw))
        for r1, r2 in zip(base, got):
            for x, y in zip(r1, r2):
                assert x[:3] == y[:3] and x[4] == y[4], kw
                assert np.allclose(x[3], y[3], atol=1e-6, rtol=0), kw


def test_shared_context_computed_once(demo_prompter):
    for cache in (True, False):
        m = ModelProxy(random_model())
        out, = serve_all(demo_prompter, [make_request(4, n_q=4, thought="never")], model=m, prefix_cache=cache)
        u = out["usage"]
        assert m.rows == u["prompt_tokens"] - u["cached_tokens"] + 4           # + one readout probe each
        if cache:
            r = make_request(4)
            shared = demo_prompter.stem(r.system, r.context, [], "x", ["a", "b"], []).shared_len
            assert u["cached_tokens"] == 3 * (shared // BLOCK) * BLOCK
        else:
            assert u["cached_tokens"] == 0


def test_images_batched_and_cached_like_text(demo_prompter):
    rng = np.random.default_rng(7)
    pics = {name: rng.standard_normal((n, 32)).astype(np.float32) for name, n in (("a", 20), ("b", 20), ("c", 9))}
    enc = lambda name: pics[name]

    def r(img):                       # identical requests but for the request image
        x = make_request(5, n_q=2, tau=0.6, cap=3)
        x.images = [img]
        x.questions[1].images = ["c"]
        return x
    probs = lambda res: [a["probabilities"] for a in res["answers"]]
    alone = [serve_all(demo_prompter, [r(img)], encode_image=enc, prefill_chunk=16)[0] for img in "ab"]
    both = serve_all(demo_prompter, [r("a"), r("b")], encode_image=enc, prefill_chunk=64, max_batch=3)
    for x, y in zip(alone, both):
        assert all(np.allclose(p, q, atol=1e-6) for p, q in zip(probs(x), probs(y)))
        assert y["usage"]["images"] == 2
    assert probs(alone[0]) != probs(alone[1])                                  # the image matters
    x = r("a")
    start = demo_prompter.stem(x.system, x.context, [20], "q", ["a", "b"], []).image_spans[0][0]
    # "b" shares the text before its image with "a", never the image: the hit ends before the image
    assert both[1]["usage"]["cached_tokens"] <= both[0]["usage"]["cached_tokens"] + 2 * (start // BLOCK) * BLOCK


# --- admission and errors ----------------------------------------------------------------------

def test_edf_order_in_the_engine(demo_prompter):
    now, order = time.monotonic(), []
    eng = Engine(random_model(), demo_prompter, EngineConfig(model_dir="", max_len=512, max_batch=1, prefill_chunk=64))
    for i, dl in enumerate((300, None, 100, 200)):
        eng.submit(make_request(i, n_q=1, tau=0.0, deadline=None if dl is None else now + dl, arrival=now + i / 1000)
                   ).add_done_callback(lambda f: order.append(f.result()["id"]))
    eng.start()
    eng.stop(30)
    assert order == ["r2", "r3", "r0", "r1"]


def test_queue_full_deadline_and_too_large(demo_prompter):
    eng = Engine(random_model(), demo_prompter, EngineConfig(model_dir="", max_len=512, max_queue=2))
    futs = [eng.submit(make_request(i, n_q=1, tau=0.0)) for i in range(3)]
    with pytest.raises(EngineError) as e:
        futs[2].result(0)
    assert e.value.status == 429 and e.value.type == "overloaded"
    eng.start()
    try:
        assert all(f.result(30)["answers"] for f in futs[:2])
        late = eng.submit(make_request(9, n_q=1, deadline=time.monotonic() - 1))
        with pytest.raises(EngineError) as e:
            late.result(30)
        assert (e.value.status, e.value.type) == (503, "deadline_exceeded")
    finally:
        eng.stop(5)
    small, = serve_all(demo_prompter, [make_request(0, n_q=1)], max_len=64)
    assert isinstance(small, EngineError) and small.status == 413
    tiny_pool, = serve_all(demo_prompter, [make_request(0, n_q=1)], model=random_model(kv_tokens=64))
    assert isinstance(tiny_pool, EngineError) and tiny_pool.status == 413


def test_step_exception_fails_only_its_requests(demo_prompter):
    m = ModelProxy(random_model())
    eng = Engine(m, demo_prompter, EngineConfig(model_dir="", max_len=512, prefill_chunk=32))
    eng.start()
    try:
        m.boom = True
        with pytest.raises(EngineError) as e:
            eng.submit(make_request(0, n_q=2)).result(30)
        assert (e.value.status, e.value.type) == (500, "internal") and "boom" not in e.value.message
        m.boom = False
        ok = eng.submit(make_request(1, n_q=2, tau=0.0)).result(30)
        assert len(ok["answers"]) == 2
        m.hold.clear()
        gone = eng.submit(make_request(2, n_q=1))
        time.sleep(0.05)
        gone.cancel()                                  # the client left: the engine drops it and goes on
        m.hold.set()
        assert eng.submit(make_request(3, n_q=1, tau=0.0)).result(30)["answers"]
        snap = eng.metrics_snapshot()
        assert snap["requests"] == {"500": 1, "ok": 2, "499": 1} and snap["answers"] == {"gate": 3}
        h = eng.health()
        assert h["queue"] == {"waiting": 0, "running": 0} and h["kv"]["capacity_tokens"] == m.num_blocks * BLOCK
    finally:
        eng.stop(5)


def test_calibrate_table(demo_prompter):
    t = calibrate(random_model(), EngineConfig(model_dir="", max_len=300, max_batch=4), repeats=1)
    assert t["batch"] == [1, 2, 4] and t["context"] == [256, 300] and check_cost_table(t)
