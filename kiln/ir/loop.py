"""Loop IR: every tensor the program materialises is a `Compute` (a loop body over its index
space, optionally reducing over extra indices), a `Gemm` (an extern call into BLAS), an
`Extern` (a call into a kiln runtime routine: sort, scans, scatters, ...; it may write several
buffers) or a `UserKernel` (a user-written Triton kernel; CUDA only).

Expressions are frozen trees: `Const`, `Load` (a flat element offset into a buffer, possibly
through `indirect` temporaries whose values are themselves loaded), `Index` (an integer index
expression used as a value) and `Op` (an operator from `OPS`). A `Compute` of rank n binds loop
variables i0..i{n-1}; with a `Reduce` of k sizes it also binds r0..r{k-1}. Buffers are always
contiguous row-major; views never appear here: lowering folded them into index expressions.

Invariants (checked by `verify_loop`): loads name declared buffers; loop variables in a body are
bound by its node; a buffer is written by exactly one node (or is an input / weight) and is
written before it is read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

import sympy

from kiln.ir.dtypes import DType
from kiln.ir.sym import contiguous_strides


@dataclass(frozen=True)
class Const:
    value: object
    dtype: DType


@dataclass(frozen=True)
class Indirect:
    """A temporary index variable `var` = `value` (an int expression), required in [0, bound)
    after negative values are wrapped by adding `bound` when `wrap` (torch indexing semantics;
    embedding, gather and index_select do not wrap)."""

    var: sympy.Symbol
    value: "Expr"
    bound: sympy.Expr
    wrap: bool = True  # negative values count from the end (index.Tensor); else an error
    #: the graph node whose indexing this is (embedding, index, gather): what a run-time
    #: "index out of range" names once the lookup is fused into another node's kernel
    site: str = field(default="", compare=False)


@dataclass(frozen=True)
class Load:
    buf: str
    index: sympy.Expr
    dtype: DType
    indirect: tuple[Indirect, ...] = ()


@dataclass(frozen=True)
class Index:
    expr: sympy.Expr
    dtype: DType


@dataclass(frozen=True)
class Op:
    op: str
    args: tuple["Expr", ...]
    dtype: DType


Expr = Union[Const, Load, Index, Op]

# op name -> arity. The C++ and numpy spellings live with their printers/interpreter.
OPS: dict[str, int] = {
    **{k: 1 for k in (
        "neg", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "relu", "abs", "sin", "cos",
        "erf", "erfc", "logical_not", "reciprocal", "floor", "ceil", "round", "trunc", "log1p",
        "expm1", "sign", "exp2", "log2", "tan", "atan", "asin", "acos", "sinh", "cosh", "asinh",
        "acosh", "atanh", "isnan", "isinf", "bitwise_not", "cast", "to_bool", "square", "log10",
        "i0", "signbit")},
    **{k: 2 for k in (
        "add", "sub", "mul", "div", "truediv_floor", "truediv_trunc", "pow", "maximum",
        "minimum", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or",
        "logical_xor", "remainder", "fmod", "atan2", "bitwise_and", "bitwise_or",
        "bitwise_xor", "hypot", "copysign", "nextafter", "shift_left", "shift_right")},
    "where": 3,
    # complex values as pairs of real parts (lowering/complex.py): a complex element's real /
    # imaginary part, and the complex element made of two parts
    "real": 1, "imag": 1, "complex": 2,
    # Philox4x32-10 (seed, run, stream, element index, lane): lane k of the 4 outputs, as an
    # int64 in [0, 2**32). Key = seed; counter = (index lo, index hi, stream, run).
    "philox": 5,
}


@dataclass(frozen=True)
class Reduce:
    kind: str  # sum, prod, max, min, any, all, argmax, argmin
    sizes: tuple[sympy.Expr, ...]


@dataclass(frozen=True)
class Compute:
    name: str
    dtype: DType
    shape: tuple[sympy.Expr, ...]
    body: Expr
    reduce: Reduce | None = None
    source: tuple[str, ...] = ()


def blas_ok(strides, shape) -> bool:
    """Whether a [rows, cols] matrix with these strides is one BLAS takes, as the run time's
    `kr::blas_layout` decides (kiln_model_rt.h): unit stride along one dim and a leading
    dimension covering the other (an expanded operand, row stride 0, is not one; nor are rows
    that overlap); where a size is symbolic, only when that holds for every size."""
    rs, cs = (sympy.sympify(x) for x in strides[-2:])
    rows, cols = (sympy.sympify(x) for x in shape[-2:])

    def covers(ld, n) -> bool:
        return n == 1 or (ld - n).is_nonnegative is True
    return ((cs == 1 or cols == 1) and (rows == 1 or covers(rs, cols))) or \
        ((rs == 1 or rows == 1) and (cols == 1 or covers(cs, rows)))


@dataclass(frozen=True)
class Operand:
    """A strided matrix operand of a GEMM: element (b..., x, y) sits at
    offset + sum(b_k * batch_strides[k]) + x * rows + y * cols."""

    buf: str
    offset: sympy.Expr
    batch_strides: tuple[sympy.Expr, ...]
    rows: sympy.Expr
    cols: sympy.Expr


@dataclass(frozen=True)
class LowpGemm:
    """What makes a `Gemm` low-precision (CUDA only, through cuBLASLt): kind "scaled" multiplies
    8-bit float operands (`a_dtype`, `b_dtype`) with float32 accumulation, then by the float32
    scalars at `scale_a` and `scale_b` (buffer, element offset; None: 1) and adds `bias` (a
    buffer of N elements of the output dtype, or None); kind "int" multiplies int8 operands
    into int32. Operands are in cuBLASLt's one layout for them: `a` row-major, `b`
    column-major, leading dimensions and addresses 16-byte aligned (lowering/lowp.py)."""

    kind: str  # "scaled" | "int"
    a_dtype: DType
    b_dtype: DType
    scale_a: tuple[str, sympy.Expr] | None = None
    scale_b: tuple[str, sympy.Expr] | None = None
    bias: str | None = None

    def reads(self) -> list[str]:
        return [x[0] for x in (self.scale_a, self.scale_b) if x is not None] + (
            [self.bias] if self.bias else [])


@dataclass(frozen=True)
class MixedGemm:
    """What makes a `Gemm` mixed-dtype (CUDA only, through the Triton template): operand
    `side` ("a" or "b") holds integers of `qdtype` (int8 / uint8), converted to the GEMM's
    float dtype as the kernel loads them (exact: every int8 is a float16 / bfloat16); the
    other operand is of the GEMM's dtype. `scale` (None: 1) multiplies the float32
    accumulator before it is rounded: a strided view broadcast over the output
    [*batch, M, N] (stride 0 along a broadcast dim; it never varies along K, which is what
    lets it leave the dot product: a per-output-channel or scalar dequantisation scale).
    Written by lowering/mixed.py from passes/mixed_gemm.py's `mixed_mm` node.

    `group` > 0: int4 weights (weight-only quantisation, targets/cuda/quant.py; side "b",
    qdtype uint8, the GEMV template only): B[k, n] = nibble - 8 of the byte at
    b.offset + (k // 2) * b.rows + n * b.cols (k even: its low nibble, odd: its high one), and
    `scale` is the [K // group, N] matrix of per-group scales, (j, n) at
    offset + j * rows + n * cols, each multiplying its group's partial sum. `tc`: the bytes
    are in kiln/gemm/int4_tc.py's `pack_tc` order (each 16 bytes along K, 32 values, hold
    k = 32 c + 4 i + j at nibble i of their 32-bit word j; the GEMV template then multiplies
    on the tensor cores)."""

    side: str  # "a" | "b"
    qdtype: DType
    scale: Operand | None = None
    scale_dtype: DType | None = None
    group: int = 0
    tc: bool = False

    def reads(self) -> list[str]:
        return [self.scale.buf] if self.scale is not None else []


@dataclass(frozen=True)
class Gemm:
    """out[b..., m, n] = sum_k a[b..., m, k] * b[b..., k, n]; out is contiguous
    [*batch, M, N]. `lowp`: a low-precision GEMM (operand dtypes differ from `dtype`);
    `mixed`: one operand is int8, converted on load, the result optionally scaled."""

    name: str
    dtype: DType
    batch: tuple[sympy.Expr, ...]
    m: sympy.Expr
    n: sympy.Expr
    k: sympy.Expr
    a: Operand
    b: Operand
    source: tuple[str, ...] = ()
    lowp: LowpGemm | None = None
    mixed: MixedGemm | None = None
    #: CPU: `b.buf` is a weight stored prepacked in panels of this many columns (NR; 0: as
    #: `b` describes it). Panel p holds B[0:K, p*NR:(p+1)*NR] k-major, zero-padded past N
    #: (passes/pack_cpu.py); `b`'s strides describe the weight as it was before packing.
    packed_b: int = 0
    #: CPU: a pointwise Compute fused into the GEMM (kiln/gemm/fuse_cpu.py), applied in place
    #: to the stored result: its loads of `name` read the GEMM's own element, its others are
    #: extra reads; the GEMM then carries the Compute's name (its buffer is the result)
    epilogue: Compute | None = None

    @property
    def shape(self) -> tuple[sympy.Expr, ...]:
        return (*self.batch, self.m, self.n)

    def blas_operands(self) -> bool:
        """Whether BLAS (and oneDNN) can take both operands: not so for an A whose rows
        overlap (the im2col view of a 1-D convolution, passes/conv1d_gemm.py), which only
        kiln's own CPU GEMM reads."""
        return blas_ok((self.a.rows, self.a.cols), (self.m, self.k)) and \
            blas_ok((self.b.rows, self.b.cols), (self.k, self.n))

    def extra_reads(self) -> list[str]:
        """Buffers read besides the operands (scales, bias, a fused epilogue's inputs)."""
        out = (self.lowp.reads() if self.lowp else []) + (
            self.mixed.reads() if self.mixed else [])
        if self.epilogue is not None:
            out += [b for b in dict.fromkeys(ld.buf for ld in loads(self.epilogue.body))
                    if b != self.name and b not in out]
        return out


# -- ATen fallback arguments ----------------------------------------------------------------
# One frozen class per kind of schema argument (`AtenArg`); printers, the interpreter and the
# analyses dispatch on the class. In Graph IR a tensor argument is an `AtenOperand` (the aten
# node's k-th input); lowering turns it into an `AtenTensor` (a strided view of a buffer).


@dataclass(frozen=True)
class AtenOperand:
    """Graph IR only: the `index`-th input of the `aten` node."""

    index: int


@dataclass(frozen=True)
class AtenTensor:
    """A strided view of buffer `buf`: element (j0, ...) at offset + sum(j_d * strides[d])."""

    buf: str
    dtype: DType
    shape: tuple[sympy.Expr, ...]
    strides: tuple[sympy.Expr, ...]
    offset: sympy.Expr


@dataclass(frozen=True)
class AtenTensors:
    """A list of tensors (Tensor[] or Tensor?[]): `AtenTensor`s (`AtenOperand`s in Graph IR),
    `AtenNone`s or `AtenOptional`s."""

    items: tuple[AtenArg, ...]


@dataclass(frozen=True)
class AtenOptional:
    """An optional argument that is present."""

    value: AtenArg


@dataclass(frozen=True)
class AtenNone:
    """An optional argument that is absent."""


@dataclass(frozen=True)
class AtenInt:
    value: sympy.Expr | int  # a size expression or a constant


@dataclass(frozen=True)
class AtenFloat:
    value: float


@dataclass(frozen=True)
class AtenBool:
    value: bool


@dataclass(frozen=True)
class AtenStr:
    value: str


@dataclass(frozen=True)
class AtenInts:
    values: tuple[sympy.Expr | int, ...]


@dataclass(frozen=True)
class AtenDtype:
    """A ScalarType argument."""

    dtype: DType


AtenArg = Union[AtenOperand, AtenTensor, AtenTensors, AtenOptional, AtenNone, AtenInt,
                AtenFloat, AtenBool, AtenStr, AtenInts, AtenDtype]


def aten_arg_buffers(arg: AtenArg) -> list[str]:
    """Buffers an `AtenCall` argument reads."""
    match arg:
        case AtenTensor(buf=buf):
            return [buf]
        case AtenTensors(items=items):
            return [b for a in items for b in aten_arg_buffers(a)]
        case AtenOptional(value=value):
            return aten_arg_buffers(value)
    return []


def map_aten_tensors(arg: AtenArg, f) -> AtenArg:
    """`arg` with every tensor argument `t` (inside lists and optionals too) replaced by
    `f(t)`."""
    match arg:
        case AtenTensor() | AtenOperand():
            return f(arg)
        case AtenTensors(items=items):
            return AtenTensors(tuple(map_aten_tensors(a, f) for a in items))
        case AtenOptional(value=value):
            return AtenOptional(map_aten_tensors(value, f))
    return arg


@dataclass(frozen=True)
class AtenCall:
    """out = result `result` of the ATen op `op`.`overload` (of `n_results` tensor results),
    called through torch's stable C interface at run time: the ATen fallback for ops kiln does
    not lower. `args` are the op's schema arguments in order (`AtenArg`s; tensors are
    `AtenTensor`s)."""

    name: str
    dtype: DType
    shape: tuple[sympy.Expr, ...]
    op: str  # "aten::linalg_inv_ex"
    overload: str  # "" for the default overload
    args: tuple[AtenArg, ...]
    result: int
    n_results: int
    keywords: tuple[str, ...] = ()  # names of the trailing keyword-only arguments
    source: tuple[str, ...] = ()
    # data-dependent sizes this call defines: (dim of the result, symbol u<k>, upper bound)
    binds: tuple[tuple[int, str, sympy.Expr], ...] = ()
    # the op's other results the program uses, written by this same call (one call per op)
    also: tuple[AtenResult, ...] = ()

    def results(self) -> tuple[AtenResult, ...]:
        """Every result this call writes: its own first, then `also`."""
        return (AtenResult(self.result, self.name, self.dtype, self.shape, self.binds),
                *self.also)

    def all_binds(self) -> tuple[tuple[int, str, sympy.Expr], ...]:
        return tuple(b for r in self.results() for b in r.binds)


@dataclass(frozen=True)
class AtenResult:
    """Result `result` of an `AtenCall`, copied into buffer `name` (contiguous `shape`);
    `binds` as `AtenCall.binds`, dims of this result."""

    result: int
    name: str
    dtype: DType
    shape: tuple[sympy.Expr, ...]
    binds: tuple[tuple[int, str, sympy.Expr], ...] = ()


@dataclass(frozen=True)
class ReadSize:
    """`symbol` = the value of the 0-d tensor `src` (`x.item()` used as a size), checked to lie
    in [lo, hi]; `name` is an int64 scalar buffer holding it."""

    name: str
    dtype: DType
    src: str
    symbol: str
    lo: int
    hi: sympy.Expr
    source: tuple[str, ...] = ()

    @property
    def shape(self) -> tuple[sympy.Expr, ...]:
        return ()

    @property
    def binds(self) -> tuple[tuple[int, str, sympy.Expr], ...]:
        return ((0, self.symbol, self.hi),)


@dataclass(frozen=True)
class LibArg:
    """A strided tensor operand of a library call: element (j0, ..., j{k-1}) of the operand
    sits at offset + sum(j_d * strides[d]) in buffer `buf` (a transposed or sliced input is
    passed as it is, without a copy)."""

    buf: str
    offset: sympy.Expr
    shape: tuple[sympy.Expr, ...]
    strides: tuple[sympy.Expr, ...]


@dataclass(frozen=True)
class Extern:
    """outs... = routine(args..., attrs...): a call into a kiln runtime routine (C++ templates
    in kiln/runtime/model/kiln_lib.h; numpy twins in ir/interp.py). `outs` are contiguous
    buffers declared in the program (the node is named after the first); `attrs` are static
    ints, floats, bools or tuples of ints."""

    routine: str
    outs: tuple[str, ...]
    args: tuple[LibArg, ...]
    attrs: tuple[tuple[str, object], ...] = ()
    source: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.outs[0]

    def attr(self, key: str, default: object = None) -> object:
        return next((v for k, v in self.attrs if k == key), default)


# -- user Triton kernel arguments ----------------------------------------------------------
# One frozen class per kind of kernel parameter value (`UserArg`). In Graph IR (the
# `UserKernelSpec` of a user_kernel node) a tensor is a `UserOperand` (the node's k-th input);
# lowering turns it into a `UserBuf` (a whole contiguous buffer).


@dataclass(frozen=True)
class UserOperand:
    """Graph IR only: the `index`-th operand of the user_kernel node."""

    index: int


@dataclass(frozen=True)
class UserBuf:
    """A tensor: the pointer to buffer `buf`."""

    buf: str


@dataclass(frozen=True)
class UserInt:
    value: sympy.Expr  # a constant or an expression over size symbols


@dataclass(frozen=True)
class UserFloat:
    value: float


@dataclass(frozen=True)
class UserBool:
    value: bool


@dataclass(frozen=True)
class UserNone:
    """None (a constant of the compiled kernel)."""


@dataclass(frozen=True)
class UserConstexpr:
    """A constexpr parameter given `value` by the caller."""

    value: object


@dataclass(frozen=True)
class UserConfigured:
    """A constexpr the chosen launch config sets."""


UserArg = Union[UserOperand, UserBuf, UserInt, UserFloat, UserBool, UserNone, UserConstexpr,
                UserConfigured]


@dataclass(frozen=True)
class UserKernel:
    """A user-written Triton kernel (frontend/user_triton.py), launched as written: `args` are
    the kernel's parameters in order, each (param, `UserArg`; tensors are `UserBuf`s). Every
    buffer the kernel writes is one of `outs`, a fresh contiguous buffer; `inits[k]` is the
    buffer copied into `outs[k]` before the launch (None: uninitialised, the input was
    `empty`). `spec` keeps the kernel, its configs and grids."""

    name: str
    kernel: str  # the Triton function's name
    args: tuple[tuple[str, UserArg], ...]
    outs: tuple[str, ...]
    inits: tuple[str | None, ...]
    spec: object  # frontend.user_triton.UserKernelSpec
    source: tuple[str, ...] = ()

    @property
    def operands(self) -> tuple[str, ...]:
        return tuple(v.buf for _, v in self.args if isinstance(v, UserBuf))


LoopNode = Union[Compute, Gemm, AtenCall, ReadSize, Extern, UserKernel]
CALLS = (Gemm, AtenCall, ReadSize, Extern, UserKernel)  # steps of their own: never fused


@dataclass(frozen=True)
class Buffer:
    name: str
    dtype: DType
    shape: tuple[sympy.Expr, ...]
    kind: str  # input, weight, state (a weight the program updates), temp, output

    @property
    def strides(self) -> tuple[sympy.Expr, ...]:
        return contiguous_strides(self.shape)

    @property
    def numel(self) -> sympy.Expr:
        out = sympy.Integer(1)
        for d in self.shape:
            out = out * d
        return out


@dataclass(frozen=True)
class LoopProgram:
    buffers: tuple[Buffer, ...]
    nodes: tuple[LoopNode, ...]
    outputs: tuple[str, ...]  # buffer per flat user output (kind "output")
    inputs: tuple[str, ...]  # buffer per flat user input
    output_shapes: tuple[tuple[sympy.Expr, ...], ...] = ()  # logical shape of each output
    mutations: tuple[tuple[str, str], ...] = ()  # (state buffer, buffer with its new value)

    def buffer(self, name: str) -> Buffer:
        for b in self.buffers:
            if b.name == name:
                return b
        raise KeyError(name)


def loads(e: Expr) -> list[Load]:
    """Every Load in `e` (including those inside indirect index values), in order."""
    out: list[Load] = []
    stack = [e]
    while stack:
        x = stack.pop()
        if isinstance(x, Load):
            out.append(x)
            stack.extend(ind.value for ind in x.indirect)
        elif isinstance(x, Op):
            stack.extend(x.args)
    return out


def node_reads(node: LoopNode) -> set[str]:
    if isinstance(node, CONTROL):
        return set(node.reads)
    if isinstance(node, Gemm):
        return {node.a.buf, node.b.buf, *node.extra_reads()}
    if isinstance(node, AtenCall):
        return {b for a in node.args for b in aten_arg_buffers(a)}
    if isinstance(node, ReadSize):
        return {node.src}
    if isinstance(node, Extern):
        return {a.buf for a in node.args}
    if isinstance(node, UserKernel):
        return ({b for b in node.operands if b not in node.outs} |
                {b for b in node.inits if b is not None})
    return {ld.buf for ld in loads(node.body)}


def node_writes(node: LoopNode) -> tuple[str, ...]:
    """The buffers `node` writes (one, except for an `Extern` with several outputs, an
    `AtenCall` with several results used, and a control node, which writes its results)."""
    if isinstance(node, CONTROL):
        return tuple(node.writes)
    if isinstance(node, AtenCall):
        return tuple(r.name for r in node.results())
    return node.outs if isinstance(node, (Extern, UserKernel)) else (node.name,)


# -- control flow ---------------------------------------------------------------------------
# A control node runs sub-programs (`Region`s) on the host's decision. A region's Loop IR names
# the parent buffers it reads as kind "input" and those it writes as kind "output"; its own
# temps carry a prefix naming the control node, so every buffer and kernel name is unique in
# the whole program. Fusion never crosses a region boundary: a control node is a step of its
# own and each region is scheduled separately (`Region.steps`).


@dataclass(frozen=True)
class Region:
    prog: LoopProgram
    steps: tuple = ()  # its kernels / GEMMs / control nodes once scheduled


@dataclass(frozen=True)
class Branch:
    """torch.cond: run `then` when the predicate holds, else `orelse`. Both write `results`
    (parent buffers). The predicate is the 0-d buffer `pred` (read on the host) or, when
    `pred` is None, `expr`, a sympy condition over size symbols."""

    name: str
    pred: str | None
    expr: object
    then: Region
    orelse: Region
    operands: tuple[str, ...]
    results: tuple[str, ...]
    source: tuple[str, ...] = ()

    @property
    def reads(self) -> tuple[str, ...]:
        return ((self.pred,) if self.pred is not None else ()) + self.operands

    @property
    def writes(self) -> tuple[str, ...]:
        return self.results

    @property
    def regions(self) -> tuple[Region, ...]:
        return (self.then, self.orelse)


@dataclass(frozen=True)
class Loop:
    """while_loop: `carries` (parent buffers, the results) start as copies of `inits`; while
    `cond` (reading carries and `extra`) writes a true `pred`, `body` writes the next carried
    values into `nexts`, which are then copied into `carries` (double buffering: the body
    reads iteration i's carries while writing iteration i+1's). `pred` and `nexts` are
    loop-local buffers (`locals`), allocated and freed inside each iteration."""

    name: str
    inits: tuple[str, ...]
    extra: tuple[str, ...]
    carries: tuple[str, ...]
    pred: str
    nexts: tuple[str, ...]
    cond: Region
    body: Region
    locals: tuple[Buffer, ...]
    source: tuple[str, ...] = ()

    @property
    def reads(self) -> tuple[str, ...]:
        return self.inits + self.extra

    @property
    def writes(self) -> tuple[str, ...]:
        return self.carries

    @property
    def regions(self) -> tuple[Region, ...]:
        return (self.cond, self.body)


CONTROL = (Branch, Loop)


def all_buffers(prog: LoopProgram) -> dict[str, Buffer]:
    """Every buffer of `prog` and of its regions, by name (a region's view of a parent buffer
    is the parent's declaration; loop-local buffers come from their Loop node)."""
    out = {b.name: b for b in prog.buffers}
    for node in prog.nodes:
        if isinstance(node, CONTROL):
            for r in node.regions:
                for name, b in all_buffers(r.prog).items():
                    out.setdefault(name, b)
            if isinstance(node, Loop):
                out.update({b.name: b for b in node.locals})
    return out


def flat_steps(steps) -> list:
    """Kernels and GEMMs of `steps` and of every region inside them, in program order."""
    out = []
    for s in steps:
        if isinstance(s, CONTROL):
            for r in s.regions:
                out += flat_steps(r.steps)
        else:
            out.append(s)
    return out
