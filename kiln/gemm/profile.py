"""Run one autotuning candidate in a child process, with a timeout.

The child is a benchmark program (`cpu.py` builds the CPU one; the GPU ones are launched the
same way). Protocol: it prints one line `KILN_PROFILE <seconds per run> <max error> <tolerance>`
and exits 0. Anything else - a non-zero exit or a signal (crash), no answer before the timeout
(hang), a missing line, or an error above the tolerance (wrong answer) - drops the candidate
with the reason, and the compile carries on with the others."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class Measured:
    seconds: float | None  # None: dropped
    reason: str = ""  # why it was dropped


def run_candidate(cmd: list[str], timeout_s: float, env: dict | None = None) -> Measured:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired:
        return Measured(None, f"hang: no result within {timeout_s:g} s")
    except OSError as e:
        return Measured(None, f"could not start: {e}")
    if proc.returncode != 0:
        what = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
        return Measured(None, f"crash ({what}): {proc.stderr.strip()[-200:]}")
    for line in proc.stdout.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == "KILN_PROFILE":
            try:
                seconds, err, tol = map(float, parts[1:])
            except ValueError:
                break
            if not err <= tol:  # also catches NaN
                return Measured(None, f"wrong answer: max error {err:g} > tolerance {tol:g}")
            if not seconds > 0:
                break
            return Measured(seconds)
    return Measured(None, f"no result line in output: {proc.stdout.strip()[-200:]!r}")
