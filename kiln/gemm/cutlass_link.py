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
`kiln_cutlass_workspace_<tag>` (the rendered entries of kiln/gemm/cutlass.py renamed; tag:
a hash of the kernel's name, and of its epilogue visitor tree for a fused one), so several
CUTLASS kernels link into one library and GEMMs that chose the same kernel (and epilogue)
share one object. The wrapper passes the caller's stream and a workspace the instance owns
(sized at creation for the Dim ranges' maxima and checked before every call). A GEMM whose
choice fused its epilogue (`gemm/fuse.py: CutlassGemm`) links the kernel rendered
with that tree (kiln/gemm/cutlass_evt.py): its entry also takes C (the tree's full-size
operand) and `ext`, an array of the tree's other operand pointers. Other CUTLASS GEMMs run
the plain kernel (beta = 0, C unused) and their epilogue stays a kiln kernel."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from kiln.gemm.cutlass import CutlassCandidate, _sm90_operations, compile_all, render
from kiln.errors import CompileError, UnsupportedError
from kiln.ir import loop as L
from kiln.schedule.steps import CutlassGemm
from kiln.gemm.cutlass_evt import Evt, from_epilogue
from kiln.gemm.cutlass import nvcc


def _tag(kernel: str, evt_key: str = "") -> str:
    return hashlib.sha256((kernel + ("|" + evt_key if evt_key else "")).encode()
                          ).hexdigest()[:12]


def entry(kernel: str, evt_key: str = "") -> str:
    return f"kiln_cutlass_run_{_tag(kernel, evt_key)}"


def workspace_entry(kernel: str, evt_key: str = "") -> str:
    return f"kiln_cutlass_workspace_{_tag(kernel, evt_key)}"


def source_for(kernel: str, gemm: str = "", evt=None) -> str:
    """The .cu source of CUTLASS kernel `kernel` (a cutlass_library procedural name), fusing
    visitor tree `evt` when given, with its entries renamed after the kernel (and tree)."""
    ops = [op for op in _sm90_operations() if op.procedural_name() == kernel]
    if not ops:
        raise UnsupportedError(f"GEMM {gemm}: CUTLASS kernel {kernel!r} (from the autotuning "
                               f"cache or choice) is not among cutlass_library's sm_90 kernels")
    src = render(CutlassCandidate(kernel, ops[0], evt=evt))
    key = evt.key if evt is not None else ""
    return src.replace("kiln_cutlass_run", entry(kernel, key)).replace(
        "kiln_cutlass_workspace", workspace_entry(kernel, key))


def fused_evt(step: CutlassGemm):
    """The visitor tree of a fused CUTLASS GEMM (the one its choice was made for)."""
    evt = from_epilogue(step.gemm, step.epilogue)
    if not isinstance(evt, Evt) or evt.key != step.config.evt:
        raise CompileError(f"GEMM {step.gemm.name}: its epilogue no longer matches the "
                           "visitor tree its CUTLASS kernel was chosen for")
    return evt


def build_objects(steps, choices: dict, opts, out_dir: Path) -> tuple[list[Path], dict]:
    """(object paths, {file name: source}) for the CUTLASS kernels chosen for the GEMMs of
    `steps` (one object per distinct kernel and epilogue)."""
    sources = {}
    for g in L.flat_steps(steps):
        if isinstance(g, CutlassGemm):
            kernel, evt = g.config.name, fused_evt(g)
            sources.setdefault(f"cutlass_{_tag(kernel, evt.key)}",
                               source_for(kernel, g.name, evt))
        elif isinstance(g, L.Gemm) and g.name in choices:
            kernel = choices[g.name].config.name
            sources.setdefault(f"cutlass_{_tag(kernel)}", source_for(kernel, g.name))
    built = compile_all(sources, out_dir, jobs=opts.jobs)
    bad = {n: r for n, r in built.items() if not isinstance(r, Path)}
    if bad:
        n, why = next(iter(bad.items()))
        raise CompileError(f"CUTLASS kernel {n} failed to compile: {why[-1500:]}")
    return [built[n] for n in sorted(built)], {f"{n}.cu": s for n, s in sources.items()}


def cudart_static() -> list[str]:
    """Linker arguments for CUDA's static runtime (next to the nvcc that built the objects)."""
    real = Path(shutil.which(nvcc()) or nvcc()).resolve()
    for d in (real.parent.parent / "lib64", real.parent.parent / "lib",
              Path("/usr/local/cuda/lib64")):
        if (d / "libcudart_static.a").is_file():
            return [str(d / "libcudart_static.a"), "-lrt", "-lpthread", "-ldl"]
    raise CompileError(f"libcudart_static.a not found next to {real} (needed to link CUTLASS "
                       "GEMMs into model.so)")
