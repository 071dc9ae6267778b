"""Python front end of libkiln: load a package and call it like the original module.

Input: a package path; at call time the same ``(*args, **kwargs)`` the exported program took.
Output: the outputs as torch tensors in the exported output structure (manifest ``out_spec``).
Invariants: the C ABI of kiln.h is the only path to the model (ctypes over libkiln.so); inputs
are passed as DLTensors pointing at the tensors' own memory with their own strides (the model
validates dtype/device/shape; libkiln copies a CPU input whose strides are not compact into a
scratch buffer of the handle, so transposed, sliced, expanded and channels-last tensors are
valid inputs). Torch tensors and numpy arrays (any strides, negative ones included) are taken;
a CUDA input that is not contiguous or not 16-byte aligned (a slice at an offset) is copied
here, on torch's current stream, since libkiln cannot copy device memory; every
DLManagedTensor returned by the model is either handed to ``torch.from_dlpack`` (which then owns
it and calls its deleter when the tensor dies) or deleted here, exactly once. Runs on one Runner
are serialised by libkiln. A CUDA runner
(``device="cuda:N"``) passes CUDA tensors as kDLCUDA DLTensors and runs on torch's current
stream of its device (``kiln_model_run_on_stream``); its outputs are CUDA tensors ordered on
that stream, as torch's own results would be.

Size: about 810 lines, kept in one module on purpose. The Runner's two call paths (the fast
path's preallocated DLTensor slots and capsule adoption, the general path's ctypes structs)
share the slot layout, the capsule prototypes and the output adoption; split apart they would
import each other's private details. Output aliasing (aliases.py) and call-structure errors
(call_structure.py) have their own modules.
"""
from __future__ import annotations

import ctypes
import functools
import operator
import os
import pathlib
import re
import struct
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree

from kiln.errors import InputError, KilnError, PackageError, UnsupportedError
from kiln.package import read_package
from kiln.package.entries import DEFAULT_ENTRY, entry_manifest, entry_names
from kiln.runtime import dlpack_ctypes as dl
from kiln.runtime import comm
from kiln.runtime.aliases import alias_plan, share_storage
from kiln.runtime.call_structure import output_builder, spec_children, structure_error
from kiln.runtime.preload import preload_cublas, preload_dnnl
from kiln.runtime.build import libkiln_path
from kiln.runtime.weights import checked_tensors, write_weights_file

KILN_ABI_VERSION = 1
# the fast path's (device_type, device_id, code, bits, lanes) of a CPU tensor, by torch dtype
# (complex ones left out: a conjugate view of one takes the general path, which resolves it)
_CPU_FIELDS: dict = {d: (dl.KDL_CPU, 0, code, bits, 1) for d, (code, bits) in
                     dl.DTYPE_TO_DL.items() if code != dl.KDL_COMPLEX}
_FAST_RANK = 8  # the fast path's most dimensions per input (more: the general path)
# one fast-path input: its DLTensor (data, device, ndim, dtype, shape, strides, byte_offset;
# 48 bytes, as dlpack_ctypes.DLTensor), then room for _FAST_RANK sizes and _FAST_RANK strides
_DLT_HEAD = "=QiiiBBHQQQ"
_SLOT = struct.calcsize(_DLT_HEAD) + 16 * _FAST_RANK
assert struct.calcsize(_DLT_HEAD) == ctypes.sizeof(dl.DLTensor)
_PTR_FMT = struct.Struct("=Q").pack_into  # a slot's data pointer (its DLTensor's first field)
_SLOT_FMT = [struct.Struct(f"{_DLT_HEAD}{r}q{8 * (_FAST_RANK - r)}x{r}q").pack_into
             for r in range(_FAST_RANK + 1)]


@functools.lru_cache(maxsize=None)
def _i64_array(n: int) -> type:
    """The ctypes array type of `n` int64s (at least one, so its address is never NULL)."""
    return ctypes.c_int64 * max(n, 1)


# torch's C entry points, where this torch has them: the public wrappers around them cost
# microseconds per call (argument checks, Stream objects), a large share of a small model's run.
_from_capsule = getattr(torch._C, "_from_dlpack", None) or torch.from_dlpack
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_CAPSULE_NAME = ctypes.create_string_buffer(b"dltensor")  # must outlive every capsule
_CAPSULE_ADDR = ctypes.addressof(_CAPSULE_NAME)
_USED_NAME = b"used_dltensor"

# Prototypes of kiln's own: `ctypes.pythonapi.X` is one shared object per process, whose
# argtypes any other module may set differently.
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_void_p)(("PyCapsule_New", ctypes.pythonapi))
_capsule_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(
    ("PyCapsule_GetName", ctypes.pythonapi))


_LIBKILN: list[ctypes.CDLL] = []  # the process's one libkiln, once loaded
_LIBKILN_LOCK = threading.Lock()


def libkiln(package: str | os.PathLike[str] | None = None) -> ctypes.CDLL:
    """libkiln.so, loaded once per process: the installed or cached copy, else the one
    `package` carries (kiln/runtime/build.py; no compiler runs unless none exists)."""
    if _LIBKILN:
        return _LIBKILN[0]
    with _LIBKILN_LOCK:
        if not _LIBKILN:
            _LIBKILN.append(_open_libkiln(libkiln_path(package)))
    return _LIBKILN[0]


def _open_libkiln(path: pathlib.Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.kiln_abi_version.restype = ctypes.c_int
    lib.kiln_abi_version.argtypes = []
    lib.kiln_model_load.restype = ctypes.c_int
    lib.kiln_model_load.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(vp)]
    lib.kiln_model_num_inputs.restype = i64
    lib.kiln_model_num_inputs.argtypes = [vp]
    lib.kiln_model_num_outputs.restype = i64
    lib.kiln_model_num_outputs.argtypes = [vp]
    lib.kiln_model_run.restype = ctypes.c_int
    lib.kiln_model_run_on_stream.restype = ctypes.c_int
    lib.kiln_model_run_on_stream.argtypes = [vp, ctypes.POINTER(ctypes.POINTER(dl.DLTensor)), i64,
                                             ctypes.POINTER(vp), i64, vp]
    lib.kiln_model_run.argtypes = [vp, ctypes.POINTER(ctypes.POINTER(dl.DLTensor)), i64,
                                   ctypes.POINTER(vp), i64]
    lib.kiln_last_error.restype = ctypes.c_char_p
    lib.kiln_last_error.argtypes = []
    lib.kiln_model_update_weights.restype = ctypes.c_int
    lib.kiln_model_update_weights.argtypes = [vp, ctypes.c_char_p]
    lib.kiln_abi_minor.restype = ctypes.c_int
    lib.kiln_abi_minor.argtypes = []
    lib.kiln_model_set_num_threads.restype = ctypes.c_int
    lib.kiln_model_set_num_threads.argtypes = [vp, ctypes.c_int]
    lib.kiln_model_num_threads.restype = ctypes.c_int
    lib.kiln_model_num_threads.argtypes = [vp]
    lib.kiln_model_free.restype = None
    lib.kiln_model_free.argtypes = [vp]
    lib.kiln_cpu_supports.restype = ctypes.c_int
    lib.kiln_cpu_supports.argtypes = [ctypes.c_char_p]
    lib.kiln_model_cpu_level.restype = ctypes.c_char_p
    lib.kiln_model_cpu_level.argtypes = [vp]
    cp, sz = ctypes.c_char_p, ctypes.c_size_t
    for name, res, args in (  # minor 5: entry points, state, sampling
            ("kiln_model_num_entries", i64, [vp]),
            ("kiln_model_entry_name", cp, [vp, i64]),
            ("kiln_model_entry_num_inputs", i64, [vp, cp]),
            ("kiln_model_entry_num_outputs", i64, [vp, cp]),
            ("kiln_model_reset_state", ctypes.c_int, [vp]),
            ("kiln_model_num_state", i64, [vp]),
            ("kiln_model_state_name", cp, [vp, i64]),
            ("kiln_model_state_nbytes", i64, [vp, i64]),
            ("kiln_model_read_state", ctypes.c_int, [vp, i64, vp, sz]),
            ("kiln_model_write_state", ctypes.c_int, [vp, i64, vp, sz]),
            ("kiln_model_copy_state", ctypes.c_int, [vp, vp]),
            ("kiln_sample", ctypes.c_int, [ctypes.POINTER(dl.DLTensor), ctypes.c_float, i64,
                                           ctypes.c_float, ctypes.POINTER(ctypes.c_uint64),
                                           ctypes.POINTER(i64)])):
        getattr(lib, name).restype = res
        getattr(lib, name).argtypes = args
    if lib.kiln_abi_version() != KILN_ABI_VERSION:
        raise KilnError(f"libkiln ABI version {lib.kiln_abi_version()}, expected "
                        f"{KILN_ABI_VERSION}")
    return lib


def last_error() -> str:
    return (libkiln().kiln_last_error() or b"").decode("utf-8", "replace")


def cpu_supports(feature: str) -> bool | None:
    """Whether this CPU (and OS) supports the instruction-set extension `feature`, named as
    manifests list them (requires.cpu_features: "avx2", "avx512f", ...); None when libkiln
    does not know the name. `load` refuses a package needing a feature this CPU lacks."""
    r = libkiln().kiln_cpu_supports(feature.encode())
    return None if r < 0 else bool(r)


class Runner:
    """A loaded model. Call it with the exported program's arguments."""

    def __init__(self, path: str | os.PathLike[str], device: str = "cpu",
                 num_threads: int | None = None) -> None:
        self._handle: ctypes.c_void_p | None = None
        self._path = pathlib.Path(path)
        self._device = _parse_device(device)
        if self._device.type == "cuda":
            preload_cublas()
        self._manifest = read_package(self._path).manifest
        if any("libdnnl" in str(lib) for lib in self._manifest.get("requires", {}).get(
                "shared_libraries", ())):
            preload_dnnl()
        self._entries: dict[str, _Entry] = {}
        self._lib = libkiln(self._path)
        handle = ctypes.c_void_p()
        if self._lib.kiln_model_load(os.fsencode(self._path), str(self._device).encode(),
                                     ctypes.byref(handle)) != 0:
            raise PackageError(last_error())
        self._handle = handle
        if num_threads is not None:
            try:
                self.num_threads = num_threads
            except (KilnError, TypeError):
                self.close()
                raise
        self._bind(self._manifest, None)

    def _bind(self, m: Mapping[str, Any], entry: str | None) -> None:
        """The call machinery of one entry point (None: the default one) from its manifest."""
        self._in_spec = pytree.treespec_loads(m["in_spec"]) if "in_spec" in m else None
        self._out_spec = pytree.treespec_loads(m["out_spec"]) if "out_spec" in m else None
        self._names = [str(i.get("name", f"arg{k}")) if isinstance(i, dict) else f"arg{k}"
                       for k, i in enumerate(m.get("inputs", []))]
        self._inputs = [i for i in m.get("inputs", []) if isinstance(i, dict)]
        handle = self._handle
        if entry is None:
            self._n_in = int(self._lib.kiln_model_num_inputs(handle))
            self._n_out = int(self._lib.kiln_model_num_outputs(handle))
        else:
            self._n_in = int(self._lib.kiln_model_entry_num_inputs(handle, entry.encode()))
            self._n_out = int(self._lib.kiln_model_entry_num_outputs(handle, entry.encode()))
            if self._n_in < 0 or self._n_out < 0:
                raise KilnError(last_error())
        self._constants = {int(c["index"]): c for c in m.get("constant_inputs", [])}
        self._int_outputs = [k for k, o in enumerate(m.get("outputs", []))
                             if isinstance(o, dict) and (o.get("python_int") or
                                                         o.get("python_number"))]
        # ints marked dynamic at export: passed to the model as 0-d int64 host tensors
        self._int_inputs = {k for k, i in enumerate(m.get("inputs", []))
                            if isinstance(i, dict) and i.get("python_int")}
        self._positional = self._in_spec is not None and self._in_spec == pytree.tree_flatten(
            (tuple(range(self._in_spec.num_leaves)), {}))[1]
        if self._in_spec is not None and \
                self._in_spec.num_leaves - len(self._constants) != self._n_in:
            self.close()
            raise PackageError(f"package '{self._path}': in_spec has "
                               f"{self._in_spec.num_leaves} leaves, the model {self._n_in} inputs")
        # outputs after the user outputs: new contents of inputs the program writes in place
        self._writes = [(int(w["input"]), int(w["output"]))
                        for w in m.get("input_mutations", [])]
        n_user = self._n_out - len(self._writes)
        if self._out_spec is not None and self._out_spec.num_leaves != n_user:
            self.close()
            raise PackageError(f"package '{self._path}': out_spec has {self._out_spec.num_leaves}"
                               f" leaves, the model {self._n_out} outputs")
        self._unflatten = output_builder(self._out_spec)
        self._aliases = alias_plan(m)  # outputs returned as views, as eager shares storage
        self._inputs_t = ctypes.POINTER(dl.DLTensor) * max(self._n_in, 1)
        self._outputs_t = ctypes.c_void_p * max(self._n_out, 1)
        # the fast path (_call_fast): positional tensors written straight into preallocated
        # DLTensors; programs with specialised constants or int inputs take the general path
        self._fast = (self._in_spec is None or self._positional) and not self._constants \
            and not self._int_inputs
        self._free: list[_Scratch] = []  # idle scratch buffers (one per call in flight)
        vp, i64 = ctypes.c_void_p, ctypes.c_int64
        self._cuda = self._device.type == "cuda"
        # ctypes objects built once (this handle, the counts; the scratch's pointers): no
        # per-call argument conversion (kiln_model_run has no argtypes: every argument of
        # every call must be a ctypes object of the C type)
        self._run_args = (ctypes.c_void_p(handle.value), ctypes.c_int64(self._n_in),
                          ctypes.c_int64(self._n_out))
        if entry is not None:  # kiln_model_run_entry(_on_stream) with the entry's name
            fn = self._lib["kiln_model_run_entry_on_stream" if self._cuda else
                           "kiln_model_run_entry"]
            fn.argtypes = [vp, ctypes.c_char_p, vp, i64, vp, i64] + [vp] * self._cuda
            fn.restype = ctypes.c_int
            name = entry.encode()
            self._run_raw = lambda h, *rest: fn(h, name, *rest)
            return
        if self._cuda:
            self._run_raw = self._lib["kiln_model_run_on_stream"]  # a fresh function object
            self._run_raw.argtypes = [vp, vp, i64, vp, i64, vp]
        else:
            self._run_raw = self._lib["kiln_model_run"]
        self._run_raw.restype = ctypes.c_int

    @property
    def manifest(self) -> dict[str, Any]:
        return self._manifest

    @property
    def cpu_level(self) -> str:
        """The -march level of the code loaded: for a portable package (Options(march=
        "portable")) the best of its levels this CPU runs, e.g. "x86-64-v4"; else the
        package's one build ("native", "x86-64-v3", "" without -march)."""
        if self._handle is None:
            raise KilnError(f"kiln: runner for '{self._path}' is closed")
        return self._lib.kiln_model_cpu_level(self._handle).decode()

    @property
    def num_inputs(self) -> int:
        return self._n_in

    @property
    def num_outputs(self) -> int:
        return self._n_out

    @property
    def num_threads(self) -> int:
        """This handle's thread budget per run (the threads of the model's own pool); 0 (the
        default) is automatic: OMP_NUM_THREADS, else the CPUs the process may use, divided
        by the number of kiln runs in flight."""
        if self._handle is None:
            raise KilnError(f"kiln: runner for '{self._path}' is closed")
        return int(self._lib.kiln_model_num_threads(self._handle))

    @num_threads.setter
    def num_threads(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"num_threads must be an int (0: automatic), got {type(n).__name__}")
        if self._handle is None:
            raise KilnError(f"kiln: runner for '{self._path}' is closed")
        if not -2**31 <= n < 2**31:  # would not fit the C int
            raise KilnError(f"kiln_model_set_num_threads: num_threads must be in [0, 4096] "
                            f"(0: automatic), got {n}")
        if self._lib.kiln_model_set_num_threads(self._handle, n):
            raise KilnError(last_error())

    @property
    def input_specs(self) -> list[dict[str, Any]]:
        """The manifest's records of this entry point's flat inputs (name, dtype, shape)."""
        return list(self._inputs)

    @property
    def positional(self) -> bool:
        """Whether the program takes its inputs as plain positional arguments."""
        return self._in_spec is None or self._positional

    @property
    def entries(self) -> list[str]:
        """The package's entry points ("forward" for a package of one program)."""
        return entry_names(self._manifest)

    def entry(self, name: str) -> Runner:
        """Entry point `name`, callable like the runner, sharing its weights and state (also
        `runner.<name>(...)`). An unknown name raises KilnError naming the entry points."""
        if self._handle is None:
            raise KilnError(f"kiln: runner for '{self._path}' is closed")
        e = self._entries.get(name)
        if e is None:
            if "entries" not in self._manifest and name == DEFAULT_ENTRY:
                return self
            e = self._entries[name] = _Entry(self, name, entry_manifest(self._manifest, name))
        return e

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or "_manifest" not in self.__dict__:
            raise AttributeError(name)
        if name in entry_names(self._manifest):
            return self.entry(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r} (the "
                             f"package's entry points: {', '.join(self.entries)})")

    def _check_open(self) -> None:
        if self._handle is None:
            raise KilnError(f"kiln: runner for '{self._path}' is closed")
        if self._device.type == "cuda":  # state copies are on the legacy default stream:
            torch.cuda.synchronize(self._device)  # runs on torch's streams finish first

    def reset_state(self) -> None:
        """Every state buffer (KV cache, counters: the buffers the programs update) back to
        its value in the package (or in the last update_weights)."""
        self._check_open()
        if self._lib.kiln_model_reset_state(self._handle):
            raise KilnError(last_error())

    def _state_slots(self) -> list[tuple[int, str, dict[str, Any]]]:
        """(index, key, manifest weight record) of each state buffer."""
        self._check_open()
        records = {w["name"]: w for w in self._manifest.get("weights", [])}
        out = []
        for i in range(int(self._lib.kiln_model_num_state(self._handle))):
            key = self._lib.kiln_model_state_name(self._handle, i)
            if key is None:
                raise KilnError(last_error())
            key = key.decode()
            out.append((i, key, records.get(key, {"name": key, "fqn": key})))
        return out

    def state(self) -> dict[str, torch.Tensor]:
        """A copy of every state buffer, by FQN (CPU tensors): load_state takes it back, into
        this runner or another handle of the same package."""
        out = {}
        for i, key, rec in self._state_slots():
            n = int(self._lib.kiln_model_state_nbytes(self._handle, i))
            t = torch.empty(rec["shape"], dtype=getattr(torch, rec["dtype"])) if "shape" in rec \
                else torch.empty(n, dtype=torch.uint8)
            if t.numel() * t.element_size() != n:
                raise KilnError(f"state buffer {key!r}: {n} bytes, the manifest says "
                                f"{rec.get('dtype')}{rec.get('shape')}")
            if self._lib.kiln_model_read_state(self._handle, i, t.data_ptr(), n):
                raise KilnError(last_error())
            out[rec.get("fqn") or key] = t
        return out

    def load_state(self, state: Mapping[str, Any] | Runner) -> None:
        """Sets the state buffers: from `state()`'s dict (keys FQNs or the package's names;
        every buffer must be given) or from another Runner of the same package (its state
        copied, e.g. to fork a KV cache)."""
        self._check_open()
        if isinstance(state, Runner):
            state._check_open()
            if self._lib.kiln_model_copy_state(self._handle, state._handle):
                raise KilnError(last_error())
            return
        slots = self._state_slots()
        given = {}
        for i, key, rec in slots:
            t = state.get(rec.get("fqn"), state.get(key)) if rec.get("fqn") else state.get(key)
            if t is None:
                names = ", ".join(r.get("fqn") or k for _, k, r in slots)
                raise InputError(f"load_state: missing state buffer {rec.get('fqn') or key!r} "
                                 f"(the model's: {names})")
            if not isinstance(t, torch.Tensor):
                raise InputError(f"load_state: {key!r}: expected a tensor, got "
                                 f"{type(t).__name__}")
            want = (str(t.dtype).removeprefix("torch."), list(t.shape))
            if "shape" in rec and want != (rec["dtype"], list(rec["shape"])):
                raise InputError(f"load_state: state buffer {rec.get('fqn') or key!r}: expected "
                                 f"{rec['dtype']}{list(rec['shape'])}, got {want[0]}{want[1]}")
            given[i] = t.detach().to("cpu").contiguous()
        for i, t in given.items():
            if self._lib.kiln_model_write_state(self._handle, i, t.data_ptr(),
                                                t.numel() * t.element_size()):
                raise KilnError(last_error())

    def close(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            self._lib.kiln_model_free(handle)

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def _name(self, i: int) -> str:
        return self._names[i] if i < len(self._names) else f"arg{i}"

    def _flatten(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        if self._positional and not kwargs and len(args) == self._in_spec.num_leaves and \
                not any(isinstance(a, (list, tuple, dict)) for a in args):
            return self._drop_constants(list(args))  # plain positional leaves: no pytree work
        if self._in_spec is None:
            if kwargs:
                raise InputError("this model takes no keyword arguments")
            return list(args)
        flat, spec = pytree.tree_flatten((args, kwargs))
        if spec != self._in_spec and kwargs:  # same keywords in another order
            try:
                order = spec_children(self._in_spec)[1].context
                if sorted(order) == sorted(kwargs):
                    flat, spec = pytree.tree_flatten((args, {k: kwargs[k] for k in order}))
            except (AttributeError, IndexError, TypeError):
                pass
        if spec != self._in_spec:
            names, rest = [], iter(self._names)
            for k in range(self._in_spec.num_leaves):
                names.append(self._constants[k]["name"] if k in self._constants
                             else next(rest, f"arg{k}"))
            raise InputError(structure_error(self._in_spec, names, args, kwargs))
        return self._drop_constants(flat)

    def _drop_constants(self, flat: list[Any]) -> list[Any]:
        """Scalars the export specialised: check each equals the exported value, then drop it."""
        if not self._constants:
            return flat
        for k, c in self._constants.items():
            got, want = flat[k], c["value"]
            if type(got) is not type(want) or got != want:
                raise InputError(f"input {k} ({c['name']}): the program was exported with the "
                                 f"constant {want!r}, got {got!r} (mark it dynamic at export to "
                                 "vary it)")
        return [x for k, x in enumerate(flat) if k not in self._constants]

    def _int_tensor(self, i: int, v: Any) -> torch.Tensor:
        """An int input (exported as a dynamic Python int) as the 0-d int64 CPU tensor the
        model reads its value from; its range is checked by the model."""
        if isinstance(v, torch.Tensor) and v.dim() == 0 and not v.is_floating_point() \
                and not v.is_complex() and v.dtype != torch.bool:
            v = int(v.item())
        if not isinstance(v, bool):
            try:
                v = operator.index(v)  # numpy ints too
            except TypeError:
                pass
        if isinstance(v, bool) or not isinstance(v, int):
            raise InputError(f"input {i} ({self._name(i)}): expected an int, got "
                             f"{type(v).__name__}")
        if not -2**63 <= v < 2**63:
            raise InputError(f"input {i} ({self._name(i)}): {v} does not fit in int64")
        return torch.tensor(v, dtype=torch.int64)

    def _dltensor(self, i: int, t: Any, keep: list[Any]) -> dl.DLTensor:
        if isinstance(t, np.ndarray):
            return self._dl_numpy(i, t, keep)
        if not isinstance(t, torch.Tensor):
            raise InputError(f"input {i} ({self._name(i)}): expected a torch.Tensor, got "
                             f"{type(t).__name__}")
        if t.layout != torch.strided:
            raise InputError(f"input {i} ({self._name(i)}): expected a strided tensor, got "
                             f"layout {t.layout}")
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()
        f = _fields(t)
        if f is None:
            raise InputError(f"input {i} ({self._name(i)}): unsupported dtype/device "
                             f"{t.dtype}/{t.device}")
        if not t.is_cpu and (not t.is_contiguous() or t.data_ptr() % 16):
            # libkiln copies only host memory, and CUDA kernels read 16-byte aligned inputs: a
            # strided or offset view (a slice of a token stream) is copied here
            t = t.clone(memory_format=torch.contiguous_format)
        n = t.dim()
        arr = _i64_array(n)
        shape, strides = arr(*t.shape), arr(*t.stride())
        keep += [t, shape, strides]
        device, dtype = _dl_structs(f)
        return dl.DLTensor(t.data_ptr(), device, n, dtype, shape, strides, 0)

    def _dl_numpy(self, i: int, a: np.ndarray, keep: list[Any]) -> dl.DLTensor:
        """A numpy array as a CPU DLTensor over its own memory and strides (negative and
        zero strides included; libkiln copies a non-compact one in)."""
        code = _NP_TO_DL.get(a.dtype.newbyteorder("=")) if a.dtype.isnative else None
        if code is None:
            raise InputError(f"input {i} ({self._name(i)}): unsupported numpy dtype {a.dtype}")
        if any(st % a.itemsize for st in a.strides):  # not whole elements (a record field)
            a = np.ascontiguousarray(a)
        n = a.ndim
        arr = _i64_array(n)
        shape, strides = arr(*a.shape), arr(*[st // a.itemsize for st in a.strides])
        keep += [a, shape, strides]
        device, dtype = _dl_structs((dl.KDL_CPU, 0, *code, 1))
        return dl.DLTensor(a.__array_interface__["data"][0], device, n, dtype, shape, strides, 0)

    def update_weights(self, weights: Mapping[str, Any] | str | os.PathLike[str]) -> None:
        """Replace the weights without recompiling: a safetensors file (keys are the manifest's
        weight names) or a state_dict (keys are FQNs). Checked against the manifest; atomic
        with respect to concurrent runs."""
        if self._handle is None:
            raise KilnError(f"kiln: runner for '{self._path}' is closed")
        if isinstance(weights, (str, os.PathLike)):
            path, temporary = os.fspath(weights), False
        else:
            path = write_weights_file(checked_tensors(self._manifest, weights))
            temporary = True
        try:
            if self._lib.kiln_model_update_weights(self._handle, os.fsencode(path)):
                msg = last_error()
                raise (InputError if "weight" in msg else KilnError)(msg)
        finally:
            if temporary:
                os.unlink(path)  # the model keeps its mapping; the name is no longer needed

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._handle is None:
            raise KilnError(f"kiln: runner for '{self._path}' is closed")
        if self._fast and not kwargs and len(args) == self._n_in:
            out = self._call_fast(args)
            if out is not _MISS:
                return out
        return self._call_general(args, kwargs)

    def _call_fast(self, args: tuple[Any, ...]) -> Any:
        """The run for plain strided tensors of a DLPack dtype and device, at most _FAST_RANK
        dimensions, passed positionally: each one's DLTensor is written into a scratch buffer
        kept by this runner (one struct.pack_into per input), no ctypes objects made per call.
        The model gets the same DLTensors as from the general path and checks them the same
        way; any other input returns _MISS and the general path takes the call (and raises the
        same errors it always has)."""
        free = self._free
        try:
            s = free.pop()
        except IndexError:  # first call, or every scratch in use by a concurrent call
            s = _Scratch(self._n_in, self._n_out)
        try:
            buf, base, off, last = s.buf, s.base, 0, s.last
            for i, t in enumerate(args):
                if type(t) is not torch.Tensor or t.layout is not torch.strided or t.is_neg():
                    return _MISS
                if t.is_cpu:
                    f = _CPU_FIELDS.get(t.dtype)  # no complex dtypes: no conj views
                elif t.is_conj() or not t.is_contiguous() or t.data_ptr() & 15:
                    # the general path copies it
                    return _MISS
                else:
                    f = _fields(t)
                shape, stride = t.shape, t.stride()
                key = (f, shape, stride)
                if key == last[i]:  # this slot holds the same DLTensor but for its data
                    _PTR_FMT(buf, off, t.data_ptr())
                    off += _SLOT
                    continue
                n = len(shape)
                if f is None or n > _FAST_RANK:
                    return _MISS
                a = base + off + 48
                last[i] = None  # (a failed pack leaves no stale key)
                _SLOT_FMT[n](buf, off, t.data_ptr(), f[0], f[1], n, f[2], f[3], f[4], a,
                             a + 8 * _FAST_RANK, 0, *shape, *stride)
                last[i] = key
                off += _SLOT
            if self._cuda:
                stream = (_raw_stream(self._device.index) if _raw_stream is not None else
                          torch.cuda.current_stream(self._device).cuda_stream)
                rc = self._run_raw(self._handle, s.inputs, self._n_in, s.outputs, self._n_out,
                                   stream)
            else:
                h, n_in, n_out = self._run_args
                rc = self._run_raw(h, s.inputs_arg, n_in, s.outputs_arg, n_out)
            if rc:
                msg = last_error()
                raise (InputError if msg.startswith("input ") else KilnError)(msg)
            results = _adopt_pointers(s.read_outputs(buf, s.out_off))
        finally:
            free.append(s)
        if self._writes:
            results = self._write_inputs(results, args)
        if self._aliases:
            share_storage(self._aliases, results, args)
        for k in self._int_outputs:  # numbers the program returns (Python ints, ...)
            results[k] = results[k].item()  # int, float or bool
        return self._unflatten(results)

    def _write_inputs(self, results: list, inputs) -> list:
        """The program's in-place writes of user inputs (manifest `input_mutations`): each
        extra output copied into the caller's tensor (any strides), then dropped."""
        with torch.no_grad():
            for i, k in self._writes:
                inputs[i].copy_(results[k])
        return results[:self._n_out - len(self._writes)]

    def _call_general(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        flat = self._flatten(args, kwargs)
        if len(flat) != self._n_in:
            raise InputError(f"expected {self._n_in} inputs, got {len(flat)}")
        keep: list[Any] = []
        for k in self._int_inputs:
            flat[k] = self._int_tensor(k, flat[k])
        flat = list(flat)  # the caller's objects stay in `flat` (outputs may be their views)
        structs = [self._dltensor(i, t, keep) for i, t in enumerate(flat)]
        inputs = self._inputs_t(*[ctypes.pointer(s) for s in structs])
        outputs = self._outputs_t()
        h, n_in, n_out = self._run_args
        args = (h, ctypes.c_void_p(ctypes.addressof(inputs)), n_in,
                ctypes.c_void_p(ctypes.addressof(outputs)), n_out)
        if self._device.type == "cuda":
            stream = (_raw_stream(self._device.index) if _raw_stream is not None else
                      torch.cuda.current_stream(self._device).cuda_stream)
            rc = self._run_raw(*args, stream)
        else:
            rc = self._run_raw(*args)
        if rc:
            msg = last_error()
            raise (InputError if msg.startswith("input ") else KilnError)(msg)
        results = _adopt_outputs(outputs, self._n_out)
        if self._writes:
            results = self._write_inputs(results, flat)
        if self._aliases:
            share_storage(self._aliases, results, flat)
        for k in self._int_outputs:  # numbers the program returns (Python ints, ...)
            results[k] = results[k].item()  # int, float or bool
        return self._unflatten(results)


_MISS = object()  # _call_fast: not a fast-path call


class _Entry(Runner):
    """One entry point of a loaded package (`Runner.entry`): called like the Runner, on the
    runner's handle, weights and state; closing the runner closes it."""

    def __init__(self, parent: Runner, name: str, manifest: Mapping[str, Any]) -> None:
        self._parent = parent
        self._path, self._device, self._lib = parent._path, parent._device, parent._lib
        self._manifest = parent._manifest
        self._entries = parent._entries
        self._entry_name = name
        self._bind(manifest, name)

    @property
    def _handle(self):  # the runner's (None once it is closed)
        return self._parent._handle

    def close(self) -> None:  # the runner owns the handle
        pass

    def __repr__(self) -> str:
        return f"<kiln entry point {self._entry_name!r} of {self._path}>"


class _Scratch:
    """One fast-path call's memory: _SLOT bytes per input (its DLTensor, sizes, strides), the
    array of pointers to those DLTensors, the model's output pointers."""

    __slots__ = ("buf", "base", "inputs", "outputs", "out_off", "read_outputs", "inputs_arg",
                 "outputs_arg", "last")

    def __init__(self, n_in: int, n_out: int) -> None:
        ptrs = n_in * _SLOT
        self.out_off = ptrs + 8 * max(n_in, 1)
        self.buf = ctypes.create_string_buffer(self.out_off + 8 * max(n_out, 1))
        self.base = ctypes.addressof(self.buf)
        self.inputs = self.base + ptrs
        self.outputs = self.base + self.out_off
        struct.pack_into(f"={n_in}Q", self.buf, ptrs,
                         *[self.base + i * _SLOT for i in range(n_in)])
        self.read_outputs = struct.Struct(f"={n_out}Q").unpack_from
        self.inputs_arg = ctypes.c_void_p(self.inputs)
        self.outputs_arg = ctypes.c_void_p(self.outputs)
        # per input slot: (fields, shape, strides) of the DLTensor written there last; a call
        # with the same ones rewrites only the data pointer
        self.last: list = [None] * n_in


# numpy dtype -> (DLDataTypeCode, bits), for numpy inputs (numpy has no bfloat16 / float8)
_NP_TO_DL: dict = {}
for _t, _code in dl.DTYPE_TO_DL.items():
    if _t == torch.complex32:  # numpy has no complex32 (and torch warns on an empty one)
        continue
    try:
        _NP_TO_DL[np.dtype(torch.empty(0, dtype=_t).numpy().dtype)] = _code
    except (TypeError, RuntimeError):
        pass

_FIELDS: dict = {}  # (torch dtype, device) -> the fast path's fields, None: not DLPack's


def _fields(t: torch.Tensor) -> tuple[int, int, int, int, int] | None:
    key = (t.dtype, t.device)
    try:
        return _FIELDS[key]
    except KeyError:
        code, dev = dl.DTYPE_TO_DL.get(t.dtype), dl.dl_device(t.device)
        f = _FIELDS[key] = None if code is None or dev is None else (*dev, *code, 1)
        return f


@functools.lru_cache(maxsize=None)
def _dl_structs(f: tuple[int, int, int, int, int]) -> tuple[dl.DLDevice, dl.DLDataType]:
    """The general path's DLDevice and DLDataType of `_fields` (copied into each DLTensor)."""
    return dl.DLDevice(f[0], f[1]), dl.DLDataType(*f[2:])


def _adopt_pointers(ptrs: tuple[int, ...]) -> list[torch.Tensor]:
    """The model's DLManagedTensors (addresses, none NULL after a successful run) as torch
    tensors; on failure frees those torch did not take."""
    results: list[torch.Tensor] = []
    owned = 0  # ptrs[:owned] belong to torch
    try:
        for ptr in ptrs:
            capsule = _capsule_new(ptr, _CAPSULE_ADDR, None)
            try:
                results.append(_from_capsule(capsule))
            except BaseException:
                if _capsule_name(capsule) == _USED_NAME:
                    owned += 1
                raise
            owned += 1  # torch renames the capsule once it owns the tensor
    except BaseException:
        for ptr in ptrs[owned:]:
            _delete(ptr)
        raise
    return results


def _delete(ptr: int) -> None:
    managed = dl.DLManagedTensor.from_address(ptr)
    if managed.deleter:
        managed.deleter(ptr)


def _adopt_outputs(outputs: ctypes.Array, n: int) -> list[torch.Tensor]:
    """Turns the model's DLManagedTensors into torch tensors; frees the rest on failure."""
    return _adopt_pointers(tuple(outputs[:n]))


def _parse_device(device: str | torch.device) -> torch.device:
    text = str(device)
    if text == "cpu" or re.fullmatch(r"cuda(:\d+)?", text):
        d = torch.device(text)
        return torch.device("cuda", d.index or 0) if d.type == "cuda" else d
    raise UnsupportedError(f"kiln: unsupported device {text!r} (use 'cpu', 'cuda' or 'cuda:N')")


def load(path: str | os.PathLike[str], device: str = "cpu",
         num_threads: int | None = None, rank: int | None = None,
         world_size: int | None = None, comm_id: bytes | None = None) -> Runner:
    """Opens the package at ``path`` for ``device`` ("cpu", "cuda", "cuda:N"; the package must
    have been compiled for that kind of device) and returns a callable Runner. ``num_threads``:
    threads per run of this handle (CPU: the model's own pool); None or 0 is automatic
    (OMP_NUM_THREADS, else the CPUs the process may use, divided by the kiln runs in flight).
    ``rank``, ``world_size``, ``comm_id``: for a package whose program runs collectives, this
    process's rank among ``world_size`` ranks joined by ``comm_id`` (CUDA: NCCL, a
    `kiln.runtime.nccl_unique_id()` shared by the ranks; CPU: MPI under mpirun, comm_id
    optional); every rank loads at the same time (see kiln.h: kiln_model_set_comm)."""
    runner = Runner(path, device, num_threads)
    if rank is not None or world_size is not None or comm_id is not None:
        if rank is None or world_size is None:
            runner.close()
            raise KilnError("kiln.load: give both rank= and world_size= (and comm_id= for NCCL)")
        try:
            comm.attach(runner._lib, runner._handle, rank, world_size, comm_id, last_error,
                        cuda=runner._cuda)
        except BaseException:
            runner.close()
            raise
    return runner
