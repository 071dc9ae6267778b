"""A Triton compile worker of `triton_aot.compile_cubins` and `triton_aot.Pool`, run as a
script (`python .../triton_warm.py TASKS`, or `... --serve`:
started ahead of its tasks, which then come on stdin, `triton_aot.Workers`) so that it imports
only Triton, not kiln or torch (building launchers too: `_launcher`): it starts in well under a
second.

TASKS is a JSON file: {"tasks": [[module path, module name, kernel name, signature,
constexprs, options, arch(, launcher)], ...], "out": directory or absent, "first": the
number of the first task (0 if absent: its files' names count from it), "launchers": bool
(for the tasks without their own launcher flag),
"triton_key": the parent's `triton.runtime.cache.triton_key()`}. Each kernel
is compiled with exactly the arguments `triton_aot.compile_kernel` uses. With "out", task i's
cubin and metadata (`metadata`, plus Triton's hash and cache files of the compile) are written
there as `i.cubin` and `i.json` (the JSON last: a task is done when it exists; a failed task
leaves `i.failed` instead); without, Triton's
on-disk cache then holds what the parent's compile asks for; with "launchers", Triton's host
launcher of each kernel is built too (`_launcher`), before the task's files. A failure is
skipped: the parent's own compile reports it."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time


def compile_args(sig: dict, consts: dict) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) as triton.compiler.ASTSource takes them: pointers are
    16-byte aligned (the CUDA wrapper guarantees it)."""
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values())
             if t.startswith("*")}
    return dict(sig), dict(consts), attrs


def metadata(ck) -> dict:
    """What kiln reads of a Triton CompiledKernel's metadata, as plain data."""
    md = ck.metadata
    return {"name": md.name, "num_warps": md.num_warps, "shared": md.shared,
            "profile_scratch_size": getattr(md, "profile_scratch_size", 0),
            "global_scratch_size": getattr(md, "global_scratch_size", 0),
            "global_scratch_align": getattr(md, "global_scratch_align", 1)}


def main(path: str) -> None:
    # deferred: Triton is optional (GPU builds only)
    import triton
    with open(path) as f:
        job = json.load(f)
    _run(triton, job, {})


def serve() -> None:
    """A worker started ahead of its tasks (`triton_aot.Workers`): Triton imported, then
    jobs read from stdin, one JSON object a line (the first holds only "triton_key"), each
    run as `main` runs its file's, until stdin closes."""
    # deferred: Triton is optional (GPU builds only)
    import triton
    # deferred: Triton is optional (GPU builds only)
    import triton.backends.nvidia.compiler  # noqa: F401 - the first compile's imports, early
    mods: dict = {}
    for line in sys.stdin:
        if line.strip():
            _run(triton, json.loads(line), mods)


def _run(triton, job: dict, mods: dict) -> None:
    # deferred: Triton is optional (GPU builds only)
    from triton.backends.compiler import GPUTarget
    if job.get("triton_key"):  # the parent's: hashing libtriton (400 MB) again costs ~0.5 s
        # deferred: Triton is optional (GPU builds only)
        import triton.runtime.cache as tc
        key = job["triton_key"]
        tc.triton_key = lambda: key
    out = job.get("out")
    for i, (mpath, mname, kname, sig, consts, options, arch, *own) in enumerate(
            job.get("tasks", ()), job.get("first", 0)):
        launcher = own[0] if own else job.get("launchers")  # a task's own flag first
        try:
            if mpath not in mods:
                spec = importlib.util.spec_from_file_location(mname, mpath)
                mod = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(mod)
                mods[mpath] = mod
            sig_, consts_, attrs = compile_args(sig, consts)
            src = triton.compiler.ASTSource(fn=getattr(mods[mpath], kname), signature=sig_,
                                            constexprs=consts_, attrs=attrs)
            t0 = time.perf_counter()
            ck = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
            t1 = time.perf_counter()
            if launcher:  # before the task is marked done: the parent launches it
                _launcher(src, ck)
            seconds = {"compile": t1 - t0, "launcher": time.perf_counter() - t1}
            if out:
                with open(os.path.join(out, f"{i}.cubin"), "wb") as f:
                    f.write(bytes(ck.asm["cubin"]))
                with open(os.path.join(out, f"{i}.json.tmp"), "w") as f:
                    # where Triton's cache holds this compile (`triton_aot.load_compiled`)
                    files = {k: str(v) for k, v in (ck.metadata_group or {}).items()}
                    json.dump({**metadata(ck), "triton": {"hash": ck.hash, "files": files},
                               "seconds": seconds}, f)
                os.replace(os.path.join(out, f"{i}.json.tmp"), os.path.join(out, f"{i}.json"))
        except Exception:  # noqa: BLE001 - the parent's compile reports it
            if out:  # done, without a result (a parent waiting on the task goes on)
                open(os.path.join(out, f"{i}.failed"), "w").close()
            continue


def _launcher(src, ck) -> None:
    """Builds Triton's host launcher of `ck` (a C extension compiled with the system's C
    compiler, one per kernel signature, on the first launch of a kernel) and, once per
    process, Triton's CUDA utilities (`cuda_utils`, another C extension, which the parent's
    first launch loads), so that the parent finds both in Triton's cache: the launch-config
    tuner launches every candidate. Through Triton's NVIDIA driver classes directly, not
    `triton.runtime.driver.active`, whose choice of backend imports torch (2-3 s, longer than
    the compiles it waits for). Needs the CUDA driver library; without it nothing is built (the
    parent builds them)."""
    try:
        # deferred: Triton is optional (GPU builds only)
        from triton.backends.nvidia.driver import CudaLauncher, CudaUtils
        if not hasattr(CudaUtils, "instance"):  # (its __init__ compiles again each call)
            CudaUtils()
        CudaLauncher(src, ck.metadata)
    except Exception:  # noqa: BLE001 - no driver here: the parent's first launch builds it
        pass


if __name__ == "__main__":
    serve() if sys.argv[1] == "--serve" else main(sys.argv[1])
