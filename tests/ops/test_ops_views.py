"""Differential tests of views and data movement: view/reshape, permute, transpose, expand,
slice, select, squeeze/unsqueeze, flatten, cat, stack, constant pad, split/chunk/unbind, and
tensor creation (arange/full/zeros/ones) inside the model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from difftest import Cases, Checker, Fn, Layout, case_name, dim, gen, layout_shape, rand

F32, F64, I64, I32, BOOL = torch.float32, torch.float64, torch.int64, torch.int32, torch.bool


@pytest.fixture(scope="module")
def check(tmp_path_factory) -> Checker:
    return Checker(tmp_path_factory.mktemp("ops_views"))


def _ids(v) -> str:
    if isinstance(v, tuple) and not all(isinstance(d, int) for d in v):
        return "-".join(map(_ids, v))
    return str(v).replace(" ", "").removeprefix("torch.")


def check_cases(check: Checker, cases: dict, **kw) -> None:
    """`cases`: name -> (module, args); all checked as one difftest.Cases program (one package,
    each case its own static shapes, kernels and per-dtype tolerance; outputs named
    "<name>__<output>", so a failure names its case); `kw` as for Checker.__call__."""
    mods = {case_name(k): (m, len(a)) for k, (m, a) in cases.items()}
    assert len(mods) == len(cases), list(cases)
    check(Cases(mods), [x for _, a in cases.values() for x in a], **kw)


def movement(x):
    """Pure data movement of x [a, b, c] (c even): works for every dtype and any a, b >= 1."""
    a, b, c = x.shape
    return {
        "merge_last": x.reshape(a, b * c), "merge_first": x.reshape(a * b, c),
        "split_last": x.reshape(a, b, c // 2, 2), "split_merge": x.reshape(a * b * c // 2, 2),
        "infer": x.reshape(-1, c), "flatten": x.flatten(), "flatten_1": x.flatten(1),
        "permute_merge": x.permute(2, 0, 1).reshape(c, a * b),
        "permute_split": x.permute(0, 2, 1).reshape(a, c // 2, 2 * b),
        "permute": x.permute(1, 2, 0), "transpose": x.transpose(0, 2), "swap_neg": x.mT,
        "transpose_view": x.transpose(1, 2).contiguous().view(a, -1),
        "expand": x[:, :1, :].expand(a, 4, c), "expand_new": x.unsqueeze(1).expand(a, 3, b, c),
        "expand_permute": x[:1].expand(3, b, c).permute(2, 0, 1),
        "slice_step": x[:, ::2, 1::3], "slice_neg": x[..., -3:], "slice_neg_2": x[-2:, -2:],
        "slice_neg_end": x[:, :, :-1], "slice_inner": x[:, -1:, 1:-1:2],
        "select": x[:, -1], "select_0": x[0], "select_neg": x.select(2, -2),
        "select_slice": x[-1, :, ::2],
        "unsqueeze": x.unsqueeze(0).unsqueeze(-1), "squeeze_dim": x[:, :1].squeeze(1),
        "squeeze_all": x[:1, :, :1].squeeze(), "unsqueeze_mid": x.unsqueeze(2),
        "cat_1": torch.cat([x, x[:, :1], x], dim=1),
        "cat_0": torch.cat([x[:1], x, x[-1:]], 0), "cat_neg": torch.cat([x[..., :1], x], -1),
        "cat_single": torch.cat([x]), "cat_views": torch.cat([x.mT, x.mT[:, ::2]], 1),
        "stack_0": torch.stack([x[..., ::2], x[..., 1::2]]),
        "stack_last": torch.stack([x[..., 1::2], x[..., ::2], x[..., ::2]], -1),
        "pad_last": F.pad(x, (1, 2), value=1), "pad_2d": F.pad(x, (0, 0, 2, 1)),
        "pad_3d": F.pad(x, (1, 1, 1, 1, 1, 1)), "pad_crop": F.pad(x, (-1, 1)),
        "split": x.split(3, dim=-1), "split_sizes": x.split([c // 2, c - c // 2], dim=2),
        "chunk": x.chunk(2, dim=0), "unbind": x.unbind(1), "unbind_0": x.unbind(0),
    }


MOVE_CASES = [((4, 6, 10), "contig", F32), ((1, 1, 2), "contig", F32),
              ((3, 1, 4), "contig", F32), ((16, 33, 24), "contig", F32),
              ((4, 6, 10), "t", F32), ((4, 6, 10), "step", F32), ((4, 6, 10), "perm", F64),
              ((3, 5, 8), "neg", F32), ((4, 6, 10), "contig", I64),
              ((2, 3, 4), "contig", BOOL), ((2, 3, 4), "contig", torch.uint8)]


def test_data_movement(check):
    """`movement` at each (shape, layout, dtype) of MOVE_CASES, in one program (check_cases)."""
    check_cases(check, {_ids(c): (Layout(Fn(movement), c[1]), (
        rand(layout_shape(*c[:2]), c[2], gen("move", *c)),)) for c in MOVE_CASES})


def fused(x, y):
    """Views consumed by arithmetic: the index maps end up inside fused kernels."""
    a, b, c = x.shape
    return {
        "reshape_add": x.reshape(a * b, c) + y[:c], "permute_mul": x.permute(2, 0, 1) * 2 - 1,
        "t_plus_t": x.mT + x.mT.exp(), "expand_bcast": x[:, :1].expand(a, b, c) * x,
        "slice_sum": x[:, ::2].sum(-1) + x[:, -1].amax(-1, keepdim=True),
        "cat_then_exp": torch.cat([x.exp(), x * 3, x[..., :1]], -1).tanh(),
        "pad_then_relu": F.pad(x, (2, 1), value=-1.5).relu() + 1,
        "stack_math": torch.stack([x, -x], 1).sigmoid(), "select_add": x[:, 0] + x[:, -1],
        "unbind_sum": sum(x.unbind(2)), "chunk_mul": x.chunk(2, -1)[0] * x.chunk(2, -1)[1],
        "view_of_expand": y[:c].expand(a * b, c).reshape(a, b, c) + x,
        "reshape_of_view_chain": (x.transpose(0, 1)[:, :, 1:] * 2).reshape(b, -1).t(),
    }


FUSED_CASES = [((4, 6, 10), "contig"), ((2, 1, 2), "contig"), ((16, 33, 24), "t"),
               ((3, 5, 8), "neg")]


def _fused_args(shape, layout):
    g = gen("fused", shape, layout)
    return rand(layout_shape(shape, layout), F32, g), rand((64,), F32, g)


def test_views_fused_with_math(check):
    """`fused` at each (shape, layout) of FUSED_CASES, in one program (check_cases)."""
    check_cases(check, {_ids(c): (Layout(Fn(fused), c[1]), _fused_args(*c))
                        for c in FUSED_CASES})


def test_cat_many_inputs_and_dtypes(check):
    g = gen("cat-many")
    xs = [rand((3, k, 5), F32, g) for k in (1, 2, 3, 4, 7)]
    i = rand((3, 2, 5), I64, g)
    check(Fn(lambda a, b, c, d, e, i: {
        "cat5": torch.cat([a, b, c, d, e], 1), "cat_promote": torch.cat([a, i], 1),
        "cat_0": torch.cat([a.transpose(0, 1), b.transpose(0, 1), e.transpose(0, 1)], 0),
        "cat_last": torch.cat([a, a * 2, a * 3], -1), "stack3": torch.stack([a, a, -a], 2)}),
        (*xs, i))


def test_outputs_aliasing_inputs_and_0d(check):
    x, s = rand((4, 5), F32, gen("alias")), torch.tensor(1.5)
    check(Fn(lambda x, s: {
        "input": x, "input_again": x, "t": x.t(), "flat": x.view(20), "row": x[1],
        "twice": (x.exp(),) * 2, "0d": s, "0d_math": s * 2 + x, "0d_view": s.view(1, 1),
        "0d_expand": s.expand(2, 3), "sum_expand": x.sum().expand(2, 2), "0d_sum": s.sum(),
        "where_0d_cond": torch.where(s > 1, x, -x)}), (x, s))


def test_creation_ops(check):
    g = gen("creation")
    x, i = rand((5, 7), F32, g), rand((5, 7), I64, g)
    check(Fn(lambda x, i: {
        "arange": torch.arange(7), "arange_add": x + torch.arange(7),
        "arange_start_step": torch.arange(2, 23, 3), "arange_float": torch.arange(0.0, 1.0, 0.125),
        "arange_neg_step": torch.arange(10, -5, -2),
        "arange_view": torch.arange(35).view(5, 7) * i,
        "full": torch.full((5, 7), 2.5), "full_int": torch.full((3,), 7, dtype=I64),
        "zeros": torch.zeros(5, 7), "ones": torch.ones(4, dtype=I32),
        "zeros_like": torch.zeros_like(x),
        "ones_like_add": torch.ones_like(i) + i, "full_like": torch.full_like(x, -1.0) * x,
        "new_zeros": x.new_zeros(2, 3), "new_ones": i.new_ones(3),
        "new_full": x.new_full((2,), 3.0),
        "eye_like": (torch.arange(5)[:, None] == torch.arange(7)).float(),
        "bool_full": torch.full((2, 2), True)}), (x, i))


# -- dynamic shapes ---------------------------------------------------------------------------
def test_dynamic_views(check):
    n = dim("n", 2, 300)  # (torch.export cannot slice [1:-1] on a symbolic dim)
    fn = Fn(lambda x: {
        "reshape": x.reshape(-1, 4, 3), "merge": x.reshape(x.shape[0] * 12),
        "permute": x.permute(1, 0) * 2, "slice": x[:, 1:-1:2], "slice_neg": x[-2:],
        "select": x[-1], "cat": torch.cat([x, x[:1], -x], 0), "stack": torch.stack([x, -x], 1),
        "pad": F.pad(x, (0, 0, 1, 2)), "split": x.split(5, dim=1), "chunk": x.chunk(3, 1),
        "unsqueeze_expand": x.unsqueeze(1).expand(-1, 2, -1),
        "arange": x + torch.arange(x.shape[0]).unsqueeze(1),
        "ones": torch.ones(x.shape[0], 2), "t_view": x.t().contiguous().view(12, -1, 1)})
    xs = [rand((k, 12), F32, gen("dyn-views", k)) for k in (6, 2, 37, 300)]
    check(fn, (xs[0],), more=[(x,) for x in xs[1:]], dynamic_shapes=({0: n},))


def test_dynamic_two_symbols_reshape(check):
    n, m = dim("n", 2, 64), dim("m", 2, 64)
    fn = Fn(lambda x: {"merge": x.reshape(-1), "merge_t": x.t().reshape(-1),
                       "split": x.reshape(x.shape[0], x.shape[1], 1), "flat_perm":
                       x.unsqueeze(0).permute(2, 0, 1).flatten(1)})
    xs = [rand(s, F32, gen("dyn2", s)) for s in [(3, 5), (2, 2), (64, 7), (9, 64)]]
    check(fn, (xs[0],), more=[(x,) for x in xs[1:]], dynamic_shapes=({0: n, 1: m},))


def test_dynamic_step_slice(check):
    n = dim("n", 3, 300)  # torch.export needs n >= 3 for [::2] of a symbolic dim
    fn = Fn(lambda x: {"step": x[::2], "step_math": x[::2].exp() + 1})
    xs = [rand((k, 4), F32, gen("dyn-step", k)) for k in (6, 3, 37, 300)]
    check(fn, (xs[0],), more=[(x,) for x in xs[1:]], dynamic_shapes=({0: n},))


# -- flip, roll, diagonal, as_strided and the scatter-into-view family --------------------------
def more_movement(x):
    """Index-map views of x [a, b, c] (a, b, c >= 2): every dtype."""
    xc = x.contiguous()
    a, b, c = x.shape
    return {
        "flip_0": x.flip(0), "flip_all": x.flip(0, 1, 2), "flip_neg": x.flip(-1),
        "roll": x.roll(1, 0), "roll_neg": x.roll(-2, 2), "roll_two": x.roll((1, 3), (1, 2)),
        "roll_flat": x.roll(5), "roll_big": x.roll(2 * c + 1, 2),
        "diag": x.diagonal(), "diag_off": x.diagonal(1, 1, 2), "diag_neg": x.diagonal(-1, 2, 0),
        "diag_swapped": x.diagonal(0, 2, 1), "diag_flip": x.flip(1).diagonal(0, 0, 1),
        "as_strided": xc.as_strided((2, 3), (c, 1), 1),
        "as_strided_overlap": xc.as_strided((3, 4), (1, 1)),
        "as_strided_3d": xc.as_strided((a, 2, 2), (b * c, 1, c), 0),
        "as_strided_bcast": xc.as_strided((2, 3), (0, 2), 3),
    }


MORE_MOVE_CASES = [
    ((4, 6, 10), "contig", F32), ((2, 2, 2), "contig", F64), ((3, 5, 8), "t", F32),
    ((4, 6, 10), "neg", F32), ((4, 6, 10), "contig", I64), ((3, 4, 5), "contig", BOOL),
    ((5, 7, 9), "step", F64)]


def test_flip_roll_diagonal_as_strided(check):
    """`more_movement` at each case of MORE_MOVE_CASES, in one program (check_cases)."""
    check_cases(check, {_ids(c): (Layout(Fn(more_movement), c[1]), (
        rand(layout_shape(*c[:2]), c[2], gen("more-move", *c)),)) for c in MORE_MOVE_CASES})


def scatters(x, y):
    """out = x with a view replaced by values computed from y (shapes [a, b, c], b, c >= 3)."""
    xc = x.contiguous()
    a, b, c = x.shape
    return {
        "slice_scatter": torch.slice_scatter(x, y[:, 1:3] * 2, 1, 1, 3),
        "slice_scatter_step": torch.slice_scatter(x, y[..., ::2], 2, 0, None, 2),
        "slice_scatter_step3": torch.slice_scatter(x, y[:, :, 1::3][:, :, :(c - 1 + 2) // 3 - 0],
                                                   2, 1, None, 3),
        "slice_scatter_neg": torch.slice_scatter(x, y[-1:], 0, -1),
        "select_scatter": torch.select_scatter(x, y[:, 0] * 3, 1, -1),
        "diagonal_scatter": torch.diagonal_scatter(x, y.diagonal(0, 1, 2) * 5, 0, 1, 2),
        "diagonal_scatter_off": torch.diagonal_scatter(x, y.diagonal(1, 0, 2) + 1, 1, 0, 2),
        "diagonal_scatter_neg": torch.diagonal_scatter(x, y.diagonal(-2, 1, 2), -2, 1, 2),
        "as_strided_scatter": torch.as_strided_scatter(xc, y[0, :2, :2] - 7, (2, 2), (c, 2), 1),
        "as_strided_scatter_3d": torch.as_strided_scatter(
            xc, y[:, :2, :1] * 0 + 1, (a, 2, 1), (b * c, c, 1), 1),
        "scatter_then_math": torch.slice_scatter(x, y[:, :1].exp(), 1, 0, 1) * 2,
    }


SCATTER_CASES = [((3, 4, 6), "contig", F32), ((2, 5, 7), "t", F64), ((4, 6, 9), "neg", F32),
                 ((3, 4, 6), "contig", F64)]


def _scatter_args(shape, layout, dtype):
    g = gen("scatter-views", shape, layout, dtype)
    return (rand(layout_shape(shape, layout), dtype, g),
            rand(layout_shape(shape, layout), dtype, g))


def test_scatter_into_views(check):
    """`scatters` at each case of SCATTER_CASES, in one program (check_cases)."""
    check_cases(check, {_ids(c): (Layout(Fn(scatters), c[1]), _scatter_args(*c))
                        for c in SCATTER_CASES})


def test_scatter_into_views_integer(check):
    g = gen("scatter-int")
    x, y = rand((3, 4, 6), I64, g), rand((3, 4, 6), I64, g)
    check(Fn(lambda x, y: {
        "slice": torch.slice_scatter(x, y[:, ::2], 1, 0, None, 2),
        "diag": torch.diagonal_scatter(x, y.diagonal(1, 1, 2), 1, 1, 2),
        "as_strided": torch.as_strided_scatter(x, y[0, :3, :1], (3, 1), (2, 1), 4)}), (x, y))


def test_index_select_of_a_scalar(check):
    s, i = torch.tensor(2.5), torch.tensor([0])
    check(Fn(lambda s, i: {"one": torch.index_select(s, 0, i),
                           "0d": torch.index_select(s, 0, i[0])}), (s, i))


def test_as_strided_scatter_overlapping_is_unsupported(tmp_path):
    import kiln
    from kiln.errors import UnsupportedError
    x = torch.zeros(4, 4)
    with pytest.raises(UnsupportedError, match="overlapping strides"):
        kiln.compile(Fn(lambda x: torch.as_strided_scatter(x, x[:2, :3], (2, 3), (1, 1))), (x,))


def test_as_strided_of_views_reads_their_storage(check):
    """as_strided addresses the storage: of a transposed or sliced view, that is its base's."""
    g = gen("as-strided-views")
    x = rand((6, 8), F32, g)
    check(Fn(lambda x: {
        "of_t": x.t().as_strided((4, 3), (1, 8), 2),
        "of_slice": x[1:].as_strided((2, 5), (8, 1), 9),
        "of_step": x[:, ::2].as_strided((3, 3), (8, 2), 1),
        "of_math": (x * 2).as_strided((2, 2), (8, 1), 3),
        "of_unsqueeze": x.unsqueeze(1).as_strided((2, 4), (1, 8), 3)}), (x,))


def test_select_scatter_copy_fill(check):
    """Ops export keeps as they are when no other op forces a decomposition."""
    g = gen("select-scatter-copy")
    x, y, i = rand((4, 5, 6), F32, g), rand((4, 6), F32, g), rand((5, 6), I64, g)
    check(Fn(lambda x, y, i: {
        "select_scatter": torch.select_scatter(x, y, 1, 2),
        "select_scatter_neg": torch.select_scatter(x, y[:, :5] * 2, 2, -1),
        "copy": torch.ops.aten.copy(x, i), "copy_bcast": torch.ops.aten.copy(x, y[0]),
        "fill": torch.ops.aten.fill(x, 2.5), "fill_t": torch.ops.aten.fill(i, y[0, 0]),
        "empty_strided_shape": torch.empty_strided((2, 3), (1, 2)).shape[0] * x}), (x, y, i))
