"""User Triton kernels (Loop IR `UserKernel`) -> launch descriptions and cubins, ahead of time.

Input: a `UserKernel` step, the Loop IR buffers, the size hints (the export's example sizes),
the target architectures and the cache directory. Output: a `UserLaunch` (the chosen config,
the Triton signature, constexprs and specialisation attributes, the arguments the cubin takes)
and one `triton_aot.Cubin` per architecture.

Specialisation (what Triton would specialise, never more): pointers are 16-byte aligned (kiln
passes whole arena buffers, inputs and weights, all at least 16-byte aligned) unless the
parameter is `do_not_specialize_on_alignment`; an int known at compile time is i32 (i64
beyond int32) and divisible by 16 when it is (unless `do_not_specialize`); an int that depends
on a dynamic size is i64 with no assumption (no divisibility, not ==1); floats are fp32, bools
i1, None and constexprs are constants.

Config choice (`choose_config`): one config for every run. With a GPU of a target architecture
at compile time and `Options.autotune`, each config is timed (triton.testing.do_bench) through
Triton's launcher at the example sizes (float tensors random, integer and bool tensors zero),
the winner cached on disk per kernel source, configs, key-argument values and device; without a
GPU, the first config. Every config computes the same result, so the choice is only speed; the
key arguments are evaluated at their example values."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import sympy

from kiln.errors import CompileError
from kiln.ir import dtypes
from kiln.ir import loop as L
from kiln.ir.sym import evaluate
from kiln.toolchain import triton_aot
from kiln.targets.cuda.ops import SIG_PTR
import torch

_I32 = (-2**31, 2**31 - 1)
# the dtypes a user kernel's tensor arguments may have (spelled as SIG_PTR spells them)
TENSOR_DTYPES = (dtypes.float32, dtypes.float16, dtypes.bfloat16, dtypes.float64, dtypes.int64,
                 dtypes.int32, dtypes.int16, dtypes.int8, dtypes.uint8, dtypes.bool_)


@dataclass(frozen=True)
class UserLaunch:
    name: str  # the step (graph node) name: kernel table entry and cubin name
    call: L.UserKernel
    config: int
    signature: dict  # parameter -> Triton type ("constexpr" for constants)
    constexprs: dict  # parameter -> value
    attrs: dict  # {(index,): [["tt.divisibility", 16]]}
    source_ops: tuple[str, ...] = ()

    status = False  # no index-status flag (see TritonKernel.status)

    @property
    def grid(self) -> tuple[sympy.Expr, ...]:
        return self.call.spec.configs[self.config].grid

    @property
    def num_warps(self) -> int:
        return self.call.spec.configs[self.config].num_warps

    @property
    def num_stages(self) -> int:
        return self.call.spec.configs[self.config].num_stages

    def launch_args(self) -> list[tuple[str, L.UserArg, str]]:
        """(parameter, value, Triton type) of every argument the cubin takes, in order."""
        return [(p, v, self.signature[p]) for p, v in self.call.args
                if self.signature[p] != "constexpr"]


def prepare(call: L.UserKernel, config: int, buffers: dict) -> UserLaunch:
    fn = call.spec.fn
    params = {p.name: p for p in fn.params}
    cfg = dict(call.spec.configs[config].constexprs)
    sig, consts, attrs = {}, {}, {}
    for i, (p, v) in enumerate(call.args):
        match v:
            case L.UserBuf(buf=buf):
                dt = buffers[buf].dtype
                if dt not in TENSOR_DTYPES:
                    raise CompileError(f"Triton kernel {call.kernel}: tensor argument {p} is "
                                       f"{dt.name}; supported: "
                                       f"{', '.join(d.name for d in TENSOR_DTYPES)}")
                sig[p] = SIG_PTR[dt]
                if not params[p].do_not_specialize_on_alignment:
                    attrs[(i,)] = [["tt.divisibility", 16]]
            case L.UserInt(value=value):
                e = sympy.sympify(value)
                if e.is_Integer:
                    x = int(e)
                    sig[p] = "i32" if _I32[0] <= x <= _I32[1] else "i64"
                    if x % 16 == 0 and not params[p].do_not_specialize:
                        attrs[(i,)] = [["tt.divisibility", 16]]
                else:  # a dynamic size: the widest type, no value assumed
                    sig[p] = "i64"
            case L.UserFloat():
                sig[p] = "fp32"
            case L.UserBool():
                sig[p] = "i1"
            case L.UserNone():
                sig[p], consts[p] = "constexpr", None
            case L.UserConstexpr(value=value):
                sig[p], consts[p] = "constexpr", value
            case L.UserConfigured():
                sig[p], consts[p] = "constexpr", cfg[p]
            case _:
                raise TypeError(v)
    extra = set(cfg) - set(params)
    if extra:
        raise CompileError(f"Triton kernel {call.kernel}: its config sets {sorted(extra)}, "
                           "which are not parameters of the kernel")
    return UserLaunch(call.name, call, config, sig, consts, attrs, call.source)


def _key(launch: UserLaunch, arch: int) -> str:
    blob = json.dumps([launch.call.spec.fn.cache_key, launch.signature,
                       repr(sorted(launch.constexprs.items())),
                       repr(sorted(launch.attrs.items())), launch.num_warps, launch.num_stages,
                       arch, triton_aot.triton_version()])
    return hashlib.sha256(blob.encode()).hexdigest()


def compile_user(launch: UserLaunch, arch: int):
    """Triton's CompiledKernel of `launch` for sm_arch (CompileError naming the kernel)."""
    # deferred: Triton is optional (GPU builds only)
    import triton
    # deferred: Triton is optional (GPU builds only)
    from triton.backends.compiler import GPUTarget

    src = triton.compiler.ASTSource(fn=launch.call.spec.fn, signature=dict(launch.signature),
                                    constexprs=dict(launch.constexprs), attrs=launch.attrs)
    try:
        return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": launch.num_warps,
                                       "num_stages": launch.num_stages})
    except Exception as e:  # Triton raises many types; name the kernel and keep the message
        raise CompileError(f"Triton failed to compile user kernel {launch.call.kernel} (node "
                           f"{launch.name}) for sm_{arch}: {type(e).__name__}: {e}") from e


def user_cubins(launches: list[UserLaunch], archs: tuple[int, ...], cache: Path
                ) -> dict[tuple[str, int], triton_aot.Cubin]:
    """Every launch for every arch, cached like kiln's own kernels (`<cache>/triton/`)."""
    out = {}
    for k in launches:
        for a in archs:
            d = cache / "triton" / _key(k, a)
            hit = triton_aot._load_cached(d, k, a)
            if hit is None:
                hit = triton_aot._to_cubin(compile_user(k, a), k, a)
                triton_aot._store(d, hit)
            out[(k.name, a)] = hit
    return out


def _example_args(launch: UserLaunch, buffers: dict, hints: dict, device: str) -> dict:

    out = {}
    for p, v in launch.call.args:
        match v:
            case L.UserBuf(buf=buf):
                b = buffers[buf]
                n = max(evaluate(b.numel, hints), 1)
                dt = b.dtype.torch
                out[p] = (torch.randn(n, device=device).to(dt) if dt.is_floating_point
                          else torch.zeros(n, dtype=dt, device=device))
            case L.UserInt(value=e):
                out[p] = evaluate(e, hints)
            case L.UserFloat(value=c) | L.UserBool(value=c) | L.UserConstexpr(value=c):
                out[p] = c
            case L.UserNone():
                out[p] = None
    return out


def _key_text(v: L.UserArg) -> str:
    """An autotune key argument's value as the on-disk cache key spells it (the repr of its
    payload as a tuple: `(x,)`, or `()` for None and config-set values)."""
    match v:
        case L.UserBuf(buf=c) | L.UserFloat(value=c) | L.UserBool(value=c) | \
                L.UserConstexpr(value=c):
            return repr((c,))
    return repr(())


def _bench(call: L.UserKernel, k: int, args: dict, hints: dict) -> float:
    # deferred: Triton is optional (GPU builds only)
    import triton.testing

    c = call.spec.configs[k]
    grid = tuple(evaluate(g, hints) for g in c.grid)
    if min(grid) <= 0:
        return 0.0
    kw = {**args, **dict(c.constexprs)}

    def run():
        call.spec.fn[grid](**kw, num_warps=c.num_warps, num_stages=c.num_stages)
    return float(triton.testing.do_bench(run, warmup=5, rep=25))


def choose_config(call: L.UserKernel, buffers: dict, hints: dict, measure: bool,
                  cache: Path) -> tuple[int, dict]:
    """(index of the config to compile, the timings in ms by config index, if measured)."""
    spec = call.spec
    if len(spec.configs) == 1 or not measure:
        return 0, {}

    keyvals = {p: str(evaluate(v.value, hints)) if isinstance(v, L.UserInt) else _key_text(v)
               for p, v in call.args if p in spec.keys}
    blob = json.dumps([spec.fn.cache_key, repr(spec.configs), keyvals, sorted(hints.items()),
                       torch.cuda.get_device_name(), triton_aot.triton_version()])
    path = cache / "user_triton" / f"{hashlib.sha256(blob.encode()).hexdigest()}.json"
    if path.exists():
        got = json.loads(path.read_text())
        return got["best"], {int(k): v for k, v in got["ms"].items()}
    t0 = time.perf_counter()
    args = _example_args(prepare(call, 0, buffers), buffers, hints, "cuda")
    ms = {k: _bench(call, k, args, hints) for k in range(len(spec.configs))}
    best = min(ms, key=ms.get)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump({"best": best, "ms": ms, "seconds": time.perf_counter() - t0}, f)
    os.replace(tmp, path)
    return best, ms
