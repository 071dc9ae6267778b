"""libkiln's kiln_sample (through kiln.runtime.Sampler): greedy is eager's argmax over every
float dtype and strides; seeded sampling is reproducible; the empirical distribution of many
draws matches softmax(logits / T) restricted to top-k / top-p (statistical checks whose
tolerances fail on a wrong distribution); bad arguments are clear errors."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.errors import InputError
from kiln.runtime import Sampler

DRAWS = 20000


def _freq(logits: torch.Tensor, n: int = DRAWS, **kw) -> torch.Tensor:
    s = Sampler(**kw)
    counts = torch.zeros(logits.shape[-1], dtype=torch.float64)
    for _ in range(n):
        counts[s(logits)] += 1
    return counts / n


def _expected(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
              ) -> torch.Tensor:
    p = torch.softmax(logits.double() / temperature, -1)
    order = torch.argsort(p, descending=True, stable=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    kept = order[:top_k] if top_k else order
    if 0 < top_p < 1:
        mass, n = 0.0, 0
        for i in kept.tolist():
            mass += float(p[i] / p[kept].sum())
            n += 1
            if mass >= top_p:
                break
        kept = kept[:n]
    keep[kept] = True
    q = torch.where(keep, p, torch.zeros_like(p))
    return q / q.sum()


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    # 5 standard deviations of a binomial proportion per token, and no mass off the support
    sd = torch.sqrt(want * (1 - want) / DRAWS)
    assert torch.all((got - want).abs() <= 5 * sd + 1e-9), (got, want)
    assert float(got[want == 0].sum()) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_greedy_is_argmax_of_the_last_row(dtype):
    g = torch.Generator().manual_seed(0)
    for shape in [(7,), (3, 50), (2, 5, 33)]:
        x = torch.randn(shape, generator=g).to(dtype)
        assert Sampler()(x) == int(x.reshape(-1, shape[-1])[-1].float().argmax())
    x = torch.randn(40, 6, generator=g).to(dtype).t()  # [6, 40], strided: the last row
    assert Sampler()(x) == int(x[-1].float().argmax())
    x = torch.randn(2, 9, 40, generator=g).to(dtype).transpose(0, 1)  # [9, 2, 40]
    assert Sampler()(x) == int(x[-1, -1].float().argmax())


def test_greedy_ties_take_the_first():
    assert Sampler()(torch.tensor([0.0, 3.0, 1.0, 3.0])) == 1


def test_seeded_sampling_is_reproducible():
    x = torch.randn(64, generator=torch.Generator().manual_seed(1))
    a = [Sampler(temperature=1.0, seed=5)(x) for _ in range(1)]
    s1, s2, s3 = (Sampler(temperature=1.0, seed=s) for s in (5, 5, 6))
    one = [s1(x) for _ in range(200)]
    assert one == [s2(x) for _ in range(200)]
    assert one != [s3(x) for _ in range(200)]
    assert a[0] == one[0]
    assert len(set(one)) > 10  # it does sample


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_distribution_matches_softmax(temperature):
    x = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
    _close(_freq(x, temperature=temperature, seed=11), _expected(x, temperature))


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_top_k_keeps_the_k_most_likely(top_k):
    x = torch.tensor([0.3, 2.0, 1.0, -0.5, 1.7, 0.9])
    _close(_freq(x, temperature=1.0, top_k=top_k, seed=3), _expected(x, 1.0, top_k=top_k))


@pytest.mark.parametrize("top_p", [0.3, 0.6, 0.8])  # none at a mass boundary
def test_top_p_keeps_the_nucleus(top_p):
    x = torch.log(torch.tensor([0.1, 0.4, 0.05, 0.25, 0.2]))
    _close(_freq(x, temperature=1.0, top_p=top_p, seed=9), _expected(x, 1.0, top_p=top_p))


def test_top_k_then_top_p():
    x = torch.log(torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1]))
    _close(_freq(x, temperature=1.0, top_k=3, top_p=0.6, seed=2),
           _expected(x, 1.0, top_k=3, top_p=0.6))


def test_uniform_draws_cover_a_large_vocabulary():
    x = torch.zeros(1000)
    s = Sampler(temperature=1.0, seed=123)
    seen = {s(x) for _ in range(5000)}
    # expected distinct tokens after 5000 uniform draws of 1000: 1000 * (1 - e^-5) ~ 993
    assert len(seen) > 1000 * (1 - math.exp(-5)) - 15


def test_bad_arguments_are_clear_errors():
    x = torch.randn(8)
    with pytest.raises(InputError, match="top_p must be in"):
        Sampler(temperature=1.0, top_p=1.5)(x)
    with pytest.raises(InputError, match="top_k must be >= 0"):
        Sampler(temperature=1.0, top_k=-1)(x)
    with pytest.raises(InputError, match="NaN"):
        Sampler()(torch.full((4,), float("nan")))
    with pytest.raises(InputError, match="float32, float64, float16 or bfloat16"):
        Sampler()(torch.arange(4))
    with pytest.raises(InputError, match="last dimension is empty"):
        Sampler()(torch.zeros(3, 0))
