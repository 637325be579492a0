"""The `brownout` command line: serve, check, fallback-server, make-tiny-model.

Heavy imports (aiohttp app, torch, transformers) happen inside each
subcommand so `brownout check` stays fast and needs no ML stack.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _cmd_serve(args: argparse.Namespace) -> int:
    from proxy.config import PolicyError, load_policy
    from proxy.server import run

    try:
        policy = load_policy(args.config)
    except PolicyError as exc:
        for line in exc.lines():
            print(line, file=sys.stderr)
        return 2
    run(policy, host=args.host, port=args.port)
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from proxy.config import PolicyError, load_policy

    if args.diff:
        from proxy.state import policy_diff

        try:
            old, new = load_policy(args.file), load_policy(args.diff)
        except PolicyError as exc:
            for line in exc.lines():
                print(line, file=sys.stderr)
            return 1
        changes = policy_diff(old, new)
        for line in changes:
            print(line)
        if not changes:
            print("no changes")
        return 0
    try:
        load_policy(args.file)
    except PolicyError as exc:
        for line in exc.lines():
            print(line, file=sys.stderr)
        return 1
    print(f"{args.file}: ok")
    return 0


def _cmd_fallback_server(args: argparse.Namespace) -> int:
    from proxy.fallback.server import main as fallback_main

    return fallback_main(args)


def _cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from proxy.tinymodel import write_tiny_model

    path = write_tiny_model(args.dir, seed=args.seed)
    print(f"tiny model written to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="brownout", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the proxy")
    serve.add_argument("--config", required=True, help="policy YAML file")
    serve.add_argument("--host", default=None, help="override server.host")
    serve.add_argument("--port", type=int, default=None, help="override server.port")
    serve.set_defaults(func=_cmd_serve)

    check = sub.add_parser(
        "check", help="validate a policy file (with --diff: what a reload to NEW would change)"
    )
    check.add_argument("file", help="the policy (OLD with --diff)")
    check.add_argument("--diff", metavar="NEW", default=None, help="compare FILE with NEW")
    check.set_defaults(func=_cmd_check)

    fb = sub.add_parser("fallback-server", help="run the Transformers OpenAI-compatible server")
    fb.add_argument("--model", required=True, help="model directory (local, no hub downloads)")
    fb.add_argument("--host", default="127.0.0.1")
    fb.add_argument("--port", type=int, default=8001)
    fb.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    fb.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    fb.add_argument(
        "--engine",
        default="auto",
        choices=["auto", "batched", "threads"],
        help="batched: Transformers continuous batching; threads: one generate() per slot; "
        "auto: batched on cuda, threads on cpu",
    )
    fb.add_argument(
        "--cuda-graphs",
        default="auto",
        choices=["auto", "on", "off"],
        help="batched engine: capture CUDA graphs (auto: on with --device cuda)",
    )
    fb.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="generations at once (default: from the device's free memory and the model's KV size)",
    )
    fb.add_argument("--max-queue", type=int, default=8)
    fb.add_argument("--served-model-name", default=None)
    fb.add_argument("--max-model-len", type=int, default=None)
    fb.set_defaults(func=_cmd_fallback_server)

    tiny = sub.add_parser("make-tiny-model", help="write a tiny random-weight Llama, offline")
    tiny.add_argument("dir")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_cmd_make_tiny_model)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
