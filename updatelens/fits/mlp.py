"""A small nonlinear tokenwise map x -> x + g(x), one per layer (docs/method.md: a local MLP on k
points is ill-posed). g is a one-hidden-layer GELU network on RMS-normalised inputs, trained with
Adam on the training folds' tokens (full batch, fixed seed) and evaluated on held-out sequences.
"""

from __future__ import annotations

import torch
from torch import nn


def fit_mlp(X: torch.Tensor, Y: torch.Tensor, hidden: int, steps: int, lr: float, seed: int) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    Xf, Df = X.float(), (Y - X).float()
    x_scale = Xf.pow(2).mean().sqrt().clamp_min(1e-12)
    d_scale = Df.pow(2).mean().sqrt().clamp_min(1e-12)
    d = Xf.shape[1]
    net = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / p.shape[-1]) ** 0.5)
        last = net[2]
        assert isinstance(last, nn.Linear)
        last.weight.mul_(0.1)
        last.bias.zero_()
    net = net.to(Xf.device)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    xin, target = Xf / x_scale, Df / d_scale
    with torch.enable_grad():
        for _ in range(steps):
            opt.zero_grad()
            loss = (net(xin) - target).pow(2).mean()
            loss.backward()
            opt.step()
    return _Scaled(net.eval(), x_scale, d_scale)


class _Scaled(nn.Module):
    def __init__(self, net: nn.Module, x_scale: torch.Tensor, d_scale: torch.Tensor) -> None:
        super().__init__()
        self.net, self.x_scale, self.d_scale = net, x_scale, d_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return x + (self.net(x.float() / self.x_scale) * self.d_scale).to(x.dtype)
