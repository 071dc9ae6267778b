"""User-written Triton kernels and the models that call them
(tests/targets/cuda/test_user_triton*.py).

Kernels live in a file of their own because Triton reads a @triton.jit function's source back
from its file; the triton_op names are registered once per process, on import."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton


@triton.jit
def add_relu_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m)
    y = tl.load(y_ptr + offs, mask=m)
    tl.store(out_ptr + offs, tl.maximum(x + y, 0), mask=m)


@triton_op("kiln_test::add_relu", mutates_args={})
def add_relu(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    n = x.numel()
    wrap_triton(add_relu_kernel)[lambda meta: (triton.cdiv(n, meta["BLOCK_SIZE"]),)](
        x, y, out, n, BLOCK_SIZE=128)
    return out


@triton.autotune(configs=[triton.Config({"BLOCK": 64}, num_warps=2),
                          triton.Config({"BLOCK": 256}, num_warps=4)], key=["n"])
@triton.jit
def scale_kernel(x_ptr, bias_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m)
    if bias_ptr is not None:
        x = x + tl.load(bias_ptr + offs, mask=m)
    tl.store(out_ptr + offs, x * alpha, mask=m)


@triton.jit
def _row_factor(r):
    return (r + 1).to(tl.float32)


@triton.jit
def row_scale_kernel(x_ptr, out_ptr, D, BLOCK_D: tl.constexpr):
    """out[r, c] = x[r, c] * (r + 1) on a 2-D grid (rows, column blocks)."""
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m = cols < D
    x = tl.load(x_ptr + r * D + cols, mask=m)
    tl.store(out_ptr + r * D + cols, x * _row_factor(r), mask=m)


@triton.jit
def _store_at(ptr, offs, value, m):
    tl.store(ptr + offs, value, mask=m)


@triton.jit
def via_helper_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """Stores through a @triton.jit helper: the analysis must see dst_ptr written."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    dst = dst_ptr
    _store_at(dst, offs, tl.load(src_ptr + offs, mask=m), m)


@triton.jit
def double_inplace_kernel(p_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(p_ptr + offs, tl.load(p_ptr + offs, mask=m) * 2, mask=m)


@triton.autotune(configs=[triton.Config({"BLOCK": 128})], key=[])
@triton.heuristics({"EVEN": lambda args: args["n"] % args["BLOCK"] == 0})
@triton.jit
def neg_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if EVEN:
        tl.store(out_ptr + offs, -tl.load(x_ptr + offs))
    else:
        m = offs < n
        tl.store(out_ptr + offs, -tl.load(x_ptr + offs, mask=m), mask=m)


class AddRelu(torch.nn.Module):
    """(a) a triton_op with a BLOCK_SIZE constexpr and a grid lambda, between kiln ops."""

    def forward(self, x, y):
        return add_relu(x * 2, y) + 1


class Scale(torch.nn.Module):
    """(b) wrap_triton in forward: autotune configs, a None argument, a float argument."""

    def forward(self, x):
        out = torch.empty_like(x)
        n = x.numel()
        wrap_triton(scale_kernel)[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](
            x, None, out, n, 0.5)
        return out.relu()


class RowScale(torch.nn.Module):
    """(c) a 2-D grid over a dynamic batch and a @triton.jit helper."""

    def forward(self, x):
        out = torch.empty_like(x)
        b, d = x.shape
        wrap_triton(row_scale_kernel)[(b, triton.cdiv(d, 32))](x, out, d, BLOCK_D=32)
        return out


class Fused(torch.nn.Module):
    """linear -> user kernel -> layer_norm."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 32)
        self.ln = torch.nn.LayerNorm(32)

    def forward(self, x, y):
        return self.ln(add_relu(self.fc(x), y))


class InPlace(torch.nn.Module):
    """A kernel that doubles an intermediate in place, which is read again afterwards."""

    def forward(self, x):
        y = x + 1
        n = y.numel()
        wrap_triton(double_inplace_kernel)[(triton.cdiv(n, 64),)](y, n, BLOCK=64)
        return y * 3 + x


class WritesInput(torch.nn.Module):
    """A kernel that writes a user input in place (written back by the runner)."""

    def forward(self, x):
        n = x.numel()
        wrap_triton(double_inplace_kernel)[(triton.cdiv(n, 64),)](x, n, BLOCK=64)
        return x + 1


class Neg(torch.nn.Module):
    """triton.heuristics computing a constexpr from a size."""

    def forward(self, x):
        out = torch.empty_like(x)
        n = x.numel()
        wrap_triton(neg_kernel)[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, out, n)
        return out


class Transposed(torch.nn.Module):
    """A transposed (non-contiguous) tensor argument: kiln refuses."""

    def forward(self, x):
        out = torch.empty_like(x)
        n = x.numel()
        wrap_triton(add_relu_kernel)[(triton.cdiv(n, 128),)](x.t(), x, out, n, BLOCK_SIZE=128)
        return out


@triton.jit
def affine_kernel(x_ptr, out_ptr, n, scale, shift, negate, BLOCK: tl.constexpr):
    """out = +-(x * scale + shift) in x's dtype (float16 here): float, int and bool scalars."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    y = tl.load(x_ptr + offs, mask=m).to(tl.float32) * scale + shift
    if negate:
        y = -y
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=m)


@triton_op("kiln_test::affine_into", mutates_args={"out"})
def affine_into(x: torch.Tensor, out: torch.Tensor, shift: int, negate: bool) -> None:
    n = x.numel()
    wrap_triton(affine_kernel)[(triton.cdiv(n, 256),)](x, out, n, 0.25, shift, negate,
                                                        BLOCK=256)


class Affine(torch.nn.Module):
    """A triton_op that writes its `out` argument (mutates_args), on float16 tensors."""

    def forward(self, x):
        out = torch.empty_like(x)
        affine_into(x, out, 3, True)
        return out * 2


class UnbackedGrid(torch.nn.Module):
    """A grid from a data-dependent size with no upper bound (`k.item()`): cdiv(k, 64)
    programs of add_relu_kernel over x's n elements; blocks past k stay 0 (torch.zeros_like),
    so a grid evaluated for any other value gives other numbers."""

    def forward(self, x, y, k):
        out = torch.zeros_like(x)
        m = k.item()
        n = x.numel()
        wrap_triton(add_relu_kernel)[lambda meta: (triton.cdiv(m, meta["BLOCK_SIZE"]),)](
            x, y, out, n, BLOCK_SIZE=64)
        return out * 2


class UnbackedSized(torch.nn.Module):
    """A triton_op on tensors of a data-dependent size with no upper bound: buffers allocated
    at run time, the grid cdiv(u0, 128)."""

    def forward(self, x, k):
        m = k.item()
        torch._check_is_size(m)
        a = torch.arange(m, dtype=torch.float32, device=x.device) * x.sum() - 3
        return add_relu(a, torch.ones(m, device=x.device) * x[0]) * 2
