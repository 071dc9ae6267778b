"""What the compile-time tuner of a CUDA build compiles and times, decided without a GPU: a
roofline estimate of each kernel's time at the example sizes, and the pruning rules built on it.

Input: schedule kernels, NHWC convolution calls (targets/cuda/conv_template.py), the Loop IR
buffers and the size hints. Output: predicted microseconds (`kernel_us`, `conv_us`), whether a
kernel or convolution is worth tuning at all (`tune_kernel`, `tune_conv`), and which of a
convolution's tile candidates are timed (`keep_conv`). Every rule is a pure function of sizes,
so the planner (launch_tune.py) can count what a build would compile on a machine without a GPU
(bench/compile_time.py --plan).

Why these rules keep run time: tuning a kernel can save at most the difference between its
heuristic config and the best one, a fraction of the kernel's time. A kernel predicted under
KERNEL_MIN_US (a few microseconds: latency, which the model's CUDA graph hides, dominates) gains
less than a microsecond, while its candidates cost seconds of compiles; such kernels keep the
heuristic (bytes / bandwidth, or the serial part when there are fewer programs than SMs, decides,
so a long reduction over few rows is still tuned). Convolution candidates are ranked by a tile
model (waves of output tiles over the SMs, each tile's K loop bound by operand traffic or tensor
math) and the best few are timed (`conv_keep`: none under CONV_LOW_US, 2 under CONV_MIN_US, else
CONV_KEEP), the heuristic always among them: the kept set can only
match or beat the heuristic, and it loses to the full search only where the model misranks the
winner out of the top few. `Options.max_autotune` skips every pruning rule here (the full search,
as before).

Figures are an H100 SXM's (132 SMs, ~3 TB/s HBM, ~990 dense bf16 TFLOP/s); an H200 differs by
its bandwidth only, which scales every estimate alike, so rankings and thresholds hold."""

from __future__ import annotations

from kiln.ir import loop as L
from kiln.ir.sym import evaluate, product
from kiln.targets.cuda.attention import choose_attention_config
from kiln.targets.cuda.attention_decode import is_decode
from kiln.targets.cuda.conv_template import _block_k, _m, _split, _taps, geometry
from kiln.targets.cuda.kernel import Config

SMS = 132
HBM_B_PER_US = 3.0e6  # bytes per microsecond, the whole GPU
SM_B_PER_US = 1.1e5  # one SM's own load bandwidth (~64 B/clk at 1.75 GHz)
L2_B_PER_US = 7.0e6  # L2 bandwidth shared by the SMs (tiles' operand reloads hit L2)
MAC_PER_US_SM = {2: 3.75e6, 1: 7.5e6, 4: 0.62e6}  # by operand itemsize; float32 is 3xTF32
LAUNCH_US = 2.0  # a kernel's fixed cost (launch, first wave's latency)
STEP_US = 0.06  # one pipelined K step's latency (loads in flight, the dot's issue)

#: kernels (and attention calls) predicted faster than this keep the heuristic config
KERNEL_MIN_US = 4.0
#: convolutions predicted faster than this keep the heuristic tile
CONV_LOW_US = 2.5
#: convolutions predicted at least this fast but faster than CONV_MIN_US time CONV_KEEP_LOW
#: candidates (the heuristic and the tile model's best other), slower ones CONV_KEEP
CONV_MIN_US = 3.0
CONV_KEEP_LOW = 2
CONV_KEEP = 4


def _n(e, hints) -> int:
    return max(1, int(evaluate(e, hints)))


def roofline_us(nbytes: float, programs: int, bytes_per_program: float) -> float:
    """Predicted microseconds of a memory-bound kernel: the whole GPU's bandwidth over all its
    bytes, or, when its programs cannot fill the SMs for long, the waves of one program's bytes
    at one SM's bandwidth (a long reduction over few rows runs serially), plus LAUNCH_US."""
    waves = -(-max(1, programs) // SMS)
    return LAUNCH_US + max(nbytes / HBM_B_PER_US, waves * bytes_per_program / SM_B_PER_US)


def kernel_points(kernel, hints: dict[str, int]) -> int:
    """The elements a schedule kernel iterates over: its rows times its widest member (a
    reduction's reduced extent, else the member's inner extent)."""
    k = len(kernel.outer)
    width = 1
    for m in kernel.members:
        width = max(width, _n(product(m.reduce.sizes if m.reduce is not None else m.shape[k:]),
                              hints))
    return _n(product(kernel.outer), hints) * width


def kernel_bytes(kernel, buffers, hints: dict[str, int]) -> int:
    """Bytes a schedule kernel reads and writes at the example sizes: every buffer it loads
    once, but no more elements of it than the kernel has points (a gather reads the rows it
    indexes, not the whole table), every member it stores once (register-kept reductions are
    not stored)."""
    points = kernel_points(kernel, hints)
    read = {ld.buf for m in kernel.members for ld in L.loads(m.body) if ld.buf in buffers}
    wrote = {m.name for m in kernel.members if m.name not in kernel.locals and
             m.name in buffers}
    return sum(min(_n(buffers[b].numel, hints), points if b in read - wrote else 2**62) *
               buffers[b].dtype.itemsize for b in read | wrote)


def kernel_us(kernel, buffers, hints: dict[str, int], config: Config) -> float:
    """`roofline_us` of a schedule kernel launched with `config` (its programs: rows over
    XBLOCK)."""
    rows = _n(product(kernel.outer), hints)
    nbytes = kernel_bytes(kernel, buffers, hints)
    programs = -(-rows // max(1, config.xblock))
    return roofline_us(nbytes, programs, nbytes / programs)


def gemv_us(gk, hints: dict[str, int]) -> float:
    """`roofline_us` of a GEMV template kernel (M = 1): its weight bytes streamed once, over
    its programs (N / BLOCK_N)."""
    g, cfg = gk.gemm, gk.config
    n, k = _n(g.n, hints), _n(g.k, hints)
    nbytes = n * k * g.dtype.itemsize
    programs = -(-n // max(1, cfg.block_n))
    return roofline_us(nbytes, programs, nbytes / programs)


def tune_kernel(predicted_us: float) -> bool:
    """Whether a kernel's launch configs are worth compiling and timing."""
    return predicted_us >= KERNEL_MIN_US


def dense_conv_us(m: int, n: int, k: int, groups: int, split: int, bm: int, bn: int, bk: int,
                  itemsize: int) -> float:
    """Predicted microseconds of an implicit-GEMM convolution (M output pixels, N output
    channels and K reduction per group) with BLOCK_M x BLOCK_N tiles and BLOCK_K steps: the
    tiles run in waves over the SMs; a tile's K loop takes, per step, the longer of its tensor
    math and its operand loads ((BLOCK_M + BLOCK_N) x BLOCK_K elements, at one SM's
    bandwidth or its share of L2's when every SM loads), plus a step's latency; split-K
    divides the steps among more programs."""
    tiles = -(-m // bm) * -(-n // bn) * groups * split
    waves = -(-tiles // SMS)
    active = min(tiles, SMS)
    steps = -(-(-(-k // bk)) // split)
    bw = min(SM_B_PER_US, L2_B_PER_US / active)
    step = max(bm * bn * bk / MAC_PER_US_SM.get(itemsize, MAC_PER_US_SM[4]),
               (bm + bn) * bk * itemsize / bw) + STEP_US
    store = bm * bn * itemsize / bw
    return LAUNCH_US + waves * (steps * step + store)


def depthwise_conv_us(m: int, c: int, taps: int, bm: int, bn: int, itemsize: int) -> float:
    """Predicted microseconds of the direct depthwise kernel with BLOCK_M pixels x BLOCK_N
    channels a program: waves of programs, each loading its pixels' taps (KH x KW per output,
    mostly L1/L2 hits shared by neighbours) and storing its outputs at one SM's bandwidth or
    its share of L2's."""
    tiles = -(-m // bm) * -(-c // bn)
    waves = -(-tiles // SMS)
    bw = min(SM_B_PER_US, L2_B_PER_US / min(tiles, SMS))
    per = (bm * bn * (taps + 1) * itemsize) / bw + STEP_US * taps
    return LAUNCH_US + waves * per


def conv_us(call, buffers, hints: dict[str, int], config: Config) -> float:
    """The tile model's microseconds of convolution `call` launched with `config`."""
    a = dict(call.attrs)
    gm = geometry(call)
    m = _m(call, buffers, hints)
    size = buffers[call.args[0].buf].dtype.itemsize
    if a["depthwise"]:
        return depthwise_conv_us(m, gm["c"], gm["kh"] * gm["kw"], config.xblock,
                                 config.rblock, size)
    bk = _block_k((config.xblock, config.rblock, 64), call, buffers)
    k = gm["cg"] * gm["kh"] * gm["kw"]
    if _taps(gm):  # one K step per tap and BLOCK_K channels
        k = gm["kh"] * gm["kw"] * -(-gm["cg"] // bk) * bk
    return dense_conv_us(m, gm["ocg"], k, gm["g"], _split(call), config.xblock, config.rblock,
                         bk, size)


def conv_keep(predicted_us: float) -> int:
    """How many tile candidates a convolution predicted at `predicted_us` (with the heuristic
    tile) times: none below CONV_LOW_US (a microsecond-scale kernel, mostly launch latency),
    CONV_KEEP_LOW up to CONV_MIN_US, CONV_KEEP above."""
    if predicted_us < CONV_LOW_US:
        return 0
    return CONV_KEEP_LOW if predicted_us < CONV_MIN_US else CONV_KEEP


def tune_conv(predicted_us: float) -> bool:
    """Whether a convolution's tiles are worth compiling and timing."""
    return conv_keep(predicted_us) > 0


def keep_best(candidates: list, predicted: list[float], keep: int) -> list:
    """The first candidate (the heuristic's) and the `keep - 1` others of least predicted
    time (ties: the earlier), in their original order."""
    if len(candidates) <= keep:
        return list(candidates)
    rest = sorted(range(1, len(candidates)), key=lambda i: (predicted[i], i))[:keep - 1]
    return [candidates[0]] + [candidates[i] for i in sorted(rest)]


def keep_conv(call, buffers, hints: dict[str, int], candidates: list[Config],
              keep: int | None = None) -> list[Config]:
    """The convolution candidates worth timing: `keep_best` over the tile model, `keep` of
    them (default `conv_keep` of the heuristic's predicted time; the heuristic is first)."""
    us = [conv_us(call, buffers, hints, c) for c in candidates]
    return keep_best(candidates, us, conv_keep(us[0]) if keep is None else keep)


def attention_us(batch_heads: int, lq: int, s: int, e: int, ev: int, itemsize: int,
                 causal: bool, group: int = 1, splits: int | None = None) -> float:
    """Predicted microseconds of a flash-attention call: the longer of its two products on
    the tensor cores (half the score matrix when causal) and its q, k, v and output bytes,
    plus LAUNCH_US. The decode path (`splits` given: targets/cuda/attention_decode.py) reads each kv
    head's keys and values once for its `group` query heads, in batch_heads / group x splits
    programs: `roofline_us` of those bytes (a program's share at one SM's bandwidth when they
    are few), plus its serial key steps' latency, plus half a launch for the combine kernel
    when split."""
    if splits is None:
        macs = batch_heads * lq * s * (e + ev) * (0.5 if causal else 1.0)
        nbytes = batch_heads * (lq * (e + ev) + s * (e + ev)) * itemsize
        return LAUNCH_US + max(macs / (MAC_PER_US_SM.get(itemsize, MAC_PER_US_SM[4]) * SMS),
                               nbytes / HBM_B_PER_US)
    kv = max(1, batch_heads // max(1, group))
    span = -(-s // splits)
    nbytes = kv * s * (e + ev) * itemsize + batch_heads * lq * (e + ev) * itemsize
    if splits > 1:  # the partial states, written then read by the combine
        nbytes += 2 * batch_heads * lq * splits * (ev + 2) * 4
    us = roofline_us(nbytes, kv * splits, span * (e + ev) * itemsize)
    return us + -(-span // 64) * STEP_US + (LAUNCH_US / 2 if splits > 1 else 0.0)


def attention_call_us(call, buffers, hints: dict[str, int], config: Config | None = None
                      ) -> float:
    """`attention_us` of an attention call at the example sizes (the decode path with
    `config`'s key splits, the heuristic's when none is given)."""
    q, k, v = call.args[:3]
    bh = _n(q.shape[0] * q.shape[1], hints)
    splits = None
    if is_decode(call):
        splits = (config or choose_attention_config(call, buffers, hints)).xblock
    return attention_us(bh, _n(q.shape[2], hints), _n(k.shape[2], hints), int(q.shape[3]),
                        int(v.shape[3]), buffers[q.buf].dtype.itemsize,
                        bool(call.attr("causal")), int(call.attr("group", 1)), splits)
