"""The server-level figures of performance.md, through real HTTP against a real `span02.py serve` subprocess.

    load_s        process start to the first `/health` 200 (the checkpoint was just read: page cache warm)
    readout_ms    one question with a 512-token stem, server under `--serial`, request policy tau 0 so that the
                  gate passes at the first readout and the answer ends there: the answer's `ms` (the server's
                  clock, request arrival to answer = arrival to first readout). Beside it `readout_stage_ms` (the
                  trace's readout stage: the question's start to its readout) and `readout_wall_ms` (client clock,
                  request sent to response read). Median of `--readout-repeats` distinct stems after one warm-up.
                  With them, from the server's /metrics over the timed requests: readout_steps, readout_step_ms
                  (their mean) and on the GPU readout_step_host_ms (the mean part the host was not blocked on the
                  GPU: close to readout_step_ms, the readout was bound by the host's launches); and per request,
                  read between requests, readout_steps_ms_each (its steps' total ms) and on the GPU
                  readout_steps_host_ms_each (their host part): which of a slow readout's parts grew; and
                  readout_replays_each (its steps replayed from the plan of an earlier step's shape, step_plans.py).
    decisions_s   the standard workload: N requests of 4 questions (300-token context shared by a request's
                  questions, ~60 tokens and 4 choices per question), policy tau 0.8 / cap 256, no deadline, all
                  sent at once by a local client (one thread and one connection per request), default serving
                  mode: answered questions per second (first send to last response) and p50 / p99 request latency.

Used by `bench.py run` (after the in-process model part has freed the GPU) and by the tests on the CPU demo model.
The client is the standard library only (http.client and threads). Every wait has a time limit; the server is
stopped with SIGTERM (then SIGKILL) whatever happens, and dies with this process (PR_SET_PDEATHSIG on Linux).
"""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
WORDS = ("the ship left the harbour at noon with grain for the islands and the office logged it while a storm "
         "was forming to the west so the captain asked the port for a later berth and the crew waited on deck "
         "counting sacks as gulls circled over the quay and a clerk checked the manifest twice").split()


class BenchError(RuntimeError):
    """A server-level measurement could not be made (the message says which and why)."""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent():
    """preexec_fn: SIGTERM the child when the bench dies (Linux), so no server outlives a killed bench. (The signal
    comes when the *thread* that started the child exits: start servers from the main thread, as bench.py does.)"""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)      # PR_SET_PDEATHSIG
    except Exception:
        pass


# --- the server subprocess -----------------------------------------------------------------------------------

class Server:
    """`python span02.py serve --model DIR --bind 127.0.0.1:PORT --device D ARGS...` as a context manager.

    `start()` returns load_s (Popen to the first /health 200). The server's log goes to a temporary file (never a
    pipe, which a chatty server could fill and block on); its tail is in every error message. `stop()` sends
    SIGTERM, waits up to `stop_timeout` s for the graceful exit, then SIGKILLs; it is called by __exit__ always."""

    def __init__(self, model_dir, device="gpu", args=(), ready_timeout=300.0, stop_timeout=60.0, log=print):
        self.model_dir, self.device, self.args = model_dir, device, list(args)
        self.ready_timeout, self.stop_timeout, self.log = ready_timeout, stop_timeout, log
        self.port, self.proc, self.exit_code = None, None, None
        self.logfile = tempfile.NamedTemporaryFile(prefix="span02-bench-server-", suffix=".log", delete=False)

    @property
    def cmd(self):
        return [sys.executable, os.path.join(HERE, "span02.py"), "serve", "--model", self.model_dir,
                "--bind", f"127.0.0.1:{self.port}", "--device", self.device, "--log-level", "warning", *self.args]

    def log_tail(self, n=3000):
        try:
            with open(self.logfile.name, "rb") as f:
                f.seek(0, 2)
                f.seek(max(0, f.tell() - n))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def start(self):
        self.port = _free_port()
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, stdout=self.logfile, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     cwd=HERE, preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        while True:
            if self.proc.poll() is not None:
                raise BenchError(f"server exited with {self.proc.returncode} before /health said ok; "
                                 f"command {' '.join(self.cmd)}; log tail:\n{self.log_tail()}")
            status = None
            with contextlib.suppress(OSError, http.client.HTTPException):
                status, _ = http_call(self.port, "GET", "/health", timeout=2.0)
            if status == 200:
                return time.monotonic() - t0
            if time.monotonic() - t0 > self.ready_timeout:
                raise BenchError(f"server not ready (/health 200) within {self.ready_timeout:.0f} s; "
                                 f"last status {status}; log tail:\n{self.log_tail()}")
            time.sleep(0.05)

    def stop(self):
        p = self.proc
        if p is None or p.poll() is not None:
            self.exit_code = None if p is None else p.returncode
            return self.exit_code
        p.send_signal(signal.SIGTERM)
        try:
            self.exit_code = p.wait(timeout=self.stop_timeout)
        except subprocess.TimeoutExpired:
            self.log(f"server pid {p.pid} still running {self.stop_timeout:.0f} s after SIGTERM: SIGKILL")
            p.kill()
            self.exit_code = p.wait(timeout=30)
        return self.exit_code

    def __enter__(self):
        try:
            self.load_s = self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()
        self.logfile.close()
        if exc[0] is None:
            with contextlib.suppress(OSError):
                os.unlink(self.logfile.name)
        else:
            self.log(f"server log kept at {self.logfile.name}")
        return False


# --- the client ------------------------------------------------------------------------------------------------

def http_call(port, method, path, body=None, timeout=60.0):
    """One request on a new connection: (status, parsed JSON body or None)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        r = conn.getresponse()
        raw = r.read()
        try:
            return r.status, json.loads(raw) if raw else None
        except ValueError:
            return r.status, {"raw": raw[:500].decode("utf-8", "replace")}
    finally:
        conn.close()


def metric_sums(port, names, timeout=30.0):
    """{name: value} of the plain (label-free) series `names` in the server's /metrics text; a series the server
    does not export is left out."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", "/metrics")
        r = conn.getresponse()
        text = r.read().decode()
        if r.status != 200:
            raise BenchError(f"/metrics: HTTP {r.status}: {text[:300]}")
    finally:
        conn.close()
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            out[name] = float(value)
    return out


STEP_SERIES = ("span02_step_seconds_sum", "span02_step_seconds_count", "span02_step_gpu_wait_seconds_sum",
               "span02_prompt_step_replays_total")


def _text(prompter, n_tokens, rng, lead=""):
    """Words of WORDS in random order after `lead`, trimmed to at most `n_tokens` tokens (close to it)."""
    words = [lead] if lead else []
    while prompter.count(" ".join(words)) < n_tokens:
        words += [WORDS[int(i)] for i in rng.integers(0, len(WORDS), 64)]
    lo, hi = 1, len(words)                              # the most words within n_tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if prompter.count(" ".join(words[:mid])) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def workload_requests(prompter, n_requests, questions=4, context_tokens=300, question_tokens=60, tau=0.8, cap=256,
                      seed=0):
    """The standard workload's request bodies: each request its own context (so requests share no prefix beyond
    the template), each question its own ~question_tokens text ending in '?' and 4 choices."""
    rng = np.random.default_rng(seed)
    choices = [["north", "south", "east", "west"], ["red", "green", "blue", "grey"],
               ["never", "rarely", "often", "always"], ["one", "two", "three", "four"]]
    reqs = []
    for r in range(n_requests):
        context = _text(prompter, context_tokens, rng, lead=f"Case {r}:")
        qs = [{"id": f"q{k}", "text": _text(prompter, question_tokens - 1, rng, lead=f"Question {k} of case {r}:") + "?",
               "choices": choices[k % len(choices)]} for k in range(questions)]
        reqs.append({"id": f"bench-{r}", "context": context, "questions": qs, "policy": {"tau": tau, "cap": cap}})
    return reqs


def readout_stem_request(prompter, stem_tokens, i):
    """One question whose whole stem (template + context + question + choices) is <= stem_tokens tokens and close
    to it; `i` makes the context differ from the start so that no two such requests share a cached prefix."""
    q, ch = "Which ship?", ["a", "b", "c", "d"]
    rng = np.random.default_rng(1000 + i)
    over = len(prompter.stem("", "", [], q, ch, []).tokens)
    context = _text(prompter, stem_tokens - over, rng, lead=f"Log {i}:")
    while len(prompter.stem("", context, [], q, ch, []).tokens) > stem_tokens:
        context = context[: int(len(context) * 0.97)]
    return {"id": f"readout-{i}", "context": context, "questions": [{"id": "q", "text": q, "choices": ch}],
            "policy": {"tau": 0.0, "cap": 0}}


def measure_readout(port, prompter, stem_tokens=512, repeats=5, timeout=120.0):
    """readout figures (module docstring) from 1 warm-up + `repeats` requests with distinct stems, one at a time."""
    rows, sums = [], []
    for i in range(repeats + 1):
        if i:                                            # the engine's step series before each timed request
            sums.append(metric_sums(port, STEP_SERIES))
        body = readout_stem_request(prompter, stem_tokens, i)
        t0 = time.perf_counter()
        status, out = http_call(port, "POST", "/v1/systemone", body, timeout=timeout)
        wall = (time.perf_counter() - t0) * 1e3
        if status != 200:
            raise BenchError(f"readout request {i}: HTTP {status}: {out}")
        a = out["answers"][0]
        if a["stop"] != "gate" or a["trace"][0]["stage"] != "readout":
            raise BenchError(f"readout request {i} did not stop at the first readout: stop {a['stop']}")
        if i:                                            # request 0 is the warm-up
            rows.append((a["ms"], a["trace"][0]["ms"], wall, out["usage"]["prompt_tokens"]))
    a = np.array(rows, dtype=float)
    r = {"readout_ms": round(float(np.median(a[:, 0])), 2), "readout_stage_ms": round(float(np.median(a[:, 1])), 2),
         "readout_wall_ms": round(float(np.median(a[:, 2])), 2), "readout_stem_tokens": int(a[0, 3]),
         "readout_repeats": repeats, "readout_ms_each": [round(float(x), 2) for x in a[:, 0]]}
    sums.append(metric_sums(port, STEP_SERIES))
    each = [_step_totals(b, e) for b, e in zip(sums, sums[1:])]
    r["readout_steps_ms_each"] = [round(step_s * 1e3, 2) for _, step_s, _ in each]
    if all(wait_s is not None for *_, wait_s in each):
        r["readout_steps_host_ms_each"] = [round((step_s - wait_s) * 1e3, 2) for _, step_s, wait_s in each]
    replays = "span02_prompt_step_replays_total"
    if all(replays in d for d in sums):                  # steps replayed from the plan of their shape (GPU)
        r["readout_replays_each"] = [int(round(e[replays] - b[replays])) for b, e in zip(sums, sums[1:])]
    return {**r, **_step_split(sums[0], sums[-1])}


def _step_totals(before, after):
    """(steps, their seconds, the seconds of them blocked on the GPU or None off the GPU) between two metric_sums."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in STEP_SERIES}
    wait = d["span02_step_gpu_wait_seconds_sum"] if "span02_step_gpu_wait_seconds_sum" in after else None
    return int(round(d["span02_step_seconds_count"])), d["span02_step_seconds_sum"], wait


def _step_split(before, after):
    """The engine's steps between two metric_sums: readout_steps, readout_step_ms (their mean wall time) and,
    on a GPU server, readout_step_host_ms (the mean part of it the host did not spend blocked on the GPU: near
    readout_step_ms, the steps were bound by the host's launches, not the GPU)."""
    n, step_s, wait_s = _step_totals(before, after)
    if not n:
        return {"readout_steps": 0}
    out = {"readout_steps": n, "readout_step_ms": round(step_s / n * 1e3, 2)}
    if wait_s is not None:
        out["readout_step_host_ms"] = round((step_s - wait_s) / n * 1e3, 2)
    return out


def run_workload(port, reqs, timeout=540.0):
    """Send every request at once (one thread + one connection each, connected first, released by one barrier),
    wait for all (at most `timeout` s) and summarise: decisions_s = answered questions / (first send to last
    response); latency = request sent to response read, per request."""
    n = len(reqs)
    results = [None] * n
    barrier = threading.Barrier(n + 1)
    deadline = time.monotonic() + timeout

    def one(i):
        conn = None
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
            conn.connect()
            data = json.dumps(reqs[i]).encode()
            barrier.wait(timeout=60)
            t0 = time.perf_counter()
            conn.request("POST", "/v1/systemone", body=data, headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            raw = r.read()
            t1 = time.perf_counter()
            results[i] = (r.status, t0, t1, json.loads(raw) if r.status == 200 else raw[:300])
        except Exception as e:                           # noqa: BLE001 - recorded, reported below
            results[i] = (None, None, None, f"{type(e).__name__}: {e}")
        finally:
            if conn is not None:
                conn.close()

    threads = [threading.Thread(target=one, args=(i,), daemon=True, name=f"bench-client-{i}") for i in range(n)]
    for t in threads:
        t.start()
    try:
        barrier.wait(timeout=120)
    except threading.BrokenBarrierError:
        raise BenchError(f"the {n} client threads did not all connect within 120 s: "
                         f"{[r for r in results if r is not None][:3]}") from None
    for t in threads:
        t.join(timeout=max(0.1, deadline - time.monotonic() + 5))
    if any(t.is_alive() for t in threads):
        raise BenchError(f"{sum(t.is_alive() for t in threads)} of {n} requests unanswered after {timeout:.0f} s")
    ok = [r for r in results if r[0] == 200]
    bad = [r for r in results if r[0] != 200]
    if not ok:
        raise BenchError(f"no request answered: {bad[0]}")
    t_first = min(r[1] for r in results if r[1] is not None)
    t_last = max(r[2] for r in ok)
    lat = np.array([(r[2] - r[1]) * 1e3 for r in ok])
    answers = [a for r in ok for a in r[3]["answers"]]
    stops = {}
    for a in answers:
        stops[a["stop"]] = stops.get(a["stop"], 0) + 1
    wall = t_last - t_first
    think = sum(a["reasoning_tokens"] for a in answers)
    return {"decisions_s": round(len(answers) / wall, 3), "decisions_p50_ms": round(float(np.percentile(lat, 50)), 1),
            "decisions_p99_ms": round(float(np.percentile(lat, 99)), 1), "decisions_wall_s": round(wall, 2),
            "decisions_requests": n, "decisions_questions": len(answers), "decisions_errors": len(bad),
            "decisions_error_sample": str(bad[0][3])[:300] if bad else None,
            "decisions_reasoning_tokens": think, "decisions_thought_tok_s": round(think / wall, 1),
            "decisions_stops": stops,
            "decisions_prompt_tokens_mean": round(float(np.mean([r[3]["usage"]["prompt_tokens"] for r in ok])), 1),
            "decisions_cached_tokens_mean": round(float(np.mean([r[3]["usage"]["cached_tokens"] for r in ok])), 1)}


# --- all server figures ----------------------------------------------------------------------------------------

def server_figures(model_dir, device="gpu", requests=128, cap=256, tau=0.8, questions=4, context_tokens=300,
                   question_tokens=60, stem_tokens=512, readout_repeats=5, kv_tokens=0, extra_args=(),
                   ready_timeout=300.0, workload_timeout=540.0, log=print):
    """load_s, the readout figures (a `--serial` server) and the decisions figures (a default-mode server), each
    server started on `model_dir` and stopped before the next. Returns one flat dict (module docstring)."""
    from prompt import Prompter
    pr = Prompter(model_dir)
    base = ["--kv-tokens", str(kv_tokens), "--max-queue", str(max(256, requests)),
            "--max-connections", str(max(512, requests + 16)), "--cap", str(max(1024, cap)), *extra_args]
    r = {"server_args": " ".join(base)}
    log(f"server (--serial): starting on {model_dir} ({device})")
    with Server(model_dir, device, base + ["--serial"], ready_timeout=ready_timeout, log=log) as s:
        r["load_s"] = round(s.load_s, 2)
        log(f"server (--serial): /health 200 after {s.load_s:.1f} s; readout, {stem_tokens}-token stem")
        r.update(measure_readout(s.port, pr, stem_tokens, readout_repeats))
    r["server_exit_serial"] = s.exit_code
    reqs = workload_requests(pr, requests, questions, context_tokens, question_tokens, tau, cap)
    log(f"server (default mode): starting; then {requests} requests x {questions} questions, tau {tau}, cap {cap}")
    with Server(model_dir, device, base, ready_timeout=ready_timeout, log=log) as s:
        r["load_s_second"] = round(s.load_s, 2)
        t0 = time.monotonic()
        r.update(run_workload(s.port, reqs, timeout=workload_timeout))
        log(f"workload done in {time.monotonic() - t0:.1f} s")
        if r["decisions_errors"]:                       # our bug: the server's own account of it, in the report
            r["decisions_server_log_tail"] = s.log_tail(4000)
            log(f"{r['decisions_errors']} requests failed; server log tail:\n{r['decisions_server_log_tail']}")
    r["server_exit_default"] = s.exit_code
    r["decisions_cap"], r["decisions_tau"] = cap, tau
    return r
