"""Per-request seeded sampling inside Transformers' continuous batching.

Continuous batching samples every row of a batch with one `torch.multinomial`
on the global RNG, so a request's `seed` cannot be honoured by seeding
anything. This processor, last in the batch's logits processor list, picks
the token of each seeded row by the Gumbel-max trick with noise from a
counter-based hash of (seed, token index, vocabulary id), then leaves only
that token finite; the library's multinomial then has nothing left to choose.
Same seed, same prompt, same parameters: same text, whatever else shares the
batch. Rows without a seed are left alone (the library samples them).

It is a `ContinuousBatchingLogitsProcessor`: its per-request argument is one
int32 per row (the hashed key, or -1), prepared on the host each step, and
its device work is plain tensor arithmetic, so it also runs inside CUDA
graphs.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingLogitsProcessor,
)

SEED_KWARG = "brownout_seed"
_MASK32 = 0xFFFFFFFF
_MASK31 = 0x7FFFFFFF


def _mix(x: int) -> int:
    """A 32-bit integer hash (the 'lowbias32' finaliser)."""
    x &= _MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    x ^= x >> 16
    return x


def row_key(seed: int, index: int) -> int:
    """The non-negative 31-bit key of the `index`-th sampled token of a seeded request."""
    return _mix(_mix(seed & _MASK32) ^ _mix((seed >> 32) & _MASK32) ^ _mix(index)) & _MASK31


def _mix_tensor(x: torch.Tensor) -> torch.Tensor:
    # int64 throughout: every product stays below 2**63 (32-bit value times 31-bit constant).
    x = (x ^ (x >> 32)) & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


def gumbel_pick(scores: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Rows with a key >= 0: only the Gumbel-max pick stays finite; other rows unchanged.

    `scores` [rows, vocab] (already warped), `keys` [rows] int64 (`row_key`, or -1).
    """
    vocab = scores.shape[1]
    seeded = keys >= 0
    ids = torch.arange(vocab, device=scores.device, dtype=torch.int64)
    bits = _mix_tensor(keys.clamp(min=0).unsqueeze(-1) * vocab + ids)  # [rows, vocab]
    uniform = ((bits >> 8).to(torch.float32) + 0.5) / float(1 << 24)  # in (0, 1)
    gumbel = -torch.log(-torch.log(uniform))
    choice = torch.argmax(scores.float() + gumbel, dim=-1, keepdim=True)
    only = torch.full_like(scores, float("-inf")).scatter_(1, choice, 0.0)
    return torch.where(seeded.unsqueeze(-1), only, scores)


class SeededGumbelSampler(ContinuousBatchingLogitsProcessor):
    def __init__(self) -> None:
        self.supported_kwargs = {SEED_KWARG: int}
        self.ignored_kwargs = ()
        self._counts: dict[str, int] = {}  # request id -> tokens sampled so far
        self._lock = threading.Lock()

    def forget(self, request_id: str) -> None:
        """The request is over (any thread)."""
        with self._lock:
            self._counts.pop(request_id, None)

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(-1)

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        keys = []
        with self._lock:
            for request in requests_with_new_token:
                state = request.state
                seed = state.logit_processor_kwargs.get(SEED_KWARG)
                if seed is None or seed < 0:
                    keys.append(-1)
                    continue
                index = self._counts.get(state.request_id, 0)
                self._counts[state.request_id] = index + 1
                keys.append(row_key(seed, index))
        return torch.tensor(keys, dtype=torch.int32, device="cpu")

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        return gumbel_pick(scores, tensor_arg[: scores.shape[0]].to(torch.int64))


def install(processors: Any) -> SeededGumbelSampler | None:
    """Append the sampler to a manager's `ContinuousBatchingLogitsProcessorList` (before start).

    Returns None when that list does not look like the one this was written
    against (another Transformers version): seeds are then not honoured and
    the engine says so in its capabilities.
    """
    needed = ("logits_processor", "tensors_required", "supported_keys", "do_processing")
    if not all(hasattr(processors, name) for name in needed):
        return None
    sampler = SeededGumbelSampler()
    processors.logits_processor.append(sampler)
    processors.tensors_required += 1
    processors.supported_keys.update(sampler.supported_kwargs)
    processors.do_processing = True
    return sampler
