"""A corpus of Hugging Face architectures built from configs (issue 16: no downloads, random
weights), shared by `bench/hf_coverage.py` and the real-model test (`tests/e2e/test_hf_corpus.py`).

Each model type is built from its transformers config shrunk to a few layers of small width
(`config`), fed inputs of its kind (`inputs`: token ids, image, waveform, mel features) and
wrapped in `Flat`: a module whose `forward` takes the model's inputs as explicit named tensors
(so `torch.export` can name their dims; a `**kwargs` forward cannot be given dynamic shapes)
and returns every tensor of the model's output, flattened to a tuple. The model keeps
`return_dict=True` (some architectures' own code reads attributes of their sub-modules'
outputs, which `return_dict=False` turns into tuples).

    model, cfg = build("bart")
    flat = Flat.of(model, ARCHS["bart"])
    ep = export(flat, inputs("s2s", cfg, 2, 16), dynamic=True)

This module needs `transformers` (not one of kiln's own requirements; nothing else in kiln
imports it).
"""

from __future__ import annotations

import torch
from torch.export import Dim
from transformers import CONFIG_MAPPING, AutoModel

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

#: per model type, set after TINY (attributes TINY would set to values the model cannot use)
OVERRIDES: dict[str, dict] = {
    # EfficientNet-B0 widths (TINY's hidden_dim must equal the scaled last width) at 64x64
    "efficientnet": {"width_coefficient": 1.0, "depth_coefficient": 1.0, "hidden_dim": 1280},
}

#: the input names of each kind, in the order `Flat.forward` takes them
INPUT_NAMES: dict[str, tuple[str, ...]] = {
    "text": ("input_ids",), "s2s": ("input_ids", "decoder_input_ids"),
    "image": ("pixel_values",), "audio": ("input_values",),
    "mel": ("input_features", "decoder_input_ids"),
}


def config(model_type: str, tiny: bool = True):
    """The transformers config of `model_type`, shrunk (`tiny`) or its default."""
    cfg = CONFIG_MAPPING[model_type]()
    for k, v in TINY.items() if tiny else ():
        current = getattr(cfg, k, None)
        if isinstance(current, int) and not isinstance(current, bool) or \
                isinstance(v, tuple) and current is not None:
            try:
                setattr(cfg, k, list(v) if isinstance(v, tuple) else v)
            except AttributeError:  # a derived property (Falcon's head_dim)
                pass
    for k, v in OVERRIDES.get(model_type, {}).items() if tiny else ():
        setattr(cfg, k, v)
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


def inputs(kind: str, cfg, batch: int, length: int) -> dict[str, torch.Tensor]:
    """Random inputs of `kind` (seeded by the size) for `batch` sequences of `length` tokens
    (images: `batch` images at the config's size; waveforms: 400 samples a token)."""
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
    raise ValueError(f"unknown input kind {kind!r}; expected one of {sorted(INPUT_NAMES)}")


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):  # a ModelOutput: its set fields in order
        x = tuple(v for v in x.values() if v is not None)
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _tensors(v)]
    return []


class Flat(torch.nn.Module):
    """`model` with named tensor inputs and a flat tuple of tensors as output (see module doc);
    `Flat.of(model, kind)` picks the subclass whose `forward` takes that kind's inputs."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def call(self, **kw) -> tuple[torch.Tensor, ...]:
        return tuple(_tensors(self.model(**kw, return_dict=True)))

    @staticmethod
    def of(model, kind: str) -> "Flat":
        return _KINDS[kind](model)


class _Text(Flat):
    def forward(self, input_ids):
        return self.call(input_ids=input_ids)


class _S2S(Flat):
    def forward(self, input_ids, decoder_input_ids):
        return self.call(input_ids=input_ids, decoder_input_ids=decoder_input_ids)


class _Image(Flat):
    def forward(self, pixel_values):
        return self.call(pixel_values=pixel_values)


class _Audio(Flat):
    def forward(self, input_values):
        return self.call(input_values=input_values)


class _Mel(Flat):
    def forward(self, input_features, decoder_input_ids):
        return self.call(input_features=input_features, decoder_input_ids=decoder_input_ids)


_KINDS = {"text": _Text, "s2s": _S2S, "image": _Image, "audio": _Audio, "mel": _Mel}


def build(model_type: str, device: str = "cpu", realistic: bool = False):
    """(Flat module, config, whether the config is the shrunk one) of `model_type`, seeded; a
    shrunk config eager cannot run falls back to the type's default config. `realistic`
    redraws every matrix and kernel with std 1/sqrt(fan-in), the magnitude of trained weights
    (transformers' init of std 0.02 makes activations small enough to hide errors)."""
    kind = ARCHS[model_type]
    for tiny in (True, False):
        torch.manual_seed(0)
        cfg = config(model_type, tiny)
        model = AutoModel.from_config(cfg).eval().to(device)
        model.requires_grad_(False)
        if realistic:
            with torch.no_grad():
                for p in model.parameters():
                    if p.dim() >= 2:
                        p.normal_(0.0, p[0].numel() ** -0.5)
        flat = Flat.of(model, kind).eval()
        example = {k: v.to(device) for k, v in inputs(kind, cfg, 2, 16).items()}
        try:
            with torch.no_grad():
                flat(**example)
            return flat, cfg, tiny
        except Exception:  # noqa: BLE001 - the default config is the fallback
            if not tiny:
                raise
    raise AssertionError("unreachable")


def dynamic_shapes(kind: str, example: dict[str, torch.Tensor]) -> dict:
    """Batch and sequence (images: batch) of every input as automatic dynamic dims."""
    auto = Dim.AUTO
    return {k: ({0: auto} if kind == "image" else {0: auto, 1: auto}) for k in example}


def export(flat: Flat, kind: str, example: dict[str, torch.Tensor],
           dynamic: bool) -> torch.export.ExportedProgram:
    """`torch.export` of `flat` on `example` (keyword inputs), dynamic batch/sequence or not."""
    shapes = dynamic_shapes(kind, example) if dynamic else None
    with torch.no_grad():
        return torch.export.export(flat, (), example, dynamic_shapes=shapes)
