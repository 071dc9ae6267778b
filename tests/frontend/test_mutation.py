"""Programs that update their own buffers (counters, accumulators, batch-norm running stats,
caches) persist the update across runs exactly as eager does; each model handle owns its state."""

from __future__ import annotations

import torch

import kiln


class Stateful(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(1))
        self.register_buffer("acc", torch.zeros(4))
        self.register_buffer("cache", torch.zeros(5, 4))
        self.bn = torch.nn.BatchNorm1d(4)

    def forward(self, x, slot):
        self.count.add_(1)
        self.acc.mul_(0.5).add_(x.sum(0))
        self.cache.copy_(torch.cat([self.cache[1:], x[:1] * slot]))  # a shift-register cache
        return x * self.count, self.acc.clone(), self.bn(x), self.cache.sum(0)


def _pair():
    torch.manual_seed(0)
    return Stateful().train(), Stateful().train()


def test_state_persists_across_runs_like_eager(tmp_path):
    eager, other = _pair()
    other.load_state_dict(eager.state_dict())
    runner = kiln.compile(other, (torch.randn(3, 4), torch.tensor([1.0]))).load(tmp_path / "s.kiln")
    for k in range(4):
        x, slot = torch.randn(3, 4), torch.tensor([float(k % 5)])
        got, want = runner(x, slot), eager(x, slot)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w.detach(), rtol=1e-5, atol=1e-5)


def test_each_handle_owns_its_state(tmp_path):
    eager, other = _pair()
    path = kiln.compile(other, (torch.randn(3, 4), torch.tensor([1.0]))).save(tmp_path / "s.kiln")
    a, b = kiln.load(path), kiln.load(path)
    x = torch.ones(3, 4)
    for _ in range(3):
        a(x, torch.tensor([1.0]))
    (count_a, *_), (count_b, *_) = a(x, torch.tensor([1.0])), b(x, torch.tensor([1.0]))
    torch.testing.assert_close(count_a, x * 4)
    torch.testing.assert_close(count_b, x * 1)


def test_update_weights_resets_state(tmp_path):
    eager, other = _pair()
    runner = kiln.compile(other, (torch.randn(3, 4), torch.tensor([1.0]))).load(tmp_path / "s.kiln")
    x = torch.ones(3, 4)
    runner(x, torch.tensor([1.0]))
    runner.update_weights(Stateful().state_dict())  # count back to 0
    torch.testing.assert_close(runner(x, torch.tensor([1.0]))[0], x)
