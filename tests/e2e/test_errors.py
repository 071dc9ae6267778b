"""Errors that explain: an export failure in full with the likely fix, a compiler crash as a
CompileError naming the stage, node and op with the program saved for a bug report, a run-time
index error naming the op and input the user wrote (not the kernel it was fused into), and a
call of the wrong structure naming the missing or extra argument."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.export import Dim

import kiln
from kiln.errors import CompileError, InputError, KilnError, UnsupportedError


def test_export_failure_shows_torch_reason_and_the_likely_fix():
    with pytest.raises(UnsupportedError) as info:
        kiln.compile(torch.nn.Linear(4, 3), (torch.randn(1, 4),),
                     dynamic_shapes={"input": {0: Dim("batch")}})
    text = str(info.value)
    assert "Constraints violated (batch)" in text
    assert "specialized it to be a constant (1)" in text  # torch's reason, not its first line
    assert "likely fix: torch.export specialises example sizes of 0 and 1" in text


def test_function_dynamic_shapes_per_argument():
    def f(x, y):
        return x * 2 + y

    c = kiln.compile(f, (torch.randn(3, 4), torch.randn(4)),
                     dynamic_shapes=({0: Dim("n")}, None))
    r = c.load()
    x, y = torch.randn(7, 4), torch.randn(4)
    torch.testing.assert_close(r(x, y), f(x, y))


def _crashing():
    def f(x):  # a size used as a value (the example of a crash, compiled since)
        return x + torch.full((1,), x.shape[1])
    return f


def _inject_bug(monkeypatch):
    """A compiler bug, injected: lowering `full` fails the way it used to for that example."""
    from kiln import lowering

    def buggy(ctx, node, args):
        return int(node)  # TypeError: a graph node where an int is wanted

    monkeypatch.setitem(lowering.RULES, "full", buggy)


def test_size_as_a_fill_value_matches_eager():
    def f(x):
        return x + torch.full((1,), x.shape[1]), torch.full((2, 3), x.shape[0] * 2 + 1.0)

    c = kiln.compile(f, (torch.randn(3, 4),),
                     dynamic_shapes=({0: Dim("b", min=2, max=16), 1: Dim("n", max=64)},))
    r = c.load()
    for shape in ((3, 4), (2, 9), (16, 64)):
        x = torch.randn(*shape)
        for a, b in zip(r(x), f(x)):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b)


def test_compiler_crash_is_a_compile_error_with_a_reproducer(monkeypatch):
    monkeypatch.delenv("KILN_DEBUG", raising=False)
    _inject_bug(monkeypatch)
    with pytest.raises(CompileError) as info:
        kiln.compile(_crashing(), (torch.randn(3, 4),), dynamic_shapes=({1: Dim("n")},))
    text = str(info.value)
    assert re.search(r"kiln crashed in stage \w+ while processing node `\w+` \(op \w+\)", text)
    assert "TypeError" in text and "KILN_DEBUG=1" in text
    path = Path(re.search(r"saved to (\S+\.pt2)", text).group(1))
    ep = torch.export.load(str(path))  # the reproducer loads and crashes the same way
    with pytest.raises(CompileError, match="kiln crashed"):
        kiln.compile(ep)
    assert isinstance(info.value.__cause__, TypeError)


def test_kiln_debug_lets_the_crash_through(monkeypatch):
    monkeypatch.setenv("KILN_DEBUG", "1")
    _inject_bug(monkeypatch)
    with pytest.raises(TypeError):
        kiln.compile(_crashing(), (torch.randn(3, 4),), dynamic_shapes=({1: Dim("n")},))


class _EmbedBmm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.w = torch.nn.Parameter(torch.randn(2, 8, 4))

    def forward(self, input_ids):
        return torch.bmm(self.emb(input_ids), self.w)


def test_index_out_of_range_names_the_op_and_input(tmp_path):
    torch.manual_seed(0)
    m = _EmbedBmm().eval()
    c = kiln.compile(m, (torch.randint(0, 10, (2, 5)),))
    r = c.load(tmp_path / "m.kiln")
    good = torch.randint(0, 10, (2, 5))
    torch.testing.assert_close(r(good), m(good))
    bad = good.clone()
    bad[1, 3] = 12
    want = "index out of range in embedding (node `embedding`, input `input_ids`)"
    with pytest.raises(KilnError, match=re.escape(want)):
        r(bad)
    # the Python printer's wrapper (the torch.compile backend's path) says the same
    assert want in c.sources["model.py"]


class _EmbedLinearGather(torch.nn.Module):
    """The lookups inlined into other nodes' kernels: the embedding into linear's view of
    it, the gather into the add that reads it."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, ids, table, pick):
        return self.fc(self.emb(ids)), torch.gather(table, 1, pick) + 1.0


@pytest.mark.parametrize("bad_input, want", [
    ("ids", "index out of range in embedding (node `embedding`, input `ids`)"),
    ("pick", "index out of range in gather (node `gather`, input `pick`)"),
])
def test_index_error_names_the_lookup_fused_into_another_node(tmp_path, bad_input, want):
    torch.manual_seed(0)
    m = _EmbedLinearGather().eval()
    args = (torch.randint(0, 10, (2, 3)), torch.randn(4, 6), torch.randint(0, 6, (4, 2)))
    c = kiln.compile(m, args)
    r = c.load(tmp_path / "m.kiln")
    for a, b in zip(r(*args), m(*args)):
        torch.testing.assert_close(a, b)
    bad = list(args)
    k = ("ids", "table", "pick").index(bad_input)
    bad[k] = bad[k].clone()
    bad[k][1, 1] = 40
    with pytest.raises(KilnError, match=re.escape(want)):
        r(*bad)
    assert want in c.sources["model.py"]  # the Python wrapper says the same


class _EmbedNorm(torch.nn.Module):
    """Embedding sums feeding a LayerNorm: the gathers sit inside the norm's vectorised
    reduction loops (their index tests are branch-free there, flagged after the loop)."""

    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(50, 64)
        self.typ = torch.nn.Embedding(2, 64)
        self.norm = torch.nn.LayerNorm(64)

    def forward(self, ids, types):
        return self.norm(self.tok(ids) + self.typ(types))


@pytest.mark.parametrize("threads", [1, 2])
def test_index_out_of_range_inside_vectorised_reduction(tmp_path, threads):
    torch.manual_seed(0)
    m = _EmbedNorm().eval()
    ids, types = torch.randint(0, 50, (4, 33)), torch.randint(0, 2, (4, 33))
    c = kiln.compile(m, (ids, types), options=kiln.Options(num_threads=threads))
    assert "reduction(|:kiln_bad)" in c.sources["kernels_0.cpp"]
    r = c.load(tmp_path / "m.kiln")
    torch.testing.assert_close(r(ids, types), m(ids, types), rtol=1e-5, atol=1e-5)
    for which, pos, value in ((0, (3, 32), 50), (0, (0, 0), -51), (1, (2, 7), 2)):
        bad = [ids.clone(), types.clone()]
        bad[which][pos] = value
        with pytest.raises(KilnError, match="index out of range in "):
            r(*bad)
        torch.testing.assert_close(r(ids, types), m(ids, types), rtol=1e-5, atol=1e-5)


def test_call_structure_errors_name_the_argument():
    class M(torch.nn.Module):
        def forward(self, x, y, *, mask):
            return x + y * mask

    t = torch.randn(3)
    r = kiln.compile(M(), (t, t), example_kwargs={"mask": t}).load()
    cases = [
        (((t,), {"mask": t}), "missing positional argument `y` (the model takes 2: `x`, `y`"),
        (((t, t, t), {"mask": t}), "1 extra positional argument (the model takes 2"),
        (((t, t), {}), "missing keyword argument `mask`"),
        (((t, t), {"mask": t, "bias": t}), "unexpected keyword argument `bias`"),
        ((([t] * 1000, t), {"mask": t}), "argument 0 (`x`): expected a tensor or scalar, got a "
                                         "list of 1000 items"),
    ]
    for (args, kwargs), want in cases:
        with pytest.raises(InputError, match=re.escape(want)) as info:
            r(*args, **kwargs)
        assert len(str(info.value)) < 300
    torch.testing.assert_close(r(t, t, mask=t), t + t * t)


def test_cli_shows_the_export_reason(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import torch\nfrom torch.export import Dim\n"
                   "def build():\n"
                   "    return torch.nn.Linear(4, 3), (torch.randn(1, 4),), "
                   "{'input': {0: Dim('batch')}}\n")
    out = subprocess.run([sys.executable, "-m", "kiln.cli.main", "compile", f"{src}:build",
                          "-o", str(tmp_path / "m.kiln")], capture_output=True, text=True)
    assert out.returncode == 2
    assert "specialized it to be a constant (1)" in out.stderr
    assert "likely fix" in out.stderr
