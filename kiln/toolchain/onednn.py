"""oneDNN's shared library (libdnnl.so.3) from an installed PyPI wheel, for the CPU
convolution's optional oneDNN backend (kiln/targets/cpu/dnnl.py, include/kiln_dnnl.h).

The wheels put the library in the environment's lib/ (a wheel "data" file); the installed
distribution's file list says where. `onednn-cpu-gomp` (GNU OpenMP runtime, no further
dependencies) comes first: it is the build whose threads kiln can bound (omp_set_num_threads).
PyPI's `onednn` is a SYCL / TBB build (with ~600 MB of Intel runtime wheels): kiln_dnnl.h
refuses its CPU runtime with an error naming the OpenMP wheel. Nothing here loads the
library; the model opens it with dlopen (kiln_dnnl.h)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

#: the PyPI distributions that ship libdnnl.so.3, the ones kiln can use first
DISTRIBUTIONS = ("onednn-cpu-gomp", "onednn-cpu-iomp", "onednn", "onednn-cpu-tbb")
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
