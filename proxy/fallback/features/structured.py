"""Constrained decoding with xgrammar (vLLM's structured-output backend).

`Structured` holds one model's xgrammar tokenizer info and grammar compiler;
`compile(output)` turns what a request asks for — `response_format`
json_object / json_schema or a forced tool call — into factories of
per-generation Transformers logits processors (`GenerationSpec.
logits_processors`). Compiles go through the grammar lane (`grammarlane`:
a bounded pool and line, a deadline, an LRU cache keyed by the schema's
JSON), never on the event loop nor on the tokenizer thread. A schema over
the static limits (`schemalimits`) was refused at parsing; one xgrammar
cannot compile is the request's fault (400).

A forced tool call (tool_choice "required" or a named function) is the
grammar `<tool_call>\\n{"name": <one of the names>, "arguments": <its
parameters schema>}\\n</tool_call>`, so even a random-weight model emits a
call that parses. Whitespace is fixed (`any_whitespace=False`): a model
cannot wander off into endless blanks inside the JSON.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any, Literal

import xgrammar as xgr
from xgrammar.contrib.hf import LogitsProcessor as GrammarProcessor

from proxy.fallback.api.errors import APIError, invalid
from proxy.fallback.engines.interface import LogitsProcessorFactory
from proxy.fallback.features.grammarlane import GrammarLane, LaneLimits
from proxy.fallback.features.tools import CLOSE, OPEN
from proxy.fallback.protocol import Output, Tool, ToolUse


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


GrammarKind = Literal["json_object", "json_schema", "tool_call"]
#: What is compiled: the kind and the schema's compact JSON text (the cache key).
GrammarKey = tuple[GrammarKind, str]


def grammar_key(output: Output) -> GrammarKey | None:
    """The cache key of the grammar `output` needs; None for none."""
    if output.tool_use.constrained:
        return "tool_call", json.dumps(tool_call_schema(output.tool_use), separators=(",", ":"))
    fmt = output.response_format
    if fmt.kind == "json_object":
        return "json_object", ""
    if fmt.kind == "json_schema":
        return "json_schema", fmt.schema or "{}"
    return None


class Structured:
    """xgrammar for one model's vocabulary."""

    def __init__(self, tokenizer: Any, vocab_size: int, limits: LaneLimits | None = None) -> None:
        self._info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # The lane caches compiled grammars; xgrammar's own cache would only double them.
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)
        self.vocab_size = vocab_size
        #: Each token id's raw bytes (what OpenAI's logprobs `bytes` are).
        self.token_bytes: tuple[bytes, ...] = tuple(self._info.decoded_vocab)
        self.lane: GrammarLane[GrammarKey, xgr.CompiledGrammar] = GrammarLane(
            self._grammar, limits or LaneLimits()
        )

    async def compile(self, output: Output) -> tuple[LogitsProcessorFactory, ...]:
        """The grammar processor `output` needs, if any, through the lane.

        Raises `LaneFull` / `CompileTimeout` (load: 503) or a 400 `APIError`.
        """
        key = grammar_key(output)
        if key is None:
            return ()
        grammar = await self.lane.get(key)
        return (partial(GrammarProcessor, grammar),)

    def shutdown(self) -> None:
        self.lane.shutdown()

    # --- compiling (a grammar thread) ------------------------------------------------------

    def processors(self, output: Output) -> tuple[LogitsProcessorFactory, ...]:
        """The grammar processor the output needs, if any, compiled now on this thread."""
        key = grammar_key(output)
        return () if key is None else (partial(GrammarProcessor, self._grammar(key)),)

    def _grammar(self, key: GrammarKey) -> xgr.CompiledGrammar:
        kind, schema = key
        if kind == "tool_call":
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
        if kind == "json_object":
            # OpenAI's JSON mode answers an object, not any JSON value.
            return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        try:
            return self._compiler.compile_json_schema(
                schema, any_whitespace=False, strict_mode=True
            )
        except RuntimeError as exc:
            raise _schema_error("response_format", exc) from exc


def _literal(text: str) -> xgr.Grammar:
    return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")


def _schema_error(param: str, exc: Exception) -> APIError:
    detail = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    # xgrammar prefixes its C++ source location: keep only the message.
    detail = detail.split(": ", 1)[-1] if ".cc:" in detail else detail
    return invalid(f"The JSON schema cannot be used for constrained decoding: {detail}", param)
