"""The driver: runs a target's stage list from an ExportedProgram to a shared library.

A target is a folder (kiln/targets/<name>/) whose `stages.py` declares its `TARGET`: a name and
an ordered tuple of stages (kiln/targets/stages.py says what a stage is). `build` picks the
target from the device string ("cpu", "cuda", "cuda:N"), then for each stage whose `when`
holds: runs it, times it into `Built.timings` (the report's `stages`; a stage's timed parts as
`<stage>.<part>`), runs its verifier (Options.verify) and writes its dumps
(Options.dump_dir: `NN_<stage>.txt`, and files by name such as the generated sources). Timing,
dumps and verification happen here, between stages, never inside them; nothing here depends
on which target runs. A new target is a new folder with its stage list and one entry in
`TARGETS`. A target's modules are imported when a build names it: a CPU build never loads the
CUDA target's (which import Triton, about 1.4 s)."""

from __future__ import annotations

import importlib
import re
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch

from kiln.errors import UnsupportedError
from kiln.options import Options
from kiln.targets.stages import Build, Stage, Target

#: the targets' names: kiln/targets/<name>/stages.py declares each one's `TARGET`
TARGETS: tuple[str, ...] = ("cpu", "cuda")


def _target(name: str) -> Target:
    return importlib.import_module(f"kiln.targets.{name}.stages").TARGET


@dataclass(frozen=True)
class Built:
    graph: Any
    loop: Any
    steps: tuple
    program: Any
    plan: Any
    intervals: list
    sources: dict[str, str]
    library: Path
    weights: dict[str, torch.Tensor]
    timings: dict[str, float]
    device: str = "cpu"  # the target's name: "cpu" or "cuda"
    info: dict = field(default_factory=dict)  # the target's manifest record (CUDA: archs, ...)
    reorder: tuple = (0, 0)  # peak temp bytes of program order, and of the order chosen
    gemms: dict = field(default_factory=dict)  # GEMM name -> gemm Choice
    cpu_features: tuple[str, ...] | None = None  # extensions the code uses (checked at load)
    cpu_levels: tuple = ()  # portable builds: targets.stages.CpuLevel per level, best first
    #: other builds to time against this one, by name (targets.stages.Variant; CPU
    #: max_autotune: "default", the heuristic's GEMM choices)
    variants: dict = field(default_factory=dict)


def target_of(device: str) -> Target:
    """The target a device string names: "<target>", or "<target>:N" for targets of several
    devices."""
    m = re.fullmatch(r"(\w+?)(:\d+)?", device)
    target = _target(m.group(1)) if m and m.group(1) in TARGETS else None
    if target is None or (m.group(2) and not target.numbered):
        targets = [_target(t) for t in TARGETS]
        names = [f"'{t.name}'" for t in targets]
        names += [f"'{t.name}:N'" for t in targets if t.numbered]
        raise UnsupportedError(f"device {device!r} is not supported (use "
                               f"{', '.join(names[:-1])} or {names[-1]})")
    return target


def _run(stage: Stage, state: Build, timings: dict[str, float], opts: Options,
         detail: Callable[[str, str, int, int], None] | None = None) -> Build:
    t0 = time.perf_counter()
    if detail is not None:  # the stage's counts (Build.progress), told with its name
        state = replace(state, progress=partial(detail, stage.name))
    state = stage.run(state)
    timings[stage.name] = time.perf_counter() - t0
    if stage.verify is not None and opts.verify:
        stage.verify(state)
    if opts.dump_dir and (stage.dump is not None or stage.dump_files is not None):
        d = Path(opts.dump_dir)
        d.mkdir(parents=True, exist_ok=True)
        if stage.dump is not None:
            (d / f"{len(timings):02d}_{stage.name}.txt").write_text(stage.dump(state))
        for name, text in (stage.dump_files(state) if stage.dump_files else {}).items():
            (d / name).write_text(text)
    timings.update({f"{stage.name}.{k}": v for k, v in state.times.items()})
    return replace(state, times={}, progress=None)


def build(ep: torch.export.ExportedProgram, opts: Options, device: str = "cpu",
          progress: Callable[[str, int, int], None] | None = None,
          detail: Callable[[str, str, int, int], None] | None = None,
          early: Any = None) -> Built:
    """`progress(stage, k, n)`, when given, is called before each of the target's n stages
    (k from 0; a skipped stage too) and once after the last with ("done", n, n); `detail(stage,
    what, done, total)` with the counts a long stage reports as it goes (Build.progress: C++
    files and Triton kernels built, GEMM candidates and launch configs timed): the CLI's
    progress display; nothing here prints. `early`: what the target's `prestart` started
    before the export (kiln.compile), handed to the first state."""
    target = target_of(device)
    timings: dict[str, float] = {}
    state = target.state(options=opts, ep=ep, **({"early": early} if early is not None else {}))
    n = len(target.stages)
    for k, stage in enumerate(target.stages):
        if progress is not None:
            progress(stage.name, k, n)
        if stage.when(state):
            state = _run(stage, state, timings, opts, detail)
    if progress is not None:
        progress("done", n, n)
    return Built(state.graph, state.loop, state.steps, state.program, state.plan,
                 state.intervals, dict(state.sources), state.library, dict(state.weights),
                 timings, target.name, dict(state.info), reorder=tuple(state.reorder),
                 gemms=dict(state.gemms), cpu_features=state.cpu_features,
                 cpu_levels=tuple(state.cpu_levels), variants=dict(state.variants))
