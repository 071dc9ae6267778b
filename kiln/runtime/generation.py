"""Token generation with a package of two entry points (kiln/models/hf_decoder.py):
`prefill` on the prompt, then `decode` one token at a time, each token chosen by libkiln's
`kiln_sample` (greedy, or temperature / top-k / top-p with a seeded generator): the same
function examples/c/generate.c calls, so both give the same tokens for the same seed.

Each entry takes `input_ids` (int64 [1, T]) and `cache_position` (int64 [T]) and returns
logits [1, T, vocab]; the KV cache is the runner's state (reset before each generation)."""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass

import torch

from kiln.errors import InputError, KilnError
from kiln.runtime import dlpack_ctypes as dl
from kiln.runtime.loader import Runner, last_error, libkiln


@dataclass(frozen=True)
class Generation:
    tokens: list[int]        # the new tokens (not the prompt)
    prefill_seconds: float   # the prompt's run, its token chosen
    decode_seconds: float    # every decode step
    decode_steps: int

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_steps / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:  # every new token over the whole time
        total = self.prefill_seconds + self.decode_seconds
        return len(self.tokens) / total if total > 0 else 0.0


class Sampler:
    """kiln_sample with its generator state: temperature <= 0 is greedy."""

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0) -> None:
        self.temperature, self.top_k, self.top_p = float(temperature), int(top_k), float(top_p)
        self._rng = ctypes.c_uint64(seed & (2**64 - 1))
        self._token = ctypes.c_int64()
        self._lib = libkiln()

    def __call__(self, logits: torch.Tensor) -> int:
        """The next token from the last row of `logits` ([..., vocab])."""
        if logits.device.type != "cpu":
            logits = logits.to("cpu")
        shape = (ctypes.c_int64 * logits.dim())(*logits.shape)
        strides = (ctypes.c_int64 * logits.dim())(*logits.stride())
        code = dl.DTYPE_TO_DL.get(logits.dtype)
        if code is None:
            raise InputError(f"sample: unsupported logits dtype {logits.dtype}")
        t = dl.DLTensor(logits.data_ptr(), dl.DLDevice(dl.KDL_CPU, 0), logits.dim(),
                        dl.DLDataType(*code, 1), shape, strides, 0)
        if self._lib.kiln_sample(ctypes.byref(t), self.temperature, self.top_k, self.top_p,
                                 ctypes.byref(self._rng), ctypes.byref(self._token)):
            raise InputError(last_error())
        return int(self._token.value)


def generate(runner: Runner, prompt: list[int], max_new_tokens: int, *,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             stop: int | None = None) -> Generation:
    """Prefill the prompt, then decode up to max_new_tokens tokens (fewer when `stop` is
    generated). The runner's state (the KV cache) is reset first."""
    if not prompt:
        raise InputError("generate: the prompt is empty (give at least one token id)")
    if max_new_tokens < 1:
        raise InputError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens}")
    missing = [e for e in ("prefill", "decode") if e not in runner.entries]
    if missing:
        raise KilnError(f"generate: the package has no entry point {missing[0]!r} (its entry "
                        f"points: {', '.join(runner.entries)}); compile it with "
                        "kiln.models.hf_decoder.export_decoder")
    sample = Sampler(temperature, top_k, top_p, seed)
    prefill, decode = _call(runner.entry("prefill")), _call(runner.entry("decode"))
    runner.reset_state()
    t0 = time.perf_counter()
    logits = prefill(torch.tensor([prompt], dtype=torch.long), torch.arange(len(prompt)))
    tokens = [sample(logits)]
    t1 = time.perf_counter()
    ids, pos = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    while len(tokens) < max_new_tokens and tokens[-1] != stop:
        ids[0, 0], pos[0] = tokens[-1], len(prompt) + len(tokens) - 1
        tokens.append(sample(decode(ids, pos)))
    t2 = time.perf_counter()
    return Generation(tokens, t1 - t0, t2 - t1, len(tokens) - 1)


def _call(entry: Runner):
    """entry(input_ids, cache_position): positionally, or by keyword for programs exported
    with keyword inputs (transformers' wrappers)."""
    names = [i.get("name") for i in entry.input_specs]
    if len(names) != 2:
        raise KilnError(f"generate: entry point {entry!r} takes {len(names)} inputs "
                        f"({', '.join(map(str, names))}); expected input_ids [1, T] and "
                        "cache_position [T]")
    if entry.positional:
        return entry
    a, b = names
    return lambda ids, pos: entry(**{a: ids, b: pos})
