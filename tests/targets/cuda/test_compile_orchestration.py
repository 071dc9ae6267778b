"""How a CUDA compile spends its time, without a GPU (kiln/toolchain/triton_aot.py,
kiln/targets/cuda/launch_tune.py): kernels of the same code up to names compile once and share
a cubin; compiling in worker processes gives the same package as compiling in this process;
launch-config tuning results are remembered (a second compile with the same cache measures
nothing) and kernels of the same code are tuned once."""

from __future__ import annotations

import json
import shutil
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from torch.utils import _pytree as pytree

triton = pytest.importorskip("triton")

import kiln  # noqa: E402
from kiln.api import export  # noqa: E402
from kiln.ir import loop as L  # noqa: E402
from kiln.pipeline import target_of  # noqa: E402
from kiln.targets.cuda import build as cuda_build  # noqa: E402
from kiln.targets.cuda import launch_tune  # noqa: E402
from kiln.targets.cuda.kernel import print_triton_kernel, print_triton_module  # noqa: E402
from kiln.toolchain import triton_aot  # noqa: E402
from kiln.toolchain.cxx import split_prelude  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.fc = torch.nn.Linear(d, d)

    def forward(self, x):
        return x + torch.softmax(self.fc(self.ln(x)), -1) * 0.5


class Blocks(torch.nn.Module):
    """Three blocks of the same code on the same sizes (a GEMM between their kernels), then a
    different tail: the kernel of block 1's tail with block 2's LayerNorm has the code of
    block 2's tail with block 3's."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(Block(d), Block(d), Block(d))

    def forward(self, x):
        return torch.tanh(self.blocks(x)).sum(-1)


def _model(rows=8, d=64):
    torch.manual_seed(0)
    return Blocks(d).eval(), (torch.randn(rows, d),)


def _timeless(x):
    """A manifest without what differs between two builds of one model: timings and the
    `jobs` option."""
    if isinstance(x, dict):
        return {k: _timeless(v) for k, v in x.items()
                if k != "jobs" and not k.endswith(("seconds", "_s"))}
    if isinstance(x, list):
        return [_timeless(v) for v in x]
    return x


def _entries(path) -> dict:
    """The package's entries, the manifest without timings."""
    with zipfile.ZipFile(path) as z:
        out = {n: z.read(n) for n in z.namelist()}
    out["manifest.json"] = _timeless(json.loads(out["manifest.json"]))
    out.pop("manifest.sha256", None)
    return out


def test_same_code_compiles_once(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton_home"))
    model, args = _model()
    cm = kiln.compile(model, args, device="cuda",
                      options=kiln.Options(cuda_archs=(90,), cache_dir=str(tmp_path / "c")))
    st = cm.report["stages"]
    kernels = cm.manifest["cuda"]["kernels"]
    assert st["cubins.shared"] >= 1
    assert st["cubins.compiled"] + st["cubins.shared"] == len(kernels)
    src = cm.sources["kernels_triton.py"]
    assert all(f"def {k}(" in src for k in kernels)  # the package's source keeps every kernel


def test_canonical_ignores_names_only():
    @dataclass(frozen=True)
    class K:
        name: str
        source: str
        signature: dict
        config: object = launch_tune.Config(4, 64, 2)
        constexprs: tuple = ()
        num_stages: int = 0

    a = K("k1_ln", "@triton.jit\ndef k1_ln(buf_x, buf_y, s0, XBLOCK: tl.constexpr):\n"
                   "    # k1_ln: from ln\n    acc_x = tl.load(buf_x + s0)\n"
                   "    tl.store(buf_y, kiln_erf(acc_x))\n",
          {"buf_x": "*fp32", "buf_y": "*fp32", "s0": "i64", "XBLOCK": "constexpr"})
    b = K("k7_ln_1", a.source.replace("k1_ln", "k7_ln_1").replace("buf_x", "buf_h")
          .replace("acc_x", "acc_h").replace("from ln", "from ln_1"),
          {"buf_h": "*fp32", "buf_y": "*fp32", "s0": "i64", "XBLOCK": "constexpr"})
    assert triton_aot.canonical(a) == triton_aot.canonical(b)
    for other in (replace(a, source=a.source.replace("kiln_erf", "kiln_tanh")),  # a global
                  replace(a, source=a.source.replace("s0)", "s0 + 1)")),
                  replace(a, signature={**a.signature, "buf_x": "*bf16"}),
                  replace(a, config=launch_tune.Config(8, 64, 2))):
        assert triton_aot.canonical(other) != triton_aot.canonical(a)


def test_parallel_compile_is_byte_identical_to_serial(tmp_path, monkeypatch):
    model, args = _model()
    cache = tmp_path / "c"
    packages = []
    monkeypatch.setattr(triton_aot, "PER_PROCESS", 1)  # a worker even for 3 kernels
    for jobs in (1, 3):
        shutil.rmtree(cache, ignore_errors=True)
        monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / f"triton_home{jobs}"))
        cm = kiln.compile(model, args, device="cuda", options=kiln.Options(
            cuda_archs=(90,), cache_dir=str(cache), jobs=jobs))
        assert cm.report["stages"]["cubins.workers"] == min(jobs, 3) - 1
        packages.append(cm.save(tmp_path / f"m{jobs}.kiln"))
    serial, parallel = (_entries(p) for p in packages)
    assert serial.keys() == parallel.keys()
    for name in serial:
        assert serial[name] == parallel[name], name


def _tuning_state(tmp_path, rows: int, d: int):
    """The CUDA pipeline's state after planning, for a model big enough to be tuned."""
    model, args = _model(rows, d)
    opts = kiln.Options(cuda_archs=(90,), cache_dir=str(tmp_path / "c"))
    target = target_of("cuda")
    st = target.state(options=opts, ep=export(model, args, None, None))
    for s in target.stages:
        if s.name == "check_routines":
            break
        if s.when(st):
            st = s.run(st)
    return st


def test_tuning_is_remembered_and_shared(tmp_path, monkeypatch):
    st = _tuning_state(tmp_path, 512, 1024)  # LayerNorm rows of 512 x 1024: worth tuning
    kernels = cuda_build._kernels(st.steps)
    hints = cuda_build._hints(st)
    tuned = [k for k in kernels if launch_tune.worth_tuning(k, hints)]
    assert len(tuned) >= 2
    base = cuda_build._heuristic_configs(st)
    compiled, timed = [], []

    def fake_compile(todo, cache, arch, workers=1, extra=(), started=None):
        compiled.extend(step.name for step, _, _ in todo)
        return {(i, j): tk.config for i, (_, tks, _) in enumerate(todo)
                for j, tk in enumerate(tks)}

    def fake_time(cfg, grid, args, torch, reps=20):
        timed.append(cfg)
        return 1.0 / (cfg.num_warps * cfg.xblock)  # a made-up winner: the most warps x rows

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(launch_tune, "_compile_candidates", fake_compile)
    monkeypatch.setattr(launch_tune, "_time_ms", fake_time)
    monkeypatch.setattr(launch_tune, "_args", lambda *a: [])
    monkeypatch.setattr(triton_aot, "store_compiled", lambda *a: None)
    cache = tmp_path / "c"
    buffers = L.all_buffers(st.loop)
    best1, report1 = launch_tune.tune(kernels, buffers, hints, base, 90, cache)
    assert set(best1) == {k.name for k in tuned}
    # the two blocks' kernels share code and sizes: each pair is compiled and timed once
    assert len(compiled) < len(tuned) and timed
    assert set(report1) == set(compiled)

    def no_compile(*a, **k):
        raise AssertionError("a second compile with the same cache tuned again")

    monkeypatch.setattr(launch_tune, "_compile_candidates", no_compile)
    best2, report2 = launch_tune.tune(kernels, buffers, hints, base, 90, cache)
    assert best2 == best1 and report2 == {}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Other GPU")
    with pytest.raises(AssertionError, match="tuned again"):  # another device: not reused
        launch_tune.tune(kernels, buffers, hints, base, 90, cache)


def test_tuning_loads_the_workers_compile_whatever_key_this_process_computes(
        tmp_path, monkeypatch):
    """Launch tuning loads each candidate from the Triton cache files its worker wrote, not
    by a new lookup: torch.compile, run earlier in a process, can make this process's Triton
    cache keys differ from its workers' (TRITON_PTXAS_PATH set after the ptxas version was
    cached), and every lookup then compiled the candidate again here (18-43 s a model)."""
    st = _tuning_state(tmp_path, 512, 1024)
    hints, base = cuda_build._hints(st), cuda_build._heuristic_configs(st)
    k = next(k for k in cuda_build._kernels(st.steps) if launch_tune.worth_tuning(k, hints))
    cands = launch_tune.candidates(base[k.name], launch_tune._shape(k, hints)[1])[:2]
    kernels = [print_triton_kernel(k, L.all_buffers(st.loop), hints, c) for c in cands]
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    texts = [print_triton_module([tk]) for tk in kernels]  # a module each, as tuning does
    pool = triton_aot.Pool([(x, tk, 90) for x, tk in zip(texts, kernels)], tmp_path / "c", 2)
    assert len(pool.procs) == 2

    def no_compile(*a, **k):
        raise AssertionError("compiled again in this process")

    monkeypatch.setattr(triton, "compile", no_compile)
    for t, tk in enumerate(kernels):
        mod = triton_aot.import_module(texts[t], tmp_path / "c")
        files = pool.compiled_files(t)
        ck = triton_aot.load_compiled(mod, tk, files)
        assert ck is not None and ck.name == pool.cubin(t, tk, 90).symbol
        assert bytes(ck.asm["cubin"]) == pool.cubin(t, tk, 90).cubin
    pool.close()
    gone = {**files, "files": {n: str(tmp_path / "gone" / n) for n in files["files"]}}
    assert triton_aot.load_compiled(mod, kernels[-1], gone) is None  # then compiled here


def test_compile_time_is_accounted_for(tmp_path, monkeypatch):
    """A compile's seconds are its export's plus its named stages' (the compiler's imports,
    the target's stages, the manifest): little is left outside them (bench/compile_time.py's
    "rest", which was 3-4 s of a cold H100 compile before the imports were named)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton_home"))
    model, args = _model()
    cm = kiln.compile(model, args, device="cuda",
                      options=kiln.Options(cuda_archs=(90,), cache_dir=str(tmp_path / "c")))
    st, total = cm.report["stages"], cm.report["compile_seconds"]
    assert {"compiler_imports", "workers", "wrapper_header", "cubins", "compile",
            "manifest"} <= set(st)
    named = cm.report["export_seconds"] + sum(v for k, v in st.items() if "." not in k)
    assert named <= total and total - named < 0.1 + 0.05 * total, (total, named)


def test_wrapper_header_is_used_and_changes_no_byte(tmp_path, monkeypatch):
    """The wrapper's includes precompiled while the front end runs (stage wrapper_header,
    with at least 4 jobs) are what every wrapper starts with, the compile stage uses them
    (its source compiled with -include), and the package is byte for byte the one compiled
    without them (1 job: no header)."""
    monkeypatch.setattr(cuda_build, "HEADER_WAIT_S", 120.0)  # (this box may be slow)
    monkeypatch.setenv("KILN_PCH", "0")  # (the suite's conftest builds them on demand)
    model, args = _model()
    packages = []
    cache = tmp_path / "c"  # (one path: the wrapper's source names it)
    for jobs in (4, 1):
        shutil.rmtree(cache, ignore_errors=True)
        monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / f"triton_home{jobs}"))
        cm = kiln.compile(model, args, device="cuda", options=kiln.Options(
            cuda_archs=(90,), cache_dir=str(cache), jobs=jobs))
        pre, _ = split_prelude(cm.built.sources["model_cuda.cpp"])
        assert tuple(pre) == cuda_build.WRAPPER_INCLUDES
        used = list((cache / "build" / "src" / "pch").glob("*_model_cuda.cpp"))
        assert bool(used) == (jobs >= 4), jobs
        packages.append(_entries(cm.save(tmp_path / f"m{jobs}.kiln")))
    with_header, without = packages
    assert with_header.keys() == without.keys()
    for name in without:
        assert with_header[name] == without[name], name


class _FakeWorkers:
    """triton_aot.Workers' interface over make-believe processes: a job's task is done at
    once (its JSON written), except on worker 0, whose first task stays running until
    `release()`; records which worker got which task."""

    class Proc:
        def poll(self):
            return None

    def __init__(self, n: int) -> None:
        self.procs = [self.Proc() for _ in range(n)]
        self.got: list[tuple[int, int]] = []
        self.held: list[Path] = []

    def alive(self) -> list[int]:
        return list(range(len(self.procs)))

    def send(self, w: int, job: dict) -> bool:
        t = job["first"]
        self.got.append((w, t))
        done = Path(job["out"]) / f"{t}.json"
        if w == 0 and not self.held:
            self.held.append(done)
        else:
            done.write_text("{}")
        return True

    def release(self) -> None:
        for p in self.held:
            p.write_text("{}")

    def close(self, kill: bool = False) -> None:
        pass


def test_pool_hands_tasks_to_free_workers(tmp_path):
    """With workers started ahead, a pool hands out its tasks in order to whichever worker is
    free, not dealt round-robin: a worker busy with a long compile gets no more while the
    others take the rest (dealt round-robin, the busiest of 16 workers had twice the
    average's compiles and the tuner waited on it)."""
    st = _tuning_state(tmp_path, 512, 1024)
    hints, base = cuda_build._hints(st), cuda_build._heuristic_configs(st)
    k = next(k for k in cuda_build._kernels(st.steps) if launch_tune.worth_tuning(k, hints))
    cands = launch_tune.candidates(base[k.name], launch_tune._shape(k, hints)[1])
    kernels = [print_triton_kernel(k, L.all_buffers(st.loop), hints, c) for c in cands]
    assert len(kernels) >= 5
    text = print_triton_module(kernels[:1])
    workers = _FakeWorkers(3)
    pool = triton_aot.Pool([(text, tk, 90) for tk in kernels], tmp_path / "c", 3,
                           started=workers)
    for t in range(1, len(kernels)):
        pool.wait(t)
        assert pool.where[t][0] in (1, 2), t  # worker 0 is still on task 0
    assert [t for w, t in workers.got if w == 0] == [0]
    assert sorted(t for _, t in workers.got) == list(range(len(kernels)))  # each once
    workers.release()
    pool.close()
    assert not pool.procs


def test_pool_on_started_workers_compiles_every_task(tmp_path, monkeypatch):
    """Real worker processes started ahead (triton_aot.Workers), tasks handed out one at a
    time: each task's cubin comes back under its own number, the kernel it names."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    st = _tuning_state(tmp_path, 512, 1024)
    hints, base = cuda_build._hints(st), cuda_build._heuristic_configs(st)
    k = next(k for k in cuda_build._kernels(st.steps) if launch_tune.worth_tuning(k, hints))
    cands = launch_tune.candidates(base[k.name], launch_tune._shape(k, hints)[1])[:3]
    kernels = [print_triton_kernel(k, L.all_buffers(st.loop), hints, c) for c in cands]
    texts = [print_triton_module([tk]) for tk in kernels]
    started = triton_aot.Workers(2)
    try:
        pool = triton_aot.Pool([(x, tk, 90) for x, tk in zip(texts, kernels)],
                               tmp_path / "c", 2, started=started)
        cubins = [pool.cubin(t, tk, 90) for t, tk in enumerate(kernels)]
        pool.close()
    finally:
        started.close()
    assert all(c is not None for c in cubins)
    assert [c.num_warps for c in cubins] == [tk.config.num_warps for tk in kernels]
    assert {w for w, _, _ in pool.where.values()} == {0, 1}


def test_prestart_starts_the_tuning_workers_before_the_export(tmp_path, monkeypatch):
    """Where launch configs will be tuned (a local GPU: made believe here), kiln.compile's
    `prestart` starts the compile workers before torch.export runs, and the workers stage
    takes those (it used to start them after the export: the first tuning compiles then
    waited for them); without a local GPU it starts none and the stage sizes them by the
    graph, as before."""
    monkeypatch.setattr(cuda_build, "warm_driver", lambda: None)
    opts = kiln.Options(cuda_archs=(90,), cache_dir=str(tmp_path / "c"), jobs=3)
    model, args = _model()
    ep = export(model, args, None, None)
    for local in (True, False):
        monkeypatch.setattr(cuda_build, "_local", lambda o, local=local: local)
        early = cuda_build.prestart(opts)
        started = early.workers()
        assert (started is not None and len(started.alive()) == 3) == local
        st = cuda_build.CudaBuild(options=opts, ep=ep, early=early)
        st = replace(st, graph=type("G", (), {"nodes": [None] * 40})())
        st = cuda_build.start_workers(st)
        assert (st.workers is started) == local and st.early is None
        st.workers.close(kill=True)


def test_prestart_creates_the_cuda_context_beside_the_export(tmp_path, monkeypatch):
    """Where launch configs will be tuned, `prestart`'s thread also creates the CUDA context
    (launch_tune.warm_context), which the tuning's first buffer used to pay after the export
    (0.3 s on the H100 machine); without a local GPU it creates none."""
    monkeypatch.setattr(cuda_build, "warm_driver", lambda: None)
    made = []
    monkeypatch.setattr(cuda_build, "warm_context",
                        lambda: made.append(__import__("threading").current_thread().name))
    opts = kiln.Options(cuda_archs=(90,), cache_dir=str(tmp_path / "c"), jobs=1)
    for local in (False, True):
        monkeypatch.setattr(cuda_build, "_local", lambda o, local=local: local)
        cuda_build.prestart(opts).workers()
        assert made == (["kiln-prestart"] if local else [])


def test_launchers_are_built_once_per_signature(monkeypatch):
    """Triton's host launcher depends on the parameter types only: of a tuning pass's
    candidates, the first of each signature builds it (ResNet-18's 9 tuned convolutions built
    9 launchers, 2.2 s of the workers' time on the H100, where one does); the untuned kernels
    build none."""
    from types import SimpleNamespace as NS
    a = {"buf_y": "*bf16", "buf_x": "*bf16", "XBLOCK": "constexpr"}
    b = {"buf_z": "*bf16", "buf_w": "*bf16", "XBLOCK": "constexpr"}  # a's types, other names
    c = {"buf_y": "*fp32", "buf_x": "*bf16", "XBLOCK": "constexpr"}
    ks = [NS(signature=x) for x in (a, a, b, c, b, c)]
    assert launch_tune.launcher_tasks(ks) == [True, False, False, True, False, False]
    got = {}

    class FakePool:
        def __init__(self, tasks, cache, workers, launchers=False, started=None):
            got["launchers"] = launchers
            self.procs = []

    monkeypatch.setattr(triton_aot, "Pool", FakePool)
    monkeypatch.setattr(launch_tune, "print_triton_module", lambda tks: "")
    todo = [(None, [ks[0], ks[1]], None), (None, [ks[2], ks[3]], None)]
    launch_tune._Compiling(todo, Path("."), 90, 4, extra=[ks[4]])
    assert got["launchers"] == [True, False, False, True, False]


def test_cached_cubins_are_not_canonicalised(tmp_path, monkeypatch):
    """The cubins stage looks each kernel up in the cubin cache first and computes `canonical`
    (an AST pass, ~6 ms a kernel) only where one is missing: after launch tuning, whose
    workers stored every kernel, none is (0.2 s of a ResNet-18 compile); the package is the
    same."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton_home"))
    model, args = _model()
    opts = kiln.Options(cuda_archs=(90,), cache_dir=str(tmp_path / "c"))
    first = kiln.compile(model, args, device="cuda", options=opts)
    assert first.report["stages"]["cubins.compiled"] >= 1

    def no_canonical(kernel):
        raise AssertionError("canonical computed for a cached kernel")

    monkeypatch.setattr(triton_aot, "canonical", no_canonical)
    again = kiln.compile(model, args, device="cuda", options=opts)
    assert again.report["stages"]["cubins.compiled"] == 0
    assert _entries(first.save(tmp_path / "a.kiln")) == _entries(again.save(tmp_path / "b.kiln"))


@pytest.mark.parametrize("src, dst", [(torch.float32, torch.float32),
                                      (torch.float32, torch.bfloat16),
                                      (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("groups", [1, 2, 8])
def test_conv_weights_pack_exactly_without_float64(src, dst, groups):
    """The NHWC convolution's weights are permuted and rounded in their own type (no float64
    copy: 0.5 s of ResNet-18's compile), bit for bit what the float64 round trip gave (one
    rounding to the target type either way)."""
    from types import SimpleNamespace

    from kiln.ir import dtypes
    from kiln.passes.conv_nhwc import pack
    torch.manual_seed(0)
    w = torch.randn(16, 16 // groups, 3, 3, dtype=src) * 3
    conv = SimpleNamespace(attr=lambda k: {"groups": groups}[k])
    f = SimpleNamespace(conv=conv, bn=None)
    dt = {torch.float32: dtypes.float32, torch.bfloat16: dtypes.bfloat16}[dst]
    wp, _ = pack(f, w, None, [], groups == 16, dt)
    w64 = w.to(torch.float64)
    g = groups
    want = w64.reshape(g, 16 // g, 16 // g, 3, 3).permute(0, 3, 4, 2, 1).reshape(
        g, 9 * (16 // g), 16 // g).to(dst).contiguous()
    assert wp.dtype == dst and torch.equal(wp.view(torch.int16 if dst.itemsize == 2 else
                                                   torch.int32),
                                           want.view(torch.int16 if dst.itemsize == 2 else
                                                     torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tuning_on_the_gpu_uses_the_prestarted_workers(tmp_path, monkeypatch):
    """On a GPU, a cold compile that tunes launch configs gets its candidates compiled by the
    workers kiln.compile started before the export (handed out to free workers), every
    task's seconds are accounted, and the package computes what eager does."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton_home"))
    model, args = _model(512, 1024)  # LayerNorm rows worth tuning (see above)
    cm = kiln.compile(model, args, device="cuda", options=kiln.Options(
        cache_dir=str(tmp_path / "c"), jobs=4))
    st = cm.report["stages"]
    assert st["launch_autotune.candidates"] > 0 and st["launch_autotune.workers"] == 4
    busiest = st["launch_autotune.worker_busiest"]
    assert 0 < busiest <= st["launch_autotune.worker_compile"] + \
        st["launch_autotune.worker_launcher"]
    runner = kiln.load(cm.save(tmp_path / "m.kiln"), device="cuda:0")
    got = pytree.tree_leaves(runner(args[0].cuda()))
    want = pytree.tree_leaves(model(*args))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w, rtol=1e-4, atol=1e-4)
