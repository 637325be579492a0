"""`knob()`: a policy field that carries its documentation.

Used by every policy dataclass (in `proxy/config.py` and in the modules that
own their part of the policy) so the reference in docs/ is generated from the
code and never drifts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any


def knob(default: Any, doc: str) -> Any:
    """A policy field with its documentation; a dataclass default becomes a factory."""
    if isinstance(default, type) and dataclasses.is_dataclass(default):
        return field(default_factory=default, metadata={"doc": doc})
    if isinstance(default, list | dict | set):
        raise TypeError("policy defaults must be immutable (use a tuple)")
    return field(default=default, metadata={"doc": doc})
