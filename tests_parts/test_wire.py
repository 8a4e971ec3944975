"""wire.py end to end: the real server on 127.0.0.1 port 0 in a thread, a fake engine, real clients
(http.client and raw sockets). No GPU, no model."""
import base64
import concurrent.futures
import gzip
import http.client
import io
import json
import os
import random
import socket
import string
import struct
import sys
import threading
import time
import tracemalloc
import zlib

import pytest
import zstandard

sys.path.insert(0, __file__.rsplit("/tests_parts/", 1)[0])
import vision  # noqa: E402
import wire  # noqa: E402
from config import EngineConfig, PolicyConfig  # noqa: E402
from engine import EngineError  # noqa: E402


# --- fake engine ----------------------------------------------------------------------------------

class FakeWireEngine:
    """Uniform probabilities; `system` steers it: "sleep:S", "overload", "late", "long", "boom"."""

    def __init__(self):
        self.pool = concurrent.futures.ThreadPoolExecutor(64)
        self.seen, self.cancelled = [], 0
        self.lock = threading.Lock()

    def submit(self, req):
        with self.lock:
            self.seen.append(req)
        if req.system == "overload":
            raise EngineError(429, "overloaded", "queue full")
        fut = concurrent.futures.Future()
        self.pool.submit(self._work, req, fut)
        return fut

    def _work(self, req, fut):
        if req.system.startswith("sleep:"):
            time.sleep(float(req.system[6:]))
        if not fut.set_running_or_notify_cancel():
            with self.lock:
                self.cancelled += 1
            return
        if req.system == "late":
            return fut.set_exception(EngineError(503, "deadline_exceeded", "deadline passed"))
        if req.system == "long":
            return fut.set_exception(EngineError(413, "too_large", "prompt too long", field="questions[0]"))
        if req.system == "boom":
            return fut.set_exception(RuntimeError("secret internal detail /opt/x.py line 3"))
        answers = []
        for q in req.questions:
            n = len(q.choices)
            answers.append({"id": q.id, "answer": q.choices[0], "index": 0, "probabilities": [1 / n] * n,
                            "reasoning_tokens": 0, "stop": "gate", "ms": 0.1,
                            "trace": [{"stage": "echo", "text": q.text, "choices": q.choices}]})
        fut.set_result({"id": req.id, "model": "fake-model", "answers": answers, "ms": 0.2,
                        "usage": {"prompt_tokens": 1, "cached_tokens": 0, "reasoning_tokens": 0,
                                  "images": len(req.images) + sum(len(q.images) for q in req.questions)}})

    def health(self):
        return {"status": "ok", "device": "cpu", "queue": {"waiting": 0, "running": 0},
                "kv": {"used": 0.0, "capacity_tokens": 1024}}

    def metrics_snapshot(self):
        return {"queue_waiting": 0, "answers": {"gate": 3, "cap": 1}, "prompt_tokens": 17, "kv_used": 0.25,
                "step_ms": {"le": [1, 10], "counts": [2, 5], "sum": 20.0, "count": 5}}


WIRE_CFG = EngineConfig(model_dir="unused", read_timeout_s=1.5, max_connections=300, max_body_bytes=1 << 20,
                   max_decoded_bytes=2 << 20, max_questions=8, max_images=3, max_image_pixels=1_000_000,
                   image_soft_tokens=70, policy=PolicyConfig(cap=256))


def start_wire(engine=None, cfg=WIRE_CFG, vision_on=True):
    srv = wire.Server(engine, cfg, "fake-model", vision=vision_on)
    srv.bind("127.0.0.1", 0)
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    return srv, t


@pytest.fixture(scope="module")
def wire_server():
    eng = FakeWireEngine()
    srv, t = start_wire(eng)
    srv.fake = eng
    yield srv
    srv.shutdown(timeout=2)
    t.join(5)


def rnd_text(n=12):
    return "".join(random.choices(string.ascii_letters + string.digits, k=n))


def wire_question(**kw):
    q = {"text": "Which? " + rnd_text(), "choices": [rnd_text(), rnd_text(), rnd_text()]}
    q.update(kw)
    return q


def http_call(srv, method="POST", path="/v1/systemone", body=None, headers=None, raw=False):
    c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    if body is not None and not isinstance(body, (bytes, bytearray)):
        body = json.dumps(body).encode()
    h = {"Content-Type": "application/json"} if body is not None else {}
    h.update(headers or {})
    c.request(method, path, body=body, headers=h)
    r = c.getresponse()
    data = r.read()
    c.close()
    if raw:
        return r, data
    return r.status, (json.loads(data) if r.getheader("content-type", "").startswith("application/json") else data)


def raw_exchange(srv, payload, shut=True, timeout=5):
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=timeout)
    s.sendall(payload)
    if shut:
        s.shutdown(socket.SHUT_WR)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except (ConnectionResetError, socket.timeout):
        pass
    s.close()
    return out


def png_bytes(w=64, h=48, flat=False):
    b = io.BytesIO()
    from PIL import Image
    if flat:
        im = Image.new("RGB", (w, h), tuple(os.urandom(3)))
    else:
        im = Image.frombytes("RGB", (w, h), os.urandom(w * h * 3))
    im.save(b, "PNG")
    return b.getvalue()


def png_header_only(w, h):
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


# --- happy paths ----------------------------------------------------------------------------------

def test_answers_and_question_types(wire_server):
    qs = [wire_question(id="c"), {"text": "Yes? " + rnd_text(), "type": "boolean"},
          {"id": "s", "text": "How? " + rnd_text(), "type": "scale", "min": -1, "max": 3}]
    st, body = http_call(wire_server, body={"id": "mine-" + rnd_text(), "questions": qs,
                                            "policy": {"cap": 10, "tau": 0.5}})
    assert st == 200, body
    assert body["id"].startswith("mine-") and body["model"] == "fake-model"
    assert [a["id"] for a in body["answers"]] == ["c", "1", "s"]
    assert body["answers"][0]["trace"][0]["choices"] == qs[0]["choices"]
    assert body["answers"][1]["trace"][0]["choices"] == ["yes", "no"]
    assert body["answers"][2]["trace"][0]["choices"] == ["-1", "0", "1", "2", "3"]
    req = wire_server.fake.seen[-1]
    assert req.policy.cap == 10 and req.policy.tau == 0.5 and req.deadline is None


def test_deadline_policy_and_server_made_id(wire_server):
    t0 = time.monotonic()
    st, body = http_call(wire_server, body={"questions": [wire_question()], "deadline_ms": 5000, "system": None,
                                  "policy": {"thought": "always", "return_thought": True, "budget_ms": 50}})
    assert st == 200 and body["id"].startswith("req-")
    req = wire_server.fake.seen[-1]
    assert t0 <= req.arrival <= time.monotonic() and abs(req.deadline - req.arrival - 5.0) < 1e-6
    assert req.thought == "always" and req.return_thought is True and req.policy.budget_ms == 50
    assert req.policy.cap == WIRE_CFG.policy.cap and req.system == ""
    assert http_call(wire_server, body={"questions": [wire_question()], "deadline_ms": 0})[0] == 200
    assert wire_server.fake.seen[-1].deadline is None and wire_server.fake.seen[-1].thought == "auto"
    srv, t = start_wire(FakeWireEngine(), WIRE_CFG.replace(deadline_ms=700.0))  # the default applies
    try:
        assert http_call(srv, body={"questions": [wire_question()]})[0] == 200
        r = srv.engine.seen[-1]
        assert abs(r.deadline - r.arrival - 0.7) < 1e-6
    finally:
        srv.shutdown(timeout=2)
        t.join(5)


def test_health_metrics(wire_server):
    st, body = http_call(wire_server, "GET", "/health")
    assert st == 200 and body["status"] == "ok" and body["model"] == "fake-model" and "uptime_s" in body
    http_call(wire_server, body={"questions": [wire_question()]})
    r, text = http_call(wire_server, "GET", "/metrics", raw=True)
    assert r.status == 200 and r.getheader("content-type").startswith("text/plain; version=0.0.4")
    text = text.decode()
    assert 'span02_http_requests_total{endpoint="/v1/systemone",status="200"}' in text
    assert 'span02_request_duration_seconds_bucket{le="+Inf"}' in text
    assert 'span02_answers_total{stop="gate"} 3' in text and "span02_prompt_tokens_total 17" in text
    assert 'span02_step_seconds_bucket{le="0.01"} 5' in text and "span02_step_seconds_count 5" in text
    assert "# TYPE span02_queue_waiting gauge" in text and "span02_kv_used 0.25" in text


def test_loading_then_ready():
    srv, t = start_wire(None)
    try:
        st, body = http_call(srv, "GET", "/health")
        assert (st, body) == (503, {"status": "loading"})
        st, body = http_call(srv, body={"questions": [wire_question()]})
        assert st == 503 and body["error"]["type"] == "unavailable"
        srv.set_engine(FakeWireEngine())
        assert http_call(srv, "GET", "/health")[0] == 200
        assert http_call(srv, body={"questions": [wire_question()]})[0] == 200
    finally:
        srv.shutdown(timeout=2)
        t.join(5)


# --- the error table ----------------------------------------------------------------------------

def _wq(**kw):
    return {"questions": [wire_question(**kw)]}


WIRE_BAD = [  # (body, status, type, field)
    (b'{"questions": [', 400, "bad_request", None),
    (b'{"questions": [{"text": "\xff\xfe", "choices": ["a", "b"]}]}', 400, "bad_request", None),
    (b"[" * 100000 + b"]" * 100000, 400, "bad_request", None),
    (b'{"questions": [{"text": "x", "choices": ["a", "b"]}], "deadline_ms": NaN}', 400, "bad_request", None),
    ({"questions": [wire_question()], "colour": 1}, 422, "invalid_request", "colour"),
    (_wq(colour=1), 422, "invalid_request", "questions[0].colour"),
    ({"questions": [wire_question()], "policy": {"temperature": 1}}, 422, "invalid_request", "policy.temperature"),
    ({"questions": []}, 422, "invalid_request", "questions"),
    ({"questions": [wire_question() for _ in range(9)]}, 422, "invalid_request", "questions"),
    ({"questions": "q"}, 422, "invalid_request", "questions"),
    ({}, 422, "invalid_request", "questions"),
    ([1, 2], 422, "invalid_request", None),
    (_wq(choices=["a"]), 422, "invalid_request", "questions[0].choices"),
    (_wq(choices=[str(i) for i in range(27)]), 422, "invalid_request", "questions[0].choices"),
    (_wq(choices=["a", "a"]), 422, "invalid_request", "questions[0].choices"),
    (_wq(choices=["a", ""]), 422, "invalid_request", "questions[0].choices[1]"),
    (_wq(choices=["a", 3]), 422, "invalid_request", "questions[0].choices[1]"),
    (_wq(choices=["a", "b" * 1001]), 422, "invalid_request", "questions[0].choices[1]"),
    (_wq(text=""), 422, "invalid_request", "questions[0].text"),
    ({"questions": [{"choices": ["a", "b"]}]}, 422, "invalid_request", "questions[0].text"),
    (_wq(type="essay"), 422, "invalid_request", "questions[0].type"),
    ({"questions": [{"text": "t", "type": "boolean", "choices": ["a", "b"]}]}, 422, "invalid_request",
     "questions[0].choices"),
    ({"questions": [{"text": "t", "type": "scale", "min": 1, "max": 1}]}, 422, "invalid_request", "questions[0].max"),
    ({"questions": [{"text": "t", "type": "scale", "min": 1, "max": 27}]}, 422, "invalid_request", "questions[0].max"),
    ({"questions": [{"text": "t", "type": "scale", "min": 1.5, "max": 3}]}, 422, "invalid_request", "questions[0].min"),
    ({"questions": [wire_question(id="a"), wire_question(id="a")]}, 422, "invalid_request", "questions[1].id"),
    ({"questions": [wire_question(), wire_question(id="0")]}, 422, "invalid_request", "questions[1].id"),
    ({"questions": [wire_question()], "id": "x" * 129}, 422, "invalid_request", "id"),
    (_wq(id="x" * 129), 422, "invalid_request", "questions[0].id"),
    ({"questions": [wire_question()], "policy": {"cap": 257}}, 422, "invalid_request", "policy.cap"),
    ({"questions": [wire_question()], "policy": {"cap": -1}}, 422, "invalid_request", "policy.cap"),
    ({"questions": [wire_question()], "policy": {"tau": -0.1}}, 422, "invalid_request", "policy.tau"),
    ({"questions": [wire_question()], "policy": {"tau": "high"}}, 422, "invalid_request", "policy.tau"),
    ({"questions": [wire_question()], "policy": {"thought": "sometimes"}}, 422, "invalid_request", "policy.thought"),
    ({"questions": [wire_question()], "policy": {"return_thought": "yes"}}, 422, "invalid_request",
     "policy.return_thought"),
    ({"questions": [wire_question()], "policy": {"think_ms": 100}}, 422, "invalid_request", "policy.think_ms"),
    ({"questions": [wire_question()], "policy": {"budget_ms": -5}}, 422, "invalid_request", "policy.budget_ms"),
    ({"questions": [wire_question()], "deadline_ms": -1}, 422, "invalid_request", "deadline_ms"),
    ({"questions": [wire_question()], "deadline_ms": True}, 422, "invalid_request", "deadline_ms"),
    ({"questions": [wire_question()], "system": 5}, 422, "invalid_request", "system"),
    ({"questions": [wire_question()], "system": 0}, 422, "invalid_request", "system"),
    ({"questions": [wire_question()], "images": {}}, 422, "invalid_request", "images"),
    ({"questions": [wire_question()], "policy": []}, 422, "invalid_request", "policy"),
    ({"questions": [wire_question()], "images": [{"asset": "nope"}]}, 422, "invalid_request", "images[0].asset"),
    ({"questions": [wire_question()], "images": [{"data": "!!!not base64!!!"}]}, 400, "bad_request", "images[0]"),
    ({"questions": [wire_question()], "images": [{"data": "aGk=", "asset": "a"}]}, 422, "invalid_request", "images[0]"),
    ({"questions": [wire_question()], "images": ["http://example.com/a.png"]}, 422, "invalid_request", "images[0]"),
    ({"questions": [wire_question()], "images": [{"data": base64.b64encode(os.urandom(300)).decode()}]},
     422, "invalid_request", "images[0]"),
    ({"questions": [wire_question(images=[{"data": base64.b64encode(b"GIF89a" + os.urandom(40)).decode()}])]},
     422, "invalid_request", "questions[0].images[0]"),
    ({"questions": [wire_question()], "images": [{"data": "aGk="}] * 4}, 413, "too_large", "images"),
    ({"questions": [wire_question(text="\ud800")]}, 422, "invalid_request", "questions[0].text"),
]


@pytest.mark.parametrize("body,status,type,field", WIRE_BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(WIRE_BAD)])
def test_bad_requests(wire_server, body, status, type, field):
    st, out = http_call(wire_server, body=body)
    assert st == status, out
    assert out["error"]["type"] == type and out["error"]["message"]
    assert out["error"].get("field") == field


def test_engine_errors(wire_server):
    r, data = http_call(wire_server, body={"system": "overload", "questions": [wire_question()]}, raw=True)
    assert r.status == 429 and r.getheader("retry-after") and json.loads(data)["error"]["type"] == "overloaded"
    st, out = http_call(wire_server, body={"system": "late", "questions": [wire_question()]})
    assert st == 503 and out["error"]["type"] == "deadline_exceeded"
    st, out = http_call(wire_server, body={"system": "long", "questions": [wire_question()]})
    assert st == 413 and out["error"]["field"] == "questions[0]"
    st, out = http_call(wire_server, body={"system": "boom", "questions": [wire_question()]})
    assert st == 500 and out["error"]["type"] == "internal"
    assert "secret" not in out["error"]["message"] and "req-" in out["error"]["message"]
    assert http_call(wire_server, body={"questions": [wire_question()]})[0] == 200


def test_http_errors(wire_server):
    assert http_call(wire_server, "GET", "/nope")[1]["error"]["type"] == "not_found"
    r, _ = http_call(wire_server, "GET", "/v1/systemone", raw=True)
    assert r.status == 405 and r.getheader("allow") == "POST"
    assert http_call(wire_server, "POST", "/health", body=b"{}")[0] == 405
    assert http_call(wire_server, body=b"hello", headers={"Content-Type": "text/plain"})[0] == 415
    assert http_call(wire_server, body=b"{}", headers={"Content-Type": "application/x-www-form-urlencoded"})[0] == 415
    assert http_call(wire_server, body=b"{}", headers={"Content-Encoding": "br"})[0] == 415
    assert http_call(wire_server, body=b"{}", headers={"Content-Type": "application/json; charset=latin-1"})[0] == 415
    assert http_call(wire_server, body=b"{}", headers={"Content-Type": "multipart/form-data"})[0] == 400
    out = raw_exchange(wire_server, b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 411 ") and b"length_required" in out
    out = raw_exchange(wire_server, b"GARBAGE\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 400 ") and b"bad_request" in out
    out = raw_exchange(wire_server, b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                               b"Transfer-Encoding: chunked\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 400 ")
    out = raw_exchange(wire_server, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (20 << 10) + b"\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 431 ")
    assert http_call(wire_server, "GET", "/health")[0] == 200


def test_oversized_and_truncated_bodies(wire_server):
    big = json.dumps({"questions": [wire_question()], "context": rnd_text(1100 << 10)}).encode()
    st, out = http_call(wire_server, body=big)
    assert st == 413 and out["error"]["type"] == "too_large"
    # chunked, so the cap fires while reading rather than from Content-Length
    c = http.client.HTTPConnection("127.0.0.1", wire_server.port, timeout=10)
    c.request("POST", "/v1/systemone", body=iter([big[i:i + 65536] for i in range(0, len(big), 65536)]),
              headers={"Content-Type": "application/json"}, encode_chunked=True)
    assert c.getresponse().status == 413
    c.close()
    body = json.dumps({"questions": [wire_question()]}).encode()
    out = raw_exchange(wire_server, b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                               b"Content-Length: %d\r\n\r\n%s" % (len(body) + 50, body))
    assert out == b"" or out.startswith(b"HTTP/1.1 400 ")
    assert http_call(wire_server, body=body)[0] == 200


def test_compressed_request_bodies(wire_server):
    body = json.dumps({"questions": [wire_question()], "context": rnd_text(5000)}).encode()
    for enc, data in (("gzip", gzip.compress(body)), ("zstd", zstandard.ZstdCompressor().compress(body))):
        st, out = http_call(wire_server, body=data, headers={"Content-Encoding": enc})
        assert st == 200, out
        assert wire_server.fake.seen[-1].context == json.loads(body)["context"]
    st, out = http_call(wire_server, body=gzip.compress(body)[:-20], headers={"Content-Encoding": "gzip"})
    assert st == 400
    assert http_call(wire_server, body=b"\x28\xb5\x2f\xfdgarbage", headers={"Content-Encoding": "zstd"})[0] == 400


@pytest.mark.parametrize("enc", ["gzip", "zstd"])
def test_decompression_bomb(wire_server, enc):
    # a valid request padded with 256 MiB of JSON whitespace: only the decoded cap (2 MiB) refuses it
    prefix = json.dumps({"questions": [wire_question()]}).encode()
    if enc == "gzip":
        z = zlib.compressobj(9, zlib.DEFLATED, 31)
        blob = z.compress(prefix) + b"".join(z.compress(b" " * (16 << 20)) for _ in range(16)) + z.flush()
    else:
        blob = zstandard.ZstdCompressor(level=3).compress(prefix + b" " * (256 << 20))
    assert len(blob) < WIRE_CFG.max_body_bytes
    before = wire_server.metrics.decoded_bytes
    tracemalloc.start()
    try:
        st, out = http_call(wire_server, body=blob, headers={"Content-Encoding": enc})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert st == 413 and out["error"]["type"] == "too_large"
    assert wire_server.metrics.decoded_bytes - before <= WIRE_CFG.max_decoded_bytes + wire.CHUNK
    assert peak < 12 << 20, peak  # the bomb inflates to 256 MiB; we hold at most the 2 MiB cap and copies


def test_images_multipart_and_data_urls(wire_server):
    a, b = png_bytes(), png_bytes(40, 90)
    req = {"images": [{"asset": "first"}],  # "first" is used twice: decoded once, the same object twice
           "questions": [wire_question(images=[{"asset": "second"}]), wire_question(images=[{"asset": "first"}])]}
    bnd = "----" + rnd_text(20)
    parts = [("request", "application/json", json.dumps(req).encode()), ("first", "image/png", a),
             ("second", "image/png", b)]
    payload = b"".join(f"--{bnd}\r\nContent-Disposition: form-data; name=\"{n}\"; filename=\"{n}\"\r\n"
                       f"Content-Type: {t}\r\n\r\n".encode() + d + b"\r\n" for n, t, d in parts)
    payload += f"--{bnd}--\r\n".encode()
    mp = {"Content-Type": f"multipart/form-data; boundary={bnd}"}
    st, out = http_call(wire_server, body=payload, headers=mp)
    assert st == 200, out
    assert out["usage"]["images"] == 3
    r = wire_server.fake.seen[-1]
    assert len(r.images) == 1 and len(r.questions[0].images) == 1 and r.questions[1].images[0] is r.images[0]
    assert isinstance(r.images[0], vision.Preprocessed) and r.images[0].num_soft_tokens > 0
    assert r.questions[0].images[0].size != r.images[0].size  # 40x90 vs 64x48: each asset its own image
    url = "data:image/png;base64," + base64.b64encode(a).decode()
    st, out = http_call(wire_server, body={"images": [url], "questions": [wire_question(images=[{"data": url}])]})
    assert st == 200 and len(wire_server.fake.seen[-1].images) == 1
    assert len(wire_server.fake.seen[-1].questions[0].images) == 1
    bad = payload.replace(f"--{bnd}--".encode(), b"")  # no closing boundary
    assert http_call(wire_server, body=bad, headers=mp)[0] == 400
    no_req = payload.replace(b'name="request"', b'name="other"')
    assert http_call(wire_server, body=no_req, headers=mp)[0] == 400


def test_image_bomb(wire_server):
    for blob in (png_header_only(100_000, 100_000), png_bytes(1100, 1000, flat=True)):
        img = {"data": base64.b64encode(blob).decode()}
        st, out = http_call(wire_server, body={"questions": [wire_question(images=[img])]})
        assert st == 422 and out["error"]["field"] == "questions[0].images[0]"
        assert "too large" in out["error"]["message"]


def test_no_vision_tower():
    srv, t = start_wire(FakeWireEngine(), vision_on=False)
    try:
        img = {"data": base64.b64encode(png_bytes()).decode()}
        st, out = http_call(srv, body={"questions": [wire_question()], "images": [img]})
        assert st == 422 and out["error"]["field"] == "images[0]" and "vision tower" in out["error"]["message"]
    finally:
        srv.shutdown(timeout=2)
        t.join(5)


# --- transport ------------------------------------------------------------------------------------

def test_keep_alive_and_pipelining(wire_server):
    c = http.client.HTTPConnection("127.0.0.1", wire_server.port, timeout=10)
    texts = []
    for _ in range(2):
        q = wire_question()
        texts.append(q["text"])
        c.request("POST", "/v1/systemone", body=json.dumps({"questions": [q]}),
                  headers={"Content-Type": "application/json"})
        sock = c.sock
        r = c.getresponse()
        assert r.status == 200 and json.loads(r.read())["answers"][0]["trace"][0]["text"] == texts[-1]
    assert c.sock is sock  # the same connection served both
    c.close()
    bodies = [json.dumps({"questions": [wire_question()]}).encode() for _ in range(3)]
    payload = b"".join(b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(b), b) for b in bodies)
    s = socket.create_connection(("127.0.0.1", wire_server.port), timeout=10)
    s.sendall(payload + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    s.close()
    assert out.count(b"HTTP/1.1 200 ") == 4
    pos = [out.index(json.loads(b)["questions"][0]["text"].encode()) for b in bodies]
    assert pos == sorted(pos)
    # a client error, and a GET with a small body, leave the connection usable
    out = raw_exchange(wire_server, b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\n"
                               b"Content-Length: 5\r\n\r\nhello"
                               b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
                               b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 415 ") and out.count(b"HTTP/1.1 200 ") == 2


def test_chunked_request(wire_server):
    q = wire_question()
    body = json.dumps({"questions": [q], "context": rnd_text(3000)}).encode()
    c = http.client.HTTPConnection("127.0.0.1", wire_server.port, timeout=10)
    c.request("POST", "/v1/systemone", body=iter([body[i:i + 700] for i in range(0, len(body), 700)]),
              headers={"Content-Type": "application/json"}, encode_chunked=True)
    r = c.getresponse()
    assert r.status == 200 and json.loads(r.read())["answers"][0]["trace"][0]["text"] == q["text"]
    c.close()


def test_compressed_responses(wire_server):
    body = {"questions": [wire_question(choices=[rnd_text(60) for _ in range(10)]) for _ in range(4)]}
    for accept, enc in (("gzip, zstd", "zstd"), ("gzip", "gzip"), ("zstd;q=0, gzip;q=0.5", "gzip"), ("", None),
                        ("identity", None)):
        r, data = http_call(wire_server, body=body, headers={"Accept-Encoding": accept}, raw=True)
        assert r.status == 200 and r.getheader("content-encoding") == enc
        if enc == "zstd":
            data = zstandard.ZstdDecompressor().decompress(data)
        elif enc == "gzip":
            data = gzip.decompress(data)
        assert json.loads(data)["answers"][0]["trace"][0]["choices"] == body["questions"][0]["choices"]
    r, _ = http_call(wire_server, "GET", "/health", headers={"Accept-Encoding": "zstd"}, raw=True)
    assert r.getheader("content-encoding") is None  # under 1 KiB


def test_many_clients_some_disconnect(wire_server):
    cancelled0 = wire_server.fake.cancelled

    def good(i):
        q = wire_question()
        st, out = http_call(wire_server, body={"id": f"c{i}", "system": "sleep:0.3", "questions": [q]})
        return st == 200 and out["id"] == f"c{i}" and out["answers"][0]["trace"][0]["text"] == q["text"]

    def rude(i):
        body = json.dumps({"system": "sleep:0.3", "questions": [wire_question()]}).encode()
        req = (b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        s = socket.create_connection(("127.0.0.1", wire_server.port), timeout=10)
        s.sendall(req[:len(req) // 2] if i % 2 else req)  # half a request, or all of it
        time.sleep(0.05)
        if i % 3 == 0:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST
        s.close()
        return True

    kinds = [rude if i % 10 == 0 else good for i in range(200)]
    with concurrent.futures.ThreadPoolExecutor(200) as ex:
        results = list(ex.map(lambda a: a[1](a[0]), enumerate(kinds)))
    assert all(results)
    assert http_call(wire_server, "GET", "/health")[0] == 200
    time.sleep(0.5)
    assert wire_server.fake.cancelled > cancelled0  # the engine was told about the ones that left


def test_slow_client_cut_others_served(wire_server):
    s = socket.create_connection(("127.0.0.1", wire_server.port), timeout=10)
    head = b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"{" * 1000
    got, t0 = [], time.monotonic()

    def slow():
        try:
            for byte in head:  # one byte a second
                s.send(bytes([byte]))
                time.sleep(1.0)
        except OSError:
            pass
        got.append(time.monotonic() - t0)

    th = threading.Thread(target=slow)
    th.start()
    for _ in range(3):  # others are served meanwhile
        t1 = time.monotonic()
        assert http_call(wire_server, body={"questions": [wire_question()]})[0] == 200
        assert time.monotonic() - t1 < 1.0
    s.settimeout(5)
    data = s.recv(65536)
    cut = time.monotonic() - t0
    assert data.startswith(b"HTTP/1.1 408 ") or data == b""
    assert cut < WIRE_CFG.read_timeout_s + 1.0
    s.close()
    th.join(10)


def test_connection_cap():
    srv, ready = wire.Server(FakeWireEngine(), WIRE_CFG.replace(max_connections=2), "m", vision=True), threading.Event()
    t = threading.Thread(target=srv.serve, args=("127.0.0.1", 0, ready), daemon=True)
    t.start()
    assert ready.wait(5) and srv.port
    try:
        idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(2)]
        time.sleep(0.2)
        out = raw_exchange(srv, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 503 ") and b"retry-after" in out.lower()
        for s in idle:
            s.close()
        time.sleep(0.2)
        assert http_call(srv, "GET", "/health")[0] == 200
    finally:
        srv.shutdown(timeout=2)
        t.join(5)


def test_graceful_shutdown():
    srv, t = start_wire(FakeWireEngine())
    port, res = srv.port, {}

    def inflight():
        res["r"] = http_call(srv, body={"system": "sleep:1.0", "questions": [wire_question()]})

    c = threading.Thread(target=inflight)
    c.start()
    time.sleep(0.3)
    idle = socket.create_connection(("127.0.0.1", port))  # an idle keep-alive connection is closed
    time.sleep(0.1)
    t0 = time.monotonic()
    stopper = threading.Thread(target=srv.shutdown, kwargs={"timeout": 5})
    stopper.start()
    time.sleep(0.2)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2)
    idle.settimeout(3)
    assert idle.recv(100) == b""
    c.join(5)
    stopper.join(5)
    t.join(5)
    assert res["r"][0] == 200 and not t.is_alive() and not stopper.is_alive()
    assert 0.4 < time.monotonic() - t0 < 4


def test_idle_keep_alive_closed_and_expect_continue(wire_server):
    s = socket.create_connection(("127.0.0.1", wire_server.port), timeout=5)
    body = json.dumps({"questions": [wire_question()]}).encode()
    s.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body))
    assert s.recv(100).startswith(b"HTTP/1.1 100 ")
    s.sendall(body)
    out = s.recv(65536)
    assert out.startswith(b"HTTP/1.1 200 ")
    t0 = time.monotonic()
    assert s.recv(100) == b""  # idle past the read timeout: closed
    assert WIRE_CFG.read_timeout_s - 0.2 < time.monotonic() - t0 < WIRE_CFG.read_timeout_s + 1.0
    s.close()


def test_shutdown_from_the_serving_thread():
    """What a signal handler in the thread running run() does: shutdown() must schedule, not deadlock."""
    srv, t = start_wire(FakeWireEngine())
    assert http_call(srv, "GET", "/health")[0] == 200
    srv._loop.call_soon_threadsafe(srv.shutdown)
    t.join(5)
    assert not t.is_alive()
    srv2 = wire.Server(None, WIRE_CFG, "m", vision=True)  # shut down before run(): run() returns at once
    srv2.bind("127.0.0.1", 0)
    srv2.shutdown()
    srv2.run()
