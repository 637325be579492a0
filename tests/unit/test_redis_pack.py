"""The session scripts' EVALSHAs are packed by hiredis: the same bytes as
redis-py's packer, which still takes what hiredis refuses."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio.connection import Connection

from proxy.sessions import redisbatch
from proxy.sessions.redisbatch import pack


def redis_py(commands: list[tuple[Any, ...]]) -> bytes:
    conn = Connection()
    conn._command_packer = None  # redis-py's own Python packer
    return b"".join(conn.pack_commands(commands))


COMMANDS: list[tuple[Any, ...]] = [
    ("EVALSHA", "f" * 40, 2, "brownout:session:abc", "client-1", 86400, 1764900000, 0),
    (
        "EVALSHA",
        "e" * 40,
        2,
        "k",
        "k",
        b'[{"role":"user","content":"h\xc3\xa9"}]',
        20,
        60,
        1,
        b"[7]",
        3,
    ),
    ("EVALSHA", "e" * 40, 1, "k", b"\xed\xa0\x80 wtf-8 bytes stay as they are", -1),
]


def refused(commands: list[tuple[Any, ...]]) -> list[bytes]:
    raise AssertionError("hiredis refused a command it packs")


def test_hiredis_packs_the_bytes_redis_py_packs() -> None:
    assert redisbatch.hiredis_pack is not None  # a dependency: `redis[hiredis]`
    assert pack(COMMANDS, refused) == redis_py(COMMANDS)


def test_text_hiredis_refuses_takes_redis_py_packer() -> None:
    lone = ("EVALSHA", "f" * 40, 1, "prefix-\udc80:k", 5)
    used: list[int] = []

    def fallback(commands: list[tuple[Any, ...]]) -> list[bytes]:
        used.append(len(commands))
        return [b"packed by redis-py"]

    assert pack([COMMANDS[0], lone], fallback) == b"packed by redis-py"
    assert used == [2]


def test_without_hiredis_redis_py_packs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redisbatch, "hiredis_pack", None)
    assert pack(COMMANDS, lambda c: [redis_py(c)]) == redis_py(COMMANDS)
