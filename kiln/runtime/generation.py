"""Token generation with a package of two entry points (kiln/models/hf_decoder.py):
`prefill` on the prompt, then `decode` one token at a time, each token chosen by libkiln's
`kiln_sample` (greedy, or temperature / top-k / top-p with a seeded generator): the same
function examples/c/generate.c calls, so both give the same tokens for the same seed.

Each entry takes `input_ids` (int64 [1, T]) and `cache_position` (int64 [T]) and returns
logits [1, T, vocab]; the KV cache is the runner's state (reset before each generation).

On CUDA, a package with a `sample` entry point (kiln/models/device_sampler.py) samples on the
device: its output (the next ids [1, 1] and position [1], device tensors) is the next decode's
input, so a step is a decode (its CUDA graph) and a one-program sampling kernel with no host
synchronisation; the tokens are read back once at the end (each step only when `stop` is
given). Greedy tokens are the host sampler's; a seed gives the same tokens on every run (its
own generator, not the host's)."""

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
    sampling: str = "host"   # where the tokens were chosen: "host" (kiln_sample) or "device"

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
             stop: int | None = None, device_sampling: bool | None = None) -> Generation:
    """Prefill the prompt, then decode up to max_new_tokens tokens (fewer when `stop` is
    generated). The runner's state (the KV cache) is reset first. `device_sampling`: None
    samples on the device when the runner is on CUDA and the package has a `sample` entry
    point, False always on the host, True requires the device sampler."""
    if not prompt:
        raise InputError("generate: the prompt is empty (give at least one token id)")
    if max_new_tokens < 1:
        raise InputError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens}")
    missing = [e for e in ("prefill", "decode") if e not in runner.entries]
    if missing:
        raise KilnError(f"generate: the package has no entry point {missing[0]!r} (its entry "
                        f"points: {', '.join(runner.entries)}); compile it with "
                        "kiln.models.hf_decoder.export_decoder")
    _check_params(temperature, top_k, top_p)
    dev = getattr(runner, "_device", torch.device("cpu"))
    on_device = dev.type == "cuda" and "sample" in runner.entries
    if device_sampling and not on_device:
        raise KilnError("generate: device sampling needs a CUDA runner of a package with a "
                        "'sample' entry point (hf_decoder.export_decoder(..., sampler="
                        f"device_sampler.export_sampler)); this one is on {dev} with entry "
                        f"points {', '.join(runner.entries)}")
    prefill, decode = _call(runner.entry("prefill")), _call(runner.entry("decode"))
    if on_device and device_sampling is not False:
        return _generate_on_device(runner, prefill, decode, prompt, max_new_tokens, dev,
                                   temperature, top_k, top_p, seed, stop)
    sample = Sampler(temperature, top_k, top_p, seed)
    runner.reset_state()
    t0 = time.perf_counter()
    logits = prefill(torch.tensor([prompt], dtype=torch.long, device=dev),
                     torch.arange(len(prompt), device=dev))
    tokens = [sample(logits)]
    t1 = time.perf_counter()
    ids = torch.zeros(1, 1, dtype=torch.long, device=dev)
    pos = torch.zeros(1, dtype=torch.long, device=dev)
    while len(tokens) < max_new_tokens and tokens[-1] != stop:
        ids[0, 0], pos[0] = tokens[-1], len(prompt) + len(tokens) - 1
        tokens.append(sample(decode(ids, pos)))
    t2 = time.perf_counter()
    return Generation(tokens, t1 - t0, t2 - t1, len(tokens) - 1)


def _check_params(temperature: float, top_k: int, top_p: float) -> None:
    if temperature != temperature:
        raise InputError("generate: temperature is NaN")
    if top_k < 0:
        raise InputError(f"generate: top_k must be >= 0 (0: all), got {top_k}")
    if not 0.0 <= top_p <= 1.0:  # NaN too
        raise InputError(f"generate: top_p must be in [0, 1] (0 or 1: all), got {top_p}")


def _generate_on_device(runner: Runner, prefill, decode, prompt: list[int],
                        max_new_tokens: int, dev: torch.device, temperature: float, top_k: int,
                        top_p: float, seed: int, stop: int | None) -> Generation:
    """The loop with the package's `sample` entry point: nothing leaves the device per step
    (one int64 when `stop` is given)."""
    sample = runner.entry("sample")
    s = int(seed) & (2**64 - 1)
    fp = torch.tensor([float(temperature), float(top_p)], dtype=torch.float32, device=dev)
    ip = torch.tensor([int(top_k), s - 2**64 if s >= 2**63 else s], dtype=torch.int64,
                      device=dev)
    runner.reset_state()
    sync = torch.cuda.synchronize
    sync(dev)
    t0 = time.perf_counter()
    pos = torch.arange(len(prompt), device=dev)
    logits = prefill(torch.tensor([prompt], dtype=torch.long, device=dev), pos)
    ids, pos = sample(logits, pos, fp, ip)
    out = [ids]
    stopped = stop is not None and int(ids) == stop
    sync(dev)
    t1 = time.perf_counter()
    while len(out) < max_new_tokens and not stopped:
        ids, pos = sample(decode(ids, pos), pos, fp, ip)
        out.append(ids)
        stopped = stop is not None and int(ids) == stop  # one read back per step
    tokens = torch.cat(out).reshape(-1).tolist()  # synchronises
    t2 = time.perf_counter()
    return Generation(tokens, t1 - t0, t2 - t1, len(tokens) - 1, "device")


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


@dataclass(frozen=True)
class BatchGeneration:
    """Generation of several prompts together (a batched package: generate_batch)."""
    tokens: list[list[int]]  # the new tokens of each prompt, in the prompts' order
    prefill_seconds: float   # the padded prompts' run, the first tokens chosen
    decode_seconds: float    # every decode step
    decode_steps: int        # batched steps (each gives one token per sequence)
    batch: int               # the package's batch (rows past len(tokens) were padding)

    @property
    def decode_tokens_per_s(self) -> float:
        """New tokens of the real sequences from the decode steps, per second."""
        n = sum(max(len(t) - 1, 0) for t in self.tokens)
        return n / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        total = self.prefill_seconds + self.decode_seconds
        return sum(map(len, self.tokens)) / total if total > 0 else 0.0


def is_batched(runner: Runner) -> bool:
    """Whether `runner` is a batched package (kiln.models.batched_decoder.export_batched):
    its prefill takes (input_ids [B, T], lengths [B])."""
    if "prefill" not in runner.entries:
        return False
    return [s.get("name") for s in runner.entry("prefill").input_specs] == \
        ["input_ids", "lengths"]


def batched_shape(runner: Runner) -> tuple[int, int]:
    """(batch, cache length) of a batched package (kiln.models.batched_decoder): the batch
    from decode's input_ids [B, 1], the cache length from its state [B, kv, L, head_dim]."""
    missing = [e for e in ("prefill", "decode") if e not in runner.entries]
    if missing:
        raise KilnError(f"generate_batch: the package has no entry point {missing[0]!r} (its "
                        f"entry points: {', '.join(runner.entries)}); compile it with "
                        "kiln.models.batched_decoder.export_batched")
    specs = runner.entry("decode").input_specs
    shape = specs[0].get("shape") if len(specs) == 2 else None
    if not shape or len(shape) != 2 or shape[1] != 1 or not isinstance(shape[0], int):
        raise KilnError("generate_batch: the decode entry point takes "
                        f"{[(s.get('name'), s.get('shape')) for s in specs]}; expected "
                        "input_ids [B, 1] and positions [B] (kiln.models.batched_decoder)")
    caches = [t for t in runner.state().values() if t.dim() == 4 and t.shape[0] == shape[0]]
    if not caches:
        raise KilnError("generate_batch: the package has no KV-cache state of shape "
                        f"[{shape[0]}, kv_heads, max_len, head_dim]")
    return int(shape[0]), int(caches[0].shape[2])


def generate_batch(runner: Runner, prompts: list[list[int]], max_new_tokens: int, *,
                   temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                   seed: int = 0, stop: int | None = None) -> BatchGeneration:
    """Generate up to max_new_tokens tokens for each of `prompts` (of any lengths, at most the
    package's batch of them) with a batched package (kiln.models.batched_decoder): one
    prefill of the padded prompts, then decode steps of the whole batch, each sequence at its
    own position. Sequence b samples with its own generator (seed + b); a sequence that
    generates `stop` ends there (the batch runs on while others have not). Rows past
    len(prompts) run a one-token dummy prompt whose tokens are dropped. The runner's state is
    reset first."""
    batch, max_len = batched_shape(runner)
    dev = getattr(runner, "_device", torch.device("cpu"))
    return batched_loop(_call(runner.entry("prefill")), _call(runner.entry("decode")),
                        runner.reset_state, batch, max_len, dev, prompts, max_new_tokens,
                        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                        stop=stop)


def batched_loop(prefill, decode, reset, batch: int, max_len: int, dev: torch.device,
                 prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 stop: int | None = None) -> BatchGeneration:
    """generate_batch's loop over any prefill(ids [B, T], lengths [B]) -> logits [B, V] and
    decode(ids [B, 1], positions [B]) -> logits [B, V] (the eager module's too)."""
    if not prompts or any(not p for p in prompts):
        raise InputError("generate_batch: give at least one prompt, each of at least one "
                         "token id")
    if len(prompts) > batch:
        raise InputError(f"generate_batch: {len(prompts)} prompts for a package of batch "
                         f"{batch}; give at most {batch} (or compile a larger batch)")
    if max_new_tokens < 1:
        raise InputError(f"generate_batch: max_new_tokens must be >= 1, got {max_new_tokens}")
    longest = max(map(len, prompts))
    if longest + max_new_tokens - 1 > max_len:
        raise InputError(f"generate_batch: a prompt of {longest} tokens and {max_new_tokens} "
                         f"new tokens need {longest + max_new_tokens - 1} cache positions; the "
                         f"package's cache holds {max_len}")
    _check_params(temperature, top_k, top_p)
    rows = [list(map(int, p)) for p in prompts] + [[0]] * (batch - len(prompts))
    samplers = [Sampler(temperature, top_k, top_p, seed + b) for b in range(batch)]
    lens = [len(p) for p in rows]
    ids = torch.tensor([p + [0] * (longest - len(p)) for p in rows], dtype=torch.long,
                       device=dev)
    reset()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda _d: None)
    sync(dev)
    t0 = time.perf_counter()
    logits = prefill(ids, torch.tensor(lens, dtype=torch.long, device=dev)).to("cpu")
    out = [[samplers[b](logits[b])] for b in range(batch)]
    t1 = time.perf_counter()
    done = [stop is not None and o[-1] == stop for o in out]
    step_ids = torch.zeros(batch, 1, dtype=torch.long)
    pos = torch.tensor(lens, dtype=torch.long)
    steps = 0
    while steps < max_new_tokens - 1 and not all(done[:len(prompts)]):
        for b in range(batch):
            step_ids[b, 0] = out[b][-1]
        logits = decode(step_ids.to(dev), pos.to(dev)).to("cpu")
        pos += 1
        steps += 1
        for b in range(batch):
            if not done[b]:
                out[b].append(samplers[b](logits[b]))
                done[b] = stop is not None and out[b][-1] == stop
    sync(dev)
    t2 = time.perf_counter()
    return BatchGeneration(out[:len(prompts)], t1 - t0, t2 - t1, steps, batch)
