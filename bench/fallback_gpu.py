"""The fallback server's engines side by side on one device (issue 15's table).

Generates a random-weight Llama of a given shape on the spot (the tiny
model's tokenizer, `proxy.tinymodel`), then, per server configuration,
starts `brownout fallback-server`, drives 1 / 8 / 32 / 128 concurrent
streaming chat requests of `--tokens` tokens with `ignore_eos`, and measures
aggregate tok/s (content chunks per second over all streams), TTFT p50/p95
(from each request's send) and 503s. Then the library's ceiling: in-process
`generate_batch` on the same prompts. Prints one markdown table and writes it
(and the raw numbers) to `--out`.

    python bench/fallback_gpu.py --out $OUT                       # the GPU run
    python bench/fallback_gpu.py --device cpu --dtype float32 --tiny --streams 1,2 --tokens 16
    python bench/fallback_gpu.py --out $OUT --mixed              # the side lane under load

`--mixed`: the default server only, plain streams with and without side-lane
streams at once, and the side-lane features checked (see `fallback_mixed`).

Run on the device machine (see bench/results/fallback-gpu.md for the command).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fallback_mixed

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Shape:
    hidden: int = 2048
    layers: int = 16
    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 128
    intermediate: int = 5632
    max_positions: int = 2048


TINY = Shape(hidden=128, layers=2, heads=2, kv_heads=1, head_dim=64, intermediate=256)


@dataclass(frozen=True)
class ServerConfig:
    label: str
    args: tuple[str, ...]
    max_streams: int  # higher levels are skipped (a thread per slot would take minutes)
    switch_interval_ms: float | None = None  # the interpreter's GIL switch interval


@dataclass
class Level:
    streams: int
    tok_s: float = 0.0
    ttft_p50: float | None = None
    ttft_p95: float | None = None
    rejected: int = 0
    errors: int = 0
    seconds: float = 0.0
    note: str = ""


@dataclass
class Row:
    label: str
    levels: dict[int, Level] = field(default_factory=dict)
    startup_s: float = 0.0
    capacity: str = ""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- the model ---------------------------------------------------------------------------


def make_model(dest: Path, shape: Shape, device: str, dtype: str) -> Path:
    """A random-weight Llama of `shape` with the tiny model's tokenizer, written to `dest`."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from proxy.tinymodel import MARKER_FILE, write_tiny_model

    started = time.monotonic()
    tiny = write_tiny_model(dest.parent / "tiny-tokenizer")
    dest.mkdir(parents=True, exist_ok=True)
    weights = {"config.json", "generation_config.json", "model.safetensors", MARKER_FILE}
    for name in os.listdir(tiny):
        if name not in weights:  # the tokenizer's files and the chat template
            shutil.copy(tiny / name, dest / name)
    tiny_config = json.loads((tiny / "config.json").read_text())
    config = LlamaConfig(
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        vocab_size=tiny_config["vocab_size"],
        max_position_embeddings=shape.max_positions,
        bos_token_id=tiny_config["bos_token_id"],
        eos_token_id=tiny_config["eos_token_id"],
        pad_token_id=tiny_config["pad_token_id"],
        tie_word_embeddings=False,
    )
    torch_dtype = getattr(torch, dtype)
    config.dtype = torch_dtype
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch_dtype)
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(str(dest), safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    log(f"model: {params / 1e9:.2f} B parameters, {shape}, in {time.monotonic() - started:.0f} s")
    return dest


# --- load against a server ---------------------------------------------------------------


def _body(i: int, tokens: int) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": f"Tell me story number {i} about a fox."}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }


async def _one_stream(
    session: aiohttp.ClientSession, url: str, i: int, tokens: int
) -> tuple[str, float | None, int, float]:
    """(outcome, ttft, content chunks, end time)."""
    sent = time.monotonic()
    ttft: float | None = None
    chunks = 0
    async with session.post(url, json=_body(i, tokens)) as resp:
        if resp.status == 503:
            await resp.read()
            return "503", None, 0, time.monotonic()
        if resp.status != 200:
            await resp.read()
            return f"http {resp.status}", None, 0, time.monotonic()
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            if b'"error"' in line[:16]:
                return "stream error", ttft, chunks, time.monotonic()
            if b'"content":"' in line and b'"role"' not in line:
                if ttft is None:
                    ttft = time.monotonic() - sent
                chunks += 1
    return "ok", ttft, chunks, time.monotonic()


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


async def drive(base: str, streams: int, tokens: int) -> Level:
    timeout = aiohttp.ClientTimeout(total=900)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        url = base + "/v1/chat/completions"
        started = time.monotonic()
        results = await asyncio.gather(
            *(_one_stream(session, url, i, tokens) for i in range(streams))
        )
    ended = max(r[3] for r in results)
    total = sum(r[2] for r in results)
    ttfts = [r[1] for r in results if r[0] == "ok" and r[1] is not None]
    level = Level(streams=streams, seconds=ended - started)
    level.tok_s = total / (ended - started) if ended > started else 0.0
    level.ttft_p50, level.ttft_p95 = _pct(ttfts, 50), _pct(ttfts, 95)
    level.rejected = sum(1 for r in results if r[0] == "503")
    level.errors = sum(1 for r in results if r[0] not in ("ok", "503"))
    return level


def start_server(
    model: Path, config: ServerConfig, port: int, device: str, dtype: str, logf: Any
) -> subprocess.Popen[bytes]:
    entry = ["-m", "proxy.cli"]
    if config.switch_interval_ms is not None:
        seconds = config.switch_interval_ms / 1000
        code = f"import sys; sys.setswitchinterval({seconds}); from proxy.cli import main; "
        entry = ["-c", code + "sys.argv[0] = 'brownout'; sys.exit(main())"]
    cmd = [
        sys.executable, *entry, "fallback-server", "--model", str(model),
        "--port", str(port), "--device", device, "--dtype", dtype, *config.args,
    ]  # fmt: skip
    logf.write(f"\n===== {config.label}: {' '.join(cmd)}\n".encode())
    logf.flush()
    return subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, cwd=ROOT)


async def wait_healthy(base: str, proc: subprocess.Popen[bytes], limit_s: float = 600) -> None:
    deadline = time.monotonic() + limit_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                async with session.get(base + "/health") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError("server did not become healthy")


def _capacity_line(log_path: Path, offset: int) -> str:
    with log_path.open("rb") as f:
        f.seek(offset)
        for raw in f:
            if b'"event":"capacity"' in raw:
                data = json.loads(raw)
                return f"{data['engine']}, max_running {data['max_running']}"
    return ""


def run_server(
    model: Path, config: ServerConfig, levels: list[int], args: argparse.Namespace, log_path: Path
) -> Row:
    row = Row(config.label)
    port = 18000 + abs(hash(config.label)) % 1000
    base = f"http://127.0.0.1:{port}"
    with log_path.open("ab") as logf:
        offset = logf.tell()
        started = time.monotonic()
        proc = start_server(model, config, port, args.device, args.dtype, logf)
        try:
            asyncio.run(wait_healthy(base, proc))
            row.startup_s = time.monotonic() - started
            row.capacity = _capacity_line(log_path, offset)
            log(f"{config.label}: up in {row.startup_s:.0f} s ({row.capacity})")
            asyncio.run(drive(base, 2, 4))  # warm the path (first CUDA kernels, allocator)
            for n in levels:
                if n > config.max_streams:
                    row.levels[n] = Level(streams=n, note="—")
                    continue
                if past_deadline(args):
                    row.levels[n] = Level(streams=n, note="not run (time)")
                    continue
                level = asyncio.run(drive(base, n, args.tokens))
                row.levels[n] = level
                log(f"{config.label} x{n}: {_fmt_level(level)} in {level.seconds:.1f} s")
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return row


def _log_event(log_path: Path, offset: int, event: str) -> dict[str, Any]:
    with log_path.open("rb") as f:
        f.seek(offset)
        for raw in f:
            if f'"event":"{event}"'.encode() in raw:
                data: dict[str, Any] = json.loads(raw)
                return data
    return {}


def run_mixed(model: Path, config: ServerConfig, args: argparse.Namespace, log_path: Path) -> str:
    """`--mixed`: the side lane under load against one server (see `fallback_mixed`)."""
    port = 18000 + abs(hash(config.label)) % 1000
    base = f"http://127.0.0.1:{port}"
    levels = [int(s) for s in args.mixed_streams.split(",")]
    with log_path.open("ab") as logf:
        offset = logf.tell()
        started = time.monotonic()
        proc = start_server(model, config, port, args.device, args.dtype, logf)
        try:
            asyncio.run(wait_healthy(base, proc))
            engine = _log_event(log_path, offset, "batched_engine")
            head = (
                f"Server: {config.label}, up in {time.monotonic() - started:.0f} s "
                f"({_capacity_line(log_path, offset)}; side_slots {engine.get('side_slots')}, "
                f"attention {engine.get('attention')!r}).\n\n"
            )
            log(head.strip())
            md = asyncio.run(
                fallback_mixed.run(base, levels, args.tokens, args.mixed_repeat, args.deadline)
            )
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    with log_path.open("rb") as f:
        f.seek(offset)
        failures = sum(1 for raw in f if b"generation_failed" in raw or b"Traceback" in raw)
    return head + md + f"- server log: {failures} generation failures / tracebacks\n"


# --- the library's ceiling ---------------------------------------------------------------


INPROC_VARIANTS = {
    "defaults": "Transformers in process, `generate_batch` (library defaults)",
    "server": "Transformers in process, one CB manager (the server's cache sizing)",
    "graphs": "Transformers in process, one CB manager (server sizing + CUDA graphs)",
}


def run_generate_batch(
    model_dir: Path, levels: list[int], args: argparse.Namespace, variants: list[str]
) -> list[Row]:
    """In-process `generate_batch` on the same chat prompts: the library's ceiling."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from proxy.fallback.engines import capacity

    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=getattr(torch, args.dtype), attn_implementation="sdpa"
    ).to(args.device)
    model.eval()
    load_s = time.monotonic() - started
    # What `fallback-server --engine batched` plans on this device for this model.
    planned = capacity.plan(
        engine="batched",
        device=args.device,
        free_bytes=capacity.free_memory(model.device),
        kv_bytes_per_token=capacity.kv_bytes_per_token(model.config, model.dtype),
        max_model_len=model.config.max_position_embeddings,
        override=None,
    )
    sized: dict[str, Any] = {
        "num_blocks": -(-planned.kv_tokens // 256),
        "max_batch_tokens": planned.max_batch_tokens,
        "max_requests_per_batch": planned.max_running,
    }
    configs: dict[str, ContinuousBatchingConfig | None] = {
        "defaults": None,
        "server": ContinuousBatchingConfig(**sized),
        "graphs": ContinuousBatchingConfig(**sized, use_cuda_graph=True),
    }

    def prompts(n: int) -> list[list[int]]:
        out = []
        for i in range(n):
            text = tokenizer.apply_chat_template(
                _body(i, args.tokens)["messages"], tokenize=False, add_generation_prompt=True
            )
            out.append(tokenizer.encode(text, add_special_tokens=False))
        return out

    gen = GenerationConfig(  # type: ignore[no-untyped-call]
        do_sample=False, max_new_tokens=args.tokens, eos_token_id=-1, pad_token_id=0
    )
    rows = []
    for variant in variants:
        row = Row(INPROC_VARIANTS[variant], startup_s=load_s)
        rows.append(row)
        cb = configs[variant]
        try:
            with torch.inference_mode():
                if cb is None:  # the library's own entry point, sized per call
                    run = partial(_generate_batch_once, model, gen)
                    run(prompts(2))  # warm
                else:  # one manager kept running, as the server keeps its one
                    manager = model.init_continuous_batching(
                        generation_config=gen, continuous_batching_config=cb
                    )
                    manager.warmup()
                    manager.start()
                    run = partial(_manager_once, manager)
                    run(prompts(2))  # warm
                for n in levels:
                    if past_deadline(args):
                        row.levels[n] = Level(streams=n, note="not run (time)")
                        continue
                    level = run(prompts(n))
                    row.levels[n] = level
                    log(
                        f"in process [{variant}] x{n}: {_fmt_level(level)} in {level.seconds:.1f} s"
                    )
                if cb is not None:
                    manager.stop(block=True, timeout=30)
        except Exception as exc:  # a variant that fails must not lose the others
            log(f"in process [{variant}] failed: {type(exc).__name__}: {exc}")
            row.capacity = f"failed: {type(exc).__name__}"
        model.destroy_cached_continuous_batching_manager()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    del model
    return rows


def _level_of(outputs: list[Any], wall: float) -> Level:
    tokens = sum(len(o.generated_tokens) for o in outputs)
    ttfts = [o.timestamps[0] - o.created_time for o in outputs if o.timestamps]
    level = Level(streams=len(outputs), tok_s=tokens / wall, seconds=wall)
    level.ttft_p50, level.ttft_p95 = _pct(ttfts, 50), _pct(ttfts, 95)
    return level


def _generate_batch_once(model: Any, gen: Any, batch: list[list[int]]) -> Level:
    t0 = time.perf_counter()
    outputs = model.generate_batch(
        batch, generation_config=gen, record_timestamps=True, progress_bar=False
    )
    return _level_of(list(outputs.values()), time.perf_counter() - t0)


def _manager_once(manager: Any, batch: list[list[int]]) -> Level:
    t0 = time.perf_counter()
    ids = set(manager.add_requests(inputs=batch, record_timestamps=True))
    outputs = []
    while ids:
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("the generation loop stopped")
            continue
        if result.request_id in ids and result.is_finished():
            ids.discard(result.request_id)
            outputs.append(result)
    return _level_of(outputs, time.perf_counter() - t0)


def past_deadline(args: argparse.Namespace) -> bool:
    return bool(time.monotonic() > args.deadline)


# --- the table ---------------------------------------------------------------------------


def _fmt_level(level: Level) -> str:
    if level.note:
        return level.note
    parts = [f"{level.tok_s:,.0f} tok/s"]
    if level.ttft_p50 is not None and level.ttft_p95 is not None:
        parts.append(f"TTFT p50 {level.ttft_p50:.2f} s / p95 {level.ttft_p95:.2f} s")
    if level.rejected:
        parts.append(f"{level.rejected}× 503")
    if level.errors:
        parts.append(f"{level.errors} errors")
    return ", ".join(parts)


def table(rows: list[Row], levels: list[int]) -> str:
    head = "| server / engine | " + " | ".join(f"{n} stream{'s' if n > 1 else ''}" for n in levels)
    lines = [head + " |", "|---" * (len(levels) + 1) + "|"]
    for row in rows:
        label = row.label + (f" ({row.capacity})" if row.capacity else "")
        cells = [_fmt_level(row.levels[n]) if n in row.levels else "—" for n in levels]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")))
    p.add_argument("--work", type=Path, default=Path("/tmp/brownout-fallback-bench"))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--tiny", action="store_true", help="the tiny shape (a CPU shake-out)")
    for name, default in asdict(Shape()).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    p.add_argument("--streams", default="1,8,32,128")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads-max-streams", type=int, default=32)
    p.add_argument(
        "--only",
        default="batched,graphs,defaults,old,threads,nographs,server",
        help="rows to run, in this order (server engines: old, threads, batched, nographs; "
        "in-process generate_batch: defaults, server, graphs)",
    )
    p.add_argument("--budget-s", type=float, default=540, help="start no level after this")
    p.add_argument("--mixed", action="store_true", help="the side lane under load, instead")
    p.add_argument("--mixed-streams", default="32,128", help="plain streams beside 4 side")
    p.add_argument("--mixed-repeat", type=int, default=2, help="alone/mixed pairs per level")
    p.add_argument("--side-slots", type=int, help="the server's --side-slots (default: its own)")
    args = p.parse_args()
    args.deadline = time.monotonic() + args.budget_s
    levels = [int(s) for s in args.streams.split(",")]
    shape = TINY if args.tiny else Shape(**{k: getattr(args, k) for k in asdict(Shape())})
    args.out.mkdir(parents=True, exist_ok=True)
    log_path = args.out / "servers.log"
    log_path.unlink(missing_ok=True)
    model = make_model(args.work / "model", shape, args.device, args.dtype)

    # Every server gets a queue long enough for the largest level: 503s then mean a
    # capacity limit, not a short queue.
    mixed_most = max(int(n) for n in args.mixed_streams.split(",")) + 4 if args.mixed else 0
    queue = ("--max-queue", str(max(*levels, mixed_most)))
    configs = {
        "old": ServerConfig(
            "`fallback-server` as on main (threads, `--max-concurrency 1`)",
            ("--engine", "threads", "--max-concurrency", "1", *queue),
            args.threads_max_streams,
        ),
        "threads": ServerConfig(
            "`fallback-server --engine threads` (capacity from the device)",
            ("--engine", "threads", *queue),
            args.threads_max_streams,
        ),
        "batched": ServerConfig(
            "`fallback-server` default on cuda (`--engine auto` = batched, CUDA graphs)",
            ("--engine", "auto" if args.device == "cuda" else "batched", *queue),
            max(levels),
        ),
        "nographs": ServerConfig(
            "`fallback-server --engine batched --cuda-graphs off`",
            ("--engine", "batched", "--cuda-graphs", "off", *queue),
            max(levels),
        ),
    }
    if args.mixed:
        config = configs["batched"]
        if args.side_slots is not None:
            extra = ("--side-slots", str(args.side_slots))
            config = replace(config, label=f"{config.label} `--side-slots {args.side_slots}`")
            config = replace(config, args=(*config.args, *extra))
        md = run_mixed(model, config, args, log_path)
        md = (
            f"Model: random-weight Llama {shape} in {args.dtype} on {args.device}; plain: "
            f"streaming chat, {args.tokens} tokens, ignore_eos, temperature 0.\n\n" + md
        )
        (args.out / "fallback-mixed.md").write_text(md)
        print("\n" + md, flush=True)
        return 0 if "all checks: PASS" in md else 1
    wanted = args.only.split(",")
    done: dict[str, Row] = {}
    order = ["old", "threads", "nographs", "batched", *INPROC_VARIANTS]

    def write() -> None:
        rows = [done[k] for k in order if k in done]
        summary = (
            f"Model: random-weight Llama {shape} in {args.dtype} on {args.device}, "
            f"the tiny model's tokenizer; streaming chat, {args.tokens} tokens, ignore_eos, "
            f"temperature 0. tok/s = content chunks per second, all streams together.\n"
        )
        md = summary + "\n" + table(rows, levels) + "\n"
        (args.out / "fallback-gpu.md").write_text(md)
        raw = [{"label": r.label, "startup_s": r.startup_s, "capacity": r.capacity,
                "levels": {n: asdict(lv) for n, lv in r.levels.items()}} for r in rows]  # fmt: skip
        (args.out / "fallback-gpu.json").write_text(json.dumps(raw, indent=2) + "\n")
        print("\n" + md, flush=True)

    # batched-si<ms>: the batched default with another GIL switch interval (default 5 ms).
    for key in wanted:
        if key.startswith("batched-si"):
            ms = float(key.removeprefix("batched-si"))
            base = configs["batched"]
            label = f"{base.label}, GIL switch interval {ms:g} ms"
            configs[key] = ServerConfig(label, base.args, base.max_streams, ms)
            order.insert(order.index("batched") + 1, key)
    inproc = [k for k in wanted if k in INPROC_VARIANTS]
    for key in wanted:
        if key in configs:
            try:
                done[key] = run_server(model, configs[key], levels, args, log_path)
            except Exception as exc:
                log(f"{key} failed: {type(exc).__name__}: {exc}")
                done[key] = Row(configs[key].label, capacity=f"failed: {type(exc).__name__}")
            write()
        elif key in inproc and key == inproc[0]:
            for variant, row in zip(
                inproc, run_generate_batch(model, levels, args, inproc), strict=True
            ):
                done[variant] = row
            write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
