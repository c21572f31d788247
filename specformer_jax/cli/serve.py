"""`specformer serve`: the OpenAI-compatible HTTP server (specformer_jax/serving/, docs/serving.md)."""

from __future__ import annotations

import signal
import socket
import sys
import threading
import time
from pathlib import Path

from specformer_jax import defaults
from specformer_jax.checks import POSITIVE_INT, integer
from specformer_jax.cli import args as a
from specformer_jax.cli.decode import draft_len
from specformer_jax.errors import SpecformerError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PORT = integer(0, 65535, "a port number in 0..65535")


def add_parsers(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat completions, streaming)",
                       description="Serve a model over the OpenAI API: requests join the running pool as they "
                                   "arrive; speculative decoding by default with the default model.")
    a.add_model(p)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="default: the checkpoint's (GGUF: float32; random:NAME: bfloat16)")
    p.add_argument("--drafter", default=None,
                   help="as in generate: 'default' (the shipped drafter; the default with the default model), a "
                        "drafter directory, 'ngram', 'default+ngram', or 'none' for plain decoding")
    p.add_argument("--draft-len", type=draft_len, default=None,
                   help="drafts per round for every chunk; default: per chunk, what pays for the rows live in it "
                        "(" + defaults.draft_len_defaults_text() + ")")
    p.add_argument("--batch-size", type=a.kind(POSITIVE_INT), default=16, help="slots: requests decoded at once")
    p.add_argument("--context", type=a.kind(POSITIVE_INT), default=2048,
                   help="positions a request may use, prompt and answer (default 2048; at most the model's)")
    p.add_argument("--max-queue", type=a.kind(POSITIVE_INT), default=256,
                   help="requests waiting for a slot at most; past it a request is answered 503 at once")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=a.kind(PORT), default=8000)
    p.add_argument("--served-model-name", default=None,
                   help=f"the model's name in the API (default: {DEFAULT_MODEL_NAME} for the default model, else the "
                        "checkpoint's directory or file name)")
    p.add_argument("--drain-timeout", type=a.kind(POSITIVE_INT), default=30,
                   help="seconds SIGTERM waits for the running requests to finish (default 30)")
    p.add_argument("--warmup", choices=["all", "first"], default="all",
                   help="all (default): compile before serving what greedy requests of up to 256 prompt tokens run, "
                        "at every number of live requests (a few minutes on a CPU the first time; XLA's compile "
                        "cache keeps it); first: one short answer, the rest compiled when first needed")
    p.add_argument("--chunk-rounds", type=a.kind(POSITIVE_INT), default=None,
                   help=f"rounds the device runs between two looks of the host (default {defaults.CHUNK_ROUNDS})")
    a.add_device_options(p)
    p.set_defaults(func=run_serve)


def served_name(model: str) -> str:
    return DEFAULT_MODEL_NAME if model == "default" else Path(model).stem if model.endswith(".gguf") \
        else Path(model).name


def run_serve(args) -> int:
    import uvicorn

    from specformer_jax.checkpoints.loader import load_target
    from specformer_jax.decoding.names import implied_drafter, read_drafter
    from specformer_jax.serving.app import build_app
    from specformer_jax.serving.engine import ServeConfig, ServingEngine

    if args.draft_len == "auto":
        raise SpecformerError("--draft-len auto is not served: give a number, or leave it out for the default")
    _check_port(args.host, args.port)
    name = (read_drafter(args.drafter) if args.drafter is not None else implied_drafter(args.model)).on(args.model)
    print(f"specformer: loading {args.model} ...", file=sys.stderr)
    model = load_target(args.model, dtype=args.dtype, attention_impl=args.attention_impl)
    if model.tokenizer is None:
        raise SpecformerError(f"{args.model} has no tokenizer: the server answers in text")
    drafter = name.load(model)
    a.drafter_needed(drafter, args.draft_len, ": pass --drafter DIR")
    cfg = ServeConfig(args.batch_size, args.context, args.draft_len, args.chunk_rounds or defaults.CHUNK_ROUNDS,
                      args.max_queue)
    engine = ServingEngine(model, drafter, cfg, a.mesh(args))
    if args.warmup == "all":
        _compile_ahead(engine)
    _warm_up(engine.start())
    served = args.served_model_name or served_name(args.model)
    print(f"specformer: serving {served} (drafter {name.text}, {args.batch_size} slots, context {args.context}) on "
          f"http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(build_app(engine, served), host=args.host, port=args.port,
                                           log_level="warning", timeout_graceful_shutdown=args.drain_timeout))
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # what uvicorn restores and re-raises once it has drained: exit 0
    server.run()
    print("specformer: server stopped", file=sys.stderr)
    return 0


def _check_port(host: str, port: int) -> None:
    """Refuse a host and port that cannot be listened on now, before the model loads."""
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as e:
        raise SpecformerError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _compile_ahead(engine) -> None:
    from tqdm import tqdm

    with tqdm(desc="specformer: compiling", unit="function", file=sys.stderr) as bar:
        engine.compile_ahead(lambda done, total: (setattr(bar, "total", total), bar.update(done - bar.n)))


def _warm_up(engine) -> None:
    """One short greedy answer before the port opens, so the first client does not wait for the first
    compilations (others compile when a batch size or sampling setting first needs them)."""
    from specformer_jax.decoding.acceptance.sampling import SamplingConfig
    from specformer_jax.serving.engine import Request

    t, done = time.perf_counter(), threading.Event()
    ended: list[str] = []
    engine.submit(Request([1] * 8, 8, SamplingConfig(), 0, lambda ids: None,
                          lambda reason: (ended.append(reason), done.set())))
    done.wait()
    if ended[0].startswith("error"):
        raise SpecformerError(f"the warm-up request failed: {ended[0]}")
    print(f"specformer: warmed up in {time.perf_counter() - t:.1f} s", file=sys.stderr)
