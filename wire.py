"""HTTP/1.1 front of span02 (api.md): connections, limits, routes, body transport, JSON <-> request objects.

One asyncio loop runs in the thread that calls `run()`; h11 frames every connection. Body decoding, JSON
validation and image decoding run on a small thread pool, so a big body never stalls other connections;
the engine answers through a concurrent.futures.Future (design.md: HTTP loop and engine loop in separate
threads). Choices where api.md is silent:
- a policy override past the server's limit (`cap` above `--cap`) is a 422, not a silent clamp; tau,
  think_ms, budget_ms are any finite number >= 0 (think_ms > 0 needs `--think-cost`);
- `deadline_ms: 0` means no deadline (as `--deadline-ms 0`); `null` or absent means the server default;
- no Content-Type is read as JSON; JSON must be UTF-8 (another charset is 415); NaN/Infinity are 400;
- an oversized header block is 431 `too_large`; framing errors are 400 `bad_request`;
- `--read-timeout` bounds the idle time between keep-alive requests, and a whole request (headers + body)
  from its first byte; a request cut mid-way gets 408 `timeout` and the connection is closed;
- over `--max-connections`, a new connection gets 503 `unavailable` + Retry-After and is closed;
- an error sent before the body was read drains a small body (keep-alive goes on) or half-closes and
  discards the rest for up to 2 s, so the client reads the error instead of a reset;
- a client that closes (or half-closes) its side while waiting is gone: the engine's future is cancelled
  and the answer dropped;
- while draining, /health answers 503 {"status": "draining"}; responses carry `x-request-id`, the id a
  500 is logged under.
"""
import asyncio
import base64
import binascii
import concurrent.futures
import dataclasses
import gzip
import http
import io
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
import zlib

import h11
import zstandard
from python_multipart.multipart import MultipartParser, parse_options_header

import policy
import vision

log = logging.getLogger("span02.wire")
CHUNK = 64 << 10                 # read / inflate granularity
COMPRESS_MIN = 1024              # responses over this many bytes are compressed when allowed
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_REASONS = {s.value: s.phrase for s in http.HTTPStatus}
ROUTES = {"/v1/systemone": "POST", "/health": "GET", "/metrics": "GET"}


class ApiError(Exception):
    def __init__(self, status, type, message, field=None, headers=()):
        super().__init__(message)
        self.status, self.type, self.message, self.field, self.headers = status, type, message, field, list(headers)


class _Gone(Exception):
    """The client went away; nothing is sent."""


def _invalid(field, message):
    return ApiError(422, "invalid_request", message, field)


# --- body transport ---------------------------------------------------------------------------------

def decode_body(raw: bytes, encoding: str, cap: int, counter=None) -> bytes:
    """identity / gzip / zstd -> bytes, inflating CHUNK at a time and refusing (413) past `cap`."""
    out = bytearray()

    def put(b):
        out.extend(b)
        if counter:
            counter(len(b))
        if len(out) > cap:
            raise ApiError(413, "too_large", f"decoded body is over the limit of {cap} bytes")

    if encoding == "identity":
        if counter:
            counter(len(raw))
        if len(raw) > cap:
            raise ApiError(413, "too_large", f"decoded body is over the limit of {cap} bytes")
        return raw
    if encoding in ("gzip", "x-gzip"):
        data = raw
        while data:  # members may be concatenated (RFC 1952)
            d = zlib.decompressobj(31)
            try:
                while not d.eof:
                    chunk = d.decompress(data, CHUNK)
                    data = d.unconsumed_tail
                    if not chunk and not data:
                        break
                    put(chunk)
            except zlib.error as e:
                raise ApiError(400, "bad_request", f"malformed gzip body: {e}") from None
            if not d.eof:
                raise ApiError(400, "bad_request", "truncated gzip body")
            data = d.unused_data
    elif encoding == "zstd":
        try:
            r = zstandard.ZstdDecompressor(max_window_size=1 << 25).stream_reader(
                io.BytesIO(raw), read_size=CHUNK, read_across_frames=True)
            while chunk := r.read(CHUNK):
                put(chunk)
        except zstandard.ZstdError as e:
            raise ApiError(400, "bad_request", f"malformed zstd body: {e}") from None
    return bytes(out)


def parse_multipart(body: bytes, boundary: bytes) -> tuple:
    """multipart/form-data -> (bytes of the `request` part, {asset name: bytes})."""
    parts, cur, st = [], {}, {"end": False}

    def begin():
        cur.clear()
        cur.update(headers={}, field=b"", value=b"", data=bytearray())

    def header_end():
        cur["headers"][cur["field"].decode("latin-1").lower()] = cur["value"]
        cur["field"] = cur["value"] = b""

    cbs = {"on_part_begin": begin,
           "on_header_field": lambda d, s, e: cur.__setitem__("field", cur["field"] + d[s:e]),
           "on_header_value": lambda d, s, e: cur.__setitem__("value", cur["value"] + d[s:e]),
           "on_header_end": header_end,
           "on_part_data": lambda d, s, e: cur["data"].extend(d[s:e]),
           "on_part_end": lambda: parts.append((cur["headers"], bytes(cur["data"]))),
           "on_end": lambda: st.__setitem__("end", True)}
    try:
        p = MultipartParser(boundary, cbs)
        p.write(body)
        p.finalize()
    except Exception as e:  # python-multipart raises several types, all a malformed body
        raise ApiError(400, "bad_request", f"malformed multipart body: {e}") from None
    if not st["end"]:
        raise ApiError(400, "bad_request", "malformed multipart body: no closing boundary")
    named = {}
    for headers, data in parts:
        _, opts = parse_options_header(headers.get("content-disposition", b""))
        name = opts.get(b"name")
        if name is None:
            raise ApiError(400, "bad_request", "malformed multipart body: a part without a name")
        name = name.decode("utf-8", "replace")
        if name in named:
            raise _invalid(name, f"multipart part {name!r} appears twice")
        named[name] = data
    if "request" not in named:
        raise ApiError(400, "bad_request", "multipart body has no part named 'request'", "request")
    return named.pop("request"), named


# --- JSON -> request objects --------------------------------------------------------------------------

def _reject_constant(c):
    raise ValueError(f"{c} is not JSON")


def parse_json(body: bytes):
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, "bad_request", f"body is not valid UTF-8 (byte {e.start})") from None
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise ApiError(400, "bad_request", "malformed JSON: nested too deeply") from None
    except ValueError as e:
        raise ApiError(400, "bad_request", f"malformed JSON: {e}") from None


def _fields(v, field, allowed, required=()):
    if not isinstance(v, dict):
        raise _invalid(field, f"{field or 'the body'} must be an object")
    for k in v:
        if k not in allowed:
            raise _invalid(f"{field}.{k}" if field else k, f"unknown field {k!r}")
    for k in required:
        if k not in v:
            raise _invalid(f"{field}.{k}" if field else k, f"{k!r} is required")
    return v


def _str(v, field, max_len=None, nonempty=False):
    if not isinstance(v, str):
        raise _invalid(field, f"{field} must be a string")
    if max_len is not None and len(v) > max_len:
        raise _invalid(field, f"{field} is longer than {max_len} characters")
    if nonempty and not v.strip():
        raise _invalid(field, f"{field} must not be empty")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise _invalid(field, f"{field} holds an unpaired surrogate") from None
    return v


def _int(v, field, lo=None):
    if isinstance(v, bool) or not isinstance(v, int):
        raise _invalid(field, f"{field} must be an integer")
    if lo is not None and v < lo:
        raise _invalid(field, f"{field} must be >= {lo}, got {v}")
    return v


def _num(v, field, lo=0.0):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _invalid(field, f"{field} must be a finite number")
    if v < lo:
        raise _invalid(field, f"{field} must be >= {lo}, got {v}")
    return float(v)


def _opt(d, k, default):
    v = d.get(k)
    return default if v is None else v


def _image_specs(v, field, specs):
    """Collects (field, kind, payload) for each image of a list; nothing decoded yet."""
    if not isinstance(v, list):
        raise _invalid(field, f"{field} must be a list")
    for i, im in enumerate(v):
        f = f"{field}[{i}]"
        if isinstance(im, str):
            head, sep, data = im.partition(",")
            if not (head.startswith("data:") and head.endswith(";base64") and sep):
                raise _invalid(f, f"{f}: a string image must be a data:...;base64, URL")
            specs.append((f, "data", data))
            continue
        _fields(im, f, ("asset", "data"))
        if len(im) != 1:
            raise _invalid(f, f"{f} must have exactly one of 'asset' or 'data'")
        kind, payload = next(iter(im.items()))
        payload = _str(payload, f"{f}.{kind}")
        if kind == "data" and payload.startswith("data:"):  # a data URL in the object form
            payload = payload.partition(",")[2]
        specs.append((f, kind, payload))


class RequestParser:
    """Validates every field of api.md and builds a policy.Request; images are decoded last."""

    def __init__(self, cfg, vision_on):
        self.cfg, self.vision_on = cfg, vision_on

    def __call__(self, obj, assets, arrival, rid):
        cfg = self.cfg
        _fields(obj, "", ("id", "system", "context", "images", "questions", "policy", "deadline_ms"),
                required=("questions",))
        rid = _str(obj["id"], "id", 128) if obj.get("id") is not None else rid
        system = _str(_opt(obj, "system", ""), "system")
        context = _str(_opt(obj, "context", ""), "context")
        specs = []
        _image_specs(_opt(obj, "images", []), "images", specs)
        qs = obj["questions"]
        if not isinstance(qs, list):
            raise _invalid("questions", "questions must be a list")
        if not 1 <= len(qs) <= cfg.max_questions:
            raise _invalid("questions", f"questions must hold 1 to {cfg.max_questions} items, got {len(qs)}")
        questions, ids = [], set()
        for i, q in enumerate(qs):
            f = f"questions[{i}]"
            _fields(q, f, ("id", "text", "type", "choices", "min", "max", "images"), required=("text",))
            qid = _str(q["id"], f"{f}.id", 128) if q.get("id") is not None else str(i)
            if qid in ids:
                raise _invalid(f"{f}.id", f"duplicate question id {qid!r}")
            ids.add(qid)
            text = _str(q["text"], f"{f}.text", nonempty=True)
            kind = _opt(q, "type", "choice")
            if kind not in ("choice", "boolean", "scale"):
                raise _invalid(f"{f}.type", f"{f}.type must be choice, boolean or scale")
            extra = [k for k in ("choices", "min", "max") if k in q and k not in
                     {"choice": ("choices",), "boolean": (), "scale": ("min", "max")}[kind]]
            if extra:
                raise _invalid(f"{f}.{extra[0]}", f"{extra[0]!r} does not apply to type {kind!r}")
            if kind == "boolean":
                choices = ["yes", "no"]
            elif kind == "scale":
                if "min" not in q or "max" not in q:
                    raise _invalid(f"{f}.min", "a scale question needs integer 'min' and 'max'")
                lo, hi = _int(q["min"], f"{f}.min"), _int(q["max"], f"{f}.max")
                if not 2 <= hi - lo + 1 <= 26:
                    raise _invalid(f"{f}.max", f"a scale spans 2 to 26 values, {lo}..{hi} has {hi - lo + 1}")
                choices = [str(x) for x in range(lo, hi + 1)]
            else:
                choices = q.get("choices")
                if not isinstance(choices, list) or not 2 <= len(choices) <= 26:
                    raise _invalid(f"{f}.choices", f"{f}.choices must be a list of 2 to 26 strings")
                for j, c in enumerate(choices):
                    _str(c, f"{f}.choices[{j}]", 1000, nonempty=True)
                if len(set(choices)) != len(choices):
                    raise _invalid(f"{f}.choices", f"{f}.choices must be distinct")
            qspecs = []
            _image_specs(_opt(q, "images", []), f"{f}.images", qspecs)
            specs += qspecs
            questions.append((qid, text, list(choices), qspecs))
        pol, modes = self._policy(_opt(obj, "policy", {}))
        ms = self.cfg.deadline_ms if obj.get("deadline_ms") is None else _num(obj["deadline_ms"], "deadline_ms")
        images = self._images(specs, assets)
        return policy.Request(
            id=rid, system=system, context=context, images=[images[s[0]] for s in specs if s[0].startswith("images")],
            questions=[policy.Question(qid, text, ch, [images[s[0]] for s in qsp]) for qid, text, ch, qsp in questions],
            policy=pol, deadline=arrival + ms / 1000.0 if ms > 0 else None, arrival=arrival, **modes)

    def _policy(self, p):
        base = self.cfg.policy
        _fields(p, "policy", ("tau", "cap", "think_ms", "budget_ms", "thought", "return_thought"))
        over, modes = {}, {}
        if "tau" in p:
            over["tau"] = _num(p["tau"], "policy.tau")
        if "cap" in p:
            cap = _int(p["cap"], "policy.cap", 0)
            if cap > base.cap:
                raise _invalid("policy.cap", f"policy.cap {cap} is over the server's limit of {base.cap}")
            over["cap"] = cap
        for k in ("think_ms", "budget_ms"):
            if k in p:
                over[k] = _num(p[k], f"policy.{k}")
        if over.get("think_ms") and self.cfg.think_cost is None:
            raise _invalid("policy.think_ms", "think_ms needs a server started with --think-cost")
        if "thought" in p:
            if p["thought"] not in ("auto", "never", "always"):
                raise _invalid("policy.thought", "policy.thought must be auto, never or always")
            modes["thought"] = p["thought"]
        if "return_thought" in p:
            if not isinstance(p["return_thought"], bool):
                raise _invalid("policy.return_thought", "policy.return_thought must be true or false")
            modes["return_thought"] = p["return_thought"]
        return dataclasses.replace(base, **over), modes

    def _images(self, specs, assets):
        cfg = self.cfg
        if len(specs) > cfg.max_images:
            raise ApiError(413, "too_large", f"{len(specs)} images, the limit is {cfg.max_images}", "images")
        if specs and not self.vision_on:
            raise _invalid(specs[0][0], "the model has no vision tower: images are not accepted")
        out, cache = {}, {}
        for field, kind, payload in specs:
            if kind == "asset":
                if payload not in assets:
                    raise _invalid(f"{field}.asset", f"no multipart part named {payload!r}")
                key = ("asset", payload)
                data = assets[payload]
            else:
                key = None
                try:
                    data = base64.b64decode("".join(payload.split()), validate=True)
                except (binascii.Error, ValueError):
                    raise ApiError(400, "bad_request", f"{field}: bad base64", field) from None
            if key in cache:
                out[field] = cache[key]
                continue
            try:
                rgb = vision.decode(data, cfg.max_image_pixels)  # checks the pixel cap on the header first
                pre = vision.preprocess(rgb, cfg.image_soft_tokens)
            except vision.ImageError as e:
                raise _invalid(field, f"{field}: {e}") from None
            out[field] = pre
            if key:
                cache[key] = pre
        return out


# --- metrics ------------------------------------------------------------------------------------------

# engine.metrics_snapshot() keys that are counters -> (series, label of their {value: n} dict). Other numbers
# are gauges `span02_<key>`; {"le", "counts" (cumulative), "sum", "count"} dicts are histograms (`*_ms`
# ones exported in seconds, as Prometheus wants base units).
ENGINE_COUNTERS = {"answers": ("span02_answers_total", "stop"), "requests": ("span02_engine_requests_total", "result"),
                   "prompt_tokens": ("span02_prompt_tokens_total", None),
                   "cached_tokens": ("span02_cached_tokens_total", None),
                   "reasoning_tokens": ("span02_reasoning_tokens_total", None),
                   "images": ("span02_images_total", None), "steps": ("span02_steps_total", None)}


def _esc(v):
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _val(x):
    return repr(float(x)) if isinstance(x, float) else str(int(x))


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests = {}                          # (endpoint, status) -> count
        self.lat = [0] * len(LATENCY_BUCKETS)       # cumulative counts per `le`
        self.lat_sum, self.lat_count = 0.0, 0
        self.decoded_bytes = 0                      # bytes out of the body decoders, bombs included
        self.refused = 0                            # connections refused over --max-connections

    def request(self, endpoint, status, seconds):
        with self.lock:
            self.requests[endpoint, status] = self.requests.get((endpoint, status), 0) + 1
            if endpoint == "/v1/systemone":
                self.lat_sum, self.lat_count = self.lat_sum + seconds, self.lat_count + 1
                for i, b in enumerate(LATENCY_BUCKETS):
                    self.lat[i] += seconds <= b

    def decoded(self, n):
        with self.lock:
            self.decoded_bytes += n

    def render(self, connections, snap) -> str:
        out = []

        def series(name, kind, rows, help=None):
            out.append(f"# HELP {name} {help or name[7:].replace('_', ' ')}\n# TYPE {name} {kind}")
            out.extend(f"{name}{lab} {_val(v)}" for lab, v in rows)

        def hist(name, le, counts, total, count, scale=1.0, help=None):
            rows = [(f'_bucket{{le="{b * scale:g}"}}', n) for b, n in zip(le, counts)]
            series(name, "histogram", rows + [('_bucket{le="+Inf"}', count), ("_sum", total * scale),
                                              ("_count", count)], help)

        with self.lock:
            series("span02_http_requests_total", "counter",
                   [(f'{{endpoint="{_esc(e)}",status="{s}"}}', n) for (e, s), n in sorted(self.requests.items())],
                   "HTTP requests by endpoint and status")
            hist("span02_request_duration_seconds", LATENCY_BUCKETS, self.lat, self.lat_sum, self.lat_count,
                 help="/v1/systemone latency, arrival to reply")
            series("span02_http_decoded_body_bytes_total", "counter", [("", self.decoded_bytes)])
            series("span02_http_connections_refused_total", "counter", [("", self.refused)])
        series("span02_http_connections", "gauge", [("", connections)])
        for k, v in sorted((snap or {}).items()):
            name = "span02_" + "".join(c if c.isalnum() else "_" for c in str(k))
            if isinstance(v, dict) and "le" in v and "counts" in v:
                ms = k.endswith("_ms")
                hist(name[:-3] + "_seconds" if ms else name, v["le"], v["counts"], v.get("sum", 0.0),
                     v.get("count", 0), 1e-3 if ms else 1.0)
                continue
            name, label = ENGINE_COUNTERS.get(k, (name, "key"))
            kind = "counter" if k in ENGINE_COUNTERS else "gauge"
            if isinstance(v, (int, float)):
                series(name, kind, [("", v)])
            elif isinstance(v, dict):
                series(name, kind, [(f'{{{label or "key"}="{_esc(lv)}"}}', n) for lv, n in sorted(v.items())
                                    if isinstance(n, (int, float))])
        return "\n".join(out) + "\n"


# --- HTTP ---------------------------------------------------------------------------------------------

def _accepts(header: str) -> str:
    q = {}
    for tok in header.lower().split(","):
        name, _, params = tok.strip().partition(";")
        w = 1.0
        if params.strip().startswith("q="):
            try:
                w = float(params.strip()[2:])
            except ValueError:
                w = 0.0
        q[name.strip()] = w
    for enc in ("zstd", "gzip"):
        if q.get(enc, q.get("*", 0.0)) > 0:
            return enc
    return "identity"


def _error_body(e: ApiError) -> bytes:
    err = {"type": e.type, "message": e.message}
    if e.field:
        err["field"] = e.field
    return json.dumps({"error": err}).encode()


class Server:
    """Server(engine | None, cfg, model_name, vision); bind(host, port) -> .port (0: ephemeral), then run() in a
    thread (blocks until shutdown() has drained); serve(host, port, ready_event) does both. set_engine() once the
    model is loaded (/health says "loading" until then). shutdown(timeout) is safe from any thread."""

    def __init__(self, engine, cfg, model_name, vision: bool):
        self.engine, self.cfg, self.model_name, self.vision = engine, cfg, model_name, vision
        self.metrics = Metrics()
        self.parser = RequestParser(cfg, vision)
        self.port = None
        self.started = time.monotonic()
        self._sock = self._loop = self._stop = self._thread = None
        self._conns = {}                          # task -> {"idle": bool}
        self._draining = False
        self._grace = 30.0
        self._stop_requested = threading.Event()
        self._done = threading.Event()
        self._pool = concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 2), "wire-parse")

    def set_engine(self, engine):
        self.engine = engine

    def bind(self, host="127.0.0.1", port=0):
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        s = socket.socket(fam, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        s.listen(1024)
        s.setblocking(False)
        self._sock, self.port = s, s.getsockname()[1]
        return self.port

    def serve(self, host, port, ready_event=None):
        self.bind(host, port)
        if ready_event is not None:
            ready_event.set()
        self.run()

    def run(self):
        """Serves until shutdown(); returns once requests in flight are done (or the grace period ends)."""
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._main(loop))
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)
            loop.close()
            self._done.set()

    def shutdown(self, timeout=30.0):
        """Thread-safe: stop accepting, finish requests in flight (at most `timeout` s), then return. From
        the thread running run() (a signal handler there) it only schedules the stop."""
        self._grace = timeout
        self._stop_requested.set()
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # loop already closed
                pass
        if loop is not None and threading.current_thread() is not self._thread:
            self._done.wait(timeout + 5.0)  # else: not running yet, run() sees the flag and returns

    async def _main(self, loop):
        self._thread = threading.current_thread()
        self._stop = asyncio.Event()
        self._loop = loop
        if self._stop_requested.is_set():
            self._sock.close()
            return
        srv = await asyncio.start_server(self._on_connection, sock=self._sock, limit=CHUNK)
        await self._stop.wait()
        srv.close()  # the listening socket closes: new connections are refused
        self._draining = True
        for task, st in list(self._conns.items()):
            if st["idle"]:
                task.cancel()
        tasks = list(self._conns)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self._grace)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def _on_connection(self, reader, writer):
        if self._draining or len(self._conns) >= self.cfg.max_connections:
            with self.metrics.lock:
                self.metrics.refused += 1
            body = _error_body(ApiError(503, "unavailable", "too many connections" if not self._draining
                                        else "shutting down"))
            writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                         b"retry-after: 1\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            try:  # half-close, then drain what the client sent so close() does not reset the reply away
                writer.write_eof()
                await asyncio.wait_for(reader.read(1 << 20), 1.0)
            except Exception:
                pass
            writer.close()
            return
        st = {"idle": True, "writer": writer}
        self._conns[asyncio.current_task()] = st
        try:
            await self._connection(reader, writer, st)
        except (_Gone, ConnectionError, asyncio.CancelledError, asyncio.TimeoutError, h11.LocalProtocolError):
            pass
        except Exception:
            log.exception("connection handler failed")
        finally:
            self._conns.pop(asyncio.current_task(), None)
            writer.close()

    async def _read(self, conn, reader, st):
        """The next h11 event, reading as needed until st["deadline"] (loop time): read_timeout_s of idling
        on a keep-alive connection, then read_timeout_s from a request's first byte to its last."""
        while True:
            ev = conn.next_event()
            if ev is not h11.NEED_DATA:
                return ev
            left = st["deadline"] - self._loop.time()
            if left <= 0:
                raise asyncio.TimeoutError
            data = await asyncio.wait_for(reader.read(CHUNK), left)
            if data and st["idle"]:
                st["idle"] = False
                st["deadline"] = self._loop.time() + self.cfg.read_timeout_s
            conn.receive_data(data)

    async def _connection(self, reader, writer, st):
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self.cfg.max_header_bytes)
        while True:
            st["idle"] = True
            st["deadline"] = self._loop.time() + self.cfg.read_timeout_s
            try:
                ev = await self._read(conn, reader, st)
            except asyncio.TimeoutError:
                if not st["idle"]:
                    await self._send_error(conn, writer, ApiError(408, "timeout", "request not received in time"))
                return
            except h11.RemoteProtocolError as e:
                hint = 431 if e.error_status_hint == 431 else 400
                await self._send_error(conn, writer, ApiError(
                    hint, "too_large" if hint == 431 else "bad_request",
                    "request header block too large" if hint == 431 else f"bad HTTP framing: {e}"))
                return await self._linger(reader, writer)
            if not isinstance(ev, h11.Request):
                return  # ConnectionClosed
            st["idle"] = False
            status = await self._exchange(conn, reader, writer, ev, st)
            if conn.their_state in (h11.SEND_BODY, h11.ERROR):  # answered before the body was read
                return None if status == 408 else await self._linger(reader, writer)
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE or self._draining:
                return
            conn.start_next_cycle()

    async def _linger(self, reader, writer):
        """Closing with the request body unread: half-close, then discard what the client still sends (2 s at
        most) so the kernel does not reset the connection before the client has read our error."""
        try:
            writer.write_eof()
            end, n = self._loop.time() + 2.0, 0
            while n < self.cfg.max_body_bytes and (data := await asyncio.wait_for(
                    reader.read(CHUNK), max(0.0, end - self._loop.time()))):
                n += len(data)
        except Exception:
            pass

    async def _exchange(self, conn, reader, writer, req, st):
        arrival = time.monotonic()
        rid = "req-" + uuid.uuid4().hex[:16]
        path = req.target.decode("latin-1").split("?", 1)[0]
        method = req.method.decode("latin-1")
        headers = {}
        for k, v in req.headers:
            k = k.decode("latin-1")
            headers[k] = headers[k] + ", " + v.decode("latin-1") if k in headers else v.decode("latin-1")
        endpoint = path if path in ROUTES else "other"
        ctype, status, extra = "application/json", 200, []
        try:
            if len(req.target) + sum(len(k) + len(v) + 4 for k, v in req.headers) > self.cfg.max_header_bytes:
                raise ApiError(431, "too_large", "request header block too large")  # h11 checks only partial heads
            if path not in ROUTES:
                raise ApiError(404, "not_found", f"no such path: {path[:200]}")
            if method != ROUTES[path]:
                raise ApiError(405, "method_not_allowed", f"{path} takes {ROUTES[path]}",
                               headers=[("allow", ROUTES[path])])
            if path == "/health":
                status, body = self._health()
            elif path == "/metrics":
                snap = None
                if self.engine is not None:
                    try:
                        snap = self.engine.metrics_snapshot()
                    except Exception:
                        log.exception("engine.metrics_snapshot failed")
                body = self.metrics.render(len(self._conns), snap).encode()
                ctype = "text/plain; version=0.0.4; charset=utf-8"
            else:
                body = await self._systemone(conn, reader, headers, arrival, rid, st)
        except ApiError as e:
            status, body, extra = e.status, _error_body(e), e.headers
        except _Gone:
            self.metrics.request(endpoint, 499, time.monotonic() - arrival)
            raise
        except asyncio.TimeoutError:
            status, body = 408, _error_body(ApiError(408, "timeout", "request body not received in time"))
        except h11.RemoteProtocolError as e:
            status, body = 400, _error_body(ApiError(400, "bad_request", f"bad HTTP framing: {e}"))
        except Exception:
            log.exception("internal error, request id %s", rid)
            status, body = 500, _error_body(ApiError(500, "internal", f"internal error (request id {rid})"))
        self.metrics.request(endpoint, status, time.monotonic() - arrival)
        try:  # answered without reading a small body (GET with a body, early errors): read it, keep alive
            n = 0
            while (conn.their_state is h11.SEND_BODY and n <= CHUNK and status != 408
                   and not conn.client_is_waiting_for_100_continue):
                n += len(getattr(await self._read(conn, reader, st), "data", b""))
        except Exception:
            pass
        await self._send(conn, writer, status, body, ctype, headers.get("accept-encoding", ""), extra, rid)
        return status

    def _health(self):
        if self.engine is None:
            return 503, b'{"status": "loading"}'
        if self._draining:
            return 503, b'{"status": "draining"}'
        h = {"status": "ok", "model": self.model_name, **self.engine.health()}
        h.setdefault("uptime_s", round(time.monotonic() - self.started, 3))
        return (200 if h["status"] == "ok" else 503), json.dumps(h).encode()

    async def _systemone(self, conn, reader, headers, arrival, rid, st):
        cfg = self.cfg
        if "content-length" not in headers and "transfer-encoding" not in headers:
            raise ApiError(411, "length_required", "a body needs Content-Length or chunked Transfer-Encoding")
        if int(headers.get("content-length", "0").split(",")[0]) > cfg.max_body_bytes:
            raise ApiError(413, "too_large", f"body is over the limit of {cfg.max_body_bytes} bytes")
        enc = headers.get("content-encoding", "identity").strip().lower() or "identity"
        if enc not in ("identity", "gzip", "x-gzip", "zstd"):
            raise ApiError(415, "unsupported_media_type", f"Content-Encoding {enc[:100]!r}: use identity, gzip or zstd")
        mime, opts = parse_options_header(headers.get("content-type", "application/json"))
        mime = mime.decode("latin-1").lower()
        if mime == "application/json":
            if opts.get(b"charset", b"utf-8").lower() not in (b"utf-8", b"utf8"):
                raise ApiError(415, "unsupported_media_type", "JSON bodies are UTF-8")
        elif mime == "multipart/form-data":
            if not opts.get(b"boundary"):
                raise ApiError(400, "bad_request", "multipart/form-data without a boundary")
        else:
            raise ApiError(415, "unsupported_media_type",
                           f"Content-Type {mime[:100]!r}: use application/json or multipart/form-data")
        if self.engine is None:
            raise ApiError(503, "unavailable", "the model is still loading", headers=[("retry-after", "5")])
        if conn.client_is_waiting_for_100_continue:
            writer = st["writer"]
            writer.write(conn.send(h11.InformationalResponse(status_code=100, headers=[])))
        raw = bytearray()
        while True:
            ev = await self._read(conn, reader, st)
            if isinstance(ev, h11.Data):
                raw += ev.data
                if len(raw) > cfg.max_body_bytes:
                    raise ApiError(413, "too_large", f"body is over the limit of {cfg.max_body_bytes} bytes")
            elif isinstance(ev, h11.EndOfMessage):
                break
            else:
                raise _Gone()
        request = await self._loop.run_in_executor(self._pool, self._parse, bytes(raw), enc, mime,
                                                   opts.get(b"boundary"), arrival, rid)
        try:
            fut = self.engine.submit(request)
            result = await self._wait(fut, conn, reader)
        except (ApiError, _Gone):
            raise
        except Exception as e:  # engine.EngineError(status, type, message), matched by shape
            if not isinstance(getattr(e, "status", None), int) or not isinstance(getattr(e, "type", None), str):
                raise
            hdr = [("retry-after", str(getattr(e, "retry_after", None) or 1))] if e.status == 429 else []
            raise ApiError(e.status, e.type, str(getattr(e, "message", e)), getattr(e, "field", None), hdr) from None
        return json.dumps(result, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode(
            "utf-8", "replace")

    def _parse(self, raw, enc, mime, boundary, arrival, rid):
        body = decode_body(raw, enc, self.cfg.max_decoded_bytes, self.metrics.decoded)
        assets = {}
        if mime == "multipart/form-data":
            body, assets = parse_multipart(body, boundary)
        return self.parser(parse_json(body), assets, arrival, rid)

    async def _wait(self, fut, conn, reader):
        """The engine's answer; _Gone (and the engine's future cancelled) if the client leaves first."""
        afut = asyncio.wrap_future(fut)

        async def watch():  # pipelined bytes go to h11's buffer; EOF or reset means the client is gone
            got = 0
            while got < (1 << 20):
                try:
                    data = await reader.read(CHUNK)
                except ConnectionError:
                    return
                if not data:
                    return
                got += len(data)
                conn.receive_data(data)
            await asyncio.Event().wait()

        watcher = asyncio.ensure_future(watch())
        try:
            await asyncio.wait({afut, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not watcher.done():
                watcher.cancel()
        if not afut.done():
            fut.cancel()
            afut.cancel()
            raise _Gone()
        if afut.cancelled():
            raise ApiError(503, "unavailable", "the request was cancelled (server shutting down)")
        return afut.result()

    async def _send_error(self, conn, writer, e):
        try:
            await self._send(conn, writer, e.status, _error_body(e), "application/json", "", [], None)
        except Exception:
            pass

    async def _send(self, conn, writer, status, body, ctype, accept, extra, rid):
        hdrs = [("content-type", ctype), ("server", "span02")] + extra
        if rid:
            hdrs.append(("x-request-id", rid))
        if len(body) > COMPRESS_MIN:
            enc = _accepts(accept)
            if enc == "zstd":
                body = zstandard.ZstdCompressor(level=3).compress(body)
            elif enc == "gzip":
                body = gzip.compress(body, 6, mtime=0)
            if enc != "identity":
                hdrs.append(("content-encoding", enc))
            hdrs.append(("vary", "accept-encoding"))
        if conn.their_state is not h11.DONE or self._draining:
            hdrs.append(("connection", "close"))
        hdrs.append(("content-length", str(len(body))))
        data = conn.send(h11.Response(status_code=status, headers=hdrs, reason=_REASONS.get(status, "")))
        data += conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())
        writer.write(data)
        await asyncio.wait_for(writer.drain(), self.cfg.read_timeout_s)
