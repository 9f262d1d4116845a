"""Batched token choice for a whole step: greedy rows take the argmax; the others temperature +
nucleus (top-p) sampling. Sampling noise is a hash of (seed, step, token id), so a request's draws
do not depend on what else shares its batch, and one seed replays the same answer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.layers import to_device

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
    return launch_choice(logits, choices, greedy).tolist()


class TokensToHost:
    """Token ids on their way from the GPU to pinned host memory: tolist() waits for the work launched before
    them only, not for what the engine launches after (the next step's image encodes)."""

    def __init__(self, tokens: torch.Tensor):
        self._ready = None
        self.on_device = tokens if tokens.is_cuda else None  # (a decode step launched ahead may take them)
        if tokens.is_cuda:
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            tokens = host.copy_(tokens, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        self._tokens = tokens

    def tolist(self) -> list[int]:
        if self._ready is not None:
            self._ready.synchronize()
        return self._tokens.tolist()


def launch_choice(logits: torch.Tensor, choices: list[Choice], greedy=None):
    """choose_tokens without waiting for the GPU: -> the tokens as anything with tolist() (TokensToHost)."""
    sampled = [i for i, c in enumerate(choices) if c.temperature > 0]
    if greedy is not None and not sampled:
        return greedy
    dev = logits.device
    banned = [(row, token) for row, c in enumerate(choices) for token in c.banned]
    if banned and greedy is None:
        rows, tokens = to_device(banned, torch.long, dev).T  # (a Python scalar as the value would be copied in
        logits.index_put_((rows, tokens), torch.full((), float("-inf"), device=dev))  # and wait for the GPU)
    tokens = logits.argmax(dim=-1)
    if sampled:
        idx = to_device(sampled, torch.long, dev)
        temps = to_device([choices[i].temperature for i in sampled], torch.float32, dev)
        top_p = to_device([choices[i].top_p for i in sampled], torch.float32, dev)
        probs = torch.softmax(logits[idx] / temps[:, None], dim=-1)
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest head whose mass reaches top_p (the token that crosses it stays in).
        sorted_probs.masked_fill_((torch.cumsum(sorted_probs, dim=-1) - sorted_probs) > top_p[:, None], 0.0)
        seeds = to_device([choices[i].seed & _MASK64 for i in sampled], torch.int64, dev)
        steps = to_device([choices[i].step for i in sampled], torch.int64, dev)
        noise = _uniform(seeds, steps, logits.shape[-1])
        # Exponential race: argmax p / E with E ~ Exp(1) draws a token with probability p.
        race = sorted_probs.double() / -torch.log(noise.gather(1, order))
        tokens[idx] = order.gather(1, race.argmax(dim=-1, keepdim=True)).squeeze(1)
    return TokensToHost(tokens)
