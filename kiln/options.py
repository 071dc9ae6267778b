"""`Options`: every compile option, frozen, each documented. Defaults are what a production
build wants; tests flip `verify` on (it is on by default too: it costs milliseconds)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class Options:
    #: Fuse pointwise chains and reductions with their producers/consumers into shared kernels.
    #: False gives one kernel per materialised value (useful to bisect a wrong result).
    fuse: bool = True
    #: Evaluate subgraphs that depend only on weights at compile time (they ship as weights).
    #: Such packages cannot take new weights through update_weights; turn this off for those.
    fold_constants: bool = True
    #: Run the verifier of every IR level between stages and prove the memory plan overlap-free.
    verify: bool = True
    #: C++ compiler; None means $KILN_CXX, else $CXX, else `c++`.
    cxx: str | None = None
    #: Optimisation flags for generated kernels.
    opt_flags: tuple[str, ...] = ("-O3",)
    #: Target CPU for -march ("native" tunes for the build machine; "" omits the flag so the
    #: artifact runs on any x86-64 CPU). Recorded in the manifest.
    march: str = "native"
    #: Parallelise the outer loop of every kernel with OpenMP.
    openmp: bool = True
    #: Threads used by kernels and BLAS at run time; 0 keeps the OpenMP/BLAS default.
    num_threads: int = 0
    #: Parallel compiler processes; 0 means one per CPU.
    jobs: int = 0
    #: Kernel source files to split the kernels into (compiled in parallel); 0 means `jobs`.
    kernel_files: int = 0
    #: Build cache directory; None means $KILN_CACHE_DIR or ~/.cache/kiln.
    cache_dir: str | None = None
    #: When set, write every stage's IR (graph, loop, schedule, program, sources) here.
    dump_dir: str | None = None
    #: Byte alignment of every arena offset.
    alignment: int = 64
    #: Reorder independent kernels/GEMMs to lower peak memory (kept only when it helps).
    reorder_for_memory: bool = True
    #: Time budget (seconds) for the memory planner's search.
    plan_budget_s: float = 0.5
    #: CUDA builds (`kiln.compile(..., device="cuda")`): target architectures as integers
    #: (90 = sm_90); one cubin per kernel and architecture is embedded. Empty: the local GPU's
    #: architecture when torch sees one, else (90,). Ignored for CPU builds.
    cuda_archs: tuple[int, ...] = ()
    #: Warps per Triton kernel; 0 picks by tile size (1-8). Applies to every kernel.
    triton_num_warps: int = 0
    #: Largest RBLOCK (tile width along a member's inner loop or reduction); a power of two.
    triton_max_rblock: int = 1024
    #: Directory holding cuda.h for compiling the CUDA wrapper; None: Triton's bundled copy,
    #: else /usr/local/cuda/include. Only the header is used: nothing links against CUDA.
    cuda_include: str | None = None
    #: Sanitizers to build the model with, as for `-fsanitize=` (e.g. "address,undefined");
    #: "" builds without. The process must load the sanitizer runtime first (LD_PRELOAD of
    #: `c++ -print-file-name=libasan.so`); see tests/test_sanitizers.py.
    sanitize: str = ""
    #: Seed of kiln's random-number generator (rand, randn, dropout, ...). Each run of a loaded
    #: model draws fresh numbers; a freshly loaded model replays the same sequence.
    seed: int = 0

    def to_json(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
