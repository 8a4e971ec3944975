"""span02: a decision server for span-02 (Gemma-4 26B-A4B fine-tune). The command line.

    python span02.py [serve] [--bind HOST:PORT] [--model DIR] ...   serve the decision API (default command)
    python span02.py make-demo DIR                                   write the built-in tiny demo model
    python span02.py calibrate [--model DIR] [--out FILE]            measure decode cost -> think_cost.json

Also a Python entry for tools and tests: `span02.load(model_dir, device="cpu")` returns a model with
`.logits(token_ids) -> float32 [T, vocab]` (post-softcap logits of every position of one sequence).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time

from checkpoint import CheckpointError, unfit_output_dir
from config import KV_DTYPES, ConfigError, CostTableError, EngineConfig, PolicyConfig
from prompt import PromptError

log = logging.getLogger("span02")
DEMO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo")


def load(model_dir=None, device="cpu", **kw):
    """The model of `model_dir` (default: the built-in demo) on `device`; see model.load."""
    import model
    return model.load(model_dir or DEMO_DIR, device=device, **kw)


# --- arguments ---------------------------------------------------------------------------------------

def _bind(s):
    host, sep, port = s.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise argparse.ArgumentTypeError(f"--bind wants HOST:PORT, got {s!r}")
    return host or "127.0.0.1", int(port)


def _serve_args(p):
    d, dp = EngineConfig(model_dir=""), PolicyConfig()
    a = p.add_argument
    a("--bind", type=_bind, default=("127.0.0.1", 8000), metavar="HOST:PORT",
      help="address to listen on (default 127.0.0.1:8000; 0.0.0.0:8000 for every interface)")
    a("--model", default=None, metavar="DIR", help="model directory (default: the built-in tiny demo model)")
    a("--device", default=d.device, choices=["auto", "cpu", "gpu"],
      help="backend: gpu when there is one under auto (default %(default)s)")
    a("--quantize", action="store_true", help="quantize a bf16 checkpoint at load: NVFP4 experts, FP8 dense layers")
    a("--max-len", type=int, default=d.max_len, help="longest sequence, stem + thought, in tokens (default %(default)s)")
    a("--max-batch", type=int, default=d.max_batch,
      help="most sequences in one engine step; decode steps of up to 512 replay CUDA graphs (default %(default)s)")
    a("--prefill-chunk", type=int, default=d.prefill_chunk,
      help="most prompt tokens of one sequence in one step; chunk cuts sit at its multiples (default %(default)s)")
    a("--kv-tokens", type=int, default=d.kv_tokens,
      help="KV cache size in tokens, shared by all sequences through the prefix cache (default 0: on the GPU 90%% "
           "of the memory free after the weights, less 2 GiB, at most max-batch x max-len; on the CPU 16384)")
    a("--kv-dtype", default=d.kv_dtype, choices=KV_DTYPES,
      help="what the KV cache keeps: bf16, or fp8 (e4m3: half the bytes a position, so about twice the positions; "
           "K and V rounded, so answers differ from bf16's; README) (default %(default)s)")
    a("--tau", type=float, default=dp.tau, help="gate: answer at once when max probability >= tau (default %(default)s)")
    a("--cap", type=int, default=dp.cap, help="most thought tokens per question (default %(default)s)")
    a("--think-ms", type=float, default=dp.think_ms,
      help="thought budget in modelled ms, through --think-cost (default 0: off)")
    a("--think-cost", default=None, metavar="FILE", help="cost table made by `span02.py calibrate`")
    a("--budget-ms", type=float, default=dp.budget_ms, help="wall-clock thought budget per request (default 0: off)")
    a("--deadline-ms", type=float, default=d.deadline_ms, help="default request deadline (default 0: none)")
    a("--blend-closed", type=float, default=dp.blend_closed,
      help="weight of the second readout when the thought closed itself (default %(default)s)")
    a("--blend-truncated", type=float, default=dp.blend_truncated,
      help="weight of the second readout when the thought was cut (default %(default)s)")
    a("--image-soft-tokens", type=int, default=d.image_soft_tokens, choices=[70, 140, 280, 560, 1120],
      help="soft tokens per image (default %(default)s)")
    a("--serial", action="store_true", help="one request at a time, in arrival order")
    a("--no-prefix-cache", action="store_true", help="compute every prompt from scratch")
    a("--spec-draft", default=None, metavar="DIR", help="draft model for speculative decoding (not used yet)")
    a("--spec-max-branches", type=int, default=d.spec_max_branches, help="speculation branches (default %(default)s)")
    a("--max-queue", type=int, default=d.max_queue, help="most waiting requests before 429 (default %(default)s)")
    a("--max-body-bytes", type=int, default=d.max_body_bytes, help="largest request body (default %(default)s)")
    a("--max-decoded-bytes", type=int, default=d.max_decoded_bytes,
      help="largest body after gzip/zstd decoding (default %(default)s)")
    a("--max-image-pixels", type=int, default=d.max_image_pixels,
      help="largest image, width x height (default %(default)s)")
    a("--max-connections", type=int, default=d.max_connections,
      help="most open client connections (default %(default)s)")
    a("--max-questions", type=int, default=d.max_questions, help="most questions per request (default %(default)s)")
    a("--max-images", type=int, default=d.max_images, help="most images per request (default %(default)s)")
    a("--read-timeout", type=float, default=d.read_timeout_s,
      help="seconds a client may take to send a request, or stay idle between requests (default %(default)s)")
    a("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="(default %(default)s)")


def engine_config(ns) -> EngineConfig:
    cost = None
    if ns.think_cost:
        try:
            with open(ns.think_cost) as f:
                cost = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"--think-cost {ns.think_cost}: {e}") from None
    if ns.spec_draft and not os.path.isdir(ns.spec_draft):
        raise ConfigError(f"--spec-draft {ns.spec_draft}: not a directory")
    if ns.spec_draft or ns.spec_max_branches != 1:       # validated (issue 3), used once speculation exists
        log.warning("--spec-draft / --spec-max-branches: speculative decoding is not built yet; the draft model is "
                    "not loaded and every thought token comes from the model itself")
    try:
        return EngineConfig(
            model_dir=ns.model or DEMO_DIR, device=ns.device, max_len=ns.max_len, max_batch=ns.max_batch,
            prefill_chunk=ns.prefill_chunk,
            kv_tokens=ns.kv_tokens, kv_dtype=ns.kv_dtype, quantize=ns.quantize,
            policy=PolicyConfig(tau=ns.tau, cap=ns.cap, think_ms=ns.think_ms, budget_ms=ns.budget_ms,
                                blend_closed=ns.blend_closed, blend_truncated=ns.blend_truncated),
            think_cost=cost, deadline_ms=ns.deadline_ms, image_soft_tokens=ns.image_soft_tokens, serial=ns.serial,
            prefix_cache=not ns.no_prefix_cache, spec_draft=ns.spec_draft, spec_max_branches=ns.spec_max_branches,
            max_queue=ns.max_queue, max_body_bytes=ns.max_body_bytes, max_decoded_bytes=ns.max_decoded_bytes,
            max_image_pixels=ns.max_image_pixels, max_connections=ns.max_connections, max_questions=ns.max_questions,
            max_images=ns.max_images, read_timeout_s=ns.read_timeout)
    except CostTableError as e:
        raise ConfigError(f"--think-cost {ns.think_cost}: {e}") from None


def parser():
    p = argparse.ArgumentParser(prog="span02.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="{serve,make-demo,calibrate}")
    _serve_args(sub.add_parser("serve", help="serve the decision API (the default command)"))
    m = sub.add_parser("make-demo", help="write the built-in tiny demo model to DIR")
    m.add_argument("dir", help="output directory")
    c = sub.add_parser("calibrate", help="measure decode step cost per batch size and context; write think_cost.json")
    _serve_args(c)
    c.add_argument("--out", default="think_cost.json", help="output file (default %(default)s)")
    return p


# --- commands ----------------------------------------------------------------------------------------

def _load_engine_parts(cfg: EngineConfig):
    import model
    from model_gpu import MAX_ROWS
    from prompt import Prompter
    t0 = time.monotonic()
    log.info("loading %s on %s", cfg.model_dir, cfg.device)
    # the GPU model's block tables, sequences and rows a step, for the engine's limits: a step holds each running
    # sequence once, or twice when its readout probe goes in beside its stem's last chunk (scheduler._split), and a
    # whole chunk with that probe row; its decode graphs hold max_batch rows (decode_graphs.decode_buckets)
    m = model.load(cfg.model_dir, device=cfg.device, kv_tokens=cfg.kv_tokens, kv_dtype=cfg.kv_dtype,
                   quantize=cfg.quantize,
                   kv_cap=cfg.max_batch * cfg.max_len, max_len=cfg.max_len, max_seqs=2 * cfg.max_batch,
                   max_rows=max(MAX_ROWS, cfg.prefill_chunk + 1), decode_rows=cfg.max_batch)
    sized = not cfg.kv_tokens and m.device == "gpu"          # model.load sized the pool from free memory
    log.info("loaded in %.1f s: %d layers, KV cache %d positions (%d blocks, %s%s)", time.monotonic() - t0,
             m.cfg.text.n_layers, m.num_blocks * model.BLOCK, m.num_blocks, m.kv_dtype,
             ", sized by free memory" if sized else "")
    return m, Prompter(cfg.model_dir)


def cmd_serve(ns):
    import engine as engine_mod
    import wire
    from config import load_model_config
    cfg = engine_config(ns)
    has_vision = load_model_config(cfg.model_dir).vision is not None     # config.json only: fast
    name = "span02-demo" if cfg.model_dir == DEMO_DIR else os.path.basename(os.path.normpath(cfg.model_dir))
    server = wire.Server(None, cfg, model_name=name, vision=has_vision)
    try:
        server.bind(*ns.bind)          # bound first: /health says "loading" until the model is in
    except OSError as e:               # the port in use, an address not this machine's, a privileged port
        raise ConfigError(f"--bind {ns.bind[0]}:{ns.bind[1]}: {e.strerror or e}") from None
    log.info("listening on http://%s:%d", ns.bind[0], server.port)
    stop = threading.Event()

    def on_signal(signum, _frame):
        log.info("signal %d: finishing requests in flight, then exiting", signum)
        stop.set()
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    serving = threading.Thread(target=server.run, name="wire", daemon=True)
    serving.start()
    try:
        m, prompter = _load_engine_parts(cfg)
    except BaseException:              # a model directory it cannot load: close the socket, then say why (main)
        server.shutdown(timeout=1.0)
        serving.join(5.0)
        raise
    m.name = name
    eng = engine_mod.Engine(m, prompter, cfg, encode_image=m.encode_image if m.vision else None)
    eng.start()
    if not stop.is_set():
        server.set_engine(eng)
        log.info("ready: model %s on %s", name, m.device)
    serving.join()
    eng.stop(drain_timeout=10.0)
    return 0


def cmd_make_demo(ns):
    from demo import make_demo
    if why := unfit_output_dir(ns.dir):
        raise ConfigError(f"make-demo {ns.dir}: {why}; the demo's config.json, model.safetensors and tokenizer files "
                          "go to a new or empty directory (an existing model's would be overwritten)")
    try:
        print(make_demo(ns.dir))
    except OSError as e:
        raise ConfigError(f"make-demo {ns.dir}: {e.strerror or e}") from None
    return 0


def _writable(path):
    """ConfigError unless `path` can be written as a file (checked before the work whose result goes there)."""
    d = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(d) or not os.access(d, os.W_OK) or (
            os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ConfigError(f"--out {path}: cannot write a file there")


def cmd_calibrate(ns):
    import engine as engine_mod
    cfg = engine_config(ns)
    _writable(ns.out)
    m, _ = _load_engine_parts(cfg)
    table = engine_mod.calibrate(m, cfg)
    try:
        with open(ns.out, "w") as f:
            json.dump(table, f, indent=2)
    except OSError as e:                 # gone since the start: the table is not lost, it goes to stdout
        print(json.dumps(table, indent=2))
        raise ConfigError(f"--out {ns.out}: {e.strerror or e}; the table is on stdout above") from None
    print(f"wrote {ns.out}")
    return 0


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("serve", "make-demo", "calibrate", "-h", "--help"):
        argv.insert(0, "serve")
    ns = parser().parse_args(argv)
    logging.basicConfig(level=getattr(ns, "log_level", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return {"serve": cmd_serve, "make-demo": cmd_make_demo, "calibrate": cmd_calibrate}[ns.command](ns)
    except (ConfigError, CheckpointError, PromptError) as e:     # the command line's or the model directory's fault
        print(f"span02: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
