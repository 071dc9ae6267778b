"""oneDNN's shared library (libdnnl.so.3) from an installed PyPI wheel, for the CPU
convolution's and GEMM's optional oneDNN backend (kiln/targets/cpu/dnnl.py, dnnl_gemm.py,
include/kiln_dnnl.h).

The wheels put the library in the environment's lib/ (a wheel "data" file); the installed
distribution's file list says where. Only the OpenMP builds count: `onednn-cpu-gomp` (GNU
OpenMP, one 39 MB wheel, no dependencies) and `onednn-cpu-iomp`, whose threads kiln bounds to
its run's budget (omp_set_num_threads). PyPI's `onednn` (2026.x) is a SYCL build (CPU runtime
SYCL over TBB, needing ~600 MB of Intel runtime wheels: intel-sycl-rt, intel-opencl-rt,
tbb, ...) whose threads oneDNN's C API cannot bound, and `onednn-cpu-tbb` a TBB one: not used
(kiln_dnnl.h also refuses such a library at run time). Nothing here loads the library; the
model opens it with dlopen (kiln_dnnl.h)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

#: the PyPI distributions whose libdnnl.so.3 kiln uses (OpenMP builds), in order
DISTRIBUTIONS = ("onednn-cpu-gomp", "onednn-cpu-iomp")
SONAME = "libdnnl.so.3"


def find_library() -> tuple[Path, str] | None:
    """(path of libdnnl.so.3, its distribution) from the first installed distribution of
    DISTRIBUTIONS that ships it, or None."""
    for name in DISTRIBUTIONS:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        for f in dist.files or ():
            if f.name == SONAME:
                p = Path(str(dist.locate_file(f))).resolve()
                if p.exists():
                    return p, name
    return None
