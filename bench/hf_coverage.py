"""Coverage of real Hugging Face architectures (issue 16): each model is built from its config,
shrunk to a few layers of small width (random weights, no download), exported with
torch.export, compiled by kiln and compared with eager on fresh inputs.

    python bench/hf_coverage.py [--models llama,bert,...] [--device cpu|cuda] [--dynamic]
                                [--jobs 2] [--timeout 600] [--json FILE] [--markdown FILE]

One subprocess per model (a crash or hang is that model's row). Each row says where the model
stopped: `export` (torch.export refused it: not kiln's failure, listed apart), `compile`
(kiln refused or failed), `run` (the package failed at run time), `mismatch` (outputs differ
from eager beyond tolerance: max |kiln - eager| > 1e-3 * max|eager| + 1e-4, fp32), or `ok`.
`--dynamic` exports the batch and sequence (or image size) dimensions as automatic dynamic
dims and runs the package at a second size as well.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

BEGIN, END = "<!-- hf-coverage:begin -->", "<!-- hf-coverage:end -->"

# model_type -> input kind; "text": input_ids, "s2s": input_ids + decoder_input_ids,
# "image": pixel_values, "audio": input_values (raw waveform), "mel": input_features + ids
ARCHS: dict[str, str] = {
    # decoders
    "llama": "text", "mistral": "text", "mixtral": "text", "qwen2": "text", "qwen2_moe": "text",
    "qwen3": "text", "gemma": "text", "gemma2": "text", "phi": "text", "phi3": "text",
    "gpt2": "text", "gpt_neox": "text", "gptj": "text", "opt": "text", "bloom": "text",
    "falcon": "text", "starcoder2": "text", "stablelm": "text", "olmo": "text",
    "cohere": "text", "granite": "text", "codegen": "text",
    # encoders
    "bert": "text", "roberta": "text", "distilbert": "text", "albert": "text",
    "electra": "text", "deberta-v2": "text", "xlm-roberta": "text", "mpnet": "text",
    "modernbert": "text",
    # encoder-decoders
    "t5": "s2s", "bart": "s2s", "mbart": "s2s", "pegasus": "s2s", "marian": "s2s",
    # vision
    "vit": "image", "deit": "image", "swin": "image", "convnext": "image", "resnet": "image",
    "mobilenet_v2": "image", "efficientnet": "image", "regnet": "image", "beit": "image",
    "dinov2": "image", "segformer": "image",
    # audio
    "whisper": "mel", "wav2vec2": "audio", "hubert": "audio",
}

# size attributes set where the config has them (a few layers of small width)
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "d_model": 64, "encoder_layers": 2,
        "decoder_layers": 2, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
        "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "n_embd": 64, "n_layer": 2,
        "n_head": 4, "d_ff": 128, "num_layers": 2, "num_heads": 4, "d_kv": 16,
        "num_decoder_layers": 2, "vocab_size": 512, "max_position_embeddings": 128,
        "image_size": 64, "num_local_experts": 4, "num_experts": 4, "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64, "head_dim": 16, "rotary_dim": 8,
        "embedding_size": 64, "num_mel_bins": 16, "max_source_positions": 32,
        "max_target_positions": 32, "ffn_dim": 128, "hidden_dim": 128, "dim": 64,
        "n_heads": 4, "n_layers": 2, "conv_dim": (32, 32), "conv_kernel": (4, 4),
        "conv_stride": (2, 2), "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 4,
        "global_attn_every_n_layers": 1}


def _config(model_type: str, tiny: bool = True):
    from transformers import CONFIG_MAPPING

    cfg = CONFIG_MAPPING[model_type]()
    for k, v in TINY.items() if tiny else ():
        current = getattr(cfg, k, None)
        if isinstance(current, int) and not isinstance(current, bool) or \
                isinstance(v, tuple) and current is not None:
            try:
                setattr(cfg, k, list(v) if isinstance(v, tuple) else v)
            except AttributeError:  # a derived property (Falcon's head_dim)
                pass
    if getattr(cfg, "layer_types", None) is not None:  # per-layer kinds must match the depth
        n = getattr(cfg, "num_hidden_layers", 2)
        cfg.layer_types = list(cfg.layer_types)[:n] + [cfg.layer_types[-1]] * max(
            0, n - len(cfg.layer_types))
    if hasattr(cfg, "num_feat_extract_layers"):
        cfg.num_feat_extract_layers = len(cfg.conv_dim)
    for k in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        v = getattr(cfg, k, None)
        if isinstance(v, int) and hasattr(cfg, "vocab_size") and v >= cfg.vocab_size:
            setattr(cfg, k, 1)  # special tokens inside the shrunk vocabulary
    cfg.use_cache = False
    return cfg


def _inputs(kind: str, cfg, batch: int, length: int):
    import torch

    g = torch.Generator().manual_seed(batch * 1000 + length)
    vocab = getattr(cfg, "vocab_size", 512)
    ids = lambda: torch.randint(2, vocab, (batch, length), generator=g)  # noqa: E731
    if kind == "text":
        return {"input_ids": ids()}
    if kind == "s2s":
        return {"input_ids": ids(), "decoder_input_ids": ids()}
    if kind == "image":
        side = getattr(cfg, "image_size", 64)
        side = side if isinstance(side, int) else 64
        return {"pixel_values": torch.randn(batch, getattr(cfg, "num_channels", 3), side, side,
                                            generator=g)}
    if kind == "audio":
        return {"input_values": torch.randn(batch, 400 * length, generator=g)}
    if kind == "mel":
        return {"input_features": torch.randn(batch, cfg.num_mel_bins,
                                              2 * cfg.max_source_positions, generator=g),
                "decoder_input_ids": ids()}
    raise ValueError(kind)


def _first(x):
    while isinstance(x, (tuple, list)):
        x = x[0]
    return x


def _worker(model_type: str, device: str, dynamic: bool) -> dict:
    import torch
    from transformers import AutoModel

    import kiln

    class First(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, **kw):
            return _first(self.m(**kw, return_dict=False))

    kind = ARCHS[model_type]
    for tiny in (True, False):  # a shrunk config eager cannot run: the default config instead
        torch.manual_seed(0)
        cfg = _config(model_type, tiny)
        model = AutoModel.from_config(cfg).eval().to(device)
        model.requires_grad_(False)
        wrapped = First(model).eval()
        example = {k: v.to(device) for k, v in _inputs(kind, cfg, 2, 16).items()}
        try:
            with torch.no_grad():
                wrapped(**example)
            break
        except Exception:  # noqa: BLE001
            if not tiny:
                raise
    row: dict = {"kind": kind, "config": "shrunk" if tiny else "default",
                 "params": sum(p.numel() for p in model.parameters())}
    stage = "export"
    try:
        t0 = time.perf_counter()
        shapes = None
        if dynamic:
            auto = torch.export.Dim.AUTO
            shapes = {k: {0: auto, 1: auto} if kind != "image" else {0: auto} for k in example}
        # the model itself (export cannot name the dims of a wrapper's **kwargs), its outputs
        # a tuple (return_dict off)
        target = model if dynamic else wrapped
        if dynamic:
            model.config.return_dict = False
        ep = torch.export.export(target, (), example, dynamic_shapes=shapes)
        row["export_s"] = time.perf_counter() - t0
        stage = "compile"
        t0 = time.perf_counter()
        cm = kiln.compile(ep, device="cuda" if device.startswith("cuda") else "cpu")
        row["compile_s"] = time.perf_counter() - t0
        runner = cm.load(Path(tempfile.mkdtemp()) / f"{model_type}.kiln", device=device)
        sizes = [(2, 16)] + ([(3, 24)] if dynamic and kind != "image" else [])
        worst = 0.0
        with torch.no_grad():
            for batch, length in sizes:
                x = {k: v.to(device) for k, v in _inputs(kind, cfg, batch, length).items()}
                stage = "run"
                got = _first(runner(**x)).float()
                want = wrapped(**x).float()
                err = float((got - want).abs().max())
                worst = max(worst, err / (1e-3 * float(want.abs().max()) + 1e-4))
        row["err_ratio"] = worst
        row["status"] = "ok" if worst <= 1.0 else "mismatch"
    except Exception as e:  # noqa: BLE001 - the row records where and why
        row["status"] = stage
        first = (str(e).strip().splitlines() or [""])[0]
        row["error"] = f"{type(e).__name__}: {first}"[:300]
        traceback.print_exc()
    return row


def _run_one(model_type: str, a) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, __file__, "--one", model_type, "--out", f.name,
               "--device", a.device] + (["--dynamic"] if a.dynamic else [])
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, timeout=a.timeout, capture_output=True, text=True)
            text = Path(f.name).read_text()
            row = json.loads(text) if text else {
                "status": "crash", "error": f"exit {p.returncode}: {p.stderr.strip()[-200:]}"}
        except subprocess.TimeoutExpired:
            row = {"status": "timeout", "error": f"over {a.timeout:.0f} s"}
    row.update(model=model_type, wall_s=time.perf_counter() - t0)
    return row


def table(rows: list[dict], a) -> str:
    ok = sum(r["status"] == "ok" for r in rows)
    exported = [r for r in rows if r["status"] != "export"]
    lines = [f"{ok} of {len(exported)} exported models compile and match eager "
             f"({len(rows) - len(exported)} refused by torch.export); device {a.device}, "
             f"{'dynamic batch/sequence' if a.dynamic else 'static shapes'}.", "",
             "| model | input | status | compile s | error / max err over tolerance |",
             "|---|---|---|---:|---|"]
    for r in rows:
        detail = r.get("error", f"{r['err_ratio']:.2f}" if "err_ratio" in r else "")
        detail = detail.replace("|", "/").replace("\n", " ")[:140]
        cs = f"{r['compile_s']:.1f}" if "compile_s" in r else "-"
        lines.append(f"| {r['model']} | {r.get('kind', ARCHS.get(r['model'], '?'))} | "
                     f"{r['status']} | {cs} | {detail} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(ARCHS))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dynamic", action="store_true")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--markdown", metavar="FILE")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one:
        try:
            row = _worker(a.one, a.device, a.dynamic)
        except Exception as e:  # noqa: BLE001 - building the model failed
            traceback.print_exc()
            row = {"status": "build", "error": f"{type(e).__name__}: {e}"[:300]}
        Path(a.out).write_text(json.dumps(row))
        return 0
    models = [m for m in a.models.split(",") if m]
    unknown = [m for m in models if m not in ARCHS]
    if unknown:
        p.error(f"unknown model types {unknown}; known: {', '.join(ARCHS)}")
    with ThreadPoolExecutor(max(a.jobs, 1)) as pool:
        rows = []
        for row in pool.map(lambda m: _run_one(m, a), models):
            rows.append(row)
            print(json.dumps(row), flush=True)
    text = table(rows, a)
    print("\n" + text)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    if a.markdown:
        from bench.markdown import splice

        splice(a.markdown, BEGIN, END, text, "## Hugging Face coverage (issue 16)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
