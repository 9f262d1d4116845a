"""Batched token choice for a whole step: greedy rows take the argmax; the others temperature +
nucleus (top-p) sampling. Sampling noise is a hash of (seed, step, token id), so a request's draws
do not depend on what else shares its batch, and one seed replays the same answer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK64 = (1 << 63) - 1


@dataclass(frozen=True)
class Choice:
    """How one sequence picks its next token this step."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    step: int = 0
    banned: tuple[int, ...] = ()


def _uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Counter-based uniforms in (0, 1): splitmix64-style mixing of seed, step and token id."""
    x = (seeds[:, None] * 0x9E3779B97F4A7C15 + steps[:, None] * 0xBF58476D1CE4E5B9
         + torch.arange(vocab, device=seeds.device)[None, :] * 0x94D049BB133111EB) & _MASK64
    x = ((x ^ (x >> 31)) * 0x7FB5D4E3A3B1C3F5) & _MASK64
    x = ((x ^ (x >> 29)) * 0x3C79AC492BA7B653) & _MASK64
    x = x ^ (x >> 32)
    return ((x >> 11).double() + 0.5) / float(1 << 52)


def choose_tokens(logits: torch.Tensor, choices: list[Choice], greedy=None) -> list[int]:
    """logits [B, V] float32 (modified in place for bans) -> one token id per row (one host sync).
    greedy: each row's argmax with its bans applied (anything with tolist()), when the GPU step computed
    it with the logits, whose banned entries are -inf then; it saves the argmax when no row samples."""
    sampled = [i for i, c in enumerate(choices) if c.temperature > 0]
    if greedy is not None and not sampled:
        return greedy.tolist()
    banned = [(row, token) for row, c in enumerate(choices) for token in c.banned]
    if banned and greedy is None:
        rows, tokens = torch.tensor(banned, device=logits.device).T
        logits[rows, tokens] = float("-inf")
    tokens = logits.argmax(dim=-1)
    if sampled:
        dev = logits.device
        idx = torch.tensor(sampled, device=dev)
        temps = torch.tensor([choices[i].temperature for i in sampled], device=dev, dtype=torch.float32)
        top_p = torch.tensor([choices[i].top_p for i in sampled], device=dev, dtype=torch.float32)
        probs = torch.softmax(logits[idx] / temps[:, None], dim=-1)
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest head whose mass reaches top_p (the token that crosses it stays in).
        sorted_probs[(torch.cumsum(sorted_probs, dim=-1) - sorted_probs) > top_p[:, None]] = 0.0
        seeds = torch.tensor([choices[i].seed & _MASK64 for i in sampled], device=dev, dtype=torch.int64)
        steps = torch.tensor([choices[i].step for i in sampled], device=dev, dtype=torch.int64)
        noise = _uniform(seeds, steps, logits.shape[-1])
        # Exponential race: argmax p / E with E ~ Exp(1) draws a token with probability p.
        race = sorted_probs.double() / -torch.log(noise.gather(1, order))
        tokens[idx] = order.gather(1, race.argmax(dim=-1, keepdim=True)).squeeze(1)
    return tokens.tolist()
