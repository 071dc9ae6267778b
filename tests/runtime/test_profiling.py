"""Per-step profiling measured by a CPU package's own compiled code (kiln.h minor 6,
kiln/targets/cpu/wrapper_prof.py, kiln/runtime/profiling.py): every step the manifest lists is
timed, a heavy step measures heavier than a light one, the steps of a run add up to no more
than the run's wall time, the results are the same with profiling on or off, nothing is counted
while it is off, and it works from C (the functions, and KILN_PROFILE in the environment)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import kiln
from kiln.runtime import build, profiling

C_PROGRAM = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kiln.h"

/* profile_c PKG ROWS COLS RUNS [--api]: runs the model on a ROWS x COLS float32 input; with
 * --api turns profiling on itself and prints each step, else relies on KILN_PROFILE. */
int main(int argc, char **argv) {
  if (argc < 5) return 2;
  if (kiln_abi_minor() < 6) { fprintf(stderr, "old libkiln\n"); return 2; }
  int64_t shape[2] = {atoll(argv[2]), atoll(argv[3])};
  int runs = atoi(argv[4]);
  int api = argc > 5 && strcmp(argv[5], "--api") == 0;
  float *x = malloc(sizeof(float) * shape[0] * shape[1]);
  for (int64_t i = 0; i < shape[0] * shape[1]; ++i) x[i] = (float)(i % 7) * 0.25f - 0.5f;
  DLTensor t = {x, {kDLCPU, 0}, 2, {kDLFloat, 32, 1}, shape, NULL, 0};
  kiln_model *m = NULL;
  if (kiln_model_load(argv[1], "cpu", &m) || (api && kiln_model_set_profiling(m, 1))) {
    fprintf(stderr, "%s\n", kiln_last_error());
    return 1;
  }
  const DLTensor *in[1] = {&t};
  int64_t n_out = kiln_model_num_outputs(m);
  DLManagedTensor *out[8] = {NULL};
  for (int r = 0; r < runs; ++r) {
    if (kiln_model_run(m, in, 1, out, n_out)) {
      fprintf(stderr, "%s\n", kiln_last_error());
      return 1;
    }
    for (int64_t k = 0; k < n_out; ++k) out[k]->deleter(out[k]);
  }
  if (api) {
    int64_t n = kiln_model_profile_num_steps(m, NULL);
    printf("runs %lld\n", (long long)kiln_model_profile_runs(m, NULL));
    for (int64_t i = 0; i < n; ++i) {
      const char *name, *kind, *src;
      double last, total;
      if (kiln_model_profile_step(m, NULL, i, &name, &kind, &src, &last, &total)) return 1;
      printf("%s\t%s\t%s\t%.9f\t%.9f\n", name, kind, src, last, total);
    }
    if (kiln_model_profile_step(m, NULL, n, NULL, NULL, NULL, NULL, NULL) == 0) return 3;
    printf("error %s\n", kiln_last_error());
  }
  kiln_model_free(m);
  free(x);
  return 0;
}
"""


class _Model(torch.nn.Module):
    """A heavy pointwise chain over x, a GEMM and a light step on a 4-element slice."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(256, 64)

    def forward(self, x):
        heavy = (x.sin().exp().cos() * x.tanh()).sum(0)
        light = x[0, :4] + 1.0
        return self.fc(heavy.reshape(-1, 256)), light


SHAPE = (256, 4096)


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> tuple[Path, dict]:
    torch.manual_seed(0)
    model = _Model().eval()
    compiled = kiln.compile(model, (torch.randn(*SHAPE),))
    path = tmp_path_factory.mktemp("prof") / "m.kiln"
    compiled.save(path)
    return path, compiled.manifest, model


def _step(steps, op: str):
    return next(s for s in steps if any(o.startswith(op) for o in s.source_ops))


def test_every_step_timed_and_heavy_over_light(package):
    path, manifest, model = package
    x = torch.randn(*SHAPE)
    with kiln.load(path) as runner:
        assert profiling.available(runner)
        off = runner(x)
        assert profiling.runs(runner) == 0
        assert all(s.total_s == 0 for s in profiling.steps(runner))  # nothing counted while off
        profiling.enable(runner)
        for k in range(3):
            t = time.perf_counter()
            on = runner(x)
            wall = time.perf_counter() - t
            steps = profiling.steps(runner)
            assert all(s.last_s > 0 for s in steps)
            assert sum(s.last_s for s in steps) <= wall  # the steps run inside the call
        assert profiling.runs(runner) == 3
        profiling.enable(runner, False)
        runner(x)
        assert profiling.runs(runner) == 3  # off again: not counted
    names = [k["name"] for k in manifest["kernels"]]
    assert sorted(s.name for s in steps) == sorted(names)
    kinds = {k["name"]: k["kind"] for k in manifest["kernels"]}
    assert all(s.kind == kinds[s.name] for s in steps)
    assert _step(steps, "sum").last_s > 10 * _step(steps, "add").last_s  # the chain's reduction
    assert any(s.kind.endswith("_gemm") for s in steps)
    for a, b, r in zip(off, on, model(x)):  # the hooks change no result
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(b, r, rtol=1e-4, atol=1e-4)


def test_profile_package_uses_the_hooks(package):
    from kiln.cli.profile import profile_package

    path, manifest, _ = package
    prof = profile_package(path, repeat=3, warmup=1)
    assert [s["name"] for s in prof["steps"]] == [k["name"] for k in manifest["kernels"]]
    assert all(s["timed_as"] == "package (C++ hooks)" and s["median_s"] > 0
               for s in prof["steps"])
    assert 0 < sum(s["share"] for s in prof["steps"]) <= 1.5  # of the unprofiled run's median
    heavy = next(s for s in prof["steps"] if any(o.startswith("sum") for o in s["source_ops"]))
    assert heavy["share"] == max(s["share"] for s in prof["steps"])


def test_after_update_weights_still_profiled(package):
    path, _, _ = package
    x = torch.randn(*SHAPE)
    with kiln.load(path) as runner:
        profiling.enable(runner)
        runner(x)
        runner.update_weights({k: v * 2 for k, v in _Model().state_dict().items()})
        runner(x)
        assert profiling.runs(runner) == 2
        assert all(s.last_s > 0 for s in profiling.steps(runner))


@pytest.fixture(scope="module")
def c_program(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("cprof")
    (d / "p.c").write_text(C_PROGRAM)
    lib = build.build_libkiln()
    subprocess.run(["cc", "-O1", "-Wall", "-Werror", "-I", str(build.include_dir()), str(d / "p.c"),
                    f"-L{lib.parent}", "-lkiln", f"-Wl,-rpath,{lib.parent}", "-o", str(d / "p")],
                   check=True)
    return d / "p"


def test_c_api(package, c_program):
    path, manifest, _ = package
    out = subprocess.run([str(c_program), str(path), *map(str, SHAPE), "4", "--api"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "runs 4"
    rows = [line.split("\t") for line in lines[1:-1]]
    assert sorted(r[0] for r in rows) == sorted(k["name"] for k in manifest["kernels"])
    for name, kind, src, last, total in rows:
        assert 0 < float(last) <= float(total)
    assert "out of range" in lines[-1] and "has" in lines[-1]


def test_c_env_var_writes_the_summary(package, c_program, tmp_path):
    path, manifest, _ = package
    summary = tmp_path / "prof.tsv"
    env = {**os.environ, "KILN_PROFILE": str(summary)}
    out = subprocess.run([str(c_program), str(path), *map(str, SHAPE), "2"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = summary.read_text().splitlines()
    assert "entry point forward, 2 profiled runs" in text[0]
    rows = [line.split("\t") for line in text[2:]]
    assert sorted(r[0] for r in rows) == sorted(k["name"] for k in manifest["kernels"])
    assert rows[0][5].startswith("sum")  # slowest first: the heavy chain, fused into its sum
    shares = [float(r[4].rstrip("%")) for r in rows]
    assert abs(sum(shares) - 100) < 1 and shares == sorted(shares, reverse=True)
    env["KILN_PROFILE"] = "0"  # off: no summary
    summary.unlink()
    subprocess.run([str(c_program), str(path), *map(str, SHAPE), "1"], env=env, check=True,
                   timeout=120)
    assert not summary.exists()


def test_python_summary_and_stderr(package, tmp_path):
    path, _, _ = package
    code = (f"import torch, kiln; from kiln.runtime import profiling\n"
            f"r = kiln.load({str(path)!r}); profiling.enable(r); r(torch.randn{SHAPE})\n"
            f"profiling.write_summary(r)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "# kiln profile:" in out.stderr and "1 profiled runs" in out.stderr
