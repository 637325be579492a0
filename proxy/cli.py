"""The `brownout` command line: serve, check, reload, rollout, fallback-server, make-tiny-model.

Heavy imports (aiohttp app, torch, transformers) happen inside each
subcommand so `brownout check` stays fast and needs no ML stack.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence


def _cmd_serve(args: argparse.Namespace) -> int:
    from proxy.policy import PolicyError, load_policy
    from proxy.server import run

    try:
        policy = load_policy(args.config)
    except PolicyError as exc:
        for line in exc.lines():
            print(line, file=sys.stderr)
        return 2
    try:
        run(policy, host=args.host, port=args.port)
    except OSError as exc:  # the address is taken or not ours
        print(f"brownout serve: error: cannot listen: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from proxy.policy import PolicyError, load_policy

    if args.diff:
        from proxy.policy import policy_diff

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


def _cmd_schema(args: argparse.Namespace) -> int:
    from proxy.policy.jsonschema import render

    sys.stdout.write(render(faq=args.faq))
    return 0


def _cmd_fallback_server(args: argparse.Namespace) -> int:
    from proxy.fallback.api.server import main as fallback_main

    return fallback_main(args)


def _cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from proxy.tinymodel import write_tiny_model

    try:
        path = write_tiny_model(args.dir, seed=args.seed)
    except FileExistsError as exc:
        print(f"brownout make-tiny-model: error: {exc}", file=sys.stderr)
        return 1
    print(f"tiny model written to {path}")
    return 0


def _cmd_reload(args: argparse.Namespace) -> int:
    from proxy.ops.adminclient import render, request_reload

    token = args.token if args.token is not None else os.environ.get("BROWNOUT_ADMIN_TOKEN")
    rc, out, err = render(request_reload(args.url, token, args.timeout))
    for line in out:
        print(line)
    for line in err:
        print(line, file=sys.stderr)
    return rc


def _cmd_replay(args: argparse.Namespace) -> int:
    from proxy.replay.main import main as replay_main

    return replay_main(args)


def _cmd_rollout(args: argparse.Namespace) -> int:
    from proxy.ops.rolloutclient import render_rollout, request_rollout

    token = args.token if args.token is not None else os.environ.get("BROWNOUT_ADMIN_TOKEN")
    outcome = request_rollout(args.url, args.action, token, args.timeout)
    rc, out, err = render_rollout(outcome, args.action, as_json=args.json)
    for line in out:
        print(line)
    for line in err:
        print(line, file=sys.stderr)
    return rc


EXIT_CODES = """\
exit codes:
  0  success (serve and fallback-server: stopped by SIGINT or SIGTERM;
     replay: the candidate is not worse on the --fail-on figures)
  1  check: the policy is invalid; reload: the proxy rejected the new policy
     and keeps the running one; rollout: the proxy refused the action (it
     does not apply in the rollout's state, or no candidate is configured);
     serve, fallback-server: cannot listen;
     fallback-server: its engine died (stopped, as vLLM does);
     replay: the candidate is worse on one of the --fail-on figures
  2  bad command line; serve: the policy is invalid (nothing started);
     fallback-server: the model does not load or a limit is out of range;
     replay: the trace cannot be read or a policy is invalid
  3  reload, rollout: the proxy could not be reached or refused the request
     (wrong token, admin endpoints off)"""

# The lines of EXIT_CODES that concern each subcommand, shown in its --help.
_SUB_EXIT_CODES = {
    "serve": "0 stopped by a signal · 1 cannot listen · 2 bad options or invalid policy",
    "check": "0 valid (with --diff: both valid) · 1 invalid, with FILE:LINE lines · 2 bad options",
    "reload": (
        "0 reloaded · 1 rejected (errors printed; the running policy stays) · "
        "2 bad options · 3 unreachable or refused (token, admin off)"
    ),
    "rollout": (
        "0 done (status: shown) · 1 refused: the action does not apply now, or no candidate "
        "(the reason printed) · 2 bad options · 3 unreachable or refused (token, admin off)"
    ),
    "fallback-server": (
        "0 stopped by a signal · 1 cannot listen or the engine died · "
        "2 bad options, model or limits"
    ),
    "make-tiny-model": "0 written (or already there) · 1 DIR holds something else · 2 bad options",
    "schema": "0 printed · 2 bad options",
    "replay": (
        "0 not worse on the --fail-on figures · 1 worse on one of them · "
        "2 bad options, unreadable trace or invalid policy"
    ),
}


# `brownout replay`'s names (`proxy.replay.names` has them too: the parser is
# built without loading the replay, so `brownout check` stays a policy leaf).
REPLAY_SCENARIOS = ("engine-death", "overload-burst", "slow-prefill", "flapping", "fallback-down")
REPLAY_FAIL_ON = ("client_errors", "maintenance_answers", "shed", "ttft_p95")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default; options that default to None say what
    happens instead in their own help, so "(default: None)" is never shown."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.required or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class _TopHelpFormatter(_HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """`brownout --help`: the docstring and the exit-code table as written."""


class _Version(argparse.Action):
    """`--version`: the version and which run scanner runs (C or pure Python),
    imported only when asked (`brownout check` imports the policy package alone)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        from proxy import __version__
        from proxy.openai.chunkrun import NATIVE

        scanner = "C run scanner" if NATIVE is not None else "pure-Python run scanner"
        print(f"{parser.prog} {__version__} ({scanner})")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="brownout", description=__doc__, epilog=EXIT_CODES, formatter_class=_TopHelpFormatter
    )
    parser.add_argument(
        "--version", action=_Version, nargs=0, help="show the version and the run scanner, and exit"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the proxy", description="Run the proxy.")
    serve.add_argument("--config", required=True, metavar="FILE", help="policy YAML file")
    serve.add_argument(
        "--host", default=None, help="listen address (default: the policy's server.host)"
    )
    serve.add_argument(
        "--port", type=int, default=None, help="listen port (default: the policy's server.port)"
    )
    serve.set_defaults(func=_cmd_serve)

    check = sub.add_parser(
        "check",
        help="validate a policy file (with --diff: what a reload to NEW would change)",
        description="Validate a policy file; with --diff, list what a reload to NEW would change.",
    )
    check.add_argument("file", help="the policy (OLD with --diff)")
    check.add_argument(
        "--diff", metavar="NEW", default=None, help="compare FILE with NEW (default: no comparison)"
    )
    check.set_defaults(func=_cmd_check)

    schema = sub.add_parser(
        "schema", help="print the policy's JSON Schema (draft 2020-12), for editors and CI"
    )
    schema.add_argument(
        "--faq", action="store_true", help="the schema of an FAQ file (faq.file) instead"
    )
    schema.set_defaults(func=_cmd_schema)

    reload = sub.add_parser(
        "reload",
        help="make a running proxy re-read its policy file (POST /brownout/reload)",
        description=(
            "Make a running proxy re-read its policy file, through POST /brownout/reload "
            "with the admin token (the same as `kill -HUP` on the serve process), and print "
            "what changed or why the new policy was rejected."
        ),
    )
    reload.add_argument("--url", default="http://127.0.0.1:8080", help="the proxy's base URL")
    reload.add_argument(
        "--token",
        default=None,
        help="the policy's server.admin_token (default: $BROWNOUT_ADMIN_TOKEN)",
    )
    reload.add_argument(
        "--timeout", type=float, default=30.0, help="seconds to wait for the answer"
    )
    reload.set_defaults(func=_cmd_reload)

    ACTIONS = ("status", "start", "pause", "resume", "abort", "promote")

    rollout = sub.add_parser(
        "rollout",
        help="show or steer the gray release of backends.candidate (/brownout/rollout)",
        description=(
            "Show the gray release of backends.candidate (state, step and share, gates, "
            "rollback reason and bundles) through GET /brownout/rollout, or act on it "
            'through POST /brownout/rollout {"action": ...} with the admin token: start '
            "(step 1, or the mirror), pause and resume a step, abort (all traffic back on "
            "the primary), promote (all eligible traffic on the candidate now)."
        ),
    )
    rollout.add_argument("action", nargs="?", default="status", choices=ACTIONS, help="what to do")
    rollout.add_argument("--url", default="http://127.0.0.1:8080", help="the proxy's base URL")
    rollout.add_argument(
        "--token",
        default=None,
        help="the policy's server.admin_token (default: $BROWNOUT_ADMIN_TOKEN)",
    )
    rollout.add_argument(
        "--timeout", type=float, default=30.0, help="seconds to wait for the answer"
    )
    rollout.add_argument(
        "--json",
        action="store_true",
        help="print the proxy's JSON answer as it is (errors too) instead of the summary",
    )
    rollout.set_defaults(func=_cmd_rollout)

    replay = sub.add_parser(
        "replay",
        help="replay a flight recording (or a synthetic incident) under a candidate policy",
        description=(
            "Replay the arrivals of a flight recording (recorder.dir, a segment, or a "
            "download of GET /brownout/recording) or of a synthetic scenario on a virtual "
            "clock through Brownout's control code under the candidate policy and a baseline "
            "(default: the policy the trace was recorded with), with the backends simulated "
            "from what the recording saw, and print the two side by side; replaying under "
            "the recorded policy also measures the replay's fidelity to what happened."
        ),
    )
    src = replay.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--trace",
        metavar="PATH",
        default=None,
        help="the recording (default: none; give --trace or --scenario)",
    )
    src.add_argument(
        "--scenario",
        choices=REPLAY_SCENARIOS,
        default=None,
        help="a synthetic incident instead of a recording (default: none)",
    )
    replay.add_argument(
        "--policy", required=True, metavar="CANDIDATE.yaml", help="the policy to try"
    )
    replay.add_argument(
        "--baseline",
        metavar="OTHER.yaml",
        default=None,
        help="the policy to compare with (default: the recorded one; a scenario: the "
        "built-in defaults)",
    )
    replay.add_argument("--json", action="store_true", help="print one JSON object")
    replay.add_argument(
        "--html",
        metavar="FILE",
        default=None,
        help="also write a self-contained HTML report (default: none)",
    )
    replay.add_argument(
        "--fail-on",
        default="",
        metavar="LIST",
        help="exit 1 when the candidate is worse on any of (comma-separated): "
        + ",".join(REPLAY_FAIL_ON),
    )
    replay.add_argument("--seed", type=int, default=0, help="scenario and sporadic-error seed")
    replay.set_defaults(func=_cmd_replay)

    fb = sub.add_parser(
        "fallback-server",
        help="run the Transformers OpenAI-compatible server",
        description="Run the Transformers OpenAI-compatible server on a local model directory.",
    )
    fb.add_argument(
        "--model", required=True, metavar="DIR", help="model directory (local, no hub downloads)"
    )
    fb.add_argument("--host", default="127.0.0.1", help="listen address")
    fb.add_argument("--port", type=int, default=8001, help="listen port")
    fb.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="torch device")
    fb.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "float16", "bfloat16"],
        help="weights dtype",
    )
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
        "--side-slots",
        metavar="N",
        type=int,
        default=2,
        help="batched engine: threads running the requests continuous batching cannot honour "
        "(logprobs, response_format, forced tool calls, logit_bias, penalties, min_tokens); "
        "0: those fields are refused with a 400",
    )
    fb.add_argument(
        "--max-concurrency",
        metavar="N",
        type=int,
        default=None,
        help="generations running at the same time (default: from the device's free memory "
        "and the model's KV size)",
    )
    fb.add_argument(
        "--max-queue",
        metavar="N",
        type=int,
        default=8,
        help="requests waiting for a slot before 429",
    )
    fb.add_argument(
        "--served-model-name",
        metavar="NAME",
        default=None,
        help="the model name in the API (default: the model directory's name)",
    )
    fb.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context window in tokens (default: the model's max_position_embeddings)",
    )
    fb.add_argument(
        "--grammar-workers",
        metavar="N",
        type=int,
        default=2,
        help="threads compiling response_format / forced tool call grammars (xgrammar)",
    )
    fb.add_argument(
        "--grammar-queue",
        metavar="N",
        type=int,
        default=8,
        help="requests waiting for a grammar thread before a 503 with Retry-After",
    )
    fb.add_argument(
        "--grammar-timeout",
        metavar="SECONDS",
        type=float,
        default=5.0,
        help="longest a request waits for its grammar (in line and compiling), then a 503 "
        "with Retry-After; the compile goes on and is cached",
    )
    fb.set_defaults(func=_cmd_fallback_server)

    tiny = sub.add_parser(
        "make-tiny-model",
        help="write a tiny random-weight Llama, offline",
        description="Write a tiny random-weight Llama chat model to DIR, offline (about 3 MB).",
    )
    tiny.add_argument(
        "dir", metavar="DIR", help="where to write it (created; kept if already there)"
    )
    tiny.add_argument(
        "--seed", type=int, default=0, help="seed of the random weights (same seed, same model)"
    )
    tiny.set_defaults(func=_cmd_make_tiny_model)

    # Every subcommand (including ones added above this line later) shows its
    # defaults and its exit codes.
    for name, subparser in sub.choices.items():
        subparser.formatter_class = _HelpFormatter
        if subparser.epilog is None and name in _SUB_EXIT_CODES:
            subparser.epilog = f"exit codes: {_SUB_EXIT_CODES[name]}"
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
