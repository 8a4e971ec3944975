"""The per-question answer policy of policy.md: readout, gate, thought, readout, blend; budgets; the trace.

Pure Python (floats are IEEE doubles, so every probability is computed in double). The engine owns time
and the scheduler; a `QuestionPolicy` only turns model outputs into the next piece of sequence work:

    prefill stem (last row: argmax = first thought candidate t1)
    -> readout 1: probe <channel|> at position len(stem), keys' logits    (not kept in the sequence)
    -> gate -> thought: feed t, argmax -> t' ... (kept)                      (skipped when the gate stops)
    -> readout 2: feed the last thought token + probe <channel|>, keys' logits
    -> blend -> answer

Decisions (policy.md leaves them open):
- An end-of-turn token (`<eos>`, `<turn|>`) during the thought ends it like `<channel|>`: stop `closed`,
  the token is not part of the thought, readout 2 runs on stem + thought + <channel|>. The model ended
  its thought by itself, so it gets the closed blend weight.
- The time checks (budget, deadline) run before each new thought token is kept; a token already
  generated when time runs out is dropped, so `reasoning_tokens` counts only tokens kept in time.
- `passed` in the gate record is always `max >= tau`; `stop` says what happened (`never` / `always`
  ignore the test, the record still shows it).
- think_ms: batch = 1 under --serial, else the engine's max_batch (the live batch would make a
  question's thought depend on other traffic; the full batch is reproducible and bounds latency);
  context = the stem's length.
- Times: readout 1 from the question's first scheduled step (prefill included), thought from readout 1,
  readout 2 from the thought's end; an answer's `ms` from the request's arrival.
- JSON numbers: probabilities, mass, max and w are rounded to 9 significant digits (`r9`), and the
  gate test and the argmax use the rounded values, so what a client reads is what decided. Stage and
  answer times are milliseconds rounded to 0.01 (they are the only non-reproducible fields).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from config import PolicyConfig

THOUGHT_MODES = ("auto", "never", "always")


@dataclass
class Question:
    id: str
    text: str
    choices: list[str]
    images: list = field(default_factory=list)   # opaque to the engine: handed to encode_image


@dataclass
class Request:
    id: str
    questions: list[Question]
    policy: PolicyConfig = field(default_factory=PolicyConfig)  # merged with the server's limits by wire
    system: str = ""
    context: str = ""
    images: list = field(default_factory=list)
    thought: str = "auto"              # auto | never | always
    return_thought: bool = False
    deadline: float | None = None      # time.monotonic() seconds, absolute; None: no deadline
    arrival: float = field(default_factory=time.monotonic)


def r9(x: float) -> float:
    """The stable JSON form of a probability: 9 significant digits (repr of the result is short)."""
    return float(f"{x:.9g}")


def ms(t0: float, t1: float) -> float:
    return round((t1 - t0) * 1000.0, 2)


def readout(key_logits, logsumexp):
    """Key logits and the full-vocabulary logsumexp -> (softmax over the keys, mass on the keys), double."""
    m = max(key_logits)
    e = [math.exp(z - m) for z in key_logits]
    s = sum(e)
    mass = min(1.0, sum(math.exp(z - logsumexp) for z in key_logits))
    return [r9(x / s) for x in e], r9(mass)


def argmax(p) -> int:
    return max(range(len(p)), key=lambda i: (p[i], -i))   # lowest index on a tie


# --- the cost table --------------------------------------------------------------------------------
# JSON written by `span02.py calibrate` (engine.calibrate):
#   {"device": "NVIDIA H200", "model": "name", "batch": [1, 2, 4, ...], "context": [256, 1024, 4096, ...],
#    "ms": [[ms of one decode step at batch[i], context[j] for j] for i]}
# Both axes ascend. A lookup rounds batch and context UP to the next measured point (the last one when
# past the end): modelled time never undercounts inside the table.

# config.check_cost_table validates a table (EngineConfig does, at start).


def _up(points, x):
    return next((i for i, p in enumerate(points) if p >= x), len(points) - 1)


def step_cost(t: dict, batch: int, context: int) -> float:
    return t["ms"][_up(t["batch"], batch)][_up(t["context"], context)]


def thought_limit(p: PolicyConfig, cost: dict | None, batch: int, context: int) -> int:
    """policy.md: tokens = min(cap, floor(think_ms / cost(batch, context))); cap alone when think_ms is 0."""
    if p.think_ms <= 0 or cost is None:
        return p.cap
    return min(p.cap, math.floor(p.think_ms / step_cost(cost, batch, context)))


# --- one question ----------------------------------------------------------------------------------

@dataclass(slots=True)             # not frozen, a per-step record: see model.SeqStep
class Next:
    """The sequence work a question wants next: keep `feed` in the sequence, then run `probe` rows that
    are not kept; the last row returns the key logits (`readout`), the last kept row the greedy token
    (`argmax`)."""
    feed: tuple[int, ...] = ()
    probe: tuple[int, ...] = ()
    readout: bool = False
    argmax: bool = False


class QuestionPolicy:
    """Stages: prefill (with the first readout) -> thought -> readout2 -> done. `first()` is the work that goes
    with the stem; `advance(out, now)` takes the SeqOut of the stage's work and returns the Next work, or None
    when the answer is ready (`answer()`)."""

    def __init__(self, q: Question, req: Request, keys, limit: int, close: int, eos=(), decode=None):
        self.q, self.req, self.keys, self.limit = q, req, tuple(keys), limit
        self.close, self.ends = close, {close, *eos}
        self.decode = decode              # ids -> text, for return_thought
        self.stage, self.t0, self.t_stage = "prefill", None, None
        self.trace, self.thought, self.stop = [], [], None
        self.p1 = self.p = None
        pol = req.policy                  # the time limits, fixed per request: (time, stop), earliest first
        self.time_ends = sorted(([(req.arrival + pol.budget_ms / 1000.0, "budget")] if pol.budget_ms > 0 else []) +
                                ([(req.deadline, "deadline")] if req.deadline is not None else []))

    def start(self, now):
        if self.t0 is None:
            self.t0 = self.t_stage = now

    def first(self) -> Next:
        """The stem's own work: its last row's greedy token (the thought's first, should it think) and, on the
        probe row `<channel|>` after it, the first readout: stages 1 and 2 of policy.md in the stem's last step."""
        return Next(probe=(self.close,), readout=True, argmax=True)

    def advance(self, out, now) -> Next | None:
        if self.stage == "prefill":
            self.t1 = out.argmax           # the thought's first token, should it think
            return self._gate(out, now)
        if self.stage == "thought":
            return self._token(out.argmax, now)
        return self._blend(out, now)

    def _gate(self, out, now):
        p, mass = readout(out.key_logits, out.logsumexp)
        self.p1 = p
        self.trace.append({"stage": "readout", "probabilities": p, "mass": mass, "ms": ms(self.t_stage, now)})
        top, tau = max(p), self.req.policy.tau
        self.trace.append({"stage": "gate", "max": top, "tau": tau, "passed": top >= tau})
        if self.req.thought == "never" or (self.req.thought == "auto" and top >= tau):
            self.stop = "never" if self.req.thought == "never" else "gate"
            return self._finish(p, now)
        self.stage, self.t_stage = "thought", now
        return self._token(self.t1, now)

    def _time_stop(self, now):
        """The earliest time limit already passed ("budget" / "deadline"), else None (every thought token)."""
        for t, stop in self.time_ends:
            if now >= t:
                return stop
        return None

    def _token(self, t, now):
        if t in self.ends:
            return self._end("closed", (), now)
        if len(self.thought) >= self.limit:
            return self._end("cap", (), now)
        if over := self._time_stop(now):
            return self._end(over, (), now)
        self.thought.append(t)
        if len(self.thought) >= self.limit:
            return self._end("cap", (t,), now)
        return Next(feed=(t,), argmax=True)

    def _end(self, stop, feed, now):
        self.stop = stop
        rec = {"stage": "thought", "tokens": len(self.thought), "stop": stop, "ms": ms(self.t_stage, now)}
        if self.req.return_thought:
            rec["text"] = self.decode(self.thought) if self.decode else ""
        self.trace.append(rec)
        self.stage, self.t_stage = "readout2", now
        return Next(feed=feed, probe=(self.close,), readout=True)

    def _blend(self, out, now):
        p2, mass = readout(out.key_logits, out.logsumexp)
        self.trace.append({"stage": "readout", "probabilities": p2, "mass": mass, "ms": ms(self.t_stage, now)})
        pol = self.req.policy
        w = pol.blend_closed if self.stop == "closed" else pol.blend_truncated
        p = [r9(w * a + (1.0 - w) * b) for a, b in zip(p2, self.p1)]
        self.trace.append({"stage": "blend", "w": r9(w), "probabilities": p})
        return self._finish(p, now)

    def _finish(self, p, now):
        self.p, self.stage, self.t_end = p, "done", now
        return None

    def answer(self) -> dict:
        i = argmax(self.p)
        return {"id": self.q.id, "answer": self.q.choices[i], "index": i, "probabilities": self.p,
                "reasoning_tokens": len(self.thought), "stop": self.stop, "trace": self.trace,
                "ms": ms(self.req.arrival, self.t_end)}
