"""Regression tests for wrong 16-bit answers found by the OpInfo dtype sweep
(`bench/opinfo_sweep.py --dtypes float16,bfloat16,...`, docs/coverage.md).

Each compares kiln with eager and with a float64 reference on the upcast inputs (test_half's
rule: kiln's error may exceed eager's by two units in the last place of the half type), at
several shapes, both 16-bit types, and non-contiguous inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from difftest import Checker, Fn, gen, rand
from test_half import HALVES, _ids, _run


@pytest.fixture(scope="module")
def check(tmp_path_factory) -> Checker:
    return Checker(tmp_path_factory.mktemp("lowp_opinfo"))


def _group_norms(x1, w1, b1, x2, w2, b2, x3):
    y1, mean1, rstd1 = torch.ops.aten.native_group_norm(x1, w1, b1, 2, 6, 5, 3, 0.5)
    return {"y1": y1, "mean1": mean1, "rstd1": rstd1,
            "y2": F.group_norm(x2, 2, w2, b2, eps=1e-5),
            "y3": F.group_norm(x3, 4, None, None),
            "y3_weight_only": F.group_norm(x3, 2, torch.ones_like(x3[0, :, 0]) * 3)}


@pytest.mark.parametrize("dtype", HALVES, ids=_ids)
def test_group_norm_rounds_once(check, dtype):
    """native_group_norm normalises in float32 and rounds y once, as eager does (it rounded
    the normalised value to the half type at the view before the affine: 3 ulps off)."""
    def inputs(seed):
        g = gen("group_norm", dtype, seed)
        x2 = rand((1, 4, 3, 3), dtype, g, -3, 3).to(memory_format=torch.channels_last)
        x3 = rand((8, 3, 7), dtype, g, -3, 3).transpose(0, 1)  # strided: (3, 8, 7)
        return (rand((2, 6, 5), dtype, g, -3, 3), rand((6,), dtype, g, -3, 3),
                rand((6,), dtype, g, -1, 1), x2, rand((4,), dtype, g, -3, 3),
                rand((4,), dtype, g, -1, 1), x3)
    _run(check, Fn(_group_norms), inputs(0), dtype, "group_norm",
         more=[inputs(k) for k in range(1, 6)])
