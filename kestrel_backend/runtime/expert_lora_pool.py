"""Device memory for Moondream 3's LoRA adapters, one slot each, laid out for the kernels of kernels/moe_lora.

Per layer: the up (fc1) and down (fc2) projections' A [slots, E, R, in] and B transposed [slots, E, R, out], where
a dense layer is one expert (E = 1) and an expert layer has the model's E. R is a power of two: in the dense layers
the rank limit's, in the expert layers the limit over the experts a token takes (Kestrel's adapters split one rank
over them). An adapter of rank r fills its slot's first r rows and the kernels read no further (`ranks`). Slot 0 is
"no adapter". An adapter placed here is handed back as views of its slot, which the reference forms (the eager
prefill's dense layers, LoraRows.add) read like any adapter's tensors.
"""

from __future__ import annotations

import dataclasses

import torch

from ..model.config import TextConfig
from ..model.lora import LoraAdapter, expert_layers, target_shapes


def _power_of_two(n: int) -> int:
    return max(2, 1 << max(0, (n - 1).bit_length()))  # (2 at least: the kernels' rank axis)


class ExpertLoraPool:
    def __init__(self, config: TextConfig, slots: int, max_rank: int, device, dtype):
        self.experts = expert_layers(config)
        shapes = target_shapes(config)
        self.dense_cap = _power_of_two(max_rank)
        self.expert_cap = _power_of_two(max(1, max_rank // config.moe.n_experts_per_tok))
        s = slots + 1

        def zeros(*shape):
            return torch.zeros(*shape, device=device, dtype=dtype)

        self.layers = []  # per layer: (up_a, up_bt, down_a, down_bt)
        for i in range(config.n_layers):
            expert = i in self.experts
            e, r = (config.moe.n_experts, self.expert_cap) if expert else (1, self.dense_cap)
            (up_in, up_out), (down_in, down_out) = (shapes["experts_up"], shapes["experts_down"]) if expert else \
                (shapes["fc1"], shapes["fc2"])
            self.layers.append((zeros(s, e, r, up_in), zeros(s, e, r, up_out), zeros(s, e, r, down_in),
                                zeros(s, e, r, down_out)))
        self.dense_ranks = torch.zeros(s, device=device, dtype=torch.int32)
        self.expert_ranks = torch.zeros(s, device=device, dtype=torch.int32)
        self._free = list(range(slots, 0, -1))

    @property
    def nbytes_per_slot(self) -> int:
        return sum(t[0].numel() * t.element_size() for layer in self.layers for t in layer)

    def layer(self, i: int, row_slots: torch.Tensor):
        """Layer i's adapters for rows whose slots are row_slots [T] int32 (a kernels.moe_lora.ExpertLora)."""
        from ..kernels.moe_lora import ExpertLora  # (the kernels load on first use: TRITON_INTERPRET is read then)

        up_a, up_bt, down_a, down_bt = self.layers[i]
        ranks = self.expert_ranks if i in self.experts else self.dense_ranks
        return ExpertLora(up_a, up_bt, down_a, down_bt, ranks, row_slots)

    def place(self, adapter: LoraAdapter) -> LoraAdapter:
        """Copy the adapter into a free slot (the caller freed one); -> the same adapter as views of its slot."""
        slot = self._free.pop()
        layers = []
        for i, held in enumerate(adapter.layers):
            targets = ("experts_up", "experts_down") if i in self.experts else ("fc1", "fc2")
            views = {}
            for (a_all, bt_all), target in zip((self.layers[i][:2], self.layers[i][2:]), targets):
                a_all[slot].zero_()
                bt_all[slot].zero_()
                if target not in held:
                    continue  # (zeros, which the kernels add)
                a, b = held[target]
                expert = a.dim() == 3
                a, b = (a, b) if expert else (a[None], b[None])
                r = a.shape[1]
                a_all[slot, :, :r].copy_(a)
                bt_all[slot, :, :r].copy_(b.transpose(1, 2))
                a_view, b_view = a_all[slot, :, :r], bt_all[slot, :, :r].transpose(1, 2)
                views[target] = (a_view, b_view) if expert else (a_view[0], b_view[0])
            layers.append(views)
        self.dense_ranks[slot] = adapter.rank
        self.expert_ranks[slot] = adapter.expert_rank
        return dataclasses.replace(adapter, layers=layers, slot=slot, pool=self)

    def release(self, adapter: LoraAdapter) -> None:
        self.dense_ranks[adapter.slot] = 0
        self.expert_ranks[adapter.slot] = 0
        self._free.append(adapter.slot)
