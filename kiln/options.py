"""`Options`: every compile option, frozen, each documented. Defaults are what a production
build wants; tests flip `verify` on (it is on by default too: it costs milliseconds)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from enum import StrEnum


class GemmBackend(StrEnum):
    """A GEMM backend. A str-Enum: each member is equal to (and hashes as) its name, so
    manifests, the autotuning cache and `Options.gemm_backends` keep plain strings."""

    BLAS = "blas"  # OpenBLAS on CPU, cuBLAS (and cuBLASLt algorithms) on CUDA
    CPP = "cpp"  # kiln's register-blocked GEMM (CPU)
    TRITON = "triton"  # kiln's Triton GEMM template (CUDA)
    CUTLASS = "cutlass"  # CUTLASS 3.x kernels (CUDA)
    #: oneDNN's matmul (CPU, constant B): chosen through Options.cpu_gemm_backends, never
    #: through gemm_backends (kiln/targets/cpu/dnnl_gemm.py)
    ONEDNN = "onednn"


#: Every GEMM backend name `Options.gemm_backends` accepts, and the devices each applies to.
GEMM_BACKENDS = tuple(b.value for b in GemmBackend if b is not GemmBackend.ONEDNN)
BACKEND_DEVICES = {GemmBackend.BLAS: ("cpu", "cuda"), GemmBackend.CPP: ("cpu",),
                   GemmBackend.TRITON: ("cuda",), GemmBackend.CUTLASS: ("cuda",)}

#: Options.cpu_conv values
CPU_CONV = ("direct", "im2col")
#: Options.cpu_conv_backends values
CPU_CONV_BACKENDS = ("direct", "onednn")
#: Options.cpu_gemm_backends values
CPU_GEMM_BACKENDS = ("kiln", "onednn")
#: Options.cuda_conv values
CUDA_CONV = ("implicit", "im2col")
#: Options.weight_quant / weight_quant_kernel values
WEIGHT_QUANT = ("none", "int8", "int4")
WEIGHT_QUANT_KERNELS = ("dequant", "vnni")


@dataclass(frozen=True)
class Options:
    #: Fuse pointwise chains and reductions with their producers/consumers into shared kernels.
    #: False gives one kernel per materialised value (useful to bisect a wrong result).
    fuse: bool = True
    #: Evaluate subgraphs that depend only on weights at compile time (they ship as weights).
    #: Such packages cannot take new weights through update_weights; turn this off for those.
    fold_constants: bool = True
    #: Freezing: store each weight that only feeds GEMMs through a transpose in the layout the
    #: GEMM reads (transposed once at compile time; see passes/freeze.py). Helps the "cpp" and
    #: Triton GEMMs, which read row-contiguous B operands fastest; BLAS reads either layout.
    #: update_weights(state_dict) still takes tensors in the model's own layout.
    freeze: bool = False
    #: Ops kiln does not lower call ATen at run time (through torch's stable C interface); the
    #: package then needs libtorch and its manifest lists the ops. False makes them a compile
    #: error instead, for packages that must run without libtorch.
    aten_fallback: bool = True
    #: Run the verifier of every IR level between stages and prove the memory plan overlap-free.
    verify: bool = True
    #: C++ compiler; None means $KILN_CXX, else $CXX, else `c++`.
    cxx: str | None = None
    #: Optimisation flags for generated kernels.
    opt_flags: tuple[str, ...] = ("-O3",)
    #: Target CPU for -march ("native" tunes for the build machine; a level such as
    #: "x86-64-v3" (AVX2) or "x86-64-v4" (AVX-512) runs on every CPU of that level; "" omits
    #: the flag so the artifact runs on any x86-64 CPU). The instruction-set extensions it
    #: enables are recorded in the manifest (requires.cpu_features) and checked when a package
    #: loads: a CPU without one fails with an error naming it, not an illegal instruction.
    #: "portable" builds the kernels once per level of `cpu_levels` into one package; the
    #: loader runs the first (best) level the CPU supports (`Runner.cpu_level` says which).
    march: str = "native"
    #: march="portable": the -march levels the package carries, best first. The kernels and
    #: the GEMM file are compiled once per level (in parallel, Options.jobs) and linked with
    #: one wrapper object (model.cpp, compiled once at the last level) into
    #: lib/model.<level>.so, the last level as lib/model.so; the manifest lists each level's
    #: library and CPU features (requires.cpu_levels). GEMMs are chosen for the best level the
    #: build machine has; a "cpp" GEMM tile too large for a level's register file is replaced by
    #: that level's default tile in its GEMM file. Ignored unless march is "portable".
    cpu_levels: tuple[str, ...] = ("x86-64-v4", "x86-64-v3", "x86-64")
    #: Parallelise kernels over kiln's own thread pool (kiln_pool.h; the name is historical:
    #: packages no longer link OpenMP's runtime). False: every kernel runs on the caller.
    openmp: bool = True
    #: Caps the team of every kernel at run time; 0: the run's budget (kiln_model_set_num_threads,
    #: else OMP_NUM_THREADS, else the CPUs the process may use).
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
    #: CUDA builds: run the whole model as one CUDA graph per distinct input size tuple
    #: (captured on the second run with those sizes, replayed afterwards; inputs and outputs
    #: go through static device buffers). False launches every kernel and GEMM each run.
    cuda_graphs: bool = True
    #: CUDA builds for sm_90 and later only: programmatic dependent launch. Each of kiln's
    #: kernels is launched to start as the one before it ends (its launch latency hidden)
    #: and waits (griddepcontrol.wait) before touching any buffer; on a device or driver
    #: without it (< CUDA 12.3) the launches are ordinary.
    cuda_pdl: bool = True
    #: CUDA builds whose kernels look data up by index (embedding, gather, index_put): a run
    #: reports an index out of range of the run before it (on the next run), as CUDA reports
    #: asynchronous errors, so that no run waits for the device. True: every run waits for
    #: its own kernels and reports its own bad index (a host-device sync per run). The C
    #: API's stream-less kiln_model_run always checks its own run.
    cuda_sync_checks: bool = False
    #: CUDA builds on a machine whose GPU is one of the target architectures: time candidate
    #: launch configs of each large kernel on it and keep the fastest (kiln/toolchain/
    #: autotune.py; cached on disk per kernel source and device), and the triton.autotune
    #: configs of user Triton kernels (targets/cuda/user_triton.py). Off, or without a GPU: the
    #: size heuristic alone, and a user kernel's first config.
    autotune: bool = True
    #: CUDA builds with autotune: time only what the cost model says can matter
    #: (targets/cuda/tune_plan.py: kernels and attention calls predicted at KERNEL_MIN_US or
    #: more, convolutions at CONV_LOW_US or more, each convolution's heuristic tile and the
    #: best others by a tile model, `conv_keep` in all). False (or max_autotune) times every
    #: candidate of every kernel the size thresholds admit, as before (the A/B of the pruning).
    tune_prune: bool = True
    #: CUDA builds: run scaled_dot_product_attention as kiln's flash-attention Triton kernel
    #: (targets/cuda/attention.py; one step, no L x S score matrix) for float16, bfloat16
    #: and float32 (products as 3xTF32, which measured more accurate than eager's float32
    #: attention and faster than the decomposition: H100, gpt fp32 0.202 ms vs 0.236 ms, max
    #: error vs float64 1.1e-6 vs eager's 1.5e-6); False decomposes it into matmul / softmax
    #: / matmul. CPU builds: the same step as kiln_attention.h's flash-style C++ routine
    #: (float32; 16-bit types widened to float32), faster than the decomposition at seq 128,
    #: 197 and 512 (bench/cpu_attention_shapes.py).
    fused_attention: bool = True
    #: Warps per Triton kernel; 0 picks by tile size (1-8). Applies to every kernel.
    triton_num_warps: int = 0
    #: Largest RBLOCK (tile width along a member's inner loop or reduction); a power of two.
    #: Rows up to this width are one tile: each element of a softmax / norm row loads once.
    triton_max_rblock: int = 4096
    #: Directory holding cuda.h for compiling the CUDA wrapper; None: Triton's bundled copy,
    #: else /usr/local/cuda/include. Only the header is used: nothing links against CUDA.
    cuda_include: str | None = None
    #: Sanitizers to build the model with, as for `-fsanitize=` (e.g. "address,undefined");
    #: "" builds without. The process must load the sanitizer runtime first (LD_PRELOAD of
    #: `c++ -print-file-name=libasan.so`); see tests/targets/cpu/test_sanitizers.py.
    sanitize: str = ""
    #: Debugging: after every step, check the floating-point values it wrote and fail the run
    #: at the first inf or NaN, naming the buffer and its source ops (costs a pass over each).
    check_finite: bool = False
    #: GEMM autotuning (kiln/gemm): time every candidate of every GEMM at compile time, in
    #: a separate process, and link the fastest; off, a documented heuristic picks (or the
    #: autotuning cache, when it already holds the problem). Names as in the reference system.
    #: CPU builds then also build the package with the heuristic's choices (when any differs),
    #: time both end to end on the example's shapes (interleaved medians) and keep the tuned
    #: one only when it is faster by more than 2 %: the report's and manifest's `gemm_check`
    #: record both timings and the choice (kiln/targets/cpu/never_lose.py, kiln/api.py).
    max_autotune: bool = False
    #: GEMM backends to choose from. "blas": OpenBLAS on CPU, cuBLAS on GPU; "cpp": kiln's
    #: generated register-blocked GEMM (CPU only); "triton": Triton GEMM templates and
    #: "cutlass": CUTLASS 3.x kernels (GPU only). Backends that do not apply to the device are
    #: ignored; at least one that applies must remain.
    gemm_backends: tuple[str, ...] = ("blas", "cpp", "triton", "cutlass")
    #: Most CUTLASS configurations profiled per GEMM, after the regex and size filters; 0: all.
    cutlass_max_profiling_configs: int = 0
    #: Only CUTLASS kernels whose name matches this regex (re.search) are candidates; "": all.
    cutlass_op_allowlist_regex: str = ""
    #: CUTLASS kernels whose name matches this regex (re.search) are never candidates.
    cutlass_op_denylist_regex: str = ""
    #: CUTLASS is not tried for GEMMs with fewer than this many multiply-adds (M * N * K * batch).
    cutlass_min_gemm_size: int = 1
    #: Seconds one profiling run of one GEMM candidate may take before it is dropped.
    autotune_timeout_s: float = 20.0

    #: CPU builds: how 2-D float32 convolutions run. "direct": kiln's direct convolution in the
    #: blocked channel layout NCHWc (kiln/targets/cpu/include/kiln_conv.h; weights packed and
    #: batch norm folded at compile time, bias / residual add / activation in its store; see
    #: passes/conv_nchwc.py); 1-D convolutions as one GEMM over a channels-last view of the
    #: input (passes/conv1d_gemm.py); im2col + GEMM for what neither covers (transposed, 3-D,
    #: grouped but not depthwise, other dtypes, dynamic sizes). "im2col": every
    #: convolution as im2col + GEMM. The direct path packs weights, a compile-time fold: with
    #: fold_constants=False it is off. max_autotune does not time the two against each other
    #: (yet): a supported convolution always runs direct.
    cpu_conv: str = "direct"

    #: CPU builds: who may run a direct convolution (cpu_conv "direct"; not the fused
    #: inverted residual blocks). "direct": kiln_conv.h; "onednn": oneDNN (libdnnl.so.3 from
    #: the onednn-cpu-gomp wheel, the `perf` extra), the weights reordered to its layout once
    #: when the package is loaded (kiln/targets/cpu/dnnl.py). Both (the default): oneDNN is a
    #: candidate only with max_autotune and oneDNN installed at compile time, each convolution
    #: shape timed both ways and the faster kept; otherwise kiln's own, and the package never
    #: needs oneDNN. ("onednn",) alone: every direct convolution on oneDNN.
    cpu_conv_backends: tuple[str, ...] = ("direct", "onednn")

    #: CPU builds: who may run a float32 GEMM whose B is a constant weight (a Linear layer),
    #: as cpu_conv_backends for convolutions. "kiln": the backend gemm_backends and max_autotune
    #: choose (kiln's "cpp" GEMM or OpenBLAS); "onednn": oneDNN's matmul, the weight reordered
    #: to its layout once when the package is loaded, the fused epilogue as post-ops
    #: (kiln/targets/cpu/dnnl_gemm.py). Both (the default): oneDNN is a candidate only with
    #: max_autotune and oneDNN installed at compile time, each GEMM shape timed against kiln's
    #: choice and the faster kept; otherwise kiln's own, and the package never needs oneDNN.
    #: ("onednn",) alone: every such GEMM whose epilogue oneDNN can express on oneDNN.
    cpu_gemm_backends: tuple[str, ...] = ("kiln", "onednn")

    #: CPU builds: a pointwise consumer of a GEMM's result (bias, activation, residual add,
    #: scale) reading it only at the element it stores, of the GEMM's dtype, runs inside the
    #: GEMM on each part of the result once final, and the result buffer disappears
    #: (kiln/gemm/fuse_cpu.py). False keeps it a separate kernel.
    cpu_gemm_epilogue: bool = True

    #: CUDA builds: how 2-D convolutions run. "implicit": channels-last (NHWC) kiln Triton
    #: kernels, an implicit GEMM (no im2col buffer; split-K where tiles cannot fill the GPU)
    #: and a direct depthwise kernel, with batch norm, bias, residual and activation in the
    #: store, tiles measured on a local GPU (Options.autotune); with max_autotune, 1x1
    #: stride-1 convolutions are plain GEMMs on NHWC timed like every GEMM
    #: (passes/conv_nhwc.py; needs fold_constants). "im2col": im2col + batched GEMM.
    cuda_conv: str = "implicit"

    #: CPU builds: weight-only quantisation of the constant B operands of float32 GEMMs (nn.Linear
    #: weights, 2-D matmuls with a weight). "int8": int8 per output channel (symmetric, an fp32
    #: scale per column); "int4": int4 group-wise along K (`weight_quant_group` values share
    #: an fp32 scale), two values a byte. The package stores only the quantised tensors (FQN
    #: `<quantised MODE of FQN>`; update_weights refuses them), and kiln_qgemm.h's kernels
    #: dequantise in registers (passes/quant_weights.py, targets/cpu/quant.py).
    #: CUDA builds: the same for float32 / bfloat16 / float16 GEMMs, the weights stored [N, K]
    #: (int4: a power-of-two group >= 32 dividing K, else the GEMM stays unquantised) and
    #: multiplied by quantised GEMV (M = 1) / tensor-core Triton kernels (gemm/quant_gemv.py,
    #: targets/cuda/quant.py).
    weight_quant: str = "none"
    #: weight_quant="int4": values of K per scale (a positive multiple of 8).
    weight_quant_group: int = 128
    #: weight_quant="int8" / "int4": "dequant" multiplies fp32 activations by the converted
    #: weights; "vnni" also quantises each activation row to int8 (symmetric, per row) and
    #: multiplies integers (AVX-512 VNNI vpdpbusd where the -march has it, exact integer loops
    #: elsewhere): faster, less accurate (measure with kiln.models.quant_report).
    weight_quant_kernel: str = "dequant"
    #: CUDA builds, weight_quant="int4": bfloat16 weights in power-of-two groups >= 128 stored
    #: in the tensor-core GEMV's order (gemm/int4_tc.py), the launch tuner choosing per decode
    #: GEMV between the tensor-core kernel and the CUDA-core loop on that order; prefill reads
    #: the same bytes. Off by default: slower end to end so far (BENCHMARKS.md, eighteenth
    #: session, s18q4).
    cuda_int4_tensor_core: bool = False
    #: CPU builds: bfloat16 GEMMs with a constant bf16 weight run kiln_qgemm.h's bf16 kernel
    #: (vdpbf16ps where the -march has avx512_bf16; fp32 products elsewhere), the weight stored
    #: repacked, not converted; False widens them to float32 GEMMs like other bf16 ops.
    cpu_bf16_gemm: bool = True

    #: Seed of kiln's random-number generator (rand, randn, dropout, ...). Each run of a loaded
    #: model draws fresh numbers; a freshly loaded model replays the same sequence.
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.cpu_levels, list):  # as Options.to_json writes it
            object.__setattr__(self, "cpu_levels", tuple(self.cpu_levels))
        if isinstance(self.cpu_conv_backends, list):
            object.__setattr__(self, "cpu_conv_backends", tuple(self.cpu_conv_backends))
        if isinstance(self.cpu_gemm_backends, list):
            object.__setattr__(self, "cpu_gemm_backends", tuple(self.cpu_gemm_backends))
        if self.march == "portable":
            lv = self.cpu_levels
            if not isinstance(lv, tuple) or not lv or len(set(lv)) != len(lv) or any(
                    not isinstance(x, str) or x in ("", "native", "portable") or
                    not x.replace("-", "").replace("_", "").replace(".", "").isalnum()
                    for x in lv):
                raise ValueError(f"Options.cpu_levels: expected a non-empty tuple of distinct "
                                 f"-march levels, best first (e.g. (\"x86-64-v4\", "
                                 f"\"x86-64-v3\", \"x86-64\")), got {lv!r}")
        bad = [b for b in self.gemm_backends if b not in GEMM_BACKENDS]
        if bad or not self.gemm_backends:
            raise ValueError(f"Options.gemm_backends: expected a non-empty tuple of "
                             f"{GEMM_BACKENDS}, got {self.gemm_backends!r}")

        if self.weight_quant not in WEIGHT_QUANT:
            raise ValueError(f"Options.weight_quant: expected one of {WEIGHT_QUANT}, got "
                             f"{self.weight_quant!r}")
        if self.weight_quant_kernel not in WEIGHT_QUANT_KERNELS:
            raise ValueError(f"Options.weight_quant_kernel: expected one of "
                             f"{WEIGHT_QUANT_KERNELS}, got {self.weight_quant_kernel!r}")
        g = self.weight_quant_group
        if not isinstance(g, int) or isinstance(g, bool) or g <= 0 or g % 8:
            raise ValueError(f"Options.weight_quant_group: expected a positive multiple of 8, "
                             f"got {g!r}")
        if self.cuda_conv not in CUDA_CONV:
            raise ValueError(f"Options.cuda_conv: expected one of {CUDA_CONV}, got "
                             f"{self.cuda_conv!r}")
        cb = self.cpu_conv_backends
        if not cb or not isinstance(cb, tuple) or any(b not in CPU_CONV_BACKENDS for b in cb):
            raise ValueError(f"Options.cpu_conv_backends: expected a non-empty tuple of "
                             f"{CPU_CONV_BACKENDS}, got {cb!r}")
        gb = self.cpu_gemm_backends
        if not gb or not isinstance(gb, tuple) or any(b not in CPU_GEMM_BACKENDS for b in gb):
            raise ValueError(f"Options.cpu_gemm_backends: expected a non-empty tuple of "
                             f"{CPU_GEMM_BACKENDS}, got {gb!r}")
        if self.cpu_conv not in CPU_CONV:
            raise ValueError(f"Options.cpu_conv: expected one of {CPU_CONV}, got "
                             f"{self.cpu_conv!r}")

    def to_json(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
