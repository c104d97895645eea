"""The alpha-trick (Chizat & Bach 2019; Geiger, Petrini & Wyart,
*Landscape and training regimes in deep learning*, Physics Reports 2021): train F(x) = alpha (f_w(x) - f_w0(x)).

f_w0 is a frozen copy of the network at initialization, so F = 0 at initialization for every alpha,
and the loss is divided by alpha^2:

    L(w) = 1/alpha^2 * mean_mu  loss(alpha (f_w(x_mu) - f_w0(x_mu)), y_mu)

alpha -> infinity is the lazy (kernel) regime: the weights move by O(1/alpha) and the tangent kernel
stays frozen; alpha -> 0 (alpha ~ 1/sqrt(width) and below) is the feature-learning regime.

Learning-rate convention (Geiger, Petrini & Wyart's): the learning rate is *not* rescaled with alpha. With the
1/alpha^2 prefactor, gradient descent on L has an alpha-independent time scale as alpha -> infinity
(alpha dF/dt = O(1)), so one lr serves every alpha. This holds for optimizers linear in the gradient
(SGD, with or without momentum). Adam-type optimizers normalize the gradient, so for them the
prefactor is a no-op: the same function-space step at every alpha >= 1 needs lr = lr1 / alpha (what
configs/sweeps/digits_regimes.yaml does with AdamW; ViTs train poorly with plain SGD).
Weight decay pulls w towards 0, not w0; regime studies use ``--weight-decay 0``.

Model-agnostic: any module whose output is a tensor. f_w0 always runs in eval mode, so a model with
dropout, drop-path or batch-norm is only exactly zero at initialization in eval mode.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from convbias.base.errors import ConfigError


def check_alpha(alpha: float, option: str = "--output-scale") -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0 or alpha == float("inf"):
        raise ConfigError(f"{option} must be a positive finite number (the output scale alpha), got {alpha!r}")
    return float(alpha)


class OutputScale(nn.Module):
    """alpha (model(x) - initial(x)) with `initial` a frozen copy of `model` as it is now."""

    def __init__(self, model: nn.Module, alpha: float):
        super().__init__()
        self.alpha = check_alpha(alpha)
        self.model = model
        self.initial = copy.deepcopy(model).requires_grad_(False).eval()

    @property
    def trained_model(self) -> nn.Module:
        """f_w, the model whose weights train (the optimizer numbers its layers for --layer-decay)."""
        return self.model

    def train(self, mode: bool = True) -> OutputScale:
        super().train(mode)
        self.initial.eval()  # f_w0 is a fixed function
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            reference = self.initial(x)
        return self.alpha * (self.model(x) - reference)

    def no_weight_decay(self) -> set[str]:
        inner = self.model.no_weight_decay() if hasattr(self.model, "no_weight_decay") else ()
        return {f"model.{name}" for name in inner}


class ScaledLoss(nn.Module):
    """The run's loss divided by alpha^2 (Geiger, Petrini & Wyart's prefactor, see the module docstring)."""

    def __init__(self, loss: nn.Module, alpha: float):
        super().__init__()
        self.loss = loss
        self.alpha = check_alpha(alpha)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return self.loss(*args, **kwargs) / self.alpha**2
