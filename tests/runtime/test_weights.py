"""Weights: replaced without recompiling (from a state_dict or a safetensors file), checked
against the manifest, atomic with respect to runs; FQNs and dtypes in the manifest; tied
parameters stored once; returned constants and views of constants."""

from __future__ import annotations

import threading

import pytest
import torch
from safetensors.torch import save_file

import kiln
from kiln.ir.packing import pack_panels


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 4)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))) * self.scale


@pytest.fixture
def net_runner(tmp_path):
    torch.manual_seed(0)
    m = Net().eval()
    batch = torch.export.Dim("batch", min=1, max=64)
    c = kiln.compile(m, (torch.randn(3, 16),), dynamic_shapes=({0: batch},))
    return m, c.load(tmp_path / "net.kiln")


def _fresh(m):
    m2 = Net().eval()
    with torch.no_grad():
        for p in m2.parameters():
            p.normal_()
        m2.scale.fill_(-0.5)
    return m2


def test_update_from_state_dict(net_runner):
    m, runner = net_runner
    x = torch.randn(5, 16)
    with torch.no_grad():
        torch.testing.assert_close(runner(x), m(x), rtol=1e-5, atol=1e-5)
    m2 = _fresh(m)
    runner.update_weights(m2.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(runner(x), m2(x), rtol=1e-5, atol=1e-5)


def test_update_from_safetensors_file(net_runner, tmp_path):
    m, runner = net_runner
    m2 = _fresh(m)
    names = {w["fqn"]: w["name"] for w in runner.manifest["weights"]}
    path = tmp_path / "w.safetensors"
    save_file({names[k]: v.contiguous() for k, v in m2.state_dict().items() if k in names},
              str(path))
    runner.update_weights(path)
    x = torch.randn(2, 16)
    with torch.no_grad():
        torch.testing.assert_close(runner(x), m2(x), rtol=1e-5, atol=1e-5)


def test_update_is_checked(net_runner, tmp_path):
    m, runner = net_runner
    state = m.state_dict()
    x = torch.randn(2, 16)
    before = runner(x)
    bad = [
        ({**state, "fc1.weight": torch.randn(32, 15)}, "expected shape"),
        ({**state, "fc1.weight": state["fc1.weight"].double()}, "expected dtype float32"),
        ({k: v for k, v in state.items() if k != "fc2.bias"}, "missing weights"),
    ]
    for sd, msg in bad:
        with pytest.raises(kiln.errors.InputError, match=msg):
            runner.update_weights(sd)
    path = tmp_path / "wrong.safetensors"
    save_file({"nope": torch.zeros(3)}, str(path))
    with pytest.raises(kiln.errors.KilnError, match="missing weight"):
        runner.update_weights(path)
    with pytest.raises(kiln.errors.KilnError, match="cannot open"):
        runner.update_weights(tmp_path / "absent.safetensors")
    torch.testing.assert_close(runner(x), before)  # a failed update changes nothing


def test_runs_never_see_half_updated_weights(net_runner):
    m, runner = net_runner
    a, b = m, _fresh(m)
    x = torch.randn(4, 16)
    with torch.no_grad():
        ya, yb = a(x), b(x)
    states = [a.state_dict(), b.state_dict()]
    stop = threading.Event()
    bad = []

    def reader():
        while not stop.is_set():
            y = runner(x)
            if not (torch.allclose(y, ya, atol=1e-5) or torch.allclose(y, yb, atol=1e-5)):
                bad.append(y)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for k in range(20):
        runner.update_weights(states[k % 2])
    stop.set()
    for t in threads:
        t.join()
    assert not bad


def test_manifest_has_fqns_dtypes_and_tied_weights_once(tmp_path):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 8)
            self.head = torch.nn.Linear(8, 10, bias=False)
            self.head.weight = self.emb.weight
            self.register_buffer("offset", torch.arange(10, dtype=torch.int64))

        def forward(self, ids):
            return self.head(self.emb(ids)), self.offset[ids]

    m = Tied().eval()
    ids = torch.tensor([[1, 2, 9]])
    c = kiln.compile(m, (ids,))
    runner = c.load(tmp_path / "tied.kiln")
    ws = runner.manifest["weights"]
    assert sorted(w["dtype"] for w in ws) == ["float32", "int64"]
    assert len([w for w in ws if w["dtype"] == "float32"]) == 1  # tied: stored once
    assert {w["fqn"] for w in ws} <= {"emb.weight", "head.weight", "offset"}
    with torch.no_grad():
        for got, want in zip(runner(ids), m(ids)):
            torch.testing.assert_close(got, want)


def test_returning_constants_and_views_of_constants(tmp_path):
    class Const(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.arange(12.0).reshape(3, 4))

        def forward(self, x):
            return self.table, self.table[1], x + self.table, self.table.t()

    m = Const()
    x = torch.randn(3, 4)
    runner = kiln.compile(m, (x,)).load(tmp_path / "c.kiln")
    for got, want in zip(runner(x), m(x)):
        torch.testing.assert_close(got, want)


class Prep(torch.nn.Module):
    """Weight preprocessing in forward: folded at compile time."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))
        self.register_buffer("m", torch.randn(8))

    def forward(self, x):
        return x @ (torch.relu(self.w.t() * 2) + self.m), torch.cat([self.m, self.m]) * x[0, 0]


def test_weight_only_subgraphs_are_folded(tmp_path):
    m, x = Prep(), torch.randn(3, 8)
    c = kiln.compile(m, (x,))
    fqns = {w["fqn"] for w in c.manifest["weights"]}
    assert "w" not in fqns and any(f.startswith("<folded") for f in fqns)  # w only via folding
    runner = c.load(tmp_path / "f.kiln")
    for g, w in zip(runner(x), m(x)):
        torch.testing.assert_close(g, w.detach())
    with pytest.raises(kiln.errors.InputError, match="fold_constants=False"):
        runner.update_weights(m.state_dict())
    unfolded = kiln.compile(m, (x,), options=kiln.Options(fold_constants=False))
    assert not any(w["fqn"].startswith("<folded") for w in unfolded.manifest["weights"])
    r2 = unfolded.load(tmp_path / "u.kiln")
    m2 = Prep()
    r2.update_weights(m2.state_dict())
    for g, w in zip(r2(x), m2(x)):
        torch.testing.assert_close(g, w.detach())


def test_update_from_file_checks_shapes(net_runner, tmp_path):
    m, runner = net_runner
    names = {w["fqn"]: w["name"] for w in runner.manifest["weights"]}
    state = {names[k]: v.contiguous() for k, v in m.state_dict().items() if k in names}
    state[names["fc1.weight"]] = state[names["fc1.weight"]].reshape(16, 32).contiguous()
    path = tmp_path / "reshaped.safetensors"
    save_file(state, str(path))  # same dtype and byte size, different shape
    with pytest.raises(kiln.errors.KilnError, match=r"has shape \[16, 32\], the model expects "
                                                    r"\[32, 16\]"):
        runner.update_weights(path)


def test_incompatible_manifest_is_refused(tmp_path):
    import zipfile

    from kiln.package import read_package, write_package

    m = torch.nn.Linear(4, 2)
    path = kiln.compile(m, (torch.randn(1, 4),)).save(tmp_path / "m.kiln")
    pkg = read_package(path)
    files = {n: pkg.read(n) for n in pkg.names if n not in ("manifest.json",
                                                             "weights.safetensors")}
    manifest = {k: v for k, v in pkg.manifest.items() if k not in ("files", "format")}
    for key, value, msg in (("schema", "kiln.manifest/99", "manifest schema"),
                            ("abi_version", 7, "abi_version 7")):
        bad = tmp_path / f"bad_{key}.kiln"
        write_package(bad, {**manifest, key: value}, files, pkg.weights())
        with pytest.raises(kiln.errors.KilnError, match=msg):
            kiln.load(bad)
    assert zipfile.is_zipfile(path)


class TiedHead(torch.nn.Module):
    """An embedding whose table is also the output projection (read through a transpose by
    the GEMM *and* gathered): that weight must stay in its own layout."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, ids):
        h = torch.relu(self.fc(self.emb(ids)))
        return h @ self.emb.weight.t()


@pytest.mark.parametrize("backend", ["blas", "cpp"])
def test_freeze_stores_gemm_weights_transposed(tmp_path, backend):
    torch.manual_seed(0)
    m = Net().eval()
    batch = torch.export.Dim("batch", min=1, max=64)
    opts = kiln.Options(freeze=True, gemm_backends=(backend,))
    c = kiln.compile(m, (torch.randn(3, 16),), dynamic_shapes=({0: batch},), options=opts)
    frozen = {w["fqn"]: w for w in c.manifest["weights"] if w.get("permuted")}
    assert sorted(frozen) == ["fc1.weight", "fc2.weight"]
    # (the "cpp" GEMM stores it prepacked too: passes/pack_cpu.py, the shape it was packed from)
    fc1 = frozen["fc1.weight"]
    assert fc1.get("packed", fc1)["shape"] == [16, 32] and fc1["permuted"] == [1, 0]
    assert len(c.manifest["weights"]) == 5  # each weight stored once: no untransposed copy
    runner = c.load(tmp_path / "f.kiln")
    for rows in (1, 7, 64):
        x = torch.randn(rows, 16)
        torch.testing.assert_close(runner(x), m(x))
    # update_weights takes the model's own layout by FQN (the package transposes it) ...
    m2 = _fresh(m)
    runner.update_weights(m2.state_dict())
    x = torch.randn(5, 16)
    torch.testing.assert_close(runner(x), m2(x))
    with pytest.raises(kiln.errors.InputError, match="fc1.weight"):
        runner.update_weights({**m2.state_dict(), "fc1.weight": torch.randn(32, 15)})
    # ... and a safetensors file holds the stored layout under the manifest's names
    m3 = _fresh(m)
    stored = {w["name"]: (m3.state_dict()[w["fqn"]].permute(w["permuted"]) if w.get("permuted")
                          else m3.state_dict()[w["fqn"]]).contiguous()
              for w in c.manifest["weights"]}
    stored = {w["name"]: pack_panels(stored[w["name"]], w["packed"]) if w.get("packed")
              else stored[w["name"]] for w in c.manifest["weights"]}
    save_file(stored, str(tmp_path / "w.safetensors"))
    runner.update_weights(tmp_path / "w.safetensors")
    torch.testing.assert_close(runner(x), m3(x))


def test_freeze_keeps_weights_read_in_two_layouts(tmp_path):
    torch.manual_seed(0)
    m = TiedHead().eval()
    ids = torch.randint(0, 50, (2, 5))
    c = kiln.compile(m, (ids,), options=kiln.Options(freeze=True))
    frozen = [w["fqn"] for w in c.manifest["weights"] if w.get("permuted")]
    assert frozen == ["fc.weight"]
    torch.testing.assert_close(c.load(tmp_path / "t.kiln")(ids), m(ids))
