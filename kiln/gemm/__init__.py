"""GEMM autotuning: per GEMM, pick a backend and configuration among candidates.

- `problem.py`  the problem a choice is valid for (dtype, sizes or Dim ranges, layouts,
                alignment, epilogue) and its cache key (with the device)
- `configs.py`  a choice's configuration, one type per backend (BlasConfig, BlasLtConfig,
                CppConfig, TritonConfig, GemvConfig, CutlassConfig), and its JSON
- `cache.py`    the on-disk autotuning cache (one JSON file per problem and device)
- `profile.py`  runs one candidate in a child process with a timeout; a crash, a hang or a
                wrong answer drops the candidate, never the compile
- `cpu.py`      CPU candidates: OpenBLAS ("blas") and kiln's register-blocked GEMM ("cpp"),
                the benchmark driver, and the heuristic used without profiling
- `gpu.py`      CUDA candidates of every backend, the heuristic used without profiling, and
                profiling them in a child process (`gpu_child.py`, the child's side)
- `blaslt.py`   CUDA "blas" candidates beyond cuBLAS's own choice: the cuBLASLt heuristic's
                algorithms (`BlasLtConfig`) and the helper library that times them
- `cutlass.py`  CUTLASS 3.x candidates from `cutlass_library`, filtered by the Options'
                regexes / size threshold / count; rendered with an `extern "C"` entry and
                compiled with nvcc
- `cutlass_link.py`  the chosen CUTLASS kernels, compiled and linked into a CUDA package
- `cutlass_evt.py`  a GEMM's absorbed epilogue as a CUTLASS epilogue visitor tree (sm_90),
                or the reason it stays a separate kernel
- `triton_gemm.py`  the Triton GEMM template's config space and TMA rule (the template is
                printed by kiln/targets/cuda/gemm_template.py)
- `printed.py`  the template's candidates as the package prints them, for the profiling child
- `gemv.py`     the GEMV template's scope (M = 1 on CUDA), configs (`GemvConfig`) and rule
                (printed by kiln/targets/cuda/gemv_template.py)
- `prologue.py` a GEMV's prologue: the row-wise producer of its A row, recomputed per program
- `fuse.py`     GEMMs that absorb their epilogue (Triton template, CUTLASS visitor trees) and
                GEMVs their prologue
- `select.py`   the pipeline stage: one `Choice` per GEMM (profiled, cached or heuristic)
"""

from kiln.gemm.problem import GemmProblem, problem_of
from kiln.gemm.select import Choice, choose_gemms

__all__ = ["Choice", "GemmProblem", "choose_gemms", "problem_of"]
