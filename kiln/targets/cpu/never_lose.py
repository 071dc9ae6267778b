"""Autotuning that never loses, the build half: with Options.max_autotune, the package with
the default GEMM choices (the heuristic alone, no profiling and no autotuning cache) is built
next to the tuned one, so that kiln.compile can time the two end to end and keep the faster
(kiln/api.py; the timing: kiln/runtime/ab_time.py).

Only the GEMM choices differ between the two: the kernel files are the same text, so their
objects come from the build cache; the GEMM file and the wrapper (which calls BLAS or the
"cpp" GEMMs) are compiled again only when a choice differs. When every GEMM gets the same
backend and configuration either way, there is no variant and nothing to time. This module
knows nothing of the GEMM backends' internals: choices are compared as (backend, config)."""

from __future__ import annotations

from dataclasses import replace

from kiln.gemm import choose_gemms
from kiln.targets.cpu.build import (codegen, codegen_wrapper, compile_library,
                                    gemm_options)
from kiln.gemm.select import Choice
from kiln.targets.stages import Build, Variant


def tuned(state: Build) -> bool:
    """The stage's `when`: GEMMs were profiled (max_autotune) and there are some."""
    return state.options.max_autotune and bool(state.gemms)


def differing(a: dict, b: dict) -> list[str]:
    """The GEMMs whose (backend, config) differ between two choice maps."""
    return sorted(n for n in a if n not in b or (a[n].backend, a[n].config) !=
                  (b[n].backend, b[n].config))


def _packed(c: Choice) -> bool:
    return bool(getattr(c.config, "packed", False))


def packed(gemms: dict) -> set[str]:
    """The GEMMs whose B the tuned build stored packed (the pack_weights stage)."""
    return {n for n, c in gemms.items() if _packed(c)}


def same_weights(tuned: dict, default: dict) -> dict:
    """Both variants share one set of weights: a default choice that would read B in the
    other layout (packed vs not) than the tuned one takes the tuned choice for that GEMM."""
    return {n: (c if n not in tuned or _packed(c) == _packed(tuned[n]) else tuned[n])
            for n, c in default.items()}


def default_variant(state: Build) -> Build:
    """The "default" variant: the heuristic's GEMM choices, built like the tuned package."""
    opts = gemm_options(state.options)
    default = choose_gemms(state.steps, state.graph.symbols, replace(opts, max_autotune=False),
                           "cpu", None, cached=False, packable=packed(state.gemms))
    default = same_weights(state.gemms, default)
    if not differing(state.gemms, default):
        return state
    alt = compile_library(codegen_wrapper(codegen(replace(state, gemms=default))))
    variant = Variant(dict(alt.gemms), dict(alt.sources), alt.library, alt.cpu_features,
                      tuple(alt.cpu_levels))
    return replace(state, variants={**state.variants, "default": variant}, times=alt.times)
