"""Fuzzer reproducer (fixed): kiln's Loop IR interpreter crashed with `KeyError: u0` on a
kernel reading the result of an ATen fallback op whose size is data-dependent
(unique_consecutive over a dim: [B, 4, u0]); the compiled package was right. The interpreter
put the sizes it knew into index expressions by symbol with fixed assumptions (positive),
and an unbacked size's symbol is not one of those, so it stayed free; it now puts them in by
name (kiln/ir/interp.py `_Eval.index`). Found by `kiln fuzz --seed 1717 --start 97 --n 1
--index-sort 1.0` (programs 97 and 158 of that run), minimised to 6 ops by
kiln/fuzz/minimise.py."""

from kiln.fuzz.runner import check

SPEC = {'dim': 'bounded',
        'dynamic': True,
        'inputs': [{'dtype': 'int64', 'high': None, 'shape': ['B', 64]},
                   {'dtype': 'float32', 'high': None, 'shape': ['B', 4, 16]}],
        'ops': [['binary', [0, 0], {'fn': 'gt'}],
                ['softmax', [1], {'dim': 0, 'log': False}],
                ['cast', [2], {'dtype': 'float32'}],
                ['sort', [2], {'descending': True, 'dim': 1, 'part': 0}],
                ['sort', [2], {'descending': True, 'dim': 1, 'part': 1}],
                ['unique_consecutive', [1], {'dim': 2, 'part': 0}]],
        'outputs': [7, 3, 6, 6, 7],
        'params': {},
        'seed': 1717005248}


def test_interp_unbacked_size_symbol(tmp_path):
    out = check(SPEC, tmp_path)
    assert out.status == "ok", out.detail
