"""The API contract of span02 (api.md): the error type and the JSON bodies, the multipart form (a `request`
part + named assets), JSON -> policy.Request validation, and the Prometheus text of /metrics. wire.py carries
the bytes; this module says what they mean.

Choices where api.md is silent:
- a policy override past the server's limit (`cap` above `--cap`) is a 422, not a silent clamp; tau,
  think_ms, budget_ms are any finite number >= 0 (think_ms > 0 needs `--think-cost`);
- `deadline_ms: 0` means no deadline (as `--deadline-ms 0`); `null` or absent means the server default;
- JSON must be UTF-8; NaN/Infinity are 400.
"""
import base64
import binascii
import dataclasses
import json
import math
import threading

from python_multipart.multipart import MultipartParser, parse_options_header

import policy
import vision

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


# --- errors and bodies --------------------------------------------------------------------------------

class ApiError(Exception):
    def __init__(self, status, type, message, field=None, headers=()):
        super().__init__(message)
        self.status, self.type, self.message, self.field, self.headers = status, type, message, field, list(headers)



def _invalid(field, message):
    return ApiError(422, "invalid_request", message, field)



def error_body(e: ApiError) -> bytes:
    err = {"type": e.type, "message": e.message}
    if e.field:
        err["field"] = e.field
    return json.dumps({"error": err}).encode()


def answer_body(result) -> bytes:
    return json.dumps(result, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode(
        "utf-8", "replace")


def engine_error(e):
    """engine.EngineError(status, type, message), matched by shape -> ApiError; None for any other exception."""
    if not isinstance(getattr(e, "status", None), int) or not isinstance(getattr(e, "type", None), str):
        return None
    hdr = [("retry-after", str(getattr(e, "retry_after", None) or 1))] if e.status == 429 else []
    return ApiError(e.status, e.type, str(getattr(e, "message", e)), getattr(e, "field", None), hdr)


# --- multipart -> request part + assets ------------------------------------------------------------

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

JSON_INT_DIGITS = 1000      # longest integer literal read (no field takes one near it; Python's own cap is 4300)


def _reject_constant(c):
    raise ValueError(f"{c} is not JSON")


def _parse_int(s):
    if len(s.lstrip("-")) > JSON_INT_DIGITS:
        raise ValueError(f"an integer of {len(s.lstrip('-'))} digits (at most {JSON_INT_DIGITS})")
    return int(s)


def parse_json(body: bytes):
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, "bad_request", f"body is not valid UTF-8 (byte {e.start})") from None
    try:
        return json.loads(text, parse_constant=_reject_constant, parse_int=_parse_int)
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
                   "images": ("span02_images_total", None), "steps": ("span02_steps_total", None),
                   "prompt_step_replays": ("span02_prompt_step_replays_total", None)}


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
