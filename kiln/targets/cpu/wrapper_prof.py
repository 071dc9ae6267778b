"""The per-step profiling hooks of the CPU wrapper (model.cpp), printed into every package.

Each step line of the Program (a fused kernel, a GEMM, a library routine, an ATen fallback
call) is bracketed by two statements: `if (prof) prof_t0 = kr::prof_now();` before it and
`if (prof) prof[i] += kr::prof_now() - prof_t0;` after it, where `prof` is the instance's
attached nanosecond counters (NULL unless profiling is on: one predictable branch per step and
no clock read). The model exports `kiln_model_prof_v1` (kiln_model_abi.h): the steps' names
(the manifest's kernel names), kinds and source ops, and `attach`. libkiln attaches counters
when profiling is on (kiln.h: kiln_model_set_profiling, or KILN_PROFILE in the environment);
`kiln profile` and `kiln report` read them through kiln.runtime.profiling."""

from __future__ import annotations

from kiln.ir import program as P
from kiln.options import GemmBackend
from kiln.targets.cxx_wrapper import _cstr

#: the lines that are steps of the profile
STEPS = (P.CallKernel, P.CallGemm, P.CallLib, P.CallAten)


def step_of(x: P.Line, gemm_choices: dict) -> tuple[str, str, str] | None:
    """(name, kind, source ops) of a step line, None for other lines. Names and kinds are the
    manifest's (api._kernels_json)."""
    if isinstance(x, P.CallKernel):
        return x.kernel, "cpp", ", ".join(x.source)
    if isinstance(x, P.CallGemm):
        choice = gemm_choices.get(x.gemm.name)
        backend = choice.backend if choice is not None else GemmBackend.BLAS
        return x.gemm.name, f"{backend.value}_gemm", ", ".join(x.gemm.source)
    if isinstance(x, P.CallLib):
        return x.call.name, f"lib.{x.call.routine}", ", ".join(x.call.source)
    if isinstance(x, P.CallAten):
        return x.call.name, f"aten.{x.call.op.split('::')[-1]}", ", ".join(x.call.source)
    return None


def steps(prog: P.Program, gemm_choices: dict) -> list[tuple[str, str, str]]:
    """The profiled steps in program order (nested blocks included), each once."""
    out: dict[str, tuple[str, str, str]] = {}
    for x in P.walk(prog.lines):
        s = step_of(x, gemm_choices)
        if s is not None and s[0] not in out:
            out[s[0]] = s
    return list(out.values())


INSTANCE_FIELD = "  uint64_t* prof = nullptr;  // per-step ns counters (kiln_model_prof_v1)"
RUN_LOCALS = ["  uint64_t* const prof = self->prof;  // NULL unless profiling is on",
              "  uint64_t prof_t0 = 0;", "  (void)prof_t0;"]
BEGIN = "if (prof) prof_t0 = kr::prof_now();"


def end(i: int) -> str:
    return f"if (prof) prof[{i}] += kr::prof_now() - prof_t0;"


def table_lines(step_list: list[tuple[str, str, str]]) -> list[str]:
    """The step tables and `attach` (inside the wrapper's anonymous namespace), then the
    exported `kiln_model_prof_v1` (outside it)."""
    n = len(step_list)

    def array(name: str, k: int) -> str:
        items = ", ".join(_cstr(s[k]) for s in step_list) or "nullptr"
        return f"const char* const {name}[] = {{{items}}};"

    return [
        "namespace {",
        "// the profiled steps (kiln_model_prof_v1): names, kinds, source ops",
        array("kProfSteps", 0), array("kProfKinds", 1), array("kProfSources", 2),
        "void prof_attach(void* instance, uint64_t* ns) {",
        "  static_cast<Instance*>(instance)->prof = ns;",
        "}",
        "}  // namespace",
        "",
        'extern "C" KILN_KERNEL const kiln_model_prof* kiln_model_prof_v1(void) {',
        f"  static const kiln_model_prof table = {{1u, {n}, kProfSteps, kProfKinds, "
        "kProfSources, prof_attach};",
        "  return &table;",
        "}",
        "",
    ]
