"""Quantised and bf16 weight GEMMs on the CPU (Options.weight_quant, weight_quant_kernel,
cpu_bf16_gemm; passes/quant_weights.py, kiln_qgemm.h).

Each compiled GEMM is checked
  tight: against float64 products with the weights the package stores, dequantised
         (ir/quant.py's `dequantize`; for the VNNI kernel the activations quantised per row
         as the kernel does), within fp32 accumulation error;
  loose: against the float32 model, within the bound rounding to the grid implies:
         |y - y32| <= sum_k |x_k| * s / 2 (+ fp32 error), s the scale of B[k, n]'s column
         (int8) or group (int4), both computed here from the float weights.
Several M (1, small, and >= 16 where int8 / int4 dequantise panels for BLAS), K not a multiple
of the kernels' K step or the int4 group, odd N."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from torch.export import Dim

import kiln
from kiln.errors import InputError
from kiln.ir import quant as Q
from kiln.runtime import cpu_supports
from kiln.toolchain.cxx import CPU_FEATURES

SHAPES = ((70, 37), (64, 48), (133, 16), (40, 1))  # (K, N) of each Linear
ROWS = (1, 3, 4, 5, 9, 15, 17, 40)
GROUP = 16


class Net(torch.nn.Module):
    """One Linear per (K, N), each fed its own input; returns every product."""

    def __init__(self, shapes=SHAPES, bias=True):
        super().__init__()
        self.fcs = torch.nn.ModuleList(torch.nn.Linear(k, n, bias=bias) for k, n in shapes)

    def forward(self, *xs):
        return tuple(fc(x) for fc, x in zip(self.fcs, xs))


def _inputs(rows, shapes=SHAPES, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed + rows)
    return tuple(torch.randn(rows, k, generator=g).to(dtype) for k, _ in shapes)


def _compile(model, dtype=torch.float32, **opts):
    xs = _inputs(8, dtype=dtype)
    batch = Dim("batch", min=1, max=64)
    return kiln.compile(model, xs, dynamic_shapes={"xs": tuple({0: batch} for _ in xs)},
                        options=kiln.Options(**opts))


def _stored(cm, fc_index: int, mode: str) -> dict:
    """The tensors the package stores for Linear `fc_index`'s weight."""
    return _parts(cm, f"<quantised {mode} of fcs.{fc_index}.weight>")


def _parts(cm, fqn: str) -> dict:
    """The stored tensors of FQN `fqn`, by part ("q", "s", "wsum")."""
    specs = [w for w in cm.manifest["weights"] if w["fqn"] == fqn]
    assert specs, [w["fqn"] for w in cm.manifest["weights"]]
    out = {}
    for w in specs:
        part = w["name"].rsplit("_", 1)[-1]
        out["wsum" if part == "wsum" else "s" if part == "s" else "q"] = cm.built.weights[w["name"]]
    return out


def _grid_bound(w: torch.Tensor, x: torch.Tensor, mode: str, group: int) -> torch.Tensor:
    """sum_k |x[m, k]| * s[k, n] / 2 with s the int8 column / int4 group scale of B = W.t()."""
    b = w.t().double()  # [K, N]
    k = b.shape[0]
    if mode == "int8":
        s = (b.abs().amax(0) / 127).expand(k, -1)
    else:
        kp = -(-k // group) * group
        bp = torch.zeros(kp, b.shape[1], dtype=torch.float64)
        bp[:k] = b
        s = (bp.reshape(kp // group, group, -1).abs().amax(1) / 7).repeat_interleave(group, 0)[:k]
    return x.double().abs() @ s / 2


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_weight_only_matches_dequantised_weights_and_fp32_within_the_grid_bound(mode):
    torch.manual_seed(0)
    model = Net().eval()
    cm = _compile(model, weight_quant=mode, weight_quant_group=GROUP)
    assert "qgemm.cpp" in cm.sources
    wrapper = cm.sources["model.cpp"]
    assert wrapper.count("kl::qgemm(") == len(SHAPES)
    # the bias adds are folded into the qgemm calls: no kernel is left
    assert not any("void k" in t for f, t in cm.sources.items() if f.startswith("kernels"))
    runner = cm.load()
    for rows in ROWS:
        xs = _inputs(rows)
        got = runner(*xs)
        with torch.no_grad():
            ref32 = model(*xs)
        for i, ((k, n), x, y, y32) in enumerate(zip(SHAPES, xs, got, ref32)):
            fc = model.fcs[i]
            deq = Q.dequantize(mode, _stored(cm, i, mode), k, n, GROUP)
            y64 = x.double() @ deq + fc.bias.double()
            mag = x.double().abs() @ deq.abs() + fc.bias.double().abs()
            err = (y.double() - y64).abs()
            assert (err <= 1e-5 * mag + 1e-6).all(), (mode, rows, i, err.max().item())
            bound = _grid_bound(fc.weight.detach(), x, mode, GROUP) + 1e-5 * mag + 1e-6
            err32 = (y.double() - y32.double()).abs()
            assert (err32 <= bound).all(), (mode, rows, i, (err32 - bound).max().item())
            assert err32.max() > 0  # it is quantised


def test_dequantize_is_within_half_a_step_of_the_weights():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(75, 33, generator=g) * torch.linspace(0.1, 3, 33)
    w[:, 5] = 0  # an all-zero column: scale 1, values 0
    d8 = Q.dequantize("int8", Q.quantize_int8(w), 75, 33)
    s8 = w.double().abs().amax(0) / 127
    assert ((d8 - w.double()).abs() <= s8 / 2 + 1e-7).all() and (d8[:, 5] == 0).all()
    d4 = Q.dequantize("int4", Q.quantize_int4(w, 8), 75, 33, 8)
    assert ((d4 - w.double()).abs() <= _grid_bound(w.t(), torch.eye(75), "int4", 8) + 1e-7).all()
    assert torch.equal(Q.dequantize("bf16", Q.pack_bf16(w.bfloat16()), 75, 33),
                       w.bfloat16().double())


def _vnni_reference(mode: str, st: dict, x: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """ir/quant.py's float64 twin of the VNNI kernel of `mode` ("int8" / "int4")."""
    if mode == "int8":
        return torch.from_numpy(Q.routine(None, {"mode": 2, "k": k, "n": n}, x.numpy(),
                                          st["q"].numpy(), st["s"].numpy(),
                                          st["wsum"].numpy())[0])
    return torch.from_numpy(Q.routine(None, {"mode": 4, "k": k, "n": n, "group": GROUP},
                                      x.numpy(), st["q"].numpy(), st["s"].numpy())[0])


@pytest.mark.parametrize("mode,march", [("int8", "native"), ("int4", "native"),
                                        # int4: vpmaddubsw + vpmaddwd without AVX-512 VNNI
                                        ("int4", "x86-64-v4")])
def test_vnni_kernel_matches_integer_products_of_row_quantised_activations(mode, march):
    torch.manual_seed(0)
    model = Net(bias=False).eval()
    cm = _compile(model, weight_quant=mode, weight_quant_kernel="vnni", weight_quant_group=GROUP,
                  march=march)
    assert cm.sources["model.cpp"].count(f"{mode}_vnni weight GEMM") == len(SHAPES)
    runner = cm.load()
    for rows in (1, 2, 5, 12, 17):
        xs = _inputs(rows)
        got = runner(*xs)
        for i, ((k, n), x, y) in enumerate(zip(SHAPES, xs, got)):
            st = _stored(cm, i, f"{mode}_vnni")
            y64 = _vnni_reference(mode, st, x, k, n)
            xq, sx = Q.quantize_rows(x.numpy())
            deq = Q.dequantize(mode, st, k, n, GROUP)
            mag = torch.from_numpy(abs(xq) * sx).double() @ deq.abs()
            err = (y.double() - y64).abs()
            assert (err <= 1e-5 * mag + 1e-6).all(), (rows, i, err.max().item())
            with torch.no_grad():  # and near the float model, within both grids' bound:
                y32 = model.fcs[i](x).double()  # |x - xq sx| <= sx / 2, |w - deq| <= s / 2
            bound = (torch.from_numpy(sx).double() / 2 * deq.abs().sum(0) + 1e-5 * mag + 1e-6
                     + _grid_bound(model.fcs[i].weight.detach(), x, mode, GROUP))
            assert ((y.double() - y32).abs() <= bound).all(), (rows, i)


@pytest.mark.parametrize("shapes,march", [
    (((70, 37), (64, 48), (133, 16), (40, 1)), "native"), (((31, 65), (128, 17)), "native"),
    # AVX-512 without avx512_bf16's vdpbf16ps: the FMA path, every row count of the sweep
    (((70, 37), (133, 16), (31, 65), (9, 3)), "x86-64-v4")])
def test_bf16_gemm_matches_float64(shapes, march):
    torch.manual_seed(0)
    model = Net(shapes).eval().to(torch.bfloat16)
    xs = _inputs(8, shapes, torch.bfloat16)
    batch = Dim("batch", min=1, max=64)
    cm = kiln.compile(model, xs, dynamic_shapes={"xs": tuple({0: batch} for _ in xs)},
                      options=kiln.Options(march=march))
    assert all(w["fqn"].startswith("<quantised bf16") for w in cm.manifest["weights"]
               if w["fqn"].endswith(".weight>") or w["fqn"].endswith(".weight"))
    runner = cm.load()
    for rows in (1, 2, 3, 5, 11, 33):
        xs = _inputs(rows, shapes, torch.bfloat16)
        got = runner(*xs)
        for fc, x, y in zip(model.fcs, xs, got):
            assert y.dtype == torch.bfloat16
            w = fc.weight.double().t()
            y64 = x.double() @ w + fc.bias.double()  # bias in the fp32 sum: rounded once
            mag = x.double().abs() @ w.abs() + fc.bias.double().abs()
            bound = 2 ** -8 * y64.abs() + 1e-5 * mag + 1e-6
            assert ((y.double() - y64).abs() <= bound).all()


def test_bf16_gemm_off_widens_to_float32():
    model = Net(((16, 8),)).to(torch.bfloat16)
    x = (torch.randn(4, 16).bfloat16(),)
    cm = kiln.compile(model, x, options=kiln.Options(cpu_bf16_gemm=False))
    assert "qgemm.cpp" not in cm.sources
    assert not any(w["fqn"].startswith("<quantised") for w in cm.manifest["weights"])


def test_package_round_trip_stores_quantised_weights_and_refuses_update_weights(tmp_path):
    torch.manual_seed(0)
    model = Net(((64, 48),)).eval()
    x = (torch.randn(3, 64),)
    cm = kiln.compile(model, x, options=kiln.Options(weight_quant="int4", weight_quant_group=32))
    runner = kiln.load(cm.save(tmp_path / "q.kiln"))
    m = runner.manifest
    assert m["options"]["weight_quant"] == "int4" and m["options"]["weight_quant_group"] == 32
    ws = {w["name"]: w for w in m["weights"]}
    assert ws["p_fcs_0_weight_q4"]["dtype"] == "int8"
    assert ws["p_fcs_0_weight_q4"]["nbytes"] == 48 * 64 // 2  # two values a byte
    assert ws["p_fcs_0_weight_q4"]["fqn"] == "<quantised int4 of fcs.0.weight>"
    assert "p_fcs_0_weight" not in ws  # the float weight is not shipped
    deq = Q.dequantize("int4", _stored(cm, 0, "int4"), 64, 48, 32)
    want = x[0].double() @ deq + model.fcs[0].bias.double()
    torch.testing.assert_close(runner(*x)[0].double(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(InputError, match="quantised.*weight_quant='int4'"):
        runner.update_weights(model.state_dict())


def test_bad_options_name_the_option():
    with pytest.raises(ValueError, match="weight_quant: expected one of"):
        kiln.Options(weight_quant="int3")
    with pytest.raises(ValueError, match="weight_quant_group: expected a positive multiple of 8"):
        kiln.Options(weight_quant="int4", weight_quant_group=12)
    with pytest.raises(ValueError, match="weight_quant_kernel"):
        kiln.Options(weight_quant_kernel="amx")


class Mixed(torch.nn.Module):
    """A float32 Linear (quantised) and a bf16 Linear (bf16 kernel) in one package."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(70, 37)
        self.fc16 = torch.nn.Linear(45, 19).to(torch.bfloat16)

    def forward(self, x, x16):
        return self.fc(x), self.fc16(x16)


@pytest.mark.parametrize("mode,kernel", [("int4", "dequant"), ("int8", "vnni"), ("int4", "vnni")])
def test_portable_package_runs_each_level(mode, kernel):
    """march="portable": qgemm.cpp is compiled per level (AVX-512 paths, and VNNI / bf16
    only where the level has them; portable loops for x86-64-v3 and x86-64); each level's
    library gives the float64 reference within fp32 error."""
    missing = [f for f in CPU_FEATURES.values() if cpu_supports(f) is False]
    torch.manual_seed(0)
    model = Mixed().eval()
    xs = (torch.randn(5, 70), torch.randn(5, 45).bfloat16())
    cm = kiln.compile(model, xs, options=kiln.Options(
        march="portable", weight_quant=mode, weight_quant_kernel=kernel,
        weight_quant_group=GROUP))
    qmode = f"{mode}_vnni" if kernel == "vnni" else mode
    fq = f"<quantised {qmode} of fc.weight>"
    st = _parts(cm, fq)
    if kernel == "vnni":
        want = _vnni_reference(mode, st, xs[0], 70, 37)
    else:
        want = xs[0].double() @ Q.dequantize(mode, st, 70, 37, GROUP)
    want = want + model.fc.bias.double()
    w16 = model.fc16.weight.double().t()
    want16 = xs[1].double() @ w16 + model.fc16.bias.double()
    levels = cm.manifest["requires"]["cpu_levels"]
    for skip in range(len(levels)):
        if skip and not missing:
            pytest.skip("this CPU has every feature kiln knows")
        manifest = copy.deepcopy(cm.manifest)
        for lv in manifest["requires"]["cpu_levels"][:skip]:
            lv["cpu_features"].append(missing[0])
        runner = replace(cm, manifest=manifest).load()
        if not all(cpu_supports(f) for f in manifest["requires"]["cpu_levels"][skip][
                "cpu_features"]):
            continue
        assert runner.cpu_level == levels[skip]["march"]
        y, y16 = runner(*xs)
        torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(y16.double(), want16, rtol=2 ** -7, atol=1e-2)


class Tied(torch.nn.Module):
    """An embedding tied to the output projection, a weight read by two GEMMs, and a GEMM of
    two activations (not a weight: left to the float GEMM)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(40, 24)
        self.fc = torch.nn.Linear(24, 24, bias=False)

    def forward(self, tok, y):
        h = self.emb(tok)
        a, b = self.fc(h), self.fc(h * 2)
        return torch.nn.functional.linear(a + b, self.emb.weight), a @ y


def test_tied_and_shared_weights_and_activation_products():
    torch.manual_seed(0)
    model = Tied().eval()
    args = (torch.randint(0, 40, (5,)), torch.randn(24, 7))
    cm = kiln.compile(model, args, options=kiln.Options(weight_quant="int8"))
    fqns = sorted({w["fqn"] for w in cm.manifest["weights"]})
    # the embedding table stays (the lookup reads it) and is also stored quantised for the
    # tied projection; fc's weight is quantised once for both of its GEMMs
    assert fqns == ["<quantised int8 of emb.weight>", "<quantised int8 of fc.weight>",
                    "emb.weight"], fqns
    got = cm.load()(*args)
    with torch.no_grad():
        ref = model(*args)
    h = model.emb.weight[args[0]].double()
    dfc = Q.dequantize("int8", _parts(cm, "<quantised int8 of fc.weight>"), 24, 24)
    demb = Q.dequantize("int8", _parts(cm, "<quantised int8 of emb.weight>"), 24, 40)
    a = h @ dfc
    want = (a + (h * 2) @ dfc) @ demb
    torch.testing.assert_close(got[0].double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1].double(), a @ args[1].double(), rtol=1e-5, atol=1e-5)
    assert (got[0] - ref[0]).abs().max() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_embedding_gathers_rows_without_widening_the_table(dtype):
    """widen_half leaves `embedding` in the half type (a gather): rows equal eager's bit for
    bit, and no float32 copy of the table is made per run."""
    emb = torch.nn.Embedding(50, 12).to(dtype)
    tok = torch.randint(0, 50, (3, 4))
    cm = kiln.compile(emb, (tok,))
    kernels = "".join(t for n, t in cm.sources.items() if n.startswith("kernels"))
    assert "f32" not in kernels and "float*" not in kernels, kernels
    got = cm.load()(tok)
    assert got.dtype == dtype and torch.equal(got, emb(tok))
