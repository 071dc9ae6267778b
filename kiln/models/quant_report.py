"""Accuracy of weight quantisation (Options.weight_quant; issue 17 item 4): a perplexity proxy,
the KL divergence of the next-token distributions of the quantised compiled model from the
unquantised compiled model's, over a fixed token stream.

`kl_report(model, tokens, seq, options)` compiles `model` (tokens [1, seq] -> logits
[1, seq, vocab]) once unquantised and once per quantised Options, runs both over the stream in
windows of `seq` tokens, and returns per mode: the mean and max over positions of
KL(P_ref || P_q) in nats (float64 log-softmax of each model's logits), the fraction of
positions whose argmax agrees, and the max |logit difference|. `small_llama()` is the
Llama-shaped decoder of kiln/models/tp.py at a size that compiles in seconds.

    PYTHONPATH=$PWD python -m kiln.models.quant_report [--seq 32] [--windows 4] [--group 128]
        [--device cuda]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch

from kiln.api import compile as kiln_compile
from kiln.models.tp import LlamaConfig, random_llama
from kiln.options import Options


def small_llama(seed: int = 0, dtype=torch.float32, **cfg) -> torch.nn.Module:
    base = dict(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=4)
    return random_llama(LlamaConfig(**{**base, **cfg}), seed=seed, dtype=dtype)


def token_stream(vocab: int, n: int, seed: int = 0) -> torch.Tensor:
    """A fixed stream of `n` token ids (int64)."""
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _logits(runner, tokens: torch.Tensor, seq: int, device: str = "cpu") -> torch.Tensor:
    out = []
    for w in range(tokens.numel() // seq):
        y = runner(tokens[w * seq:(w + 1) * seq][None].to(device))
        out.append((y[0] if isinstance(y, (tuple, list)) else y)[0].double().cpu())
    return torch.cat(out)  # [positions, vocab]


def kl_stats(ref: torch.Tensor, got: torch.Tensor) -> dict[str, float]:
    """KL(P_ref || P_got) per position (rows of logits), in nats, and agreement figures."""
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(got.double(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return {"kl_mean": kl.mean().item(), "kl_max": kl.max().item(),
            "top1_agree": (ref.argmax(-1) == got.argmax(-1)).double().mean().item(),
            "max_abs_logit_diff": (ref.double() - got.double()).abs().max().item(),
            "positions": int(ref.shape[0])}


def kl_report(model: torch.nn.Module, tokens: torch.Tensor, seq: int,
              modes: dict[str, Options], base: Options | None = None,
              device: str = "cpu") -> dict[str, dict]:
    """{mode name: kl_stats} of each quantised build against the unquantised `base` build,
    every build for and run on `device` ("cpu" or "cuda": the CUDA target's quantised
    kernels, targets/cuda/quant.py)."""
    base = base or Options()
    example = (tokens[:seq][None],)

    def run(opts: Options) -> torch.Tensor:
        cm = kiln_compile(model, example, options=opts, device=device)
        return _logits(cm.load(device=device), tokens, seq, device)

    ref = run(replace(base, weight_quant="none"))
    return {name: kl_stats(ref, run(opts)) for name, opts in modes.items()}


def default_modes(group: int = 128, base: Options | None = None,
                  device: str = "cpu") -> dict[str, Options]:
    """The quantised builds to report (on CUDA no VNNI kernel: int8 and int4)."""
    base = base or Options()
    modes = {"int8": replace(base, weight_quant="int8"),
             "int8_vnni": replace(base, weight_quant="int8", weight_quant_kernel="vnni"),
             f"int4_g{group}": replace(base, weight_quant="int4", weight_quant_group=group),
             f"int4_g{group}_vnni": replace(base, weight_quant="int4", weight_quant_group=group,
                                            weight_quant_kernel="vnni")}
    if device != "cpu":
        del modes["int8_vnni"], modes[f"int4_g{group}_vnni"]
    return modes


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    a = ap.parse_args(argv)
    model = small_llama()
    tokens = token_stream(model.cfg.vocab_size, a.seq * a.windows)
    print(json.dumps(kl_report(model, tokens, a.seq,
                               default_modes(a.group, device=a.device), device=a.device),
                     indent=1))


if __name__ == "__main__":
    main()
