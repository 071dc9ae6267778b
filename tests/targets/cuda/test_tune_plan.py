"""What a CUDA build with Options.autotune compiles and times, without a GPU
(kiln/targets/cuda/tune_plan.py, launch_tune.plan / tune_all, triton_aot.Pool): the pruning
rules as pure functions, the candidate counts they give on ResNet-18 against the full search,
one compile pass for every family of tuned steps, and the worker pool that hands candidates
over as they finish."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import sympy
import torch

triton = pytest.importorskip("triton")

import kiln  # noqa: E402
from kiln.api import export  # noqa: E402
from kiln.ir import loop as L  # noqa: E402
from kiln.models import get  # noqa: E402
from kiln.pipeline import target_of  # noqa: E402
from kiln.targets.cuda import build as cuda_build  # noqa: E402
from kiln.targets.cuda import launch_tune  # noqa: E402
from kiln.targets.cuda import tune_plan as TP  # noqa: E402
from kiln.targets.cuda.conv_template import conv_candidates  # noqa: E402
from kiln.targets.cuda.kernel import Config, TritonKernel  # noqa: E402
from kiln.toolchain import triton_aot  # noqa: E402

# -- the rules ---------------------------------------------------------------------------------


def test_roofline_counts_bytes_and_serial_programs():
    big = TP.roofline_us(64 << 20, 4096, (64 << 20) / 4096)
    assert big == pytest.approx(TP.LAUNCH_US + (64 << 20) / TP.HBM_B_PER_US)
    assert TP.roofline_us(1 << 20, 4096, 256) < TP.roofline_us(2 << 20, 4096, 512)
    # the same bytes in one program (a long reduction over one row) run at one SM's rate
    one = TP.roofline_us(1 << 20, 1, 1 << 20)
    assert one == pytest.approx(TP.LAUNCH_US + (1 << 20) / TP.SM_B_PER_US)
    assert one > 4 * TP.roofline_us(1 << 20, 1024, 1024)


def test_tune_thresholds():
    assert not TP.tune_kernel(TP.KERNEL_MIN_US - 0.01) and TP.tune_kernel(TP.KERNEL_MIN_US)
    assert not TP.tune_conv(TP.CONV_LOW_US - 0.01) and TP.tune_conv(TP.CONV_LOW_US)
    assert [TP.conv_keep(us) for us in (TP.CONV_LOW_US - 0.01, TP.CONV_LOW_US,
                                        TP.CONV_MIN_US - 0.01, TP.CONV_MIN_US, 100.0)] == \
        [0, TP.CONV_KEEP_LOW, TP.CONV_KEEP_LOW, TP.CONV_KEEP, TP.CONV_KEEP]
    # a 2 MB pointwise kernel (ResNet-18's max pool at batch 1) is not worth its compiles,
    # a 32 MB LayerNorm is
    assert not TP.tune_kernel(TP.roofline_us(2 << 20, 3136, (2 << 20) / 3136))
    assert TP.tune_kernel(TP.roofline_us(32 << 20, 4096, (32 << 20) / 4096))


def test_dense_conv_model_prefers_filling_the_gpu():
    # a 7x7 image, 512 channels, K = 4608 (ResNet-18's last stage at batch 1): 128 x 128
    # tiles give 4 programs; 16 x 32 tiles give 64
    small, big = (TP.dense_conv_us(49, 512, 4608, 1, 1, bm, bn, 64, 2)
                  for bm, bn in ((16, 32), (128, 128)))
    assert small < big
    # a large problem (112 x 112 pixels at batch 8): big tiles reuse operands, many waves
    small, big = (TP.dense_conv_us(100352, 64, 576, 1, 1, bm, bn, 64, 2)
                  for bm, bn in ((16, 32), (128, 64)))
    assert big < small
    # split-K divides the K steps among more programs: faster when tiles are few
    assert TP.dense_conv_us(49, 512, 4608, 1, 4, 64, 64, 64, 2) < \
        TP.dense_conv_us(49, 512, 4608, 1, 1, 64, 64, 64, 2)
    # float32 (3xTF32) is never faster than bfloat16 on the same tile
    assert TP.dense_conv_us(12544, 64, 576, 1, 1, 64, 64, 32, 4) > \
        TP.dense_conv_us(12544, 64, 576, 1, 1, 64, 64, 64, 2)


def test_depthwise_model_counts_waves():
    one_wave = TP.depthwise_conv_us(3136, 96, 9, 64, 64, 2)  # 49 x 2 = 98 programs
    assert one_wave < TP.depthwise_conv_us(3136 * 4, 96, 9, 64, 64, 2)
    assert TP.depthwise_conv_us(3136, 96, 9, 8, 128, 2) > TP.LAUNCH_US


def test_keep_best_keeps_the_heuristic_first_and_the_order():
    cands = ["h", "a", "b", "c", "d", "e"]
    assert TP.keep_best(cands, [9, 1, 5, 2, 2, 7], 4) == ["h", "a", "c", "d"]
    assert TP.keep_best(cands, [0, 3, 3, 3, 3, 3], 3) == ["h", "a", "b"]  # ties: the earlier
    assert TP.keep_best(cands[:3], [5, 1, 2], 4) == ["h", "a", "b"]
    assert TP.keep_best(cands, [1] * 6, 1) == ["h"]


def test_attention_model():
    causal = TP.attention_us(8, 1024, 1024, 64, 64, 2, True)
    full = TP.attention_us(8, 1024, 1024, 64, 64, 2, False)
    assert TP.LAUNCH_US < causal < full
    # the zoo GPT's attention (batch 2, 4 heads, 128 tokens) runs in a few microseconds
    assert not TP.tune_kernel(TP.attention_us(8, 128, 128, 64, 64, 2, True))
    assert TP.tune_kernel(TP.attention_us(32 * 16, 2048, 2048, 128, 128, 2, True))


# -- the rules on a model --------------------------------------------------------------------


def _state(module, args, **opts):
    """The CUDA pipeline's state where launch_autotune would run."""
    target = target_of("cuda")
    st = target.state(options=kiln.Options(cuda_archs=(90,), **opts),
                      ep=export(module, args, None, None))
    for s in target.stages:
        if s.name == "check_routines":
            break
        if s.when(st):
            st = s.run(st)
    return st


@pytest.fixture(scope="module")
def resnet18_bf16():
    spec = get("resnet18")
    return spec.module.to(torch.bfloat16), (spec.example_args[0].to(torch.bfloat16),)


@pytest.fixture(scope="module")
def resnet18_states(resnet18_bf16, tmp_path_factory):
    """ResNet-18 bf16 where launch_autotune would run: pruned (the default) and full."""
    d = tmp_path_factory.mktemp("resnet18")
    return {"pruned": _state(*resnet18_bf16, cache_dir=str(d)),
            "full": _state(*resnet18_bf16, cache_dir=str(d), tune_prune=False)}


def _counts(st):
    fams = cuda_build.tuning_families(st)
    todo, copies, family, _ = launch_tune.plan(fams, cuda_build._hints(st))
    return fams, todo, family


def test_pruning_cuts_resnet18_candidates(resnet18_bf16, resnet18_states, tmp_path):
    full, pruned = resnet18_states["full"], resnet18_states["pruned"]
    _, todo_full, fam_full = _counts(full)
    fams, todo, family = _counts(pruned)
    n_full = sum(len(t) for _, t, _ in todo_full)
    n = sum(len(t) for _, t, _ in todo)
    assert n_full >= 100 and n <= 0.4 * n_full
    # the full search tunes the max pool kernel (2^18 reduction elements); its ~2 MB run in
    # about as long as a launch, so the pruned plan keeps its heuristic config
    assert any(not fam_full[s.name].label for s, _, _ in todo_full)
    assert all(family[s.name].label == "conv" for s, _, _ in todo)
    bufs, hints = L.all_buffers(pruned.loop), cuda_build._hints(pruned)
    for call, tks, _ in todo:
        cands = conv_candidates(call, bufs, hints)
        kept = [tk.config for tk in tks]
        us = TP.conv_us(call, bufs, hints, cands[0])
        assert len(kept) == min(len(cands), TP.conv_keep(us)) and kept[0] == cands[0]
        assert kept == TP.keep_conv(call, bufs, hints, cands)
        assert TP.tune_conv(us)
    # max_autotune searches as widely as tune_prune=False
    wide = _state(*resnet18_bf16, cache_dir=str(tmp_path), max_autotune=True)
    assert sum(len(t) for _, t, _ in _counts(wide)[1]) >= n_full - 6  # (1x1 convs: GEMMs)


class _Attn(torch.nn.Module):
    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_small_attention_is_not_tuned(tmp_path):
    args = tuple(torch.randn(2, 4, 128, 64, dtype=torch.bfloat16) for _ in range(3))
    st = _state(_Attn(), args, cache_dir=str(tmp_path))
    assert cuda_build.tuning_families(st) == []
    st = _state(_Attn(), args, cache_dir=str(tmp_path), tune_prune=False)
    (fam,) = cuda_build.tuning_families(st)
    assert fam.label == "attn" and len(fam.items) == 1


# -- one pass over every family ----------------------------------------------------------------


def test_one_compile_pass_for_every_family(resnet18_states, tmp_path, monkeypatch):
    st = resnet18_states["full"]
    fams = cuda_build.tuning_families(st)
    # the fc layer at batch 1 is a GEMV (M = 1): its launch configs are a family too
    assert {f.label for f in fams} == {"", "conv", "gemv"}
    passes, timed = [], []

    def fake_compile(todo, cache, arch, workers=1, extra=(), started=None):
        passes.append([s.name for s, _, _ in todo])
        return {(i, j): tk.config for i, (_, tks, _) in enumerate(todo)
                for j, tk in enumerate(tks)}

    def fake_time(cfg, grid, args, torch, reps=20):
        timed.append(cfg)
        return 1.0 / (cfg.xblock * cfg.rblock * cfg.num_warps)

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(launch_tune, "_compile_candidates", fake_compile)
    monkeypatch.setattr(launch_tune, "_time_ms", fake_time)
    monkeypatch.setattr(launch_tune, "_time_cold_ms",  # the GEMV: cold operands
                        lambda cfg, grid, sets, consts, torch: fake_time(cfg, grid, sets, torch))
    monkeypatch.setattr(launch_tune, "_args", lambda *a: [])
    monkeypatch.setattr(triton_aot, "store_compiled", lambda *a: None)
    bufs, hints = L.all_buffers(st.loop), cuda_build._hints(st)
    best, report = launch_tune.tune_all(fams, bufs, hints, 90, tmp_path / "c")
    assert len(passes) == 1  # kernels and convolutions compiled together
    assert set(best) == {s.name for f in fams for s in f.items}
    assert any(k.startswith("conv_") for k in report) and \
        any(k.startswith("gemv_") for k in report) and \
        any(not k.startswith(("conv_", "gemv_")) for k in report)
    assert len(timed) == sum(len(v) for v in report.values())
    again, report2 = launch_tune.tune_all(fams, bufs, hints, 90, tmp_path / "c")
    assert again == best and report2 == {} and len(passes) == 1  # remembered


# -- the worker pool ---------------------------------------------------------------------------

_SRC = """@triton.jit
def {name}(buf_x, buf_y, n, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):
    i = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    tl.store(buf_y + i, tl.load(buf_x + i, mask=i < n) {op}, mask=i < n)
"""


def _kernel(name: str, op: str, xblock: int = 64) -> TritonKernel:
    return TritonKernel(name, _SRC.format(name=name, op=op),
                        (("in", "x"), ("out", "y"), ("size", "n")),
                        {"buf_x": "*fp32", "buf_y": "*fp32", "n": "i32", "XBLOCK": "constexpr",
                         "RBLOCK": "constexpr"}, Config(xblock, 1, 1), sympy.Integer(1024))


def test_pool_hands_over_each_task_as_it_is_done(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton_home"))
    head = "import triton\nimport triton.language as tl\n\n\n"
    ks = [_kernel("k_a", "* 2.0"), _kernel("k_b", "+ 1.0"), _kernel("k_c", "+ undefined_name")]
    text = head + "\n\n".join(k.source for k in ks)
    pool = triton_aot.Pool([(text, k, 90) for k in ks], tmp_path / "c", workers=2)
    try:
        assert len(pool.procs) == 2
        for t, k in enumerate(ks[:2]):
            c = pool.cubin(t, k, 90)
            assert c is not None and c.cubin and c.kernel == k.name
        assert pool.cubin(2, ks[2], 90) is None  # it failed: the caller's compile reports it
        mod = triton_aot.import_module(text, tmp_path / "c")
        assert triton_aot.compile_kernel(mod, ks[0], 90).asm["cubin"]  # from Triton's cache
    finally:
        pool.close()
    assert pool.tmp is None and not pool.procs
    single = triton_aot.Pool([(text, ks[0], 90)], tmp_path / "c", workers=8)
    assert not single.procs  # one task: the caller compiles it
    single.wait(0)
    single.close()


def test_workers_started_ahead_serve_the_pool_and_the_cubins_stage(tmp_path, monkeypatch):
    """triton_aot.Workers: processes started before their tasks (a CUDA build's `workers`
    stage) take the tuning pool's tasks and then the cubins stage's, and give the cubins a
    compile in this process gives; a worker that has ended is passed over; close() ends
    them."""
    from kiln.targets.cuda.kernel import print_triton_module
    from kiln.targets.cuda.ops import PRELUDE
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton_home"))
    ks = [_kernel("k_a", "* 2.0"), _kernel("k_b", "+ 1.0"), _kernel("k_c", "+ undefined_name")]
    text = print_triton_module(ks)
    workers = triton_aot.Workers(3)
    try:
        assert len(workers.alive()) == 3
        pool = triton_aot.Pool([(text, k, 90) for k in ks], tmp_path / "c", workers=2,
                               started=workers)
        assert pool.procs == workers.procs[:2]  # no process of its own
        assert [pool.cubin(t, k, 90) is not None for t, k in enumerate(ks)] == \
            [True, True, False]
        pool.close()
        assert len(workers.alive()) == 3  # the pool's end is not the workers'
        more = [_kernel(f"k_{i}", f"* {i}.0", 32 << (i % 3)) for i in range(5)]
        text2 = print_triton_module(more)
        workers.procs[0].kill()
        workers.procs[0].wait()
        monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton_home2"))  # (this one's)
        here, _ = triton_aot.compile_cubins(text2, more, (90,), tmp_path / "d", workers=1,
                                            prelude=PRELUDE)
        shutil.rmtree(tmp_path / "d")  # (the same path: line tables name the module's file)
        out, times = triton_aot.compile_cubins(text2, more, (90,), tmp_path / "d", workers=8,
                                               prelude=PRELUDE, started=workers)
        assert times["workers"] == 2 and times["compiled"] == 5  # the two running
    finally:
        workers.close()
    assert not workers.procs
    assert here == out  # cubins, symbols, shared memory, argument types: the same


def test_workers_stage_starts_workers_the_cubins_stage_ends(tmp_path):
    """A CUDA build without a GPU: the `workers` stage starts one fewer than the cubins
    stage's processes (it compiles too), the cubins stage uses and ends them; a small graph
    starts none."""
    widths = (32, 48, 64, 80, 96)  # every block's kernels of other sizes: compiled apart
    model = torch.nn.Sequential(*[m for a, b in zip(widths, widths[1:]) for m in (
        torch.nn.Linear(a, b), torch.nn.LayerNorm(b), torch.nn.GELU())])
    st = _state(model.eval(), (torch.randn(8, 32),), cache_dir=str(tmp_path / "c"), jobs=3)
    assert len(st.graph.nodes) >= 12 and st.workers is not None
    assert st.workers.alive() == [0, 1]  # (waits for the spawning thread: a loaded box lags)
    procs = list(st.workers.procs)
    st = cuda_build.cubins(cuda_build.codegen_triton(st))
    assert st.workers is None and st.times["workers"] == 2 and st.times["compiled"] >= 4
    assert all(p.poll() is not None for p in procs)  # ended with the stage
    small = _state(torch.nn.Linear(32, 32).eval(), (torch.randn(8, 32),),
                   cache_dir=str(tmp_path / "c"), jobs=3)
    assert small.workers is None


def test_worker_launchers_do_not_import_torch(tmp_path):
    """A tuning worker builds Triton's host launcher and CUDA utilities through the NVIDIA
    driver classes: `triton.runtime.driver.active` would import torch (seconds) to choose
    the backend. Without a CUDA driver here the build itself fails quietly."""
    import subprocess
    import sys
    from pathlib import Path
    warm = Path(triton_aot.__file__).with_name("triton_warm.py")
    k = _kernel("k_a", "* 2.0")
    mod = tmp_path / "m.py"
    mod.write_text("import triton\nimport triton.language as tl\n\n\n" + k.source)
    code = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("triton_warm", {str(warm)!r})
w = importlib.util.module_from_spec(spec); spec.loader.exec_module(w)
import triton
from triton.backends.compiler import GPUTarget
spec = importlib.util.spec_from_file_location("m", {str(mod)!r})
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
sig, consts, attrs = w.compile_args({dict(k.signature)!r}, {{"XBLOCK": 64, "RBLOCK": 1}})
src = triton.compiler.ASTSource(fn=m.k_a, signature=sig, constexprs=consts, attrs=attrs)
ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={{"num_warps": 1}})
w._launcher(src, ck)
print("TORCH" if "torch" in sys.modules else "NO_TORCH", ck.metadata.name)
"""
    env = {k: v for k, v in __import__("os").environ.items()}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton_home")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["NO_TORCH", "k_a"]


def test_warm_driver_builds_in_a_thread_and_ends_quietly(tmp_path, monkeypatch):
    """triton_aot.warm_driver: Triton's CUDA driver utilities built in a thread (a GPU
    build's tuning then finds them); without a CUDA driver here the thread ends without
    raising (the first launch reports it), and a compile in this process still works."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton_home"))
    t = triton_aot.warm_driver()
    t.join(timeout=120)
    assert not t.is_alive()
    k = _kernel("k_a", "* 2.0")
    mod = triton_aot.import_module("import triton\nimport triton.language as tl\n\n\n" +
                                   k.source, tmp_path / "c")
    assert triton_aot.compile_kernel(mod, k, 90).asm["cubin"]


def test_compiling_waits_per_candidate(tmp_path, monkeypatch):
    """launch_tune's view of the pool: candidate (i, j) is there once compiled; a neighbour
    that fails is absent; the heuristic (j = 0) failing is an error."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton_home"))
    good = [_kernel("k_a", "* 2.0", 64), _kernel("k_a", "* 2.0", 128),
            _kernel("k_a", "* 2.0 + undefined_name", 256)]
    todo = [(dataclasses.make_dataclass("S", ["name"])("a"), good, tmp_path / "p.json")]
    compiled = launch_tune._compile_candidates(todo, tmp_path / "c", 90, workers=2)
    try:
        assert (0, 0) in compiled and (0, 1) in compiled and (0, 2) not in compiled
        assert compiled[(0, 1)].asm["cubin"]
    finally:
        compiled.close()
    bad = [_kernel("k_a", "+ undefined_name", 64), _kernel("k_a", "* 2.0", 128)]
    compiled = launch_tune._compile_candidates([(todo[0][0], bad, todo[0][2])], tmp_path / "c",
                                               90, workers=2)
    try:
        with pytest.raises(kiln.errors.CompileError):
            (0, 0) in compiled
    finally:
        compiled.close()


def test_untuned_kernels_are_what_the_build_prints(resnet18_states):
    """The kernels the tuner's workers compile beside the candidates are, byte for byte, the
    build's own kernels of the steps it does not tune (so the cubins stage finds them)."""
    st = resnet18_states["pruned"]
    fams = cuda_build.tuning_families(st)
    extra = cuda_build.untuned_kernels(st, fams)
    printed = {tk.name: tk for tk in cuda_build.codegen_triton(st).triton}
    tuned = {s.name for f in fams for s in f.items}
    assert extra and len(extra) + len(tuned) == len(printed)
    for tk in extra:
        assert printed[tk.name] == tk


def test_extra_kernels_land_in_the_cubin_cache(tmp_path, monkeypatch):
    from kiln.targets.cuda.ops import PRELUDE
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton_home"))
    cands = [_kernel("k_a", "* 2.0", 64), _kernel("k_a", "* 2.0", 128)]
    extra = [_kernel("k_b", "+ 1.0"), _kernel("k_c", "+ undefined_name")]
    todo = [(dataclasses.make_dataclass("S", ["name"])("a"), cands, tmp_path / "p.json")]
    compiled = launch_tune._compile_candidates(todo, tmp_path / "c", 90, workers=2, extra=extra)
    try:
        assert (0, 1) in compiled
        assert compiled.store_extra() == 1  # k_c failed: the cubins stage reports it
    finally:
        compiled.close()
    from kiln.targets.cuda.kernel import print_triton_module
    out, times = triton_aot.compile_cubins(print_triton_module(extra[:1]), extra[:1], (90,),
                                           tmp_path / "c", prelude=PRELUDE)
    assert times["cache_hits"] == 1 and times["compiled"] == 0 and out[("k_b", 90)].cubin


class _ConvBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(64, 64, 3, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(64)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x))).mean((2, 3))


@pytest.mark.parametrize("ahead", [False, True], ids=["own_pool", "workers_ahead"])
def test_tune_all_with_real_compiles(tmp_path, monkeypatch, ahead):
    """The whole pass without a GPU, launches faked: the pool (its own processes, or the
    build's workers started ahead) compiles a convolution's kept candidates and the build's
    untuned kernels; the winner and the untuned kernels land in the cubin cache, so the
    cubins stage compiles nothing."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton_home"))
    torch.manual_seed(0)
    m = _ConvBlock().eval().to(torch.bfloat16)
    st = _state(m, (torch.randn(1, 64, 56, 56, dtype=torch.bfloat16),),
                cache_dir=str(tmp_path / "c"))
    fams = cuda_build.tuning_families(st)
    assert [f.label for f in fams] == ["conv"]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(launch_tune, "_time_ms", lambda ck, grid, args, torch, reps=20:
                        1.0 / ck.metadata.num_warps)
    monkeypatch.setattr(launch_tune, "_args", lambda *a: [])
    bufs, hints = L.all_buffers(st.loop), cuda_build._hints(st)
    stats: dict = {}
    started = triton_aot.Workers(2) if ahead else None
    try:
        best, report = launch_tune.tune_all(fams, bufs, hints, 90, tmp_path / "c", workers=2,
                                            stats=stats, started=started,
                                            extra=cuda_build.untuned_kernels(st, fams))
        if ahead:  # the pool handed its tasks to them: still running, for the cubins stage
            assert len(started.alive()) == 2
    finally:
        if started is not None:
            started.close()
    (call,) = fams[0].items
    assert call.name in best and stats["workers"] == 2 and stats["prebuilt"] >= 1
    assert stats["candidates"] == len(report[f"conv_{call.name}"]) <= TP.CONV_KEEP
    st = cuda_build.codegen_triton(dataclasses.replace(st, configs=best))
    st = cuda_build.cubins(st)
    assert st.times["compiled"] == 0 and st.times["cache_hits"] == len(st.triton)
