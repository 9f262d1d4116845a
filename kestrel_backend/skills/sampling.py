"""Token choice: greedy at temperature 0, else temperature + nucleus (top-p) sampling."""

from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """logits [V] float32 -> token id."""
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True)
    # Keep the smallest head whose mass reaches top_p (the token that crosses it stays in).
    sorted_probs[(torch.cumsum(sorted_probs, dim=-1) - sorted_probs) > top_p] = 0.0
    choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
    return int(order[choice])
