# --- the server end to end on the demo model: real engine, real HTTP, real client ---------------------
# (uses start_wire, http_call, png_bytes from the wire tests above)
import base64
import concurrent.futures
import copy
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

import model as model_mod
import span02
from config import EngineConfig, PolicyConfig
from engine import Engine
from prompt import Prompter

ROOT = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(ROOT, "golden", "responses.json")
E2E_DOC = ("The harbour office logs every ship. The Albatross arrived at dawn with grain; the Heron left at noon "
           "for the islands, and the Osprey is held in dock for repairs to her rudder until Friday.")


def demo_server(**kw):
    """The demo model behind a real Server on an ephemeral port. Returns (server, thread, engine)."""
    policy = PolicyConfig(**kw.pop("policy", {}))
    cfg = EngineConfig(model_dir=span02.DEMO_DIR, kv_tokens=kw.pop("kv_tokens", 16384), policy=policy,
                       image_soft_tokens=kw.pop("image_soft_tokens", 70), **kw)
    m = model_mod.load(span02.DEMO_DIR, kv_tokens=cfg.kv_tokens)
    eng = Engine(m, Prompter(span02.DEMO_DIR), cfg, encode_image=m.encode_image)
    eng.start()
    srv, t = start_wire(eng, cfg)
    return srv, t, eng


def stop_server(srv, t, eng):
    srv.shutdown(timeout=5)
    t.join(10)
    eng.stop(drain_timeout=5)


def strip_times(x):
    """A response without its timing fields (they are the only ones that vary between runs)."""
    if isinstance(x, dict):
        return {k: strip_times(v) for k, v in x.items() if k != "ms"}
    if isinstance(x, list):
        return [strip_times(v) for v in x]
    return x


def check_answers(body, request):
    assert len(body["answers"]) == len(request["questions"])
    for a, q in zip(body["answers"], request["questions"]):
        n = {"boolean": 2, "scale": q.get("max", 0) - q.get("min", 0) + 1}.get(q.get("type"), len(q.get("choices", [])))
        p = a["probabilities"]
        assert len(p) == n and abs(sum(p) - 1) < 1e-6 and all(0 <= v <= 1 for v in p)
        assert a["index"] == max(range(n), key=lambda i: (p[i], -i))
        choices = {"boolean": ["yes", "no"]}.get(q.get("type")) or (
            [str(v) for v in range(q["min"], q["max"] + 1)] if q.get("type") == "scale" else q["choices"])
        assert a["answer"] == choices[a["index"]]
        stages = [s["stage"] for s in a["trace"]]
        assert stages[:2] == ["readout", "gate"]
        assert stages[2:] in ([], ["thought", "readout", "blend"])
        assert a["stop"] in ("gate", "never", "closed", "cap", "budget", "deadline")
        assert a["reasoning_tokens"] == (a["trace"][2]["tokens"] if len(stages) > 2 else 0)


def e2e_requests():
    """The fixed request set of the golden test: every shape of api.md."""
    rng = np.random.default_rng(2026)
    png = [png_of(rng, w, h) for w, h in ((40, 30), (25, 50))]
    words = "red green blue amber grain harbour ship noon dawn rudder island dock north south".split()
    reqs = []
    for i in range(14):
        qs = []
        for j in range(1 + i % 4):
            kind = ("choice", "boolean", "scale")[(i + j) % 3]
            q = {"id": f"q{j}", "text": f"Question {i}.{j}: which one, about the {words[(i * 3 + j) % len(words)]}?"}
            if kind == "choice":
                q["choices"] = [words[(i + j + k) % len(words)] for k in range(2 + (i + j) % 4)]
            elif kind == "boolean":
                q["type"] = "boolean"
            else:
                q.update(type="scale", min=1, max=3 + i % 4)
            qs.append(q)
        r = {"id": f"golden-{i}", "questions": qs}
        if i % 2 == 0:
            r["context"] = E2E_DOC
        if i % 3 == 0:
            r["system"] = "You answer questions about the harbour log."
        r["policy"] = [{}, {"thought": "never"}, {"thought": "always", "cap": 8}, {"tau": 0.3},
                       {"return_thought": True, "thought": "always", "cap": 12}][i % 5]
        reqs.append(r)
    for i, (imgs, qimgs) in enumerate((([0], []), ([], [1]), ([0, 1], [0]))):
        reqs.append({"id": f"golden-img-{i}", "context": "Look at the picture.",
                     "images": [{"data": base64.b64encode(png[k]).decode()} for k in imgs],
                     "questions": [{"id": "a", "text": "What is shown?", "choices": ["a ship", "a dock", "the sea"],
                                    "images": [{"data": "data:image/png;base64," + base64.b64encode(png[k]).decode()}
                                               for k in qimgs]},
                                   {"id": "b", "text": "Is it bright?", "type": "boolean"}]})
    reqs.append({"id": "golden-long", "context": E2E_DOC * 3, "questions": [
        {"text": "Which ship is held?", "choices": ["Albatross", "Heron", "Osprey"]}]})
    reqs.append({"id": "golden-unicode", "context": "Zürich, 東京, café — naïve façade.", "questions": [
        {"text": "Ünïcödé?", "choices": ["ja", "nein", "vielleicht"]}]})
    reqs.append({"id": "golden-26", "questions": [
        {"text": "Pick a letter.", "choices": [chr(65 + k) * 2 for k in range(26)]}]})
    return reqs


def png_of(rng, w, h):
    from PIL import Image
    b = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(b, "PNG")
    return b.getvalue()


GOLDEN_FLAGS = dict(serial=True, prefix_cache=False, policy=dict(tau=0.8, cap=64))


def golden_responses():
    srv, t, eng = demo_server(**copy.deepcopy(GOLDEN_FLAGS))
    try:
        out = []
        for r in e2e_requests():
            status, body = http_call(srv, body=r)
            assert status == 200, body
            out.append(strip_times(body))
        return out
    finally:
        stop_server(srv, t, eng)


def test_golden_responses():
    """Regenerate with: python test_span02.py --regen-golden"""
    with open(GOLDEN) as f:
        expected = json.load(f)
    got = golden_responses()
    assert len(got) == len(expected) >= 20
    for g, e in zip(got, expected):
        assert g == e, f"request {e['id']} differs"


@pytest.fixture(scope="module")
def demo_http():
    srv, t, eng = demo_server(policy=dict(tau=0.8, cap=24))
    yield srv
    stop_server(srv, t, eng)


def test_every_request_shape(demo_http):
    for r in e2e_requests():
        status, body = http_call(demo_http, body=r)
        assert status == 200, (r["id"], body)
        check_answers(body, r)
        assert body["id"] == r["id"] and body["model"]
        u = body["usage"]
        assert u["images"] == len(r.get("images", [])) + sum(len(q.get("images", [])) for q in r["questions"])
        assert u["reasoning_tokens"] == sum(a["reasoning_tokens"] for a in body["answers"])
        assert u["prompt_tokens"] > 0 and 0 <= u["cached_tokens"] <= u["prompt_tokens"]
        if r.get("policy", {}).get("return_thought") and r["policy"].get("thought") == "always":
            assert all(isinstance(a["trace"][2]["text"], str) for a in body["answers"])


def test_cached_tokens_with_and_without_prefix_cache(demo_http):
    r = {"context": E2E_DOC * 2, "questions": [{"text": f"Question {k}?", "type": "boolean"} for k in range(4)],
         "policy": {"thought": "never"}}
    status, body = http_call(demo_http, body=r)
    assert status == 200 and body["usage"]["cached_tokens"] > 0
    srv, t, eng = demo_server(prefix_cache=False)
    try:
        status, nocache = http_call(srv, body=r)
    finally:
        stop_server(srv, t, eng)
    assert status == 200 and nocache["usage"]["cached_tokens"] == 0
    assert [a["probabilities"] for a in body["answers"]] == [a["probabilities"] for a in nocache["answers"]]


def test_answers_do_not_depend_on_the_serving_mode():
    reqs = [r for r in e2e_requests() if not r["id"].startswith("golden-img")][:10]
    runs = {}
    for mode, kw in (("serial", dict(serial=True)), ("nocache", dict(prefix_cache=False)), ("batched", {})):
        srv, t, eng = demo_server(policy=dict(tau=0.8, cap=16), **kw)
        try:
            if mode == "batched":      # all at once: they share steps with each other
                with concurrent.futures.ThreadPoolExecutor(len(reqs)) as ex:
                    runs[mode] = list(ex.map(lambda r: http_call(srv, body=r)[1], reqs))
            else:
                runs[mode] = [http_call(srv, body=r)[1] for r in reqs]
        finally:
            stop_server(srv, t, eng)
    for mode in ("nocache", "batched"):
        for a, b in zip(runs["serial"], runs[mode]):
            for qa, qb in zip(a["answers"], b["answers"]):
                assert qa["answer"] == qb["answer"] and qa["stop"] == qb["stop"]
                assert qa["reasoning_tokens"] == qb["reasoning_tokens"]
                assert np.abs(np.array(qa["probabilities"]) - qb["probabilities"]).max() <= 1e-6


def test_bad_images_are_named_and_disturb_nothing(demo_http):
    good = {"questions": [{"text": "Which?", "choices": ["x", "y"]}]}
    png = png_of(np.random.default_rng(1), 30, 20)
    bad = {"corrupt": os.urandom(300), "truncated": png[:len(png) // 2],
           "unsupported": b"BM" + os.urandom(200), "oversized": png_header_only(9000, 9000)}
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        goods = [ex.submit(http_call, demo_http, body=good) for _ in range(4)]
        for name, data in bad.items():
            r = {"questions": [{"text": "What?", "type": "boolean",
                                "images": [{"data": base64.b64encode(data).decode()}]}]}
            status, body = http_call(demo_http, body=r)
            assert status == 422 and body["error"]["field"] == "questions[0].images[0]", (name, body)
        assert all(f.result()[0] == 200 for f in goods)


def test_multipart_image_request(demo_http):
    png = png_of(np.random.default_rng(4), 48, 32)
    boundary = "span02boundary"
    req = {"images": [{"asset": "photo"}], "questions": [{"text": "Describe?", "choices": ["dark", "light"]}]}
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"request\"\r\n"
            f"Content-Type: application/json\r\n\r\n{json.dumps(req)}\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"photo\"; filename=\"p.png\"\r\n"
            f"Content-Type: image/png\r\n\r\n").encode() + png + f"\r\n--{boundary}--\r\n".encode()
    status, out = http_call(demo_http, body=body, headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert status == 200 and out["usage"]["images"] == 1
    check_answers(out, req)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(port, proc, timeout=60):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        assert proc.poll() is None, proc.stderr.read()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError("server not ready")


def test_sigterm_under_load_finishes_in_flight_and_exits_0():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "span02.py"), "--bind", f"127.0.0.1:{port}",
                             "--cap", "48", "--tau", "2"], stderr=subprocess.PIPE, text=True)
    try:
        _wait_ready(port, proc)
        req = json.dumps({"questions": [{"text": f"Q{k}?", "type": "boolean"} for k in range(4)]}).encode()

        def call():
            rq = urllib.request.Request(f"http://127.0.0.1:{port}/v1/systemone", data=req,
                                        headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(rq, timeout=60) as r:
                return r.status, json.loads(r.read())

        with concurrent.futures.ThreadPoolExecutor(6) as ex:
            futs = [ex.submit(call) for _ in range(6)]
            time.sleep(0.5)                       # requests are in flight (each thinks 48 tokens x 4)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            with pytest.raises(OSError):          # new connections are refused
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
            results = [f.result() for f in futs]
        assert all(s == 200 and len(b["answers"]) == 4 for s, b in results)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_readme_examples_work():
    """The README's curl and Python client examples, run against `python span02.py`."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    py = re.search(r"```python\n(# client.*?)```", readme, re.S).group(1)
    sh = re.search(r"```sh\n(curl .*?)```", readme, re.S).group(1)
    port = _free_port()
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "span02.py"), "--bind", f"127.0.0.1:{port}"],
                            stderr=subprocess.PIPE, text=True)
    try:
        _wait_ready(port, proc)
        out = subprocess.run([sys.executable, "-c", py.replace("8000", str(port))], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0 and "answer" in out.stdout, out.stderr
        out = subprocess.run(["bash", "-c", sh.replace("8000", str(port))], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0 and json.loads(out.stdout)["answers"], out.stderr
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    if sys.argv[1:] == ["--regen-golden"]:
        os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
        with open(GOLDEN, "w") as f:
            json.dump(golden_responses(), f, indent=1, ensure_ascii=False)
            f.write("\n")
        print(f"wrote {GOLDEN}")
