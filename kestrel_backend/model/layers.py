"""Small functional building blocks shared by the vision and text towers."""

import numpy as np
import torch
import torch.nn.functional as F

from ..kernels.dense import dense
from .weights import LayerNorm, Linear, MLP


def to_device(values, dtype, device) -> torch.Tensor:
    """Host values (a list, or a CPU tensor) as a tensor on the device, the CPU not waiting for the device's queued
    work: on a GPU through pinned memory (a copy from pageable memory waits for the stream to drain, and the GPU then
    idles while the CPU prepares what it launches next)."""
    t = torch.as_tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def arrays_to_device(arrays: list[np.ndarray], device) -> torch.Tensor:
    """Host arrays joined along their first axis, as one tensor on the device; on a GPU joined straight into pinned
    memory, the CPU not waiting for the device's queued work (as to_device). Torch's caching host allocator hands
    the pinned block out again only once its copy is done, so nothing here waits for an earlier copy either."""
    if torch.device(device).type != "cuda":
        return torch.from_numpy(np.concatenate(arrays)).to(device)
    rows = sum(len(a) for a in arrays)
    host = torch.empty((rows, *arrays[0].shape[1:]), dtype=torch.from_numpy(arrays[0][:0]).dtype, pin_memory=True)
    np.concatenate(arrays, out=host.numpy())
    return host.to(device, non_blocking=True)


def linear(x: torch.Tensor, w: Linear) -> torch.Tensor:
    return F.linear(x, dense(w.weight), w.bias)


def layer_norm(x: torch.Tensor, w: LayerNorm) -> torch.Tensor:
    return F.layer_norm(x, w.weight.shape, w.weight, w.bias)


def mlp_hidden(x: torch.Tensor, w: MLP) -> torch.Tensor:
    """gelu_tanh(fc1(x)): the MLP's inner activations."""
    if x.is_cuda:  # fc1 + bias + tanh-GELU in one cuBLASLt call (GELU epilogue): one kernel less per MLP
        h = torch._addmm_activation(w.fc1.bias, x.reshape(-1, x.shape[-1]), dense(w.fc1.weight).t(), use_gelu=True)
        return h.view(*x.shape[:-1], -1)
    return F.gelu(linear(x, w.fc1), approximate="tanh")


def mlp(x: torch.Tensor, w: MLP) -> torch.Tensor:
    return linear(mlp_hidden(x, w), w.fc2)
