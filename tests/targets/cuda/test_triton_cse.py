"""Value numbering of Triton row-kernel bodies (kiln/targets/cuda/cse.py), on its own: top-level
assignments that repeat an earlier one become that one's name; a store to a buffer forgets the
earlier loads of it; names assigned more than once, nested assignments and values starting
with a `tl.full(...)` literal are never shared; the pass is pure. Then Before/After on a real
softmax kernel, whose three members load the same row."""

from __future__ import annotations

import copy

import torch

from kiln.frontend.export import import_program
from kiln.lowering import lower
from kiln.passes.dce import dce
from kiln.schedule import Kernel, schedule
from kiln.targets.cuda.cse import Assign, Line, Ref, Store, code, render, value_number
from kiln.targets.cuda.kernel import choose_config, kernel_body, print_triton_kernel


def _load(name: str, buf: str, idx: str, mask: str, depth: int = 0) -> Assign:
    return Assign(name, code("tl.load(buf_{} + {}, mask={}, other=0)", buf, Ref(idx), Ref(mask)),
                  depth, load=buf)


def _tile(j: int) -> list:
    """A member's single tile over 64 elements and its index variable r0."""
    return [Assign(f"r_m{j}", code("tl.arange(0, RBLOCK)[None, :]")),
            Assign(f"mask_m{j}", code("xmask & ({} < 64)", Ref(f"r_m{j}"))),
            Assign(f"r0_m{j}", (Ref(f"r_m{j}"),))]


def _store(buf: str, value: str, j: int, depth: int = 0) -> Store:
    return Store(buf, (Ref(f"r0_m{j}"),), (Ref(value),), (Ref(f"mask_m{j}"),), depth)


def test_three_members_loading_one_row_load_it_once():
    before = [
        Line(("# m0 <- softmax",)), *_tile(0), _load("t1", "x", "r0_m0", "mask_m0"),
        Assign("acc_m0", code("tl.full([XBLOCK, RBLOCK], 0, tl.float32)")),
        Assign("acc_m0", code("{} + {}", Ref("acc_m0"), Ref("t1"))),
        Line(("# m1 <- softmax",)), *_tile(1), _load("t2", "x", "r0_m1", "mask_m1"),
        Assign("t3", code("tl.exp({})", Ref("t2"))),
        Line(("# m2 <- softmax",)), *_tile(2), _load("t4", "x", "r0_m2", "mask_m2"),
        Assign("t5", code("tl.exp({})", Ref("t4"))),
        _store("out", "t5", 2),
    ]
    assert render(value_number(before)) == [
        "    # m0 <- softmax",
        "    r_m0 = tl.arange(0, RBLOCK)[None, :]",
        "    mask_m0 = xmask & (r_m0 < 64)",
        "    r0_m0 = r_m0",
        "    t1 = tl.load(buf_x + r0_m0, mask=mask_m0, other=0)",
        "    acc_m0 = tl.full([XBLOCK, RBLOCK], 0, tl.float32)",
        "    acc_m0 = acc_m0 + t1",
        "    # m1 <- softmax",
        "    t3 = tl.exp(t1)",
        "    # m2 <- softmax",
        "    tl.store(buf_out + r0_m0, t3, mask=mask_m0)",
    ]


def test_a_store_between_two_loads_of_a_buffer_keeps_both():
    before = [
        *_tile(0), _load("t1", "y", "r0_m0", "mask_m0"), _load("t2", "x", "r0_m0", "mask_m0"),
        Assign("t3", code("({} * 2)", Ref("t1"))),
        _store("y", "t3", 0),
        _load("t4", "y", "r0_m0", "mask_m0"),  # reads what the store wrote
        _load("t5", "x", "r0_m0", "mask_m0"),  # x was not stored: still t2
        Assign("t6", code("({} * 2)", Ref("t4"))),  # of the new load: not t3
        Assign("t7", code("({} + {})", Ref("t6"), Ref("t5"))),
    ]
    after = value_number(before)
    names = [s.name for s in after if isinstance(s, Assign)]
    assert names == ["r_m0", "mask_m0", "r0_m0", "t1", "t2", "t3", "t4", "t6", "t7"]
    assert render(after)[-1] == "    t7 = (t6 + t2)"


def test_a_nested_store_forgets_loads_too():
    before = [_load("t1", "y", "i0", "xmask"),
              Line(("for r_m0_off in range(0, 100, RBLOCK):",)),
              Store("y", (Ref("r_m0"),), (Ref("t9"),), (Ref("mask_m0"),), depth=1),
              _load("t2", "y", "i0", "xmask")]
    assert [s.name for s in value_number(before) if isinstance(s, Assign)] == ["t1", "t2"]


def test_only_single_top_level_non_constant_assignments_are_shared():
    full = code("tl.full([XBLOCK, RBLOCK], 0, tl.float32)")
    before = [
        Assign("a", full), Assign("b", full),  # tl.full(...): never shared
        Assign("c", code("tl.full([], 1.0, tl.float32).to(tl.float16)")),
        Assign("d", code("tl.full([], 1.0, tl.float32).to(tl.float16)")),
        Assign("e", code("({} + 1)", Ref("i0"))),
        Assign("e", code("({} + 2)", Ref("i0"))),  # e is assigned twice: not shared
        Assign("f", code("({} + 1)", Ref("i0"))),  # repeats the first e: not shared either
        Assign("g", code("({} * 3)", Ref("i0"))),
        Line(("for jj in range(0, 4):",)),
        Assign("h", code("({} * 3)", Ref("i0")), depth=1),  # nested: kept
        Assign("k", code("({} * 3)", Ref("i0"))),  # top level: g
        Assign("m", code("({} - 1)", Ref("k")), depth=1),  # renamed also when nested
    ]
    after = value_number(before)
    assert [s.name for s in after if isinstance(s, Assign)] == \
        ["a", "b", "c", "d", "e", "e", "f", "g", "h", "m"]
    assert render(after)[-1] == "        m = (g - 1)"


def test_value_number_is_pure():
    before = [*_tile(0), *_tile(1), _load("t1", "x", "r0_m0", "mask_m0"),
              _load("t2", "x", "r0_m1", "mask_m1")]
    kept = copy.deepcopy(before)
    after = value_number(before)
    assert before == kept
    assert value_number(before) == after
    assert value_number(after) == after  # a fixed point


class _Softmax(torch.nn.Module):
    def forward(self, x):
        return torch.softmax(x, -1)


def _softmax_kernel():
    ep = torch.export.export(_Softmax(), (torch.randn(8, 64),))
    loop = lower(dce(import_program(ep).graph))
    kernels = [s for s in schedule(loop) if isinstance(s, Kernel)]
    assert len(kernels) == 1, "max, sum and the division fuse into one kernel"
    return kernels[0], {b.name: b for b in loop.buffers}


def test_softmax_kernel_before_and_after():
    kernel, buffers = _softmax_kernel()
    config = choose_config(kernel, {})
    assert config.rblock >= 64  # single tiles: every member's body is at the top level
    before = kernel_body(kernel, buffers, config)
    after = value_number(before)

    def loads(body):
        return [s for s in body if isinstance(s, Assign) and s.load == "x"]

    assert len(kernel.members) == 3 and len(loads(before)) == 3
    assert len(loads(after)) == 1  # the row is loaded once, by the first member
    first = loads(after)[0].name
    aranges = [s for s in after if isinstance(s, Assign) and s.name.startswith("r_m")]
    assert [s.name for s in aranges] == ["r_m0"]
    # the later members read the first member's load (exp(x - max) is shared as well)
    later = render(after[after.index(loads(after)[0]) + 1:])
    assert any(f"({first} - v_" in ln for ln in later)
    assert sum("tl.exp(" in ln for ln in render(before)) == 2
    assert sum("tl.exp(" in ln for ln in render(after)) == 1
    # the printer prints exactly what the pass leaves
    source = print_triton_kernel(kernel, buffers, {}, config).source
    assert source.endswith("\n".join(render(after)) + "\n")
    assert source.count("tl.load(") == 1
