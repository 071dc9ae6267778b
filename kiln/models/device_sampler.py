"""Token sampling on the GPU, as a program of its own: the `sample` entry point of a CUDA
decoder package (kiln/models/hf_decoder.py), so the generation loop (kiln.runtime.generate,
examples/c/generate.c) never copies logits to the host.

`sample(logits [1, T, V], cache_position [T], fparams [2], iparams [2]) -> (ids [1, 1],
next_position [1])` reads the last row of the logits and writes the next token where the
`decode` entry point reads it (ids: int64 [1, 1]) and the position after the last one
(cache_position[T - 1] + 1): the output of one call is the input of the next decode, with no
host round trip. The parameters are device tensors: fparams = [temperature, top_p] (float32),
iparams = [top_k, seed] (int64).

Semantics (kiln_sample's, kiln/runtime/src/sample.cpp, up to ties and the generator):
temperature <= 0 is greedy, the first index of the largest logit (the same token as the host
sampler). Otherwise p_i = softmax(logits / temperature); top_k > 0 keeps the tokens whose logit
is at least the k-th largest (ties at the k-th value are all kept), 0 < top_p < 1 then keeps the
most likely of those whose mass reaches top_p (again by a threshold on the logit), and one kept
token is drawn by the Gumbel-max trick: argmax of logit / temperature + Gumbel noise, the noise
of token i a function of (seed, cache_position[T - 1], i) (Triton's Philox), so a seed gives the
same tokens on every run and the draw needs no sort. The thresholds are found by bisection on
the logits' 32-bit order keys (exact; a pass over the row per step, at most 32 steps each,
fewer when the keys' range is narrow or exactly k tokens are found: top-k / top-p cost tens
of passes, an estimate of tens of microseconds at a 32k vocabulary, not measured yet; greedy
takes one pass, plain temperature sampling two).

One Triton program per call (grid (1,)): a row of a vocabulary is small (64 KiB at 32k bf16),
the work is a handful of passes over it from L2. Exported as a user Triton kernel
(torch.library.triton_op), which kiln compiles ahead of time into the package like any other
user kernel. Needs Triton (kiln[cuda])."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.export import Dim
from torch.library import triton_op, wrap_triton


@triton.jit
def sample_kernel(logits_ptr, pos_ptr, fparams_ptr, iparams_ptr, ids_ptr, next_pos_ptr, T,
                  V: tl.constexpr,
                  BLOCK: tl.constexpr):
    row = logits_ptr + (T - 1) * V
    temperature = tl.load(fparams_ptr)
    top_p = tl.load(fparams_ptr + 1)
    top_k = tl.load(iparams_ptr)
    seed = tl.load(iparams_ptr + 1)
    pos = tl.load(pos_ptr + T - 1)
    offs = tl.arange(0, BLOCK)
    # pass 1: the largest logit (first index of it) and the smallest
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK], 2147483647, tl.int32)
    low = tl.full([BLOCK], float("inf"), tl.float32)
    for start in tl.range(0, V, BLOCK):
        idx = start + offs
        ok = idx < V
        x = tl.load(row + idx, mask=ok, other=float("-inf")).to(tl.float32)
        take = x > best
        best = tl.where(take, x, best)
        best_i = tl.where(take, idx, best_i)
        low = tl.minimum(low, tl.where(ok, x, float("inf")))
    m = tl.max(best, 0)
    token = tl.min(tl.where(best == m, best_i, 2147483647), 0)
    if temperature > 0.0:
        inv_t = 1.0 / temperature
        # top-k: the largest key t with count(key >= t) >= k
        # order keys: float32 bits as int32, negatives' magnitude bits flipped (monotone)
        lb = tl.min(low, 0).to(tl.int32, bitcast=True)
        lo = tl.where(lb < 0, lb ^ 0x7FFFFFFF, lb).to(tl.int64)
        mb = m.to(tl.int32, bitcast=True)
        m_key = tl.where(mb < 0, mb ^ 0x7FFFFFFF, mb).to(tl.int64)
        hi = m_key
        if top_k > 0:
            if top_k < V:
                while lo < hi:  # at most 32 passes; exactly k tokens at or above mid: done
                    mid = (lo + hi + 1) >> 1
                    cnt = tl.zeros([BLOCK], tl.int32)
                    for start in tl.range(0, V, BLOCK):
                        idx = start + offs
                        x = tl.load(row + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
                        xb = x.to(tl.int32, bitcast=True)
                        kx = tl.where(xb < 0, xb ^ 0x7FFFFFFF, xb).to(tl.int64)
                        cnt += ((kx >= mid) & (idx < V)).to(tl.int32)
                    total_cnt = tl.sum(cnt, 0)
                    enough = total_cnt >= top_k
                    lo = tl.where(enough, mid, lo)
                    hi = tl.where(total_cnt == top_k, mid, tl.where(enough, hi, mid - 1))
        kth = lo
        # top-p: the largest key t >= kth whose tokens' mass reaches top_p of the kept mass
        if top_p < 1.0:
            if top_p > 0.0:
                total = tl.zeros([BLOCK], tl.float32)
                for start in tl.range(0, V, BLOCK):
                    idx = start + offs
                    x = tl.load(row + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
                    xb = x.to(tl.int32, bitcast=True)
                    kx = tl.where(xb < 0, xb ^ 0x7FFFFFFF, xb).to(tl.int64)
                    keep = (kx >= kth) & (idx < V)
                    total += tl.where(keep, tl.exp((x - m) * inv_t), 0.0)
                target = tl.sum(total, 0) * top_p
                hi = m_key
                while lo < hi:
                    mid = (lo + hi + 1) >> 1
                    mass = tl.zeros([BLOCK], tl.float32)
                    for start in tl.range(0, V, BLOCK):
                        idx = start + offs
                        x = tl.load(row + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
                        xb = x.to(tl.int32, bitcast=True)
                        kx = tl.where(xb < 0, xb ^ 0x7FFFFFFF, xb).to(tl.int64)
                        keep = (kx >= mid) & (idx < V)
                        mass += tl.where(keep, tl.exp((x - m) * inv_t), 0.0)
                    enough = tl.sum(mass, 0) >= target
                    lo = tl.where(enough, mid, lo)
                    hi = tl.where(enough, hi, mid - 1)
        # Gumbel-max over the kept tokens; the noise's counter: (seed, position), token index
        key = seed ^ ((pos + 1) * 0x27D4EB2F165667C5)
        score = tl.full([BLOCK], float("-inf"), tl.float32)
        score_i = tl.full([BLOCK], 2147483647, tl.int32)
        for start in tl.range(0, V, BLOCK):
            idx = start + offs
            x = tl.load(row + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
            xb = x.to(tl.int32, bitcast=True)
            kx = tl.where(xb < 0, xb ^ 0x7FFFFFFF, xb).to(tl.int64)
            keep = (kx >= lo) & (idx < V)
            u = tl.rand(key, idx)
            g = -tl.log(-tl.log(tl.maximum(u, 1e-20)))
            s = tl.where(keep, (x - m) * inv_t + g, float("-inf"))
            take = s > score
            score = tl.where(take, s, score)
            score_i = tl.where(take, idx, score_i)
        top = tl.max(score, 0)
        token = tl.min(tl.where(score == top, score_i, 2147483647), 0)
    tl.store(ids_ptr, token.to(tl.int64))
    tl.store(next_pos_ptr, pos + 1)


def block_for(vocab: int) -> int:
    """The kernel's BLOCK for a vocabulary: a power of two, 128 .. 4096."""
    return max(128, min(4096, triton.next_power_of_2(vocab)))


@triton_op("kiln_sampler::sample_next", mutates_args={})
def sample_next(logits: torch.Tensor, cache_position: torch.Tensor, fparams: torch.Tensor,
                iparams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.empty((1, 1), dtype=torch.int64, device=logits.device)
    nxt = torch.empty((1,), dtype=torch.int64, device=logits.device)
    rows, vocab = logits.shape[-2], logits.shape[-1]
    wrap_triton(sample_kernel)[(1,)](logits, cache_position, fparams, iparams, ids, nxt, rows,
                                     vocab, BLOCK=block_for(int(vocab)), num_warps=8)
    return ids, nxt


class Sampler(torch.nn.Module):
    """The `sample` program: (logits [1, T, V], cache_position [T], fparams, iparams) ->
    (ids [1, 1], next_position [1])."""

    def forward(self, logits, cache_position, fparams, iparams):
        return sample_next(logits, cache_position, fparams, iparams)


def export_sampler(vocab: int, dtype: torch.dtype = torch.float32, max_rows: int = 4096
                   ) -> torch.export.ExportedProgram:
    """The `sample` program for logits [1, T, vocab] of `dtype`, T in 1 .. max_rows (the
    prompt's length after prefill, 1 after decode). Exported on the CPU (the kernel does not
    run at export)."""
    rows = Dim("rows", min=1, max=max(2, max_rows))
    args = (torch.zeros(1, 2, vocab, dtype=dtype), torch.arange(2),
            torch.tensor([0.0, 1.0]), torch.tensor([0, 0]))
    return torch.export.export(Sampler(), args,
                               dynamic_shapes=({1: rows}, {0: rows}, None, None))


def params(temperature: float, top_k: int, top_p: float, seed: int, device
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(fparams, iparams) on `device` for the `sample` program (the seed as int64 bits)."""
    s = int(seed) & (2**64 - 1)
    s = s - 2**64 if s >= 2**63 else s
    return (torch.tensor([float(temperature), float(top_p)], dtype=torch.float32,
                         device=device),
            torch.tensor([int(top_k), s], dtype=torch.int64, device=device))
