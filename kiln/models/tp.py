"""Tensor parallelism for Llama-shaped decoders: shard a model over `world_size` ranks and
build one kiln package per rank whose collectives run on NCCL (CUDA) or MPI (CPU).

`Llama` is a small Llama-shaped decoder (RMSNorm, rotary positions, grouped-query attention,
SwiGLU MLP) whose parameter names are transformers' `LlamaForCausalLM`'s
(`model.layers.N.self_attn.q_proj.weight`, ...), so `Llama.from_hf(hf_model)` takes such a
model's weights as they are.

`shard(model, world_size, rank)` is rank `rank`'s module (Megatron-style):
  column-parallel  q_proj, k_proj, v_proj (whole heads: n_heads / world_size query heads and
                   n_kv_heads / world_size key/value heads a rank), gate_proj, up_proj (rows of
                   the weight: the output features);
  row-parallel     o_proj, down_proj (columns: the input features), each followed by an
                   all_reduce (sum) through torch's functional collectives;
  lm_head          column-parallel over the vocabulary, its logits gathered with
                   all_gather_tensor (`shard_lm_head`), else replicated;
  embed_tokens and the norms are replicated.
The rank's program does not depend on its rank (only its weights do), so `export_tp` exports
and compiles rank 0's program once and writes one package per rank holding that rank's
weights (`rank{r}.kiln`). Run them with `kiln.load(path, device, rank=r, world_size=n,
comm_id=...)` in one process per rank."""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from kiln.api import compile as kiln_compile
from kiln.errors import InputError
from kiln.options import Options
from kiln.package.format import write_package
from kiln.runtime.weights import checked_tensors


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(v + self.eps)).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, heads: int, kv_heads: int, group) -> None:
        super().__init__()
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.heads, self.kv_heads, self.group = heads, kv_heads, group
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, d, bias=False)

    def forward(self, x, cos, sin):
        # rotary and the key/value head repeat in the [b, t, heads, head_dim] layout of the
        # projections, transposed to [b, heads, t, head_dim] only for the attention: every
        # elementwise op and every reshape sees one layout whose merged dims have static
        # strides (repeat_interleave on the transposed [b, kv, t, d] merges dims of strides
        # 2*t*d and t*d, a min(...) guard on seq that torch 2.11's export cannot prove)
        b, t, _ = x.shape
        hd = self.head_dim
        q = self.q_proj(x).view(b, t, self.heads, hd)
        k = self.k_proj(x).view(b, t, self.kv_heads, hd)
        v = self.v_proj(x).view(b, t, self.kv_heads, hd)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        if rep > 1:  # query head h reads key/value head h // rep (repeat_interleave)
            k = k[:, :, :, None].expand(b, t, self.kv_heads, rep, hd).reshape(b, t, self.heads, hd)
            v = v[:, :, :, None].expand(b, t, self.kv_heads, rep, hd).reshape(b, t, self.heads, hd)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = self.o_proj(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))
        return y if self.group is None else fc.all_reduce(y, "sum", self.group)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, inter: int, group) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False)
        self.group = group

    def forward(self, x):
        y = self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
        return y if self.group is None else fc.all_reduce(y, "sum", self.group)


class Layer(nn.Module):
    def __init__(self, cfg: LlamaConfig, world_size: int, group) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, cfg.num_attention_heads // world_size,
                                   cfg.num_key_value_heads // world_size, group)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, cfg.intermediate_size // world_size, group)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: LlamaConfig, world_size: int, group) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg, world_size, group)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Llama(nn.Module):
    """tokens [batch, seq] (int64) -> logits [batch, seq, vocab] (float). `world_size` > 1
    builds one rank's shard (see `shard`); `group` is the process group of its collectives."""

    def __init__(self, cfg: LlamaConfig, world_size: int = 1, group=None,
                 shard_lm_head: bool = True) -> None:
        super().__init__()
        self.cfg, self.world_size = cfg, world_size
        self.group = group if world_size > 1 else None
        self.gather_logits = shard_lm_head and world_size > 1
        self.model = Decoder(cfg, world_size, self.group)
        vocab = cfg.vocab_size // world_size if self.gather_logits else cfg.vocab_size
        self.lm_head = nn.Linear(cfg.hidden_size, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        hd = cfg.hidden_size // cfg.num_attention_heads
        t = tokens.shape[1]
        dev = tokens.device  # the tables on the tokens' device (eager on a GPU)
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=dev)
                                        / hd))
        ang = torch.arange(t, dtype=torch.float32, device=dev)[:, None] * inv[None, :]
        ang = torch.cat((ang, ang), dim=-1)[:, None, :]  # [t, 1, head_dim]: over the heads
        dt = self.lm_head.weight.dtype
        cos, sin = ang.cos().to(dt), ang.sin().to(dt)
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.model.norm(x))
        if self.gather_logits:  # [b, t, vocab / n] on each rank -> [b, t, vocab]
            b, t, v = logits.shape
            n = self.world_size
            g = fc.all_gather_tensor(logits.contiguous(), 0, self.group)  # [n * b, t, v]
            logits = g.view(n, b, t, v).permute(1, 2, 0, 3).reshape(b, t, n * v)
        return logits

    @classmethod
    def from_hf(cls, hf_model: nn.Module) -> Llama:
        """A transformers LlamaForCausalLM (no bias, default rope) as a `Llama`."""
        c = hf_model.config
        cfg = LlamaConfig(c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers,
                          c.num_attention_heads, c.num_key_value_heads, c.rms_norm_eps,
                          float(getattr(c, "rope_theta", None) or
                                (getattr(c, "rope_parameters", None) or {}).get("rope_theta",
                                                                                10000.0)))
        m = cls(cfg)
        state = {k: v for k, v in hf_model.state_dict().items() if "rotary_emb" not in k}
        m.load_state_dict(state, strict=True)
        return m.to(next(hf_model.parameters()).dtype)


def random_llama(cfg: LlamaConfig, seed: int = 0, dtype=torch.float32) -> Llama:
    g = torch.Generator().manual_seed(seed)
    m = Llama(cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return m.to(dtype).eval()


_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")


def _check(cfg: LlamaConfig, world_size: int, shard_lm_head: bool) -> None:
    need = {"num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads,
            "intermediate_size": cfg.intermediate_size}
    if shard_lm_head:
        need["vocab_size"] = cfg.vocab_size
    bad = [f"{k}={v}" for k, v in need.items() if v % world_size]
    if world_size < 1 or bad:
        raise InputError(f"tensor parallelism over {world_size} ranks: "
                         f"{', '.join(bad) or 'world_size must be >= 1'} not divisible by it")


def shard_state(model: Llama, world_size: int, rank: int,
                shard_lm_head: bool = True) -> dict[str, torch.Tensor]:
    """Rank `rank`'s weights (by the FQNs of `Llama`) of the full `model`."""
    _check(model.cfg, world_size, shard_lm_head)
    out = {}
    for name, w in model.state_dict().items():
        kind = name.split(".")[-2]
        if kind in _COLUMN or (kind == "lm_head" and shard_lm_head):
            w = w.chunk(world_size, dim=0)[rank]
        elif kind in _ROW:
            w = w.chunk(world_size, dim=1)[rank]
        out[name] = w.contiguous()
    return out


def shard(model: Llama, world_size: int, rank: int, group=None,
          shard_lm_head: bool = True) -> Llama:
    """Rank `rank`'s module: the sharded linears, all_reduce after o_proj and down_proj on
    `group` (default: the default process group), the logits gathered over the vocabulary."""
    group = group if group is not None else (dist.group.WORLD if world_size > 1 else None)
    m = Llama(model.cfg, world_size, group, shard_lm_head)
    m.load_state_dict(shard_state(model, world_size, rank, shard_lm_head))
    return m.to(model.lm_head.weight.dtype).eval()


def export_llama(model: nn.Module, example_tokens: torch.Tensor,
                 dynamic_seq: tuple[int, int] | None = None) -> torch.export.ExportedProgram:
    """torch.export of `model` (a `Llama` or a rank's shard) on `example_tokens`, the sequence
    length dynamic over `dynamic_seq` = (min, max) when given. Should this torch's export find a
    shape guard on seq it cannot prove (a named Dim's constraint violation), it exports again
    with Dim.DYNAMIC over the same range (which assumes seq != 1: its range starts at 2) and
    warns; an export whose range does not cover (max(min, 2), max) raises the first error."""
    if dynamic_seq is None:
        return torch.export.export(model, (example_tokens,))
    lo, hi = dynamic_seq
    try:
        return torch.export.export(model, (example_tokens,), dynamic_shapes=(
            {1: torch.export.Dim("seq", min=lo, max=hi)},))
    except Exception as e:  # torch._dynamo.exc.UserError; only constraint violations retry
        if "Constraints violated" not in str(e):
            raise
        first = e
    ep = torch.export.export(model, (example_tokens,), dynamic_shapes=(
        {1: torch.export.Dim.DYNAMIC(min=lo, max=hi)},))
    ranges = [(int(r.lower), int(r.upper)) for r in ep.range_constraints.values()]
    if not any(a <= max(lo, 2) and b >= hi for a, b in ranges):
        raise first
    warnings.warn(f"export_llama: seq as a named Dim failed on this torch "
                  f"({str(first).splitlines()[0]} ...); exported with Dim.DYNAMIC, range "
                  f"{ranges}", stacklevel=2)
    return ep


def export_tp(model: Llama, world_size: int, out_dir: str | os.PathLike[str],
              example_tokens: torch.Tensor, dynamic_seq: tuple[int, int] | None = None,
              device: str = "cpu", options: Options | None = None,
              shard_lm_head: bool = True) -> list[Path]:
    """Compile `model` sharded over `world_size` ranks: `out_dir/rank{r}.kiln` for each rank.
    Exports through a fake process group (torch.testing's FakeStore) of `world_size` ranks
    unless a default group of that size is initialised already. `dynamic_seq`: (min, max)
    sequence lengths the packages accept (default: the example's only)."""
    _check(model.cfg, world_size, shard_lm_head)
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        if dist.get_world_size() != world_size:
            raise InputError(f"export_tp: world_size {world_size}, but the default process group "
                             f"has {dist.get_world_size()} ranks")
        rank0 = shard(model, world_size, 0, shard_lm_head=shard_lm_head)
        ep = export_llama(rank0, example_tokens, dynamic_seq)
        # no folding: every weight keeps its FQN, so each rank's shard can replace rank 0's
        opts = replace(options or Options(), fold_constants=False)
        cm = kiln_compile(ep, device=device, options=opts)
    finally:
        if own:
            dist.destroy_process_group()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {f"src/{name}": text.encode() for name, text in cm.built.sources.items()}
    files["lib/model.so"] = Path(cm.built.library).read_bytes()
    paths = []
    for r in range(world_size):
        weights = checked_tensors(cm.manifest, shard_state(model, world_size, r, shard_lm_head))
        path = out / f"rank{r}.kiln"
        write_package(path, cm.manifest, files, weights)
        paths.append(path)
    return paths


__all__ = ["LlamaConfig", "Llama", "random_llama", "shard", "shard_state", "export_llama",
           "export_tp"]
