"""User-written Triton kernels (torch.library.triton_op / wrap_triton) compiled into CUDA
packages without a GPU (CI): the kernel is found behind the custom op or the HOP, compiled to a
cubin for sm_90 and launched from the C++ wrapper with the right grid and arguments; what kiln
refuses, it refuses with the kernel's name. Numerics against eager: test_user_triton_gpu.py."""

from __future__ import annotations

import logging
import re
import zipfile

import pytest
import torch
from torch.export import Dim

pytest.importorskip("triton")

import kiln  # noqa: E402
import user_triton_kernels as K  # noqa: E402
from kiln.errors import UnsupportedError  # noqa: E402
from kiln.frontend.user_triton import written_params  # noqa: E402
from kiln.ir import loop as L  # noqa: E402
from kiln.options import Options  # noqa: E402
from kiln.targets.cuda.user_triton import prepare  # noqa: E402

OPTS = Options(cuda_archs=(90,), autotune=False)  # the first config, GPU or not
# without a GPU driver torch cannot analyse a kernel and logs a traceback per call: noise here
logging.getLogger("torch._higher_order_ops.triton_kernel_wrap").setLevel(logging.ERROR)


def _compile(module, args, dyn=None, device="cuda"):
    ep = torch.export.export(module, args, dynamic_shapes=dyn)
    return kiln.compile(ep, device=device, options=OPTS)


def _user_block(cm, kernel: str) -> str:
    """The wrapper's lines for one user kernel: from its comment to its launch."""
    src = cm.sources["model_cuda.cpp"]
    start = src.index(f"// user Triton kernel {kernel} ")
    return src[start:src.index("return 1;\n", src.index("kc::launch_grid", start))]


def _step(cm, kernel: str) -> L.UserKernel:
    return next(s for s in cm.built.steps if isinstance(s, L.UserKernel) and s.kernel == kernel)


@pytest.fixture(scope="module")
def add_relu():
    b = Dim("b")
    return _compile(K.AddRelu(), (torch.randn(8, 16), torch.randn(8, 16)), ({0: b}, {0: b}))


def test_triton_op_compiles_to_a_cuda_package(add_relu, tmp_path):
    cm = add_relu
    kinds = [k["kind"] for k in cm.manifest["kernels"]]
    assert kinds.count("user_triton") == 1 and "triton" in kinds
    info = cm.manifest["cuda"]["user_kernels"]["add_relu_kernel"]
    assert info["constexprs"] == {"BLOCK_SIZE": "128"} and info["num_warps"] == 4
    block = _user_block(cm, "add_relu_kernel")
    # grid lambda evaluated for BLOCK_SIZE=128 over the dynamic batch; n = 16 * batch as int64
    assert "kc::launch_grid(e, \"add_relu_kernel\", self->fn[" in block
    assert "(((127 + (16 * s0)) / 128)), (1), (1)" in block
    assert "int64_t a3 = static_cast<int64_t>((16 * s0));  // n" in block
    assert "cuMemcpyDtoDAsync" not in block  # out is torch.empty_like: nothing to copy
    path = cm.save(tmp_path / "add_relu.kiln")
    with zipfile.ZipFile(path) as z:
        so = z.read("lib/model.so")
        user_src = z.read("src/user_triton.py").decode()
    assert so.count(b"\x7fELF") >= 1 + len(cm.manifest["kernels"])  # model.so + one cubin each
    assert "def add_relu_kernel(" in user_src and "grid=(FloorDiv(16*s0 + 127, 128), 1, 1)" \
        in user_src
    # a dynamic int is i64 with no divisibility assumed; pointers are 16-byte aligned
    launch = prepare(_step(cm, "add_relu_kernel"), 0, L.all_buffers(cm.built.loop))
    assert launch.signature == {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32",
                                "n": "i64", "BLOCK_SIZE": "constexpr"}
    assert sorted(launch.attrs) == [(0,), (1,), (2,)]


def test_autotuned_wrap_triton_with_none_and_float_args():
    cm = _compile(K.Scale(), (torch.randn(8, 16),), ({0: Dim("b")},))
    info = cm.manifest["cuda"]["user_kernels"]["scale_kernel"]
    # autotune off (as without a GPU): the first config, with its own grid
    assert info["config"] == 0 and info["constexprs"] == {"BLOCK": "64", "bias_ptr": "None"}
    assert info["num_warps"] == 2 and info["measured_ms"] == {}
    assert info["grid"] == ["FloorDiv(16*s0 + 63, 64)", "1", "1"]
    block = _user_block(cm, "scale_kernel")
    assert "float a3 = static_cast<float>(0.5f);  // alpha" in block
    # bias_ptr (None) is a constant, not an argument; x is passed as it is: kiln's analysis
    # finds it unwritten although torch, without a driver, listed it as mutated
    assert "void* args[] = {&buf_x, &buf_scale_kernel_out_ptr, &a2, &a3, &scratch, &scratch};" \
        in block
    assert "(((63 + (16 * s0)) / 64)), (1), (1)" in block


def test_dynamic_batch_on_a_2d_grid():
    cm = _compile(K.RowScale(), (torch.randn(4, 64),), ({0: Dim("b")},))
    block = _user_block(cm, "row_scale_kernel")
    assert "(s0), (2), (1)" in block
    assert "int32_t a2 = static_cast<int32_t>(64);  // D" in block
    launch = prepare(_step(cm, "row_scale_kernel"), 0, L.all_buffers(cm.built.loop))
    assert launch.attrs[(2,)] == [["tt.divisibility", 16]]  # a static 64 is specialised
    cm40 = _compile(K.RowScale(), (torch.randn(4, 40),), ({0: Dim("b")},))
    launch = prepare(_step(cm40, "row_scale_kernel"), 0, L.all_buffers(cm40.built.loop))
    assert (2,) not in launch.attrs


def test_kernel_writing_an_intermediate_gets_a_copy():
    cm = _compile(K.InPlace(), (torch.randn(4, 40),), ({0: Dim("b")},))
    block = _user_block(cm, "double_inplace_kernel")
    copy = re.search(r"cuMemcpyDtoDAsync\(buf_double_inplace_kernel_p_ptr, buf_(\w+), "
                     r"static_cast<size_t>\(\(40 \* s0\)\) \* 4", block)
    assert copy is not None, block
    assert copy.group(1) != "double_inplace_kernel_p_ptr"


def test_triton_op_writing_its_argument_with_scalar_args_in_float16():
    cm = _compile(K.Affine(), (torch.randn(8, 16, dtype=torch.float16),), ({0: Dim("b")},))
    block = _user_block(cm, "affine_kernel")
    for line in ("float a3 = static_cast<float>(0.25f);  // scale",
                 "int32_t a4 = static_cast<int32_t>(3);  // shift",
                 "int8_t a5 = static_cast<int8_t>(1);  // negate",
                 "void* args[] = {&buf_x, &buf_affine_kernel_out_ptr, &a2, &a3, &a4, &a5, "
                 "&scratch, &scratch};"):
        assert line in block
    launch = prepare(_step(cm, "affine_kernel"), 0, L.all_buffers(cm.built.loop))
    assert launch.signature == {"x_ptr": "*fp16", "out_ptr": "*fp16", "n": "i64",
                                "scale": "fp32", "shift": "i32", "negate": "i1",
                                "BLOCK": "constexpr"}


def test_grid_from_an_unbounded_data_dependent_size():
    """A grid cdiv(k.item(), 64) with k unbounded, over static tensors: the size is read on
    the host before the launch and the grid evaluated from it at run time (no buffer is sized
    by it: dead code elimination used to drop the read, and the C++ did not compile)."""
    cm = _compile(K.UnbackedGrid(), (torch.randn(300), torch.randn(300), torch.tensor(100)))
    src = cm.sources["model_cuda.cpp"]
    assert "int64_t u0 = 0;  // data-dependent size, no upper bound" in src
    block = _user_block(cm, "add_relu_kernel")
    assert "(((63 + u0) / 64)), (1), (1)" in block
    assert "int32_t a3 = static_cast<int32_t>(300);  // n" in block
    assert src.index("u0 = static_cast<int64_t>(v);") < src.index("// user Triton kernel")
    assert "cuMemcpyDtoDAsync(buf_add_relu_kernel_out_ptr" in block  # zeros_like: a copy in
    assert "user_kernels" in cm.manifest["cuda"]


def test_triton_op_on_tensors_of_an_unbounded_size():
    """A triton_op on tensors sized by an unbounded k.item(): its buffers are allocated once
    k is known (outside the arena) and its grid is cdiv(u0, 128), its `n` argument u0."""
    cm = _compile(K.UnbackedSized(), (torch.randn(4), torch.tensor(37)))
    block = _user_block(cm, "add_relu_kernel")
    assert "(((127 + u0) / 128)), (1), (1)" in block
    assert "int64_t a3 = static_cast<int64_t>(u0);  // n" in block
    src = cm.sources["model_cuda.cpp"]
    assert re.search(r"buf_add_relu_kernel_out_ptr = heap\.alloc\(e, \"add_relu_kernel_out_ptr\""
                     r", \(4 \* u0\), stream\);", src), src
    assert src.index("u0 = static_cast<int64_t>(v);") < src.index("heap.alloc(")


def test_fused_between_kiln_ops():
    b = Dim("b")
    cm = _compile(K.Fused(), (torch.randn(4, 16), torch.randn(4, 32)), ({0: b}, {0: b}))
    kinds = [k["kind"] for k in cm.manifest["kernels"]]
    user = kinds.index("user_triton")
    assert any(k.endswith("_gemm") for k in kinds[:user]) and "triton" in kinds[user + 1:]


def test_refusals_name_the_kernel():
    with pytest.raises(UnsupportedError, match=r"user Triton kernel add_relu_kernel .*needs a "
                                               r"GPU: compile with device=\"cuda\""):
        _compile(K.AddRelu(), (torch.randn(8, 16), torch.randn(8, 16)), device="cpu")
    # a kernel writing a user input: accepted since session 14, the new contents an extra
    # output the runner copies back (manifest input_mutations; tests/frontend/
    # test_input_mutation_cov.py runs such programs on the CPU)
    cm = _compile(K.WritesInput(), (torch.randn(4, 40),))
    assert [w["input"] for w in cm.manifest["input_mutations"]] == [0]
    with pytest.raises(UnsupportedError, match=r"add_relu_kernel .*tensor argument x_ptr has "
                                               r"strides \[1, 8\]; kiln passes contiguous"):
        _compile(K.Transposed(), (torch.randn(8, 8),))
    with pytest.raises(UnsupportedError, match="neg_kernel .*constexpr EVEN depends on a "
                                               "dynamic size"):
        _compile(K.Neg(), (torch.randn(4, 64),), ({0: Dim("b")},))


@pytest.mark.parametrize("cols,even", [(64, True), (60, False)])
def test_heuristics_on_static_sizes(cols, even):
    cm = _compile(K.Neg(), (torch.randn(4, cols),))
    assert cm.manifest["cuda"]["user_kernels"]["neg_kernel"]["constexprs"]["EVEN"] == repr(even)


def test_written_params_analysis():
    ptrs = {"x_ptr", "y_ptr", "out_ptr", "p_ptr", "src_ptr", "dst_ptr"}
    assert written_params(K.add_relu_kernel, ptrs) == {"out_ptr"}
    assert written_params(K.row_scale_kernel, ptrs) == {"out_ptr"}  # a helper gets a row index
    assert written_params(K.double_inplace_kernel, ptrs) == {"p_ptr"}
    assert written_params(K.via_helper_kernel, ptrs) == {"dst_ptr"}  # via `dst`, into a helper
