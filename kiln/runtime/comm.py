"""Communicators of packages whose programs run collectives (see kiln.h:
kiln_model_set_comm): `attach` gives a loaded Runner its communicator, `nccl_unique_id` makes
the 128-byte NCCL id one rank shares with the others (through a file, a pipe,
torch.distributed's broadcast_object_list, ...).

libnccl.so.2 comes from the NVIDIA NCCL wheel torch depends on (nvidia-nccl-cu12 /
nvidia-nccl-cu13: `site-packages/nvidia/nccl/lib`), else $KILN_NCCL_LIB, else the dynamic
loader's path; it is opened with ctypes here, and by the model library (dlopen) at attach."""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import sys

from kiln.errors import KilnError

NCCL_UNIQUE_ID_BYTES = 128


def nccl_library_path() -> str:
    """The libnccl.so.2 to open: $KILN_NCCL_LIB, else the NVIDIA wheel's, else the soname."""
    env = os.environ.get("KILN_NCCL_LIB")
    if env:
        return env
    for base in sys.path:
        hits = sorted(glob.glob(os.path.join(base, "nvidia", "nccl", "lib", "libnccl.so*")))
        if hits:
            return hits[0]
    return "libnccl.so.2"


@functools.lru_cache(maxsize=None)
def _nccl() -> ctypes.CDLL:
    path = nccl_library_path()
    try:
        return ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise KilnError(f"cannot open NCCL ({path}): {e}; install the nvidia-nccl-cu12/cu13 "
                        "wheel or set KILN_NCCL_LIB") from e


def nccl_unique_id() -> bytes:
    """A fresh ncclUniqueId (128 bytes): make it on one rank, pass it to every rank's
    `kiln.load(..., comm_id=)`."""
    buf = ctypes.create_string_buffer(NCCL_UNIQUE_ID_BYTES)
    rc = _nccl().ncclGetUniqueId(buf)
    if rc != 0:
        raise KilnError(f"ncclGetUniqueId failed (ncclResult {rc})")
    return buf.raw


def attach(lib: ctypes.CDLL, handle, rank: int, world_size: int, comm_id: bytes | None,
           last_error, cuda: bool = False) -> None:
    """kiln_model_set_comm on `handle` (libkiln `lib`); raises KilnError with its message.
    `cuda`: load the NVIDIA wheel's libnccl.so.2 first (RTLD_GLOBAL), so that the model
    library's dlopen("libnccl.so.2") finds it."""
    for name, v in (("rank", rank), ("world_size", world_size)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if comm_id is not None and not isinstance(comm_id, (bytes, bytearray)):
        raise TypeError(f"comm_id must be bytes (e.g. kiln.runtime.nccl_unique_id()), got "
                        f"{type(comm_id).__name__}")
    if lib.kiln_abi_minor() < 3:
        raise KilnError("this libkiln has no kiln_model_set_comm (ABI minor < 3)")
    fn = lib["kiln_model_set_comm"]
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    data = bytes(comm_id or b"")
    if cuda and not os.environ.get("KILN_NCCL_LIB"):
        _nccl()
    if fn(handle, rank, world_size, data or None, len(data)) != 0:
        raise KilnError(last_error())


__all__ = ["NCCL_UNIQUE_ID_BYTES", "attach", "nccl_library_path", "nccl_unique_id"]
