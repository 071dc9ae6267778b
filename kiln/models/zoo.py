"""The bundled model zoo: small, seeded PyTorch programs used by the demo, tests and benchmarks.

Each factory returns a :class:`ModelSpec` holding an eval-mode module with reproducible weights,
example arguments, the ``dynamic_shapes`` to export with, a ``make_inputs`` callable that draws
fresh inputs (other sizes inside the declared ranges) and the tolerances to compare against eager.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim
import copy

__all__ = ["ModelSpec", "ALL_MODELS", "get", "mlp", "resnet18", "mobilenet_v2", "gpt",
           "ln_softmax", "intermediates", "demo", "in_dtype"]


@dataclass(frozen=True)
class ModelSpec:
    """One bundled model: the module, how to call it, and how closely kiln must match eager."""

    name: str
    module: nn.Module
    example_args: tuple[Any, ...]
    dynamic_shapes: Any
    make_inputs: Callable[..., tuple[Any, ...]]
    rtol: float = 1e-4
    atol: float = 1e-4

    def export(self) -> torch.export.ExportedProgram:
        """Export the module with its example arguments and dynamic shapes."""
        return torch.export.export(self.module, self.example_args,
                                   dynamic_shapes=self.dynamic_shapes)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _seeded(module: nn.Module, seed: int) -> nn.Module:
    """Re-initialise every parameter and buffer from ``seed`` and put ``module`` in eval mode."""
    g = _gen(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                bound = 1.0 / math.sqrt(p[0].numel())
                p.uniform_(-bound, bound, generator=g)
            elif name.endswith("bias"):
                p.uniform_(-0.1, 0.1, generator=g)
            else:  # norm weights and the like
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
        for name, b in module.named_buffers():
            if name.endswith("running_mean"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
            elif name.endswith("running_var"):
                b.copy_(1.0 + 0.2 * torch.rand(b.shape, generator=g))
    module.requires_grad_(False)
    return module.eval()


# --------------------------------------------------------------------------------------- mlp

class MLP(nn.Module):
    """Linear+GELU+Linear+GELU+Linear."""

    def __init__(self, width: int = 1024, out: int = 256) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)
        self.fc3 = nn.Linear(width, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.gelu(self.fc2(F.gelu(self.fc1(x)))))


def _mlp_spec(name: str, width: int, out: int, batch: int, max_batch: int) -> ModelSpec:
    module = _seeded(MLP(width, out), seed=0)

    def make_inputs(seed: int = 0, batch: int = batch) -> tuple[torch.Tensor]:
        return (torch.randn(batch, width, generator=_gen(seed)),)

    return ModelSpec(
        name=name, module=module, example_args=make_inputs(0),
        dynamic_shapes=({0: Dim("batch", min=1, max=max_batch)},),
        make_inputs=make_inputs, rtol=1e-4, atol=1e-4)


def mlp() -> ModelSpec:
    """A 3-layer MLP, width 1024, batch 64 with a dynamic batch in [1, 1024]."""
    return _mlp_spec("mlp", 1024, 256, 64, 1024)


def demo() -> ModelSpec:
    """The model ``kiln demo`` compiles: the MLP at width 256 so the demo is quick."""
    return _mlp_spec("demo", 256, 64, 32, 1024)


# ---------------------------------------------------------------------------------- resnet18

class BasicBlock(nn.Module):
    """Two 3x3 conv+BN layers with a residual, downsampled by a 1x1 conv+BN when needed."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + identity)


class ResNet18(nn.Module):
    """ResNet-18-style image classifier (written here; no torchvision)."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        layers: list[nn.Module] = []
        cin = 64
        for i, cout in enumerate((64, 128, 256, 512)):
            stride = 1 if i == 0 else 2
            layers.append(nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)))
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.layers(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18() -> ModelSpec:
    """ResNet-18-style CNN on a static 1x3x224x224 input."""
    module = _seeded(ResNet18(), seed=1)

    def make_inputs(seed: int = 0) -> tuple[torch.Tensor]:
        return (torch.randn(1, 3, 224, 224, generator=_gen(seed)),)

    return ModelSpec(name="resnet18", module=module, example_args=make_inputs(0),
                     dynamic_shapes=None, make_inputs=make_inputs, rtol=1e-3, atol=1e-3)


# ------------------------------------------------------------------------------ mobilenet_v2

class ConvBNReLU6(nn.Sequential):
    """Conv2d (no bias) + BatchNorm2d + ReLU6; ``groups=cin`` makes it depthwise."""

    def __init__(self, cin: int, cout: int, kernel: int = 3, stride: int = 1,
                 groups: int = 1) -> None:
        super().__init__(nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups,
                                   bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU6())


class InvertedResidual(nn.Module):
    """MobileNetV2 block: 1x1 expand, 3x3 depthwise, 1x1 linear projection, residual when
    the shape is kept."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        layers: list[nn.Module] = [] if expand == 1 else [ConvBNReLU6(cin, hidden, 1)]
        layers += [ConvBNReLU6(hidden, hidden, 3, stride, groups=hidden),
                   nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.conv = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.residual else self.conv(x)


class MobileNetV2(nn.Module):
    """MobileNetV2 (width 1.0) image classifier (written here; no torchvision)."""

    # expansion, output channels, repeats, first stride
    SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                (6, 160, 3, 2), (6, 320, 1, 1))

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        layers: list[nn.Module] = [ConvBNReLU6(3, 32, 3, 2)]
        cin = 32
        for t, c, n, s in self.SETTINGS:
            for i in range(n):
                layers.append(InvertedResidual(cin, c, s if i == 0 else 1, t))
                cin = c
        layers.append(ConvBNReLU6(cin, 1280, 1))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(1280, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.adaptive_avg_pool2d(self.features(x), 1)
        return self.classifier(torch.flatten(x, 1))


def mobilenet_v2() -> ModelSpec:
    """MobileNetV2 (depthwise-separable convolutions, ReLU6) on a static 1x3x224x224 input."""
    module = _seeded(MobileNetV2(), seed=5)

    def make_inputs(seed: int = 0) -> tuple[torch.Tensor]:
        return (torch.randn(1, 3, 224, 224, generator=_gen(seed)),)

    return ModelSpec(name="mobilenet_v2", module=module, example_args=make_inputs(0),
                     dynamic_shapes=None, make_inputs=make_inputs, rtol=1e-3, atol=1e-3)


# --------------------------------------------------------------------------------------- gpt

class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        h = self.n_heads
        q = q.view(b, t, h, c // h).transpose(1, 2)
        k = k.view(b, t, h, c // h).transpose(1, 2)
        v = v.view(b, t, h, c // h).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-norm transformer block: attention and a 4x GELU MLP, each with a residual."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A small GPT-style decoder over int64 token ids [batch, seq]."""

    def __init__(self, vocab: int = 512, d_model: int = 256, n_heads: int = 4,
                 n_layers: int = 2, max_seq: int = 256) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def gpt() -> ModelSpec:
    """2-block GPT (vocab 512, d_model 256, 4 heads): batch 2 in [1, 4], seq 128 in [2, 256]."""
    vocab = 512
    module = _seeded(GPT(vocab=vocab), seed=2)

    def make_inputs(seed: int = 0, batch: int = 2, seq: int = 128) -> tuple[torch.Tensor]:
        return (torch.randint(0, vocab, (batch, seq), generator=_gen(seed)),)

    dyn = ({0: Dim("batch", min=1, max=4), 1: Dim("seq", min=2, max=256)},)
    return ModelSpec(name="gpt", module=module, example_args=make_inputs(0),
                     dynamic_shapes=dyn, make_inputs=make_inputs, rtol=1e-3, atol=1e-3)


# -------------------------------------------------------------------------------- ln_softmax

class LnSoftmax(nn.Module):
    """A residual chain of LayerNorm, softmax and LayerNorm."""

    def __init__(self, width: int = 1024) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.ln2 = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln1(x)
        z = torch.softmax(y * 0.5 + x, dim=-1)
        return self.ln2(z + y)


def ln_softmax() -> ModelSpec:
    """LayerNorm / softmax / LayerNorm residual chain on a static [4096, 1024] input."""
    module = _seeded(LnSoftmax(1024), seed=3)

    def make_inputs(seed: int = 0) -> tuple[torch.Tensor]:
        return (torch.randn(4096, 1024, generator=_gen(seed)),)

    return ModelSpec(name="ln_softmax", module=module, example_args=make_inputs(0),
                     dynamic_shapes=None, make_inputs=make_inputs, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- intermediates

class Intermediates(nn.Module):
    """Several intermediates live at once: a small test of the memory planner."""

    def forward(self, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        t0 = x @ y
        t1 = x @ z
        t0 = x.T @ t1
        t1 = x @ t0
        return t0.sum() + t1.sum()


def intermediates() -> ModelSpec:
    """x (n, 2), y (2, 4), z (2, 3) with n in [2, 64]; example n = 3."""
    module = Intermediates().eval()

    def make_inputs(seed: int = 0, n: int = 3) -> tuple[torch.Tensor, ...]:
        g = _gen(seed)
        return (torch.randn(n, 2, generator=g), torch.randn(2, 4, generator=g),
                torch.randn(2, 3, generator=g))

    dyn = ({0: Dim("n", min=2, max=64)}, None, None)
    return ModelSpec(name="intermediates", module=module, example_args=make_inputs(0),
                     dynamic_shapes=dyn, make_inputs=make_inputs, rtol=1e-4, atol=1e-4)


ALL_MODELS: dict[str, Callable[[], ModelSpec]] = {
    "mlp": mlp,
    "resnet18": resnet18,
    "mobilenet_v2": mobilenet_v2,
    "gpt": gpt,
    "ln_softmax": ln_softmax,
    "intermediates": intermediates,
    "demo": demo,
}


# tolerances of a 16-bit copy against eager in the same dtype (both round differently)
_HALF_TOL = {torch.float16: 2e-2, torch.bfloat16: 8e-2}


def in_dtype(spec: ModelSpec, dtype: torch.dtype) -> ModelSpec:
    """`spec` with its floating-point weights, buffers and inputs converted to `dtype`
    (e.g. torch.bfloat16); integer inputs (token ids) are left alone."""

    def conv(args):
        return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                     for a in args)

    def make_inputs(*a, **kw):
        return conv(spec.make_inputs(*a, **kw))

    tol = _HALF_TOL.get(dtype, max(spec.rtol, 1e-4))
    return ModelSpec(name=f"{spec.name}_{str(dtype).removeprefix('torch.')}",
                     module=copy.deepcopy(spec.module).to(dtype),
                     example_args=conv(spec.example_args), dynamic_shapes=spec.dynamic_shapes,
                     make_inputs=make_inputs, rtol=tol, atol=tol)


def get(name: str) -> ModelSpec:
    """Build the zoo model ``name``; raises ``KeyError`` naming the known models otherwise."""
    try:
        factory = ALL_MODELS[name]
    except KeyError:
        raise KeyError(f"unknown zoo model {name!r}; known: {', '.join(ALL_MODELS)}") from None
    return factory()
