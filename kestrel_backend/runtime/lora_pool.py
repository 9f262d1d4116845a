"""Device memory for the loaded LoRA adapters, one slot each, laid out for the decode step's kernels.

Per layer: A of qkv, proj and fc1 stacked (they read the same normed input) [slots, 3R, dim], A of fc2
[slots, R, ff], and each target's B [slots, out, R]. R is the rank limit rounded up to a power of two (16 at
least); an
adapter of rank r fills its slot's first r rows and columns and the kernels read no further (`ranks`). Slot 0
is "no adapter". An adapter placed here is handed back as views of its slot, which the eager (prefill)
path reads like any adapter's tensors.
"""

from __future__ import annotations

import dataclasses

import torch

from ..model.config import TextConfig
from ..model.lora import LoraAdapter, target_shapes

IN_GROUP = ("qkv", "proj", "fc1")  # the targets whose A is stacked in a_h, in this order


class LoraPool:
    def __init__(self, config: TextConfig, slots: int, max_rank: int, device, dtype):
        self.rank_cap = r = max(16, 1 << max(0, (max_rank - 1).bit_length()))  # (16: the kernels' smallest dot)
        shapes = target_shapes(config)
        n, s = config.n_layers, slots + 1

        def zeros(*shape):
            return torch.zeros(*shape, device=device, dtype=dtype)

        self.a_h = zeros(n, s, len(IN_GROUP) * r, config.dim)
        self.a_g = zeros(n, s, r, config.ff_dim)
        self.b = {t: zeros(n, s, shapes[t][1], r) for t in shapes}
        self.ranks = torch.zeros(s, device=device, dtype=torch.int32)
        self._free = list(range(slots, 0, -1))

    @property
    def nbytes_per_slot(self) -> int:
        tensors = [self.a_h, self.a_g, *self.b.values()]
        return sum(t[:, 0].numel() * t.element_size() for t in tensors)

    def place(self, adapter: LoraAdapter) -> LoraAdapter:
        """Copy the adapter into a free slot (the caller freed one); -> the same adapter as views of its slot."""
        slot, r = self._free.pop(), adapter.rank
        layers = []
        for i, layer in enumerate(adapter.layers):
            views = {}
            for target in self.b:  # (a target the adapter leaves out: zeros, which the kernels add)
                if target in IN_GROUP:
                    g = IN_GROUP.index(target) * self.rank_cap
                    a_view = self.a_h[i, slot, g:g + r]
                else:
                    a_view = self.a_g[i, slot, :r]
                b_view = self.b[target][i, slot, :, :r]
                a_view.zero_()
                b_view.zero_()
                if target in layer:
                    a, b = layer[target]
                    a_view[:a.shape[0]].copy_(a)  # (a target of lower rank than the adapter: zero rows)
                    b_view[:, :b.shape[1]].copy_(b)
                    views[target] = (a_view, b_view)
            layers.append(views)
        self.ranks[slot] = r
        return dataclasses.replace(adapter, layers=layers, slot=slot)

    def release(self, adapter: LoraAdapter) -> None:
        self.ranks[adapter.slot] = 0
        self._free.append(adapter.slot)
