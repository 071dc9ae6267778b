"""What every target's compiler is made of: stages, the build state they pass along, and the
stages all targets share.

A `Target` is a name and an ordered tuple of `Stage`s (kiln/targets/<name>/stages.py). A stage
is a named pure function from one `Build` (a frozen dataclass: the options, the exported
program and every artifact made so far) to the next: it returns `dataclasses.replace(state,
...)` with the fields it made and changes nothing it was given. Next to the function, as data,
a stage declares its IR printer (`dump`, for Options.dump_dir), the files it writes there
(`dump_files`, e.g. the generated sources), its verifier (`verify`, for Options.verify) and
when it runs (`when`, a predicate on the state: an option, or whether there is anything to
do). The driver (kiln/pipeline.py) runs a target's stages in order and does the timing,
dumping and verifying between them, never inside them. No stage asks which target it belongs
to: what differs between targets is the list, and the parameters a list gives a shared stage
(`import_stage(library_routines=..., fused_attention=...)`, `program_stage(inplace=...)`).

A stage that has parts worth timing apart (the C++ compile and the link) returns their seconds
in `Build.times`; the driver records them as `<stage>.<part>`.

The shared stages here (import, dce, freeze, lower, schedule, reorder, program, plan) take
Graph IR from the export to a planned Program; each target adds its own passes, its GEMM
choice and its back half (kiln/targets/cpu/build.py, kiln/targets/cuda/build.py)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, Mapping

from kiln.frontend.export import import_program
from kiln.ir.graph import print_graph, verify_graph
from kiln.ir.loop_text import print_loop, verify_loop
from kiln.ir.program import WeightSpec, print_program, verify_program
from kiln.ir.sym import UNBOUNDED_NOMINAL, evaluate
from kiln.lowering import lower
from kiln.passes.store_once import gemm_sums
from kiln.memory.assign import assign_offsets
from kiln.options import Options
from kiln.passes.dce import dce
from kiln.passes.fold_pad import fold_pads
from kiln.passes.freeze import freeze
from kiln.passes.merge_gemms import merge_gemms
from kiln.schedule import schedule
from kiln.schedule.program import build_program, unbacked_bounds
from kiln.schedule.reorder import reorder_for_memory


@dataclass(frozen=True)
class CpuLevel:
    """One -march level of a portable build: its linked library and the instruction-set
    extensions its code uses (what the loader checks to pick it)."""

    march: str
    library: Path
    cpu_features: tuple[str, ...]


@dataclass(frozen=True)
class Variant:
    """Another build of the same planned program: other GEMM choices and what they change
    (the generated sources and the linked code); everything else is the build's own."""

    gemms: Mapping[str, Any]
    sources: Mapping[str, str]
    library: Path
    cpu_features: tuple[str, ...] | None = None
    cpu_levels: tuple[CpuLevel, ...] = ()


@dataclass(frozen=True)
class Build:
    """The state between two stages. A target may extend it with the fields of its own back
    half (a subclass, `Target.state`)."""

    options: Options
    ep: Any = None  # the torch.export.ExportedProgram being compiled
    graph: Any = None  # Graph IR
    weights: Mapping[str, Any] = field(default_factory=dict)  # graph input name -> tensor
    loop: Any = None  # Loop IR (LoopProgram)
    steps: Any = ()  # the schedule: kernels, GEMMs, library and ATen calls
    reorder: tuple = (0, 0)  # peak temp bytes of program order, and of the order chosen
    gemms: Mapping[str, Any] = field(default_factory=dict)  # GEMM name -> gemm Choice
    program: Any = None  # Program IR (planned once `plan` ran)
    plan: Any = None  # the arena plan
    intervals: Any = ()  # the planned buffers' live intervals
    sources: Mapping[str, str] = field(default_factory=dict)  # file name -> generated text
    library: Path | None = None  # the linked model.so
    info: Mapping[str, Any] = field(default_factory=dict)  # the target's manifest record
    #: instruction-set extensions the compiled host code uses (the manifest's requires), None
    #: where the target does not check them at load
    cpu_features: tuple[str, ...] | None = None
    #: a portable build (Options.march="portable"): one library per -march level, best first;
    #: `library` and `cpu_features` are then the last (most widely runnable) level's
    cpu_levels: tuple[CpuLevel, ...] = ()
    #: other builds of the same program, by name, for the caller to time against this one
    #: (the CPU's "default" GEMM choices when max_autotune tuned them: never_lose.py)
    variants: Mapping[str, Variant] = field(default_factory=dict)
    times: Mapping[str, float] = field(default_factory=dict)  # the last stage's timed parts
    #: the running stage's counts, `progress(what, done, total)` (e.g. ("C++ files", 3, 8)),
    #: set by the driver around each stage when its caller listens (pipeline.build's
    #: `detail`), else None; stages hand it to their long loops through `ticker`
    progress: Callable[[str, int, int], None] | None = None


def ticker(state: Build, what: str) -> Callable[[int, int], None] | None:
    """`tick(done, total)` for one of the running stage's long loops (kernel builds,
    autotuning), told to the driver's listener as `what`; None when nobody listens."""
    if state.progress is None:
        return None
    return partial(state.progress, what)


def always(state: Build) -> bool:
    return True


@dataclass(frozen=True)
class Stage:
    name: str  # the key of its time in the report's `stages`
    run: Callable[[Build], Build]
    dump: Callable[[Build], str] | None = None  # -> dump_dir/NN_<name>.txt
    verify: Callable[[Build], None] | None = None  # raises when the artifact is malformed
    when: Callable[[Build], bool] = always  # skipped (and not timed) when false
    dump_files: Callable[[Build], Mapping[str, str]] | None = None  # -> dump_dir/<file name>


@dataclass(frozen=True)
class Target:
    name: str  # the device string's name part; Built.device and the manifest's "device"
    stages: tuple[Stage, ...]
    state: type[Build] = Build  # the state class its stages pass along
    numbered: bool = False  # whether "<name>:N" device strings select one of several devices
    #: the manifest's `kind` of a schedule kernel ("cpp": a C++ function, "triton": a cubin)
    kernel_kind: str = "cpp"
    #: the shared libraries a package needs at run time besides libkiln and libtorch:
    #: `libraries(steps, gemms) -> list[str]` (the manifest's `requires`)
    libraries: Callable[[tuple, dict], list[str]] = lambda steps, gemms: []
    #: how the manifest and users name the libtorch parts the ATen fallback needs
    torch_libraries: str = "libtorch_cpu.so"
    #: work a build can start before its program is exported (threads, processes: the CUDA
    #: target's compile workers), `prestart(options) -> handle`, called by kiln.compile
    #: before torch.export; the handle is the first state's `early` field (the target's state
    #: class has one) and has `close()`, called where the export fails
    prestart: Callable[[Options], Any] | None = None


# -- predicates on options -------------------------------------------------------------------


def freezing(state: Build) -> bool:
    return state.options.freeze


def merging_gemms(state: Build) -> bool:
    return state.options.fold_constants


def reordering(state: Build) -> bool:
    return state.options.reorder_for_memory


# -- printers and verifiers, as stages declare them ------------------------------------------


def graph_text(state: Build) -> str:
    return print_graph(state.graph)


def check_graph(state: Build) -> None:
    verify_graph(state.graph)


def loop_text(state: Build) -> str:
    return print_loop(state.loop)


def check_loop(state: Build) -> None:
    verify_loop(state.loop)


def steps_text(state: Build) -> str:
    return "\n".join(map(repr, state.steps))


def program_text(state: Build) -> str:
    return print_program(state.program)


def check_program(state: Build) -> None:
    verify_program(state.program)


def check_planned(state: Build) -> None:
    verify_program(state.program, planned=True)


def source_files(state: Build) -> Mapping[str, str]:
    return state.sources


# -- the shared stages -----------------------------------------------------------------------


def import_graph(state: Build, library_routines: bool, fused_attention: bool) -> Build:
    """torch.export -> Graph IR (core ATen decompositions, weights, pytree specs, Dim ranges).
    `library_routines`: the target links kiln's CPU library routines (else ATen computes the
    ops that would lower to them); `fused_attention`: the target runs
    scaled_dot_product_attention as one `attention` step (when Options.fused_attention)."""
    o = state.options
    imported = import_program(state.ep, o.fold_constants, o.aten_fallback, o.seed,
                              library_routines=library_routines,
                              fused_attention=fused_attention and o.fused_attention)
    return replace(state, graph=imported.graph, weights=dict(imported.weights))


def import_stage(library_routines: bool, fused_attention: bool) -> Stage:
    return Stage("import", partial(import_graph, library_routines=library_routines,
                                   fused_attention=fused_attention))


def drop_dead(state: Build) -> Build:
    """Dead nodes and unused weights dropped."""
    return replace(state, graph=dce(state.graph))


def fold_zero_pads(state: Build) -> Build:
    """Zero pads folded into the convolutions they feed, identity pads dropped
    (passes/fold_pad.py), then the pads left without users."""
    return replace(state, graph=dce(fold_pads(state.graph)))


def freeze_weights(state: Build) -> Build:
    """Weights stored in the layout their GEMMs read (passes/freeze.py)."""
    graph, weights = freeze(state.graph, dict(state.weights))
    return replace(state, graph=graph, weights=weights)


def merge_projections(state: Build) -> Build:
    """GEMMs sharing their input and reading weights become one on concatenated weights
    (passes/merge_gemms.py; a compile-time fold)."""
    graph, weights = merge_gemms(state.graph, dict(state.weights))
    return replace(state, graph=graph, weights=weights)


def lower_graph(state: Build) -> Build:
    """Graph IR -> Loop IR (views become index maps; pointwise producers inline)."""
    return replace(state, loop=lower(state.graph))


def lower_graph_storing_sums(state: Build) -> Build:
    """Graph IR -> Loop IR, sums of a GEMM's result read several times stored once, so the
    GEMM takes them as its epilogue (passes/store_once.py; CUDA), and few-row attention calls
    with a scratch for split keys (the CUDA decode path)."""
    return replace(state, loop=lower(state.graph, gemm_sums(state.graph), attention_splits=True))


def schedule_loop(state: Build) -> Build:
    """Loop IR -> kernels (fusion by shared outer loops)."""
    return replace(state, steps=schedule(state.loop, state.options.fuse))


def schedule_loop_tiny(state: Build) -> Build:
    """Loop IR -> kernels, tiny members gathered into fewer launches (CUDA: schedule's
    `tiny`)."""
    return replace(state, steps=schedule(state.loop, state.options.fuse, tiny=True))


def reorder_steps(state: Build) -> Build:
    """Independent steps in the order that lowers peak memory (never worse)."""
    env = {s.name: s.example for s in state.graph.symbols}
    for name, bound in unbacked_bounds(state.steps):  # data-dependent sizes at their bounds
        env[name] = evaluate(bound, {name: UNBOUNDED_NOMINAL, **env})  # (or a nominal size)
    steps, before, after = reorder_for_memory(state.steps, state.loop, env)
    return replace(state, steps=steps, reorder=(before, after))


def build_program_ir(state: Build, inplace: bool, state_inplace: bool | None = None) -> Build:
    """Kernels -> Program IR (input checks, liveness-based Alloc/Free; with `inplace`, a
    buffer may reuse a dead operand's bytes). Keeps only the weights the graph reads."""
    graph = state.graph
    weights = {i.name: state.weights[i.name] for i in graph.weights}
    specs = [WeightSpec(i.name, i.fqn, i.type.dtype, tuple(int(d) for d in i.type.shape),
                        weights[i.name].numel() * weights[i.name].element_size(),
                        mutable=i.kind == "state", permuted=i.permuted)
             for i in graph.weights]
    program = build_program(graph, state.loop, state.steps, specs, inplace, state_inplace)
    return replace(state, weights=weights, program=program)


def program_stage(inplace: bool, state_inplace: bool | None = None) -> Stage:
    """`inplace`: temps may reuse dying temps' bytes; `state_inplace` (default `inplace`): a
    state's update (index_put) may write the state's own storage (memory/inplace.py)."""
    return Stage("program", partial(build_program_ir, inplace=inplace,
                                    state_inplace=state_inplace), dump=program_text,
                 verify=check_program)


def plan_memory(state: Build) -> Build:
    """One arena, offsets proven overlap-free."""
    o = state.options
    program, plan, intervals = assign_offsets(state.program, o.verify, o.plan_budget_s)
    return replace(state, program=program, plan=plan, intervals=intervals)


DCE = Stage("dce", drop_dead, dump=graph_text, verify=check_graph)
FOLD_PADS = Stage("fold_pads", fold_zero_pads, dump=graph_text, verify=check_graph)
MERGE_GEMMS = Stage("merge_gemms", merge_projections, dump=graph_text, verify=check_graph,
                    when=merging_gemms)
FREEZE = Stage("freeze", freeze_weights, dump=graph_text, verify=check_graph, when=freezing)
LOWER = Stage("lower", lower_graph, dump=loop_text, verify=check_loop)
LOWER_STORING_SUMS = Stage("lower", lower_graph_storing_sums, dump=loop_text, verify=check_loop)
SCHEDULE = Stage("schedule", schedule_loop, dump=steps_text)
SCHEDULE_TINY = Stage("schedule", schedule_loop_tiny, dump=steps_text)
REORDER = Stage("reorder", reorder_steps, when=reordering)
PLAN = Stage("plan", plan_memory, dump=program_text, verify=check_planned)
