"""Differential tests of data-dependent indexing (embedding, x[idx] forms, index_select,
gather), the errors kiln raises for bad indices at run time, and the clear compile-time error
for operators kiln does not support."""

from __future__ import annotations

import pytest
import torch

import kiln
import torch.nn.functional as F
from torch import nn

from difftest import Cases, Checker, Fn, Layout, case_name, dim, gen, rand
from kiln.errors import KilnError, UnsupportedError

F32, F64, I64, I32 = torch.float32, torch.float64, torch.int64, torch.int32


@pytest.fixture(scope="module")
def check(tmp_path_factory) -> Checker:
    return Checker(tmp_path_factory.mktemp("ops_indexing"))


def _ids(v) -> str:
    return str(v).replace(" ", "").removeprefix("torch.")


class Embed(nn.Module):
    def __init__(self, n: int = 11, d: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(n, d)

    def forward(self, ids):
        e = self.emb(ids)
        return {"embedding": e, "embedding_t": self.emb(ids.t()), "scaled": e * 2 + 1,
                "summed": e.sum(-2), "functional": F.embedding(ids[:, :1], self.emb.weight.t())}


def _embed(key, dtype=F32) -> Embed:
    m = Embed()
    with torch.no_grad():
        m.emb.weight.copy_(rand(m.emb.weight.shape, F32, gen("emb", key)))
    return m.to(dtype).eval()


EMBEDDINGS = [((3, 5), I64, F32), ((1, 1), I64, F32), ((4, 7), I32, F32), ((3, 5), I64, F64),
              ((64, 200), I64, F32)]


def test_embedding(check):
    """Each (ids shape, ids dtype, table dtype) of EMBEDDINGS, all in one difftest.Cases
    program (one package; each case its own table, static shapes and kernels)."""
    cases, args = {}, []
    for ids_shape, ids_dtype, dtype in EMBEDDINGS:
        args.append(rand(ids_shape, ids_dtype, gen("ids", ids_shape), 0, 6))  # weight.t(): 6 rows
        cases[case_name(ids_shape, _ids(ids_dtype), _ids(dtype))] = (_embed(ids_shape, dtype), 1)
    check(Cases(cases), args)


def indexing(x, i, j, k):
    """x [5, 6, 7]; i [4] in [-5, 5); j [3, 1] in [-6, 6); k [2] in [-7, 7)."""
    return {
        "x[i]": x[i], "x[:,j]": x[:, j], "x[...,k]": x[..., k], "x[i,:,k0]": x[i, :, k[:1]],
        "x[j,i]": x[j % 5, i], "x[i2d]": x[i.view(2, 2)], "x[:,j,k]": x[:, j, k],
        "x[j,:,k]": x[j % 5, :, k], "xt[i]": x.transpose(0, 2)[k], "x_step[i]": x[:, ::2][i],
        "index_select0": x.index_select(0, i.abs() % 5),
        "index_select2": x.index_select(2, k.abs() % 7),
        "index_select_t": x.transpose(1, 2).index_select(1, k.abs() % 7),
        "gather2": x.gather(2, (j.abs() % 7).expand(5, 3, 1).repeat(1, 1, 2)),
        "gather0": x.gather(0, i.abs().view(4, 1, 1).expand(4, 6, 7) % 5),
        "gather_t": x.mT.gather(1, (k.abs() % 7).view(1, 1, 2).expand(5, 6, 2)),
        "x[i]+1": x[i] * 2 + 1, "sum_of_index": x[:, j].sum(1),
    }


INDEXINGS = [(F32, I64, "contig"), (F32, I32, "contig"), (F32, I64, "t"), (F64, I64, "contig"),
             (I64, I64, "contig")]


def test_tensor_indexing(check):
    """`indexing` at each (dtype, index dtype, layout) of INDEXINGS, all in one difftest.Cases
    program (one package; outputs compared per case with its dtype's tolerance)."""
    cases, args = {}, []
    for dtype, idx_dtype, layout in INDEXINGS:
        g = gen("index", dtype, idx_dtype, layout)
        x = rand((5, 7, 6) if layout == "t" else (5, 6, 7), dtype, g)
        i, j = rand((4,), idx_dtype, g, -5, 5), rand((3, 1), idx_dtype, g, -6, 6)
        k = rand((2,), idx_dtype, g, -7, 7)
        i[0], j[0, 0], k[0] = -1, -6, -7  # negative indices wrap like torch
        args += [x, i, j, k]
        cases[case_name(_ids(dtype), _ids(idx_dtype), layout)] = (Layout(Fn(indexing), layout), 4)
    check(Cases(cases), args)


def test_large_gather_and_index(check):
    g = gen("large-index")
    x, i = rand((300, 40), F32, g), rand((500,), I64, g, -300, 300)
    check(Fn(lambda x, i: {"rows": x[i], "cols": x[:, i % 40], "gather": x.gather(
        0, (i.abs() % 300).view(-1, 1).expand(500, 40))}), (x, i))


# -- errors ------------------------------------------------------------------------------------
def test_embedding_index_out_of_range_raises(check):
    m = _embed("oor")
    _, runner = check.compile(m, (torch.tensor([[0, 1, 2]]),))
    for bad in ([[0, 11, 2]], [[1, 2, 1000]], [[-1, 0, 0]]):  # eager raises for all of these
        with pytest.raises(IndexError):
            m(torch.tensor(bad))
        with pytest.raises(KilnError, match="index out of range"):
            runner(torch.tensor(bad))
    ids = torch.tensor([[3, 10, 0]])  # the model still works afterwards
    torch.testing.assert_close(runner(ids)["embedding"], m(ids)["embedding"])


def test_tensor_index_out_of_range_raises(check):
    fn = Fn(lambda x, i: {"rows": x[i], "select": x.index_select(1, i), "gather": x.gather(
        1, i.view(1, -1).expand(4, -1))})
    x, i = rand((4, 5), F32, gen("oor")), torch.tensor([0, -3, 3])
    _, runner = check.compile(fn, (x, torch.tensor([0, 1, 2])))
    for bad in ([0, 5, 1], [-6, 0, 0]):
        with pytest.raises(KilnError, match="index out of range"):
            runner(x, torch.tensor(bad))
    got, want = runner(x, i.abs()), fn(x, i.abs())
    for key in want:
        torch.testing.assert_close(got[key], want[key])
    with pytest.raises(KilnError, match="index out of range"):  # eager rejects -3 here too
        runner(x, i)


@pytest.mark.parametrize(("name", "fn", "op"), [
    # not lowered by kiln: with the ATen fallback off, a clear refusal naming the op
    ("zeta", lambda x: torch.special.zeta(x, 2.0), "special_zeta"),
])
def test_unsupported_ops_raise_clear_error(check, name, fn, op):
    with pytest.raises(UnsupportedError, match=op):
        check.compile(Fn(fn), (rand((4, 5), F32, gen("unsupported", name)),),
                      options=kiln.Options(aten_fallback=False))


# -- dynamic shapes ---------------------------------------------------------------------------
def test_dynamic_embedding(check):
    b, t = dim("b", 1, 64), dim("t", 1, 128)
    sizes = [(3, 5), (1, 1), (7, 128), (64, 2)]
    args = [(rand(s, I64, gen("dyn-emb", s), 0, 6),) for s in sizes]
    check(_embed("dyn"), args[0], more=args[1:], dynamic_shapes={"ids": {0: b, 1: t}})


def test_dynamic_index_count(check):
    n = dim("n", 1, 1000)
    fn = Fn(lambda x, i: {"rows": x[i], "cols": x[:, i % 7], "sel": x.index_select(0, i.abs()),
                          "gather": x.gather(0, i.abs().view(-1, 1).expand(-1, 7))})
    x = rand((9, 7), F32, gen("dyn-index"))
    args = [(x, rand((k,), I64, gen("dyn-i", k), -8, 9)) for k in (4, 1, 50, 1000)]
    check(fn, args[0], more=args[1:], dynamic_shapes=(None, {0: n}))
