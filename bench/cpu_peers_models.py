"""The models of bench/cpu_peers.py: zoo models at the sizes of issue 14's table, a 3x2 matmul
program, and Hugging Face models built from their configs with random weights (no download).

Each entry builds ``Case(module, args, rtol, atol, note)``: an eval-mode module, its example
arguments (static shapes) and the tolerance of a system's output against eager,
``max|got - want| <= atol + rtol * max|want|``. Builders are deterministic (seeded), so every
worker process that rebuilds a model gets the same weights.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@dataclass
class Case:
    """One benchmark model: module, example arguments, tolerance and a note for the table."""

    module: nn.Module
    args: tuple[Any, ...]
    rtol: float = 1e-3
    atol: float = 1e-4
    note: str = ""


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------ zoo

def _zoo(name: str, args: Callable[[Any], tuple] | None = None, note: str = "") -> Callable:
    def build() -> Case:
        from kiln.models import get

        spec = get(name)
        return Case(spec.module, args(spec) if args else spec.example_args,
                    max(spec.rtol, 1e-4), max(spec.atol, 1e-4), note)
    return build


class _MatMul(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b


def _matmul_3x2() -> Case:
    g = _gen(0)
    return Case(_MatMul().eval(), (torch.randn(2, 3, generator=g), torch.randn(3, 2, generator=g)),
                1e-5, 1e-6, "a @ b, 2x3 @ 3x2 (per-call overhead)")


# ----------------------------------------------------------------------------- Hugging Face

class _First(nn.Module):
    """Calls a Hugging Face model with ``return_dict=False`` and returns its first output
    (logits or last_hidden_state), so every system sees one tensor."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x, return_dict=False)[0]


def _hf(model: nn.Module) -> nn.Module:
    model.requires_grad_(False)
    return _First(model.eval()).eval()


def _image(batch: int = 1, size: int = 224) -> tuple[torch.Tensor]:
    return (torch.randn(batch, 3, size, size, generator=_gen(0)),)


def _hf_resnet50() -> Case:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.ResNetConfig(num_labels=1000)  # defaults: ResNet-50 (bottleneck, 3-4-6-3)
    return Case(_hf(tf.ResNetForImageClassification(cfg)), _image(), note="ResNetConfig, 224, b1")


def _hf_mobilenet_v2() -> Case:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.MobileNetV2Config(num_labels=1000)  # defaults: width 1.0, 224
    return Case(_hf(tf.MobileNetV2ForImageClassification(cfg)), _image(),
                note="MobileNetV2Config, 224, b1")


def _hf_convnext_tiny() -> Case:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.ConvNextConfig(num_labels=1000)  # defaults: tiny (3-3-9-3, 96..768)
    return Case(_hf(tf.ConvNextForImageClassification(cfg)), _image(),
                note="ConvNextConfig tiny, 224, b1")


def _hf_vit_base() -> Case:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.ViTConfig(num_labels=1000)  # defaults: base, patch 16, 224
    return Case(_hf(tf.ViTForImageClassification(cfg)), _image(), note="ViTConfig base/16, 224, b1")


def _bert(batch: int, seq: int, **sizes: int) -> Case:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.BertConfig(**sizes)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=_gen(0))
    return Case(_hf(tf.BertModel(cfg, add_pooling_layer=False)), (ids,))


def _hf_bert_base() -> Case:
    case = _bert(1, 128)  # defaults: base (12 layers, 768, 12 heads)
    case.note = "BertConfig base, seq 128, b1"
    return case


def _bert_like_b4() -> Case:
    case = _bert(4, 128, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                 intermediate_size=1024)
    case.note = "BertConfig 4 layers x 256, seq 128, b4"
    return case


# Whisper's encoder wants exactly 2 * max_source_positions mel frames; 1500 positions (the
# real 80x3000 input, 30 s) take about a second a call on 2 cores, so the benchmark uses half.
WHISPER_POSITIONS = int(os.environ.get("KILN_BENCH_WHISPER_POSITIONS", "750"))


def _hf_whisper_tiny_encoder() -> Case:
    import transformers as tf
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    torch.manual_seed(0)
    cfg = tf.WhisperConfig(d_model=384, encoder_layers=4, encoder_attention_heads=6,
                           encoder_ffn_dim=1536, num_mel_bins=80,
                           max_source_positions=WHISPER_POSITIONS)
    mel = torch.randn(1, 80, 2 * WHISPER_POSITIONS, generator=_gen(0))
    return Case(_hf(WhisperEncoder(cfg)), (mel,),
                note=f"WhisperConfig tiny encoder, 80x{2 * WHISPER_POSITIONS} mel")


def _tokens(vocab: int, batch: int = 1, seq: int = 128) -> tuple[torch.Tensor]:
    return (torch.randint(0, vocab, (batch, seq), generator=_gen(0)),)


def _hf_llama() -> Case:
    import transformers as tf

    torch.manual_seed(0)  # 1B-class layer shapes, 4 layers (the whole forward, no cache)
    cfg = tf.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=32000)
    return Case(_hf(tf.LlamaForCausalLM(cfg)), _tokens(cfg.vocab_size), 2e-3, 1e-3,
                note="LlamaConfig 4 layers x 2048 (GQA 32/8), seq 128, b1")


def _hf_qwen2() -> Case:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=4,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=32000)
    return Case(_hf(tf.Qwen2ForCausalLM(cfg)), _tokens(cfg.vocab_size), 2e-3, 1e-3,
                note="Qwen2Config 4 layers x 1536 (GQA 12/2), seq 128, b1")


def _hf_t5_encoder() -> Case:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.T5Config()  # defaults: t5-small (6 layers, 512, 8 heads)
    return Case(_hf(tf.T5EncoderModel(cfg)), _tokens(cfg.vocab_size),
                note="T5Config small encoder, seq 128, b1")


MODELS: dict[str, Callable[[], Case]] = {
    "mlp": _zoo("mlp", note="zoo, 4x1024 batch 64"),
    "resnet18": _zoo("resnet18", note="zoo, 224, b1"),
    "resnet18_b8": _zoo("resnet18", lambda s: (torch.randn(8, 3, 224, 224, generator=_gen(0)),),
                        note="zoo, 224, b8"),
    "mobilenet_v2": _zoo("mobilenet_v2", note="zoo, 224, b1"),
    "gpt": _zoo("gpt", note="zoo, 2 blocks, seq 128, b2"),
    "bert_like_b4": _bert_like_b4,
    "ln_softmax": _zoo("ln_softmax", note="zoo, 4096x1024"),
    "matmul_3x2": _matmul_3x2,
    "hf_resnet50": _hf_resnet50,
    "hf_mobilenet_v2": _hf_mobilenet_v2,
    "hf_convnext_tiny": _hf_convnext_tiny,
    "hf_vit_base": _hf_vit_base,
    "hf_bert_base": _hf_bert_base,
    "hf_whisper_tiny_enc": _hf_whisper_tiny_encoder,
    "hf_llama": _hf_llama,
    "hf_qwen2": _hf_qwen2,
    "hf_t5_encoder": _hf_t5_encoder,
}

# models that need `transformers` (a benchmark extra)
NEEDS_TRANSFORMERS = {m for m in MODELS if m.startswith("hf_")} | {"bert_like_b4"}


def build(name: str) -> Case:
    """Build the benchmark model ``name`` (eval mode, seeded)."""
    try:
        factory = MODELS[name]
    except KeyError:
        raise KeyError(f"unknown benchmark model {name!r}; known: {', '.join(MODELS)}") from None
    return factory()
