"""The Triton template's GEMM candidates printed as the CUDA package prints them, for the GEMM
package's profiling child (kiln/gemm/printed.py): each config's kernel from
`gemm_template.py` with the GEMM's absorbed epilogue, and the epilogue alone as a row kernel
(what runs when another backend computes the GEMM). The target hands `build` to the GEMM
package (kiln/gemm/select.py), which never imports a target."""

from __future__ import annotations

from kiln.gemm.configs import TritonConfig
from kiln.gemm.printed import Printed
from kiln.ir import loop as L
from kiln.schedule import Kernel, outer_of
from kiln.schedule.steps import GemmKernel
from kiln.targets.cuda.gemv_template import print_template_kernel
from kiln.targets.cuda.kernel import TritonKernel, print_triton_kernel, print_triton_module
from kiln.targets.cuda.wrapper_py import import_triton_module, launch_kernel


class TritonLauncher:
    """How the profiling child imports and launches the printed module (as the Python
    printer launches a package's kernels)."""

    def load(self, source: str):
        return import_triton_module(source)

    def launch(self, module, kernel: TritonKernel, env, bufs, status, device) -> None:
        launch_kernel(module, kernel, env, bufs, status, device)


def build(g: L.Gemm, epi: L.Compute | None, buffers: dict[str, L.Buffer],
          env: dict[str, int], configs: dict[str, TritonConfig]) -> Printed:
    """`configs`: candidate name -> template config."""
    kernels: dict[str, TritonKernel] = {}
    for i, (name, cfg) in enumerate(configs.items()):
        gk = GemmKernel(g, epi, cfg)
        kernels[name] = print_template_kernel(gk, buffers, f"{gk.name}__{i}")
    ek = None
    if epi is not None:
        ek = print_triton_kernel(Kernel(f"epilogue_{epi.name}", outer_of(epi), (epi,),
                                        frozenset()), buffers, env)
    used = {n for k in [*kernels.values(), *([ek] if ek else [])] for kind, n in k.params
            if kind in ("in", "out")} | {g.name, g.a.buf, g.b.buf, *g.extra_reads()}
    return Printed(g, epi, {n: buffers[n] for n in sorted(used)}, dict(env),
                   print_triton_module([*kernels.values(), *([ek] if ek else [])]), kernels, ek,
                   TritonLauncher())
