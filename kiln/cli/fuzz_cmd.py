"""``kiln fuzz --n N --seed S [--out DIR]``: differential fuzzing (see :mod:`kiln.fuzz`).

Program k of a run is generated from seed ``S * 1_000_003 + k``, so one failing program is
rerun with ``--seed S --start k --n 1``. Every mismatch or crash is minimised and written to
``--out`` as a pytest file. ``--time-limit S`` stops starting programs after S seconds. The
last line is ``N programs, M mismatches, K errors`` (errors:
kiln raised UnsupportedError; crashes count as mismatches); the exit status is 1 when M > 0.
``--device cuda`` compiles CUDA packages and runs them on cuda:0 (needs a GPU unless
``--compile-only``); a reproducer keeps the device in its spec.

C++ files compile with precompiled headers (KILN_PCH=1 unless the environment sets it:
kiln/toolchain/cxx.py; the same object code) so that many small packages do not each parse
the runtime's headers again.
"""

from __future__ import annotations

import argparse
import collections
import os
import time
import warnings

import torch

from kiln.errors import KilnError
from kiln.fuzz.generator import generate
from kiln.fuzz.minimise import _key, minimise
from kiln.fuzz.report import write_repro
from kiln.fuzz.runner import check

__all__ = ["cmd_fuzz"]  # its arguments: kiln/cli/main.py (no heavy import for --help)


def program_seed(seed: int, k: int) -> int:
    return seed * 1_000_003 + k


def cmd_fuzz(args: argparse.Namespace) -> int:
    pch = os.environ.get("KILN_PCH")
    os.environ["KILN_PCH"] = pch if pch is not None else "1"
    try:
        return _fuzz(args)
    finally:
        if pch is None:
            del os.environ["KILN_PCH"]


def _fuzz(args: argparse.Namespace) -> int:
    warnings.filterwarnings("ignore")

    counts: collections.Counter = collections.Counter()
    seen: dict[str, str] = {}  # failure key -> first program that showed it
    t0 = time.perf_counter()
    limit = getattr(args, "time_limit", None)
    device = getattr(args, "device", "cpu")
    run = not getattr(args, "compile_only", False)
    if device == "cuda" and run and not torch.cuda.is_available():
        raise KilnError("kiln fuzz --device cuda: torch sees no CUDA GPU here; add "
                        "--compile-only to check CUDA compiles without running them")
    ran = 0
    for k in range(args.start, args.start + args.n):
        if limit is not None and time.perf_counter() - t0 > limit:
            print(f"time limit of {limit:.0f} s reached after {ran} programs", flush=True)
            break
        ran += 1
        ps = program_seed(args.seed, k)
        spec = generate(ps, max_ops=args.max_ops, bounded_dims=args.bounded_dims,
                        index_sort=args.index_sort)
        if device != "cpu":
            spec["device"] = device
        out = check(spec, interp=not args.no_interp, run=run)
        counts[out.status] += 1
        if args.verbose or out.status != "ok":
            first = out.detail.splitlines()[0][:160] if out.detail else ""
            print(f"[{k}] seed {ps}: {len(spec['ops'])} ops, {out.status} {first}", flush=True)
        if out.failed:
            if _key(out) in seen:
                print(f"    same failure as {seen[_key(out)]}; not minimised again", flush=True)
                continue
            seen[_key(out)] = f"program {k}"
            if not args.no_minimise:
                spec, out = minimise(spec, out, log=print,
                                     check=lambda s: check(s, interp=not args.no_interp,
                                                           run=run))
            dev = f" --device {device}" if device != "cpu" else ""
            path = write_repro(spec, out, args.out,
                               f"--seed {args.seed} --start {k} --n 1{dev}")
            print(f"    reproducer: {path}", flush=True)
    mism = counts["mismatch"] + counts["crash"]
    secs = time.perf_counter() - t0
    print(f"({counts['ok']} ok, {counts['mismatch']} wrong results, {counts['crash']} crashes, "
          f"{counts['invalid']} refused by torch.export; {secs:.0f} s)")
    print(f"{ran} programs, {mism} mismatches, {counts['error']} errors")
    return 1 if mism else 0
