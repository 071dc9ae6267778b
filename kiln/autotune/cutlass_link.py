"""CUDA packages: the CUTLASS kernels that won their GEMM, compiled and linked into model.so.

Input: the schedule, the "cutlass" choices (GEMM name -> Choice whose config names the
CUTLASS kernel), the Options and an object cache directory. Output: one object file per GEMM
(nvcc, `-gencode arch=compute_90a,code=sm_90a`, position independent, cached by content hash)
and its source for the package's src/. The objects are linked into model.so together with
CUDA's static runtime (`libcudart_static.a`): one library to load, no nvcc and no libcudart
needed where the package runs (only the driver, which every CUDA package needs), and no
second library to find by path. A relocatable object rather than a separate .so inside the
package because a .so would need a path to dlopen and its own copy of the runtime.

Entries: each kernel gets unique C names, `kiln_cutlass_run_<tag>` and
`kiln_cutlass_workspace_<tag>` (the rendered entries of kiln/autotune/cutlass.py renamed; tag:
a hash of the kernel's name), so several CUTLASS kernels link into one library and GEMMs
that chose the same kernel share one object. The wrapper passes the caller's stream and a
workspace the instance owns (sized at creation for the Dim ranges' maxima and checked before
every call). Epilogues are not fused into CUTLASS kernels: bias, activation, residual and cast
stay in the kiln kernel after the call (beta = 0, C unused)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from kiln.autotune.cutlass import CutlassCandidate, _sm90_operations, compile_all, render
from kiln.errors import CompileError, UnsupportedError
from kiln.ir import loop as L


def _tag(kernel: str) -> str:
    return hashlib.sha256(kernel.encode()).hexdigest()[:12]


def entry(kernel: str) -> str:
    return f"kiln_cutlass_run_{_tag(kernel)}"


def workspace_entry(kernel: str) -> str:
    return f"kiln_cutlass_workspace_{_tag(kernel)}"


def source_for(kernel: str, gemm: str = "") -> str:
    """The .cu source of CUTLASS kernel `kernel` (a cutlass_library procedural name) with its
    entries renamed after the kernel."""
    ops = [op for op in _sm90_operations() if op.procedural_name() == kernel]
    if not ops:
        raise UnsupportedError(f"GEMM {gemm}: CUTLASS kernel {kernel!r} (from the autotuning "
                               f"cache or choice) is not among cutlass_library's sm_90 kernels")
    src = render(CutlassCandidate(kernel, ops[0]))
    return src.replace("kiln_cutlass_run", entry(kernel)).replace(
        "kiln_cutlass_workspace", workspace_entry(kernel))


def build_objects(steps, choices: dict, opts, out_dir: Path) -> tuple[list[Path], dict]:
    """(object paths, {file name: source}) for the CUTLASS kernels chosen for the GEMMs of
    `steps` (one object per distinct kernel)."""
    sources = {}
    for g in L.flat_steps(steps):
        if isinstance(g, L.Gemm) and g.name in choices:
            kernel = choices[g.name].config["name"]
            sources.setdefault(f"cutlass_{_tag(kernel)}", source_for(kernel, g.name))
    built = compile_all(sources, out_dir, jobs=opts.jobs)
    bad = {n: r for n, r in built.items() if not isinstance(r, Path)}
    if bad:
        n, why = next(iter(bad.items()))
        raise CompileError(f"CUTLASS kernel {n} failed to compile: {why[-1500:]}")
    return [built[n] for n in sorted(built)], {f"{n}.cu": s for n, s in sources.items()}


def cudart_static() -> list[str]:
    """Linker arguments for CUDA's static runtime (next to the nvcc that built the objects)."""
    from kiln.autotune.cutlass import nvcc
    real = Path(shutil.which(nvcc()) or nvcc()).resolve()
    for d in (real.parent.parent / "lib64", real.parent.parent / "lib",
              Path("/usr/local/cuda/lib64")):
        if (d / "libcudart_static.a").is_file():
            return [str(d / "libcudart_static.a"), "-lrt", "-lpthread", "-ldl"]
    raise CompileError(f"libcudart_static.a not found next to {real} (needed to link CUTLASS "
                       "GEMMs into model.so)")
