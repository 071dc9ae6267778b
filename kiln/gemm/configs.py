"""The configuration of a GEMM choice, one frozen type per backend (and kind of candidate):

- `BlasConfig`     "blas": OpenBLAS on CPU, cuBLAS's own algorithm on CUDA; JSON {}
- `BlasLtConfig`   "blas" on CUDA: the cuBLASLt heuristic's `algo`-th algorithm
                   (kiln/gemm/blaslt.py); JSON {"algo": i}
- `CppConfig`      "cpp": kiln's register-blocked CPU GEMM, an MR x (NV vectors) register tile,
                   K blocked by KC, N by NC (kiln/gemm/cpu.py); JSON {"mr", "nv", "kc", "nc"}
                   and "packed": true for a B packed at compile time
- `TritonConfig`   "triton": the template's tile sizes, group size, pipeline stages, warps and
                   TMA loads (kiln/gemm/triton_gemm.py); JSON {"name", "block_m", "block_n",
                   "block_k", "group_m", "num_stages", "num_warps"} and "tma": true for TMA
- `GemvConfig`     "triton" at M = 1: the GEMV template's BLOCK_N outputs a program, BLOCK_K
                   of K a step, warps, stages (kiln/gemm/gemv.py); JSON {"name", "gemv": true,
                   "block_n", "block_k", "num_warps", "num_stages"}
- `CutlassConfig`  "cutlass": the cutlass_library kernel's name and, for a kernel fusing the
                   GEMM's epilogue, the visitor tree's key (kiln/gemm/cutlass_evt.py); JSON
                   {"name"} and "evt"

`to_json` gives what manifests ("kernels" -> "gemm" -> "config"), `kiln inspect` and the
autotuning cache (kiln/gemm/cache.py) hold; `config_from_json(backend, d)` reads it back,
also entries written before these types (missing optional keys take the values the consumers
assumed: group_m 8, num_stages 3, num_warps 4; keys it does not know are ignored)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Union

from kiln.options import GemmBackend


@dataclass(frozen=True)
class BlasConfig:
    """cuBLAS's (CUDA) or OpenBLAS's (CPU) own choice of algorithm."""

    backend: ClassVar[GemmBackend] = GemmBackend.BLAS

    def to_json(self) -> dict:
        return {}


@dataclass(frozen=True)
class BlasLtConfig:
    """The cuBLASLt heuristic's `algo`-th result for the GEMM (CUDA; a package whose heuristic
    offers fewer runs result 0)."""

    algo: int
    backend: ClassVar[GemmBackend] = GemmBackend.BLAS

    def to_json(self) -> dict:
        return {"algo": self.algo}


@dataclass(frozen=True)
class CppConfig:
    """`packed`: B is a constant packed at compile time into panels of `nv` vectors
    (passes/pack_cpu.py; kr::gemm_cpp_packed), `nc` unused."""

    mr: int
    nv: int
    kc: int = 256
    nc: int = 1024
    packed: bool = False
    backend: ClassVar[GemmBackend] = GemmBackend.CPP

    @property
    def name(self) -> str:
        if self.packed:
            return f"cpp_packed_{self.mr}x{self.nv}v_k{self.kc}"
        return f"cpp_{self.mr}x{self.nv}v_k{self.kc}_n{self.nc}"

    def to_json(self) -> dict:
        return {"mr": self.mr, "nv": self.nv, "kc": self.kc, "nc": self.nc,
                **({"packed": True} if self.packed else {})}

    @classmethod
    def from_json(cls, d: dict) -> CppConfig:
        return cls(int(d["mr"]), int(d["nv"]), int(d["kc"]), int(d["nc"]),
                   bool(d.get("packed", False)))


@dataclass(frozen=True)
class TritonConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_stages: int = 3
    num_warps: int = 8
    tma: bool = False  # A and B tiles through TMA descriptors
    backend: ClassVar[GemmBackend] = GemmBackend.TRITON

    @property
    def name(self) -> str:
        return (f"triton_{self.block_m}x{self.block_n}x{self.block_k}_g{self.group_m}"
                f"_s{self.num_stages}_w{self.num_warps}" + ("_tma" if self.tma else ""))

    def to_json(self) -> dict:
        return {"name": self.name, "block_m": self.block_m, "block_n": self.block_n,
                "block_k": self.block_k, "group_m": self.group_m,
                "num_stages": self.num_stages, "num_warps": self.num_warps,
                **({"tma": True} if self.tma else {})}

    @classmethod
    def from_json(cls, d: dict) -> TritonConfig:
        """(`name` is derived from the fields; num_warps defaults to 4 here, as the package
        printer read a config without it.)"""
        return cls(int(d["block_m"]), int(d["block_n"]), int(d["block_k"]),
                   int(d.get("group_m", 8)), int(d.get("num_stages", 3)),
                   int(d.get("num_warps", 4)), bool(d.get("tma", False)))


@dataclass(frozen=True)
class GemvConfig:
    """The GEMV template (M = 1): one program per BLOCK_N outputs, streaming their weight rows
    BLOCK_K elements a step (targets/cuda/gemv_template.py)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 1
    #: "" the template's kernel for the GEMM; "cc": for int4 weights in the tensor-core
    #: order (MixedGemm.tc), the CUDA-core loop reading that order instead of the tensor-core
    #: kernel (gemm/gemv.py `gemv_configs`)
    variant: str = ""
    gemv: ClassVar[bool] = True
    backend: ClassVar[GemmBackend] = GemmBackend.TRITON

    @property
    def name(self) -> str:
        return f"gemv_{self.block_n}x{self.block_k}_s{self.num_stages}_w{self.num_warps}" + (
            f"_{self.variant}" if self.variant else "")

    def to_json(self) -> dict:
        return {"name": self.name, "gemv": True, "block_n": self.block_n,
                "block_k": self.block_k, "num_warps": self.num_warps,
                "num_stages": self.num_stages, "variant": self.variant}

    @classmethod
    def from_json(cls, d: dict) -> GemvConfig:
        return cls(int(d["block_n"]), int(d["block_k"]), int(d.get("num_warps", 4)),
                   int(d.get("num_stages", 1)), str(d.get("variant", "")))


@dataclass(frozen=True)
class CutlassConfig:
    name: str  # the cutlass_library kernel's procedural name
    evt: str | None = None  # the fused epilogue visitor tree's key (cutlass_evt.Evt.key)
    backend: ClassVar[GemmBackend] = GemmBackend.CUTLASS

    def to_json(self) -> dict:
        return {"name": self.name, **({"evt": self.evt} if self.evt is not None else {})}

    @classmethod
    def from_json(cls, d: dict) -> CutlassConfig:
        return cls(str(d["name"]), d.get("evt"))


GemmConfig = Union[BlasConfig, BlasLtConfig, CppConfig, TritonConfig, GemvConfig,
                   CutlassConfig]


def config_from_json(backend: str, d: dict) -> GemmConfig:
    """The config of a `backend` choice from its JSON (a manifest's or the cache's)."""
    b = GemmBackend(backend)
    if b is GemmBackend.BLAS:
        return BlasLtConfig(int(d["algo"])) if "algo" in d else BlasConfig()
    if b is GemmBackend.CPP:
        return CppConfig.from_json(d)
    if b is GemmBackend.TRITON:
        return GemvConfig.from_json(d) if d.get("gemv") else TritonConfig.from_json(d)
    return CutlassConfig.from_json(d)
