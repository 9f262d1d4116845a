"""Run one request alone on a dense KV cache: the simple path used by parity checks and the CLI."""

from __future__ import annotations

import torch

from ..model.lora import LoraAdapter, LoraRows
from ..model.moondream import Moondream
from ..model.text import DenseCache
from .generation import Generation, Prompt
from .sampling import choose_tokens


@torch.inference_mode()
def run_single(model: Moondream, prompt: Prompt, generation: Generation,
               adapter: LoraAdapter | None = None) -> torch.Tensor:
    """Drive `generation` to the end (with adapter's deltas on every position, the image prefix's too);
    returns the first-step logits (prefill output)."""
    inputs = model.embed_prompt(prompt.token_ids, prompt.overrides)
    prefix_len = 0
    if prompt.image_embedding is not None:
        prefix = model.image_prefix(prompt.image_embedding)
        prefix_len = prefix.shape[0]
        inputs = torch.cat([prefix, inputs], dim=0)
    blocks = tuple((prefix_len + start, prefix_len + end) for start, end in prompt.blocks)
    cache = DenseCache(model.config.text, model.device, model.dtype, prefix_len, blocks)
    positions = torch.arange(inputs.shape[0], device=model.device)
    first_logits = None
    while True:
        cache.set_positions(positions)
        lora = LoraRows([(0, inputs.shape[0], adapter)]) if adapter is not None else None
        hidden = model.forward(inputs, positions, cache, lora)[-1]
        logits = model.logits(hidden)
        if first_logits is None:
            first_logits = logits.clone()
        token = choose_tokens(logits[None], [generation.choice()])[0]
        nxt = generation.on_output(token, hidden)
        if nxt is None:
            return first_logits
        pos = int(positions[-1]) + 1
        if pos >= model.config.text.max_context:
            generation.finish("length")
            return first_logits
        positions = torch.tensor([pos], device=model.device)
        inputs = model.embed_tokens([nxt]) if isinstance(nxt, int) else nxt.reshape(1, -1)
