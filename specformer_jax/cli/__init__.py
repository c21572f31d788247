"""The `specformer` command: one module per command group (decode: generate; serve: serve; data: sample-prompts,
distill, pack-data, cache-states; train: train, eval-drafter, draft-vocab, average-drafters; bench: bench,
profile-round, bench-kernels, report), the argument types they share in args.py. Bad input is one line on stderr and
exit status 2, never a traceback."""

from __future__ import annotations

import sys

from specformer_jax.cli import bench, data, decode, serve, train
from specformer_jax.cli.args import Parser
from specformer_jax.errors import SpecformerError


def build_parser() -> Parser:
    parser = Parser(prog="specformer", description="SpecFormer speculative decoding in JAX.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for group in (decode, serve, data, train, bench):
        group.add_parsers(sub)
    return parser


def _persistent_compile_cache() -> None:
    """Keep XLA's compiled programs across runs, under SPECFORMER_CACHE/xla, so a second `generate` or `bench` skips
    most of the compilation. A cache directory set through JAX (JAX_COMPILATION_CACHE_DIR) is kept;
    JAX_ENABLE_COMPILATION_CACHE=false turns caching off, and so does a cache directory that takes no files (read-only:
    JAX would warn at every compilation)."""
    import jax

    from specformer_jax.files import cache_dir, probe_writable

    if jax.config.jax_enable_compilation_cache and not jax.config.jax_compilation_cache_dir:
        try:
            xla = probe_writable(cache_dir() / "xla", directory=True)
        except SpecformerError:
            return
        jax.config.update("jax_compilation_cache_dir", str(xla))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # recorded in result files
    try:
        _persistent_compile_cache()
        return args.func(args)
    except SpecformerError as e:
        print(f"specformer: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a path the OS refused (permissions, a file where a directory goes, a full disk)
        where = f"{e.filename}: " if e.filename else ""
        print(f"specformer: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # decoding stops at a chunk boundary and says how far it got
        print(f"specformer: interrupted{': ' + str(e) if str(e) else ''}", file=sys.stderr)
        return 130
