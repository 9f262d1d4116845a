"""The official Moondream 2 widths instantiate and run one query (random weights, CPU, short decode)."""

import dataclasses

import numpy as np
import torch

from kestrel_backend.model.config import MoondreamConfig
from kestrel_backend.model.moondream import Moondream
from kestrel_backend.model.weights import random_weights
from kestrel_backend.skills.generation import Prompt, TextGeneration
from kestrel_backend.skills.prompts import query_prompt
from kestrel_backend.skills.settings import Settings
from kestrel_backend.skills.single import run_single


def test_full_size_query_on_cpu():
    config = MoondreamConfig()
    assert (config.text.dim, config.text.n_layers, config.text.n_heads, config.text.vocab_size) == (2048, 24, 32, 51200)
    assert (config.vision.enc_dim, config.vision.enc_n_layers, config.vision.crop_size) == (1152, 27, 378)
    # every width of the official model, two of its layers of each kind (the others repeat them; all 24 and 27
    # took 110 s on a 2-CPU machine); float32: bfloat16 matmuls are slow on CPUs
    config = dataclasses.replace(config, text=dataclasses.replace(config.text, n_layers=2),
                                 vision=dataclasses.replace(config.vision, enc_n_layers=2))
    model = Moondream(config, random_weights(config, dtype=torch.float32))
    image = np.random.default_rng(0).integers(0, 256, (300, 300, 3), dtype=np.uint8)
    with torch.inference_mode():
        embedding = model.encode_image(image)
    assert embedding.shape == (729, 2048) and torch.isfinite(embedding).all()
    gen = TextGeneration(config.tokenizer, Settings(temperature=0.0, max_tokens=3))
    logits = run_single(model, Prompt(query_prompt(config.tokenizer, [100, 200], True, False), embedding), gen)
    assert logits.shape == (51200,) and torch.isfinite(logits).all()
    assert gen.done and 1 <= len(gen.tokens) <= 3
