"""Small functional building blocks shared by the vision and text towers."""

import torch
import torch.nn.functional as F

from .weights import LayerNorm, Linear, MLP


def linear(x: torch.Tensor, w: Linear) -> torch.Tensor:
    return F.linear(x, w.weight, w.bias)


def layer_norm(x: torch.Tensor, w: LayerNorm) -> torch.Tensor:
    return F.layer_norm(x, w.weight.shape, w.weight, w.bias)


def mlp(x: torch.Tensor, w: MLP) -> torch.Tensor:
    return linear(F.gelu(linear(x, w.fc1), approximate="tanh"), w.fc2)
