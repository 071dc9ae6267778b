"""Differential tests of the spatial ops (lowering/spatial.py): pooling 1-3d (ceil_mode,
padding, dilation, indices, adaptive windows of uneven length), convolution 1-3d and
transposed, upsampling (nearest, nearest-exact, linear, bilinear, bicubic, trilinear), grid
sampling, and integer matmul. Odd sizes, strided inputs, zero-size batches, float32 (against
a float64 reference), float64 and integers (exact)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from difftest import Cases, Checker, Fn, Layout, case_name, dim, gen, layout_shape, rand

F32, F64, I64, I32 = torch.float32, torch.float64, torch.int64, torch.int32
I = F.interpolate  # noqa: E741
SLOW = pytest.mark.slow  # float64 and strided variants: the slow suite


@pytest.fixture(scope="module")
def check(tmp_path_factory) -> Checker:
    return Checker(tmp_path_factory.mktemp("ops_spatial"))


def _ids(v) -> str:
    if isinstance(v, tuple):
        return "-".join(map(_ids, v))
    return str(v).replace(" ", "").removeprefix("torch.")


def check_cases(check: Checker, cases: dict) -> None:
    """`cases`: name -> (module, args); all checked as one difftest.Cases program (one package,
    each case its own static shapes, kernels and per-dtype tolerance; outputs named
    "<name>__<output>")."""
    mods = {case_name(k): (m, len(a)) for k, (m, a) in cases.items()}
    check(Cases(mods), [x for _, a in cases.values() for x in a])


def groups(default, slow):
    """Parameters: the default suite's cases as one group (one program), the slow ones as
    another."""
    return [pytest.param(tuple(default), id="default"),
            pytest.param(tuple(slow), id="slow", marks=SLOW)]


def _inputs(key, dtype, layout="contig", batch=2):
    g = gen(key, dtype, layout, batch)
    shapes = [(batch, 3, 11), (batch, 3, 9, 10), (batch, 2, 5, 6, 7)]
    return [rand(layout_shape(s, layout), dtype, g) for s in shapes]


# -- pooling -----------------------------------------------------------------------------------
def pools(x1, x2, x3):
    out = {  # the ops eager implements for integers too
        "max1_idx": F.max_pool1d(x1, 3, 2, 1, return_indices=True),
        "max2_dil_ceil_idx": F.max_pool2d(x2, 3, 2, 1, dilation=2, ceil_mode=True,
                                          return_indices=True),
        "max2_rect_idx": F.max_pool2d(x2, (2, 3), (1, 2), (1, 0), return_indices=True),
        "max3_idx": F.max_pool3d(x3, 2, (1, 2, 2), 1, return_indices=True),
        "max3_ceil": F.max_pool3d(x3, 3, 2, ceil_mode=True),
    }
    if x1.is_floating_point():
        out.update({
            "max1_ceil": F.max_pool1d(x1, 3, 2, 1, ceil_mode=True),
            "amax1": F.adaptive_max_pool1d(x1, 4, return_indices=True),
            "amax2": F.adaptive_max_pool2d(x2, (3, 4), return_indices=True),
            "amax3": F.adaptive_max_pool3d(x3, (2, 4, 3), return_indices=True),
            "avg1_ceil": F.avg_pool1d(x1, 3, 2, 1, ceil_mode=True),
            "avg1_nopad": F.avg_pool1d(x1, 3, 2, 1, ceil_mode=True, count_include_pad=False),
            "avg2_ceil": F.avg_pool2d(x2, 3, 2, 1, ceil_mode=True),
            "avg2_div": F.avg_pool2d(x2, (2, 3), (2, 1), (1, 0), ceil_mode=True,
                                     divisor_override=5),
            "avg3_nopad_ceil": F.avg_pool3d(x3, 2, 2, 1, ceil_mode=True,
                                            count_include_pad=False),
            "avg3": F.avg_pool3d(x3, (1, 2, 3), (1, 2, 2)),
            "aavg1": F.adaptive_avg_pool1d(x1, 4),
            "aavg2_uneven": F.adaptive_avg_pool2d(x2, (4, 7)),
            "aavg3": F.adaptive_avg_pool3d(x3, (2, 4, 3)),
        })
    return out


@pytest.mark.parametrize("params", groups(
    [(F32, "contig", 2), (F32, "contig", 0), (I64, "contig", 2)],
    [(F64, "contig", 2), (F32, "t", 1)]))
def test_pooling_nd(check, params):
    """`pools` at each (dtype, layout, batch), in one program (check_cases)."""
    check_cases(check, {_ids(c): (Layout(Fn(pools), c[1]), _inputs("pool", *c)) for c in params})


def test_avg_pool_int(check):
    """Integer average pooling divides like eager (truncating)."""
    x1, x2, x3 = _inputs("avg-int", I64)
    check(Fn(lambda a, b, c: {"1": F.avg_pool1d(a, 3, 2, 1, ceil_mode=True),
                              "2": F.avg_pool2d(b, 3, 2, 1, count_include_pad=False),
                              "3": F.avg_pool3d(c, 2, 1, ceil_mode=True)}), (x1, x2, x3))


def test_pooling_dynamic(check):
    """Symbolic sizes: window counts and adaptive window bounds at run time."""
    x = rand((2, 3, 9, 10), F32, gen("pool-dyn"))
    h, w = dim("h", 4, 64), dim("w", 4, 64)
    more = [(rand((1, 3, 13, 7), F32, gen("pool-dyn", 2)),)]
    check(Fn(lambda x: {"avg": F.avg_pool2d(x, 3, 2, 1, count_include_pad=False),
                        "max": F.max_pool2d(x, 3, 2, 1, return_indices=True),
                        "aavg": F.adaptive_avg_pool2d(x, (3, 4))}), (x,),
          dynamic_shapes=[{0: dim("n", 1, 8), 2: h, 3: w}], more=more)


# -- convolution -------------------------------------------------------------------------------
def convs():
    return nn.ModuleDict(dict(
        c1=nn.Conv1d(4, 6, 3, padding=1),
        c1_s2_d2_g2=nn.Conv1d(4, 6, 5, stride=2, dilation=2, groups=2, padding=3),
        c1_pw=nn.Conv1d(4, 3, 1, bias=False),
        c2_s2=nn.Conv2d(4, 6, 3, stride=2, padding=1),
        c3=nn.Conv3d(4, 5, 3, padding=1),
        c3_rect_dw=nn.Conv3d(4, 4, (1, 3, 2), stride=(1, 2, 2), groups=4),
        t1=nn.ConvTranspose1d(4, 6, 3, stride=2, padding=1, output_padding=1),
        t1_s3=nn.ConvTranspose1d(4, 2, 4, stride=3, dilation=2),
        t2_g2_d2=nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2,
                                    dilation=2),
        t2_rect=nn.ConvTranspose2d(4, 3, (2, 3), stride=(1, 3), bias=False),
        t2_s1=nn.ConvTranspose2d(4, 5, 3, padding=1),
        t3=nn.ConvTranspose3d(4, 2, 3, stride=2, padding=(0, 1, 2)),
    ))


class Convs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.m = convs()

    def forward(self, x1, x2, x3):
        xs = {1: x1, 2: x2, 3: x3}
        return {k: m(xs[len(m.kernel_size)]) for k, m in self.m.items()}


@pytest.mark.parametrize("params", groups([(F32, "contig", 2), (F32, "contig", 0)],
                                          [(F64, "contig", 1), (F32, "t", 2)]))
def test_conv_nd(check, params):
    """`Convs` at each (dtype, layout, batch), in one program (each case its own weights)."""
    cases = {}
    for dtype, layout, batch in params:
        torch.manual_seed(0)
        g = gen("conv", dtype, layout, batch)
        shapes = [(batch, 4, 11), (batch, 4, 7, 8), (batch, 4, 4, 5, 6)]
        xs = [rand(layout_shape(s, layout), dtype, g) for s in shapes]
        cases[_ids((dtype, layout, batch))] = (Layout(Convs().to(dtype), layout), xs)
    check_cases(check, cases)


def test_conv_int_unsupported():
    import kiln
    from kiln.errors import UnsupportedError

    x, w = torch.ones(1, 2, 5, dtype=I64), torch.ones(3, 2, 3, dtype=I64)
    with pytest.raises(UnsupportedError, match="convolution of dtype int64"):
        kiln.compile(Fn(lambda x, w: F.conv1d(x, w)), (x, w))


# -- upsampling and grid sampling ----------------------------------------------------------------
def upsamples(x1, x2, x3):
    out = {
        "near1_scale": I(x1, scale_factor=2.5, mode="nearest"),
        "near1_size": I(x1, size=7, mode="nearest"),
        "near2_size": I(x2, size=(13, 5), mode="nearest"),
        "near2_x2": I(x2, scale_factor=2, mode="nearest"),
        "near3": I(x3, scale_factor=(1.5, 0.5, 2), mode="nearest"),
        "exact1": I(x1, size=17, mode="nearest-exact"),
        "exact2": I(x2, scale_factor=1.7, mode="nearest-exact"),
        "exact3": I(x3, size=(3, 4, 9), mode="nearest-exact"),
    }  # eager implements nearest modes for uint8, the rest for floats only
    if x1.is_floating_point():
        out.update({
            "lin1": I(x1, size=17, mode="linear"),
            "lin1_align": I(x1, scale_factor=1.3, mode="linear", align_corners=True),
            "bilin": I(x2, scale_factor=1.7, mode="bilinear"),
            "bilin_align": I(x2, size=(4, 13), mode="bilinear", align_corners=True),
            "bilin_down_recompute": I(x2, scale_factor=0.6, mode="bilinear",
                                      recompute_scale_factor=True),
            "bicubic": I(x2, size=(13, 5), mode="bicubic"),
            "bicubic_align": I(x2, scale_factor=2.3, mode="bicubic", align_corners=True),
            "trilin": I(x3, size=(5, 4, 9), mode="trilinear"),
            "trilin_align": I(x3, scale_factor=2, mode="trilinear", align_corners=True),
            "bilin_then_relu": torch.relu(I(x2, scale_factor=2, mode="bilinear")) * 2,
        })
    return out


@pytest.mark.parametrize("params", groups(
    [(F32, "contig", 2), (F32, "contig", 0), (torch.uint8, "contig", 1)],
    [(F64, "contig", 2), (F32, "step", 1)]))
def test_upsample(check, params):
    """`upsamples` at each (dtype, layout, batch), in one program."""
    check_cases(check, {_ids(c): (Layout(Fn(upsamples), c[1]), _inputs("up", *c))
                        for c in params})


def test_upsample_dynamic(check):
    """Scales from run-time sizes (eager: in / out in float) and the identity shortcut."""
    x = rand((2, 3, 9, 10), F32, gen("up-dyn"))
    more = [(rand((1, 3, 5, 12), F32, gen("up-dyn", 2)),)]
    check(Fn(lambda x: {"bilin": I(x, size=(7, 16), mode="bilinear"),
                        "near": I(x, size=(7, 16), mode="nearest"),
                        "bicubic_align": I(x, size=(6, 6), mode="bicubic", align_corners=True)}),
          (x,), dynamic_shapes=[{0: dim("n", 1, 8), 2: dim("h", 2, 64), 3: dim("w", 2, 64)}],
          more=more)


def grid_samples(x, grid):
    out = {}
    for mode in ("bilinear", "nearest"):
        for pad in ("zeros", "border", "reflection"):
            for align in (False, True):
                out[f"{mode}_{pad}_{int(align)}"] = F.grid_sample(
                    x, grid, mode=mode, padding_mode=pad, align_corners=align)
    return out


GRID_SAMPLES = [(F32, (2, 3, 9, 10), (4, 6)), (F64, (1, 2, 5, 7), (3, 3)),
                (F32, (2, 1, 1, 4), (2, 5)), (F32, (0, 3, 4, 4), (2, 2))]


def test_grid_sample(check):
    """`grid_samples` at each (dtype, input shape, grid size) of GRID_SAMPLES, in one
    program."""
    cases = {}
    for dtype, shape, grid_hw in GRID_SAMPLES:
        g = gen("grid", dtype, shape)
        x = rand(shape, dtype, g)
        # coordinates beyond [-1, 1] exercise every padding mode
        grid = (torch.rand(shape[0], *grid_hw, 2, generator=g, dtype=F64) * 3 - 1.5).to(dtype)
        cases[_ids((dtype, shape, grid_hw))] = (Fn(grid_samples), (x, grid))
    check_cases(check, cases)


# -- integer matmul ----------------------------------------------------------------------------
def test_int_matmul(check):
    """int64 and int32 matmuls, in one program."""
    cases = {}
    for dtype in (I64, I32):
        g = gen("imm", dtype)
        a, b = rand((5, 7), dtype, g, -9, 9), rand((7, 3), dtype, g, -9, 9)
        bias = rand((3,), dtype, g)
        x, y = rand((2, 5, 7), dtype, g, -9, 9), rand((2, 7, 3), dtype, g, -9, 9)
        big = rand((1, 3), dtype, g, 2**20, 2**21)  # wraps around in int32 like eager
        cases[_ids(dtype)] = (Fn(lambda a, b, bias, x, y, big: {
            "mm": a @ b, "addmm": torch.addmm(bias, a, b, beta=2, alpha=3),
            "bmm": torch.bmm(x, y), "transposed": b.t() @ a.t(), "matmul_3d": x @ y,
            "wrap": big @ big.t() * 4096, "vec": a @ b[:, 0]}), (a, b, bias, x, y, big))
    check_cases(check, cases)
