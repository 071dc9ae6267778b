"""`x.contiguous()` of an input returned (docs/reliability.md item 8): the export cannot tell
it from `return x` (a no-op on the compact example), and eager returns x itself when x is
contiguous and a compact copy otherwise. The fuzzer's runner checks values against eager and
float64 and storage sharing both ways, on contiguous inputs and in two other layouts
(transposed, then one by seed: kiln used to return the transposed input itself, sharing its
storage where eager's copy does not), static and dynamic; the generator makes such programs
again (it skipped them while kiln could not match)."""

import pytest

from kiln.fuzz.runner import check


def _spec(dynamic: bool, seed: int) -> dict:
    b = "B" if dynamic else 5
    return {"dim": "bounded", "dynamic": dynamic, "seed": seed, "params": {},
            "inputs": [{"dtype": "float32", "high": None, "shape": [b, 4]},
                       {"dtype": "int64", "high": 9, "shape": [b, 3, 2]}],
            "ops": [["contiguous", [0], {}],
                    ["contiguous", [1], {}],
                    ["transpose", [1], {"d0": 1, "d1": 2}],
                    ["contiguous", [4], {}],
                    ["slice", [0], {"dim": 1, "start": 1, "end": None, "step": 2}]],
            "outputs": [2, 3, 5, 6, 0]}


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("seed", [16000025, 16000026, 16000027])
def test_contiguous_of_input(tmp_path, dynamic, seed):
    out = check(_spec(dynamic, seed), tmp_path)
    assert out.status == "ok", out.detail
