"""HTTP/1.1 front of span02 (api.md): connections, limits, timeouts, body transport, routes, compression,
shutdown. What a request and a reply mean (validation, JSON bodies, /metrics text) lives in api.py.

One asyncio loop runs in the thread that calls `run()`; h11 frames every connection. Body decoding, JSON
validation and image decoding run on a small thread pool, so a big body never stalls other connections;
the engine answers through a concurrent.futures.Future (design.md: HTTP loop and engine loop in separate
threads). A plain JSON body of at most INLINE_PARSE_BYTES is parsed on the loop thread itself: its ~0.1 ms of
parsing stalls the other connections less than the pool's two thread hand-overs delay this request. Choices
where api.md is silent:
- no Content-Type (or an empty one) is read as JSON; a JSON charset other than UTF-8 is 415;
- an oversized header block is 431 `too_large`; framing errors are 400 `bad_request`;
- HEAD on /health and /metrics answers as GET would, without the body; elsewhere it is a 405 without a body;
- `--read-timeout` bounds the idle time between keep-alive requests, and a whole request (headers + body)
  from its first byte; a request cut mid-way gets 408 `timeout` and the connection is closed;
- over `--max-connections`, a new connection gets 503 `unavailable` + Retry-After and is closed;
- an error sent before the body was read drains a small body (keep-alive goes on) or half-closes and
  discards the rest for up to 2 s, so the client reads the error instead of a reset;
- a client that closes (or half-closes) its side while waiting is gone: the engine's future is cancelled
  and the answer dropped;
- while draining, /health answers 503 {"status": "draining"}; responses carry `x-request-id`, the id a
  500 is logged under;
- each request is logged as its response goes out (logger span02.access: client, method, path, status, ms, body bytes
  before compression, request id), at INFO for /v1/systemone and DEBUG for the rest; `--log-level warning` silences it.
"""
import asyncio
import concurrent.futures
import gzip
import http
import io
import json
import logging
import os
import socket
import threading
import time
import uuid
import zlib

import h11
import zstandard
from python_multipart.multipart import parse_options_header

import api

log = logging.getLogger("span02.wire")
access = logging.getLogger("span02.access")    # a line a request: INFO for /v1/systemone, DEBUG for the probes
CHUNK = 64 << 10                 # read / inflate granularity
COMPRESS_MIN = 1024              # responses over this many bytes are compressed when allowed
INLINE_PARSE_BYTES = 16 << 10    # plain JSON bodies up to this size are parsed on the loop thread (BENCHMARKS.md)
_REASONS = {s.value: s.phrase for s in http.HTTPStatus}
ROUTES = {"/v1/systemone": "POST", "/health": "GET", "/metrics": "GET"}


class _Gone(Exception):
    """The client went away; nothing is sent."""


# --- body transport ---------------------------------------------------------------------------------

def decode_body(raw: bytes, encoding: str, cap: int, counter=None) -> bytes:
    """identity / gzip / zstd -> bytes, inflating CHUNK at a time and refusing (413) past `cap`."""
    out = bytearray()

    def put(b):
        out.extend(b)
        if counter:
            counter(len(b))
        if len(out) > cap:
            raise api.ApiError(413, "too_large", f"decoded body is over the limit of {cap} bytes")

    if encoding == "identity":
        if counter:
            counter(len(raw))
        if len(raw) > cap:
            raise api.ApiError(413, "too_large", f"decoded body is over the limit of {cap} bytes")
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
                raise api.ApiError(400, "bad_request", f"malformed gzip body: {e}") from None
            if not d.eof:
                raise api.ApiError(400, "bad_request", "truncated gzip body")
            data = d.unused_data
    elif encoding == "zstd":
        try:
            r = zstandard.ZstdDecompressor(max_window_size=1 << 25).stream_reader(
                io.BytesIO(raw), read_size=CHUNK, read_across_frames=True)
            while chunk := r.read(CHUNK):
                put(chunk)
        except zstandard.ZstdError as e:
            raise api.ApiError(400, "bad_request", f"malformed zstd body: {e}") from None
    return bytes(out)


# --- HTTP ---------------------------------------------------------------------------------------------

def _accepts(header: str) -> str:
    """The coding of a response for the client's Accept-Encoding: of zstd and gzip the one it weights highest
    (q-values; `*` stands for any coding it does not name; a weight that is not a number counts as 0), zstd on a
    tie; identity when neither has a weight above 0."""
    q = {}
    for tok in header.lower().split(","):
        name, *params = [p.strip() for p in tok.split(";")]
        w = 1.0
        for p in params:
            if p.startswith("q="):
                try:
                    w = float(p[2:])
                except ValueError:
                    w = 0.0
        q[name] = w if w == w else 0.0                    # NaN: 0
    weight = {enc: q.get(enc, q.get("*", 0.0)) for enc in ("zstd", "gzip")}
    best = max(weight, key=weight.get)                     # the first of a tie: zstd
    return best if weight[best] > 0 else "identity"


class Server:
    """Server(engine | None, cfg, model_name, vision); bind(host, port) -> .port (0: ephemeral), then run() in a
    thread (blocks until shutdown() has drained); serve(host, port, ready_event) does both. set_engine() once the
    model is loaded (/health says "loading" until then). shutdown(timeout) is safe from any thread."""

    def __init__(self, engine, cfg, model_name, vision: bool):
        self.engine, self.cfg, self.model_name, self.vision = engine, cfg, model_name, vision
        self.metrics = api.Metrics()
        self.parser = api.RequestParser(cfg, vision)
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
            body = api.error_body(api.ApiError(503, "unavailable", "too many connections" if not self._draining
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
                    await self._send_error(conn, writer, api.ApiError(408, "timeout", "request not received in time"))
                return
            except h11.RemoteProtocolError as e:
                hint = 431 if e.error_status_hint == 431 else 400
                await self._send_error(conn, writer, api.ApiError(
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
                raise api.ApiError(431, "too_large", "request header block too large")  # h11 checks only partial heads
            if path not in ROUTES:
                raise api.ApiError(404, "not_found", f"no such path: {path[:200]}")
            allow = "GET, HEAD" if ROUTES[path] == "GET" else ROUTES[path]    # HEAD: GET's head, no body
            if method not in allow.split(", "):
                raise api.ApiError(405, "method_not_allowed", f"{path} takes {allow}", headers=[("allow", allow)])
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
        except api.ApiError as e:
            status, body, extra = e.status, api.error_body(e), e.headers
        except _Gone:
            self.metrics.request(endpoint, 499, time.monotonic() - arrival)
            self._access(writer, method, path, 499, arrival, 0, rid)
            raise
        except asyncio.TimeoutError:
            status, body = 408, api.error_body(api.ApiError(408, "timeout", "request body not received in time"))
        except h11.RemoteProtocolError as e:
            status, body = 400, api.error_body(api.ApiError(400, "bad_request", f"bad HTTP framing: {e}"))
        except Exception:
            log.exception("internal error, request id %s", rid)
            status, body = 500, api.error_body(api.ApiError(500, "internal", f"internal error (request id {rid})"))
        self.metrics.request(endpoint, status, time.monotonic() - arrival)
        try:  # answered without reading a small body (GET with a body, early errors): read it, keep alive
            n = 0
            while (conn.their_state is h11.SEND_BODY and n <= CHUNK and status != 408
                   and not conn.client_is_waiting_for_100_continue):
                n += len(getattr(await self._read(conn, reader, st), "data", b""))
        except Exception:
            pass
        # logged before the send, so that a client holding its response finds the line written
        self._access(writer, method, path, status, arrival, len(body), rid)
        await self._send(conn, writer, status, body, ctype, headers.get("accept-encoding", ""), extra, rid,
                         head=method == "HEAD")
        return status

    @staticmethod
    def _access(writer, method, path, status, arrival, nbytes, rid):
        level = logging.INFO if path == "/v1/systemone" else logging.DEBUG
        if access.isEnabledFor(level):
            peer = writer.get_extra_info("peername")
            access.log(level, "%s %s %s %d %.1f ms %d B %s", peer[0] if peer else "-", method, path[:200], status,
                       (time.monotonic() - arrival) * 1e3, nbytes, rid)

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
            raise api.ApiError(411, "length_required", "a body needs Content-Length or chunked Transfer-Encoding")
        if int(headers.get("content-length", "0").split(",")[0]) > cfg.max_body_bytes:
            raise api.ApiError(413, "too_large", f"body is over the limit of {cfg.max_body_bytes} bytes")
        enc = headers.get("content-encoding", "identity").strip().lower() or "identity"
        if enc not in ("identity", "gzip", "x-gzip", "zstd"):
            raise api.ApiError(415, "unsupported_media_type",
                               f"Content-Encoding {enc[:100]!r}: use identity, gzip or zstd")
        mime, opts = parse_options_header(headers.get("content-type", "").strip() or "application/json")
        mime = mime.decode("latin-1").lower()
        if mime == "application/json":
            if opts.get(b"charset", b"utf-8").lower() not in (b"utf-8", b"utf8"):
                raise api.ApiError(415, "unsupported_media_type", "JSON bodies are UTF-8")
        elif mime == "multipart/form-data":
            if not opts.get(b"boundary"):
                raise api.ApiError(400, "bad_request", "multipart/form-data without a boundary")
        else:
            raise api.ApiError(415, "unsupported_media_type",
                           f"Content-Type {mime[:100]!r}: use application/json or multipart/form-data")
        if self.engine is None:
            raise api.ApiError(503, "unavailable", "the model is still loading", headers=[("retry-after", "5")])
        if conn.client_is_waiting_for_100_continue:
            writer = st["writer"]
            writer.write(conn.send(h11.InformationalResponse(status_code=100, headers=[], reason="Continue")))
        raw = bytearray()
        while True:
            ev = await self._read(conn, reader, st)
            if isinstance(ev, h11.Data):
                raw += ev.data
                if len(raw) > cfg.max_body_bytes:
                    raise api.ApiError(413, "too_large", f"body is over the limit of {cfg.max_body_bytes} bytes")
            elif isinstance(ev, h11.EndOfMessage):
                break
            else:
                raise _Gone()
        args = (bytes(raw), enc, mime, opts.get(b"boundary"), arrival, rid)
        if len(raw) <= INLINE_PARSE_BYTES and enc == "identity" and mime == "application/json":
            request = self._parse(*args)        # small plain JSON: parsed here, without two thread hand-overs
        else:
            request = await self._loop.run_in_executor(self._pool, self._parse, *args)
        try:
            fut = self.engine.submit(request)
            result = await self._wait(fut, conn, reader)
        except (api.ApiError, _Gone):
            raise
        except Exception as e:  # engine.EngineError, matched by shape
            err = api.engine_error(e)
            if err is None:
                raise
            raise err from None
        return api.answer_body(result)

    def _parse(self, raw, enc, mime, boundary, arrival, rid):
        body = decode_body(raw, enc, self.cfg.max_decoded_bytes, self.metrics.decoded)
        assets = {}
        if mime == "multipart/form-data":
            body, assets = api.parse_multipart(body, boundary)
        return self.parser(api.parse_json(body), assets, arrival, rid)

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
            # Off the reader before the connection reads its next request: a cancelled watcher still holds the
            # reader's waiter until it runs again, and nothing need yield before that read (Python 3.12's
            # wait_for does not), which then failed with "read() called while another coroutine is already
            # waiting for incoming data" and dropped the keep-alive connection.
            await asyncio.gather(watcher, return_exceptions=True)
        if not afut.done():
            fut.cancel()
            afut.cancel()
            raise _Gone()
        if afut.cancelled():
            raise api.ApiError(503, "unavailable", "the request was cancelled (server shutting down)")
        return afut.result()

    async def _send_error(self, conn, writer, e):
        try:
            await self._send(conn, writer, e.status, api.error_body(e), "application/json", "", [], None)
        except Exception:
            pass

    async def _send(self, conn, writer, status, body, ctype, accept, extra, rid, head=False):
        """One response. head: the answer to a HEAD request: the headers the GET would get (its Content-Length
        included), no body (h11 refuses body bytes there)."""
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
        data += (b"" if head else conn.send(h11.Data(data=body))) + conn.send(h11.EndOfMessage())
        writer.write(data)
        await asyncio.wait_for(writer.drain(), self.cfg.read_timeout_s)
