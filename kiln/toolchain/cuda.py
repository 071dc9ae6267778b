"""Facts about the CUDA toolchain that the GEMM package and the CUDA target both need: the
target architectures (the local GPU's when torch sees one), where cuda.h is, and the C++
toolchain that compiles code against it. Imports torch and Triton only inside functions
(both optional for CPU builds)."""

from __future__ import annotations

from pathlib import Path

from kiln import config
from kiln.errors import CompileError
from kiln.options import Options
from kiln.toolchain.cxx import INCLUDE_DIRS, Toolchain
import torch

#: the CUDA target's model-side header (kiln_cuda_rt.h), which packages' wrappers and the
#: cuBLASLt profiling helper (gemm/blaslt.py) include
CUDA_INCLUDE = Path(__file__).resolve().parents[1] / "targets" / "cuda" / "include"


def default_archs() -> tuple[int, ...]:
    """The local GPU's architecture when torch sees a CUDA device, else sm_90."""
    try:
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return (major * 10 + minor,)
    except Exception:  # no usable CUDA: build for the default target
        pass
    return (90,)


#: the most dynamic shared memory one block may use, per architecture (the CUDA programming
#: guide's table: 227 KiB on sm_90 / sm_100, 163 KiB on sm_80 / sm_87, 99 KiB on sm_86 / sm_89
#: / sm_120)
SHARED_PER_BLOCK = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448,
                    120: 101376}


def shared_per_block(archs: tuple[int, ...]) -> int:
    """What one block may use on every architecture of `archs` (sm_90's figure for one this
    table does not know)."""
    return min((SHARED_PER_BLOCK.get(a, SHARED_PER_BLOCK[90]) for a in archs),
               default=SHARED_PER_BLOCK[90])


def cuda_include_dir(opts: Options) -> Path:
    """A directory holding cuda.h: the option, else Triton's bundled copy, else CUDA's."""
    cands = [opts.cuda_include] if opts.cuda_include else []
    try:
        # deferred: Triton is optional (GPU builds only)
        import triton
        cands.append(str(Path(triton.__file__).parent / "backends" / "nvidia" / "include"))
    except ImportError:
        pass
    cands.append("/usr/local/cuda/include")
    for c in cands:
        if c and (Path(c) / "cuda.h").is_file():
            return Path(c)
    raise CompileError(f"cuda.h not found (looked in {', '.join(c for c in cands if c)}); set "
                       "Options(cuda_include=...)")


def cuda_toolchain(opts: Options) -> Toolchain:
    """The C++ toolchain of CUDA packages' wrappers: the shared runtime headers, the CUDA
    target's (CUDA_INCLUDE) and cuda.h, no CUDA library linked (the driver is opened at
    load); a wrapper's includes precompiled ahead (targets/cuda/build.py `wrapper_header`)
    are used where ready."""
    jobs = opts.jobs or config.cpu_count()
    cflags = ["-std=c++17", "-fPIC", "-fvisibility=hidden", *opts.opt_flags,
              f"-I{cuda_include_dir(opts)}"]
    cache = Path(opts.cache_dir) if opts.cache_dir else config.cache_dir()
    return Toolchain(opts.cxx or config.cxx(), cache / "build", tuple(cflags), ("-ldl",),
                     (*INCLUDE_DIRS, CUDA_INCLUDE), jobs, pch_ready=True)
