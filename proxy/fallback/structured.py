"""Constrained decoding with xgrammar (vLLM's structured-output backend).

`Structured` holds one model's xgrammar tokenizer info and grammar compiler;
`processors(output)` compiles what a request asks for — `response_format`
json_object / json_schema or a forced tool call — into factories
of per-generation Transformers logits processors (`GenerationSpec.
logits_processors`). Compiling runs on its own thread (`compile`), never on
the event loop nor on the tokenizer thread: a deep schema can take seconds
to compile, and plain requests must not wait behind it. A schema xgrammar
cannot compile is the request's fault (400).

A forced tool call (tool_choice "required" or a named function) is the
grammar `<tool_call>\\n{"name": <one of the names>, "arguments": <its
parameters schema>}\\n</tool_call>`, so even a random-weight model emits a
call that parses. Whitespace is fixed (`any_whitespace=False`): a model
cannot wander off into endless blanks inside the JSON.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import xgrammar as xgr
from xgrammar.contrib.hf import LogitsProcessor as GrammarProcessor

from proxy.fallback.errors import APIError, invalid
from proxy.fallback.interface import LogitsProcessorFactory
from proxy.fallback.protocol import Output, Tool, ToolUse
from proxy.fallback.tools import CLOSE, OPEN


def _call_schema(tool: Tool) -> dict[str, Any]:
    parameters = json.loads(tool.parameters) if tool.parameters else {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_call_schema(tool_use: ToolUse) -> dict[str, Any]:
    """The JSON Schema of one call of the forced function (or of any offered one)."""
    tools = [t for t in tool_use.tools if tool_use.forced in (None, t.name)]
    if len(tools) == 1:
        return _call_schema(tools[0])
    return {"anyOf": [_call_schema(t) for t in tools]}


_CACHE_BYTES = 64 * 1024 * 1024


class Structured:
    """xgrammar for one model's vocabulary."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # Compiled grammars are cached by schema; bounded, as clients may send many.
        self._compiler = xgr.GrammarCompiler(
            self._info, max_threads=1, cache_limit_bytes=_CACHE_BYTES
        )
        self.vocab_size = vocab_size
        #: Each token id's raw bytes (what OpenAI's logprobs `bytes` are).
        self.token_bytes: tuple[bytes, ...] = tuple(self._info.decoded_vocab)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")

    async def compile(self, output: Output) -> tuple[LogitsProcessorFactory, ...]:
        """`processors(output)` on the grammar thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.processors, output)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    # --- compiling (grammar thread) --------------------------------------------------------

    def processors(self, output: Output) -> tuple[LogitsProcessorFactory, ...]:
        """The grammar processor the output needs, if any (compiled now)."""
        grammar = self._grammar(output)
        return () if grammar is None else (partial(GrammarProcessor, grammar),)

    def _grammar(self, output: Output) -> xgr.CompiledGrammar | None:
        if output.tool_use.constrained:
            schema = json.dumps(tool_call_schema(output.tool_use))
            try:
                return self._compiler.compile_grammar(
                    xgr.Grammar.concat(
                        _literal(OPEN + "\n"),
                        xgr.Grammar.from_json_schema(schema, any_whitespace=False),
                        _literal("\n" + CLOSE),
                    )
                )
            except RuntimeError as exc:
                raise _schema_error("tools", exc) from exc
        fmt = output.response_format
        if fmt.kind == "json_object":
            # OpenAI's JSON mode answers an object, not any JSON value.
            return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if fmt.kind == "json_schema":
            try:
                return self._compiler.compile_json_schema(
                    fmt.schema or "{}", any_whitespace=False, strict_mode=True
                )
            except RuntimeError as exc:
                raise _schema_error("response_format", exc) from exc
        return None


def _literal(text: str) -> xgr.Grammar:
    return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")


def _schema_error(param: str, exc: Exception) -> APIError:
    detail = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    # xgrammar prefixes its C++ source location: keep only the message.
    detail = detail.split(": ", 1)[-1] if ".cc:" in detail else detail
    return invalid(f"The JSON schema cannot be used for constrained decoding: {detail}", param)
