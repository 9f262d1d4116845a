"""Moondream 2, 0.5B and 3: the model as a set of functions over plain weights, ready for any KV cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from . import region, text, vision
from .layers import to_device
from .config import MoondreamConfig
from .weights import MoondreamWeights, checkpoint_family, load_weights


class Moondream:
    def __init__(self, config: MoondreamConfig, weights: MoondreamWeights, tokenizer=None):
        self.config = config
        self.weights = weights
        self.tokenizer = tokenizer
        self.device = weights.text.wte.device
        self.dtype = weights.text.wte.dtype
        self.rope = text.rope_table(config.text, self.device)
        self._bos: torch.Tensor | None = None  # BOS's input row (image_prefix), made once

    @classmethod
    def from_checkpoint(cls, folder: str | Path, dtype=torch.float32, device="cpu",
                        tokenizer_dir: str | Path | None = None, fp8_experts: str = "widen") -> "Moondream":
        """A folder with config.json (optional: the official sizes of the family its tensors name), weights, and
        tokenizer.json (optional; or in tokenizer_dir). fp8_experts: see weights.load_weights."""
        from .tokenizer import load_tokenizer

        folder = Path(folder)
        config_path = folder / "config.json" if folder.is_dir() else folder.with_name("config.json")
        config = MoondreamConfig.from_file(config_path) if config_path.exists() else \
            MoondreamConfig.official(checkpoint_family(folder))
        weights = load_weights(folder, config, dtype=dtype, device=device, fp8_experts=fp8_experts)
        tokenizer_dir = tokenizer_dir or (folder if folder.is_dir() else folder.parent)
        return cls(config, weights, load_tokenizer(Path(tokenizer_dir)))

    # --- vision ---
    def encode_image(self, image: np.ndarray) -> torch.Tensor:
        """HxWx3 uint8 pixels -> [729, dim] image embedding."""
        return vision.encode_image(image, self.weights.vision, self.config.vision)

    def crop_image(self, image: np.ndarray):
        return vision.crop_image(image, self.config.vision)

    def encode_cropped(self, cropped: list, encode=None) -> list[torch.Tensor]:
        """[(crops, tiling)] of several images -> their [729, dim] embeddings, encoded as one batch (by
        encode(crops) -> features if given: see vision.encode_images)."""
        return vision.encode_images(cropped, self.weights.vision, self.config.vision, encode)

    def image_prefix(self, image_embedding: torch.Tensor) -> torch.Tensor:
        """BOS followed by the image: the 730 inputs that attend to each other bidirectionally."""
        if self._bos is None:  # (each request's prefix would otherwise copy one token id to the device)
            self._bos = self.embed_tokens([self.config.tokenizer.bos_id])
        return torch.cat([self._bos, image_embedding.to(self.dtype)], dim=0)

    # --- text ---
    def embed_tokens(self, ids) -> torch.Tensor:
        return text.embed_tokens(to_device(ids, torch.long, self.device), self.weights.text)

    def embed_prompt(self, ids, overrides: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Token embeddings, with the rows that overrides names replaced: a prompt index -> an embedding, or the
        first of several rows ([n, dim]: an image's)."""
        x = self.embed_tokens(ids)
        for index, embedding in (overrides or {}).items():
            if embedding.dim() == 2:
                x[index:index + embedding.shape[0]] = embedding
            else:
                x[index] = embedding
        return x

    def spatial_ref_overrides(self, refs, first_index: int) -> dict[int, torch.Tensor]:
        """The embeddings of spatial_ref_tokens(refs) laid out from prompt index first_index."""
        coords, sizes = region.spatial_ref_embeddings(refs, self.weights.region)
        overrides, index, c, s = {}, first_index, 0, 0
        for ref in refs:
            overrides[index], overrides[index + 1] = coords[c], coords[c + 1]
            index, c = index + 2, c + 2
            if len(ref) == 4:
                overrides[index] = sizes[s]
                index, s = index + 1, s + 1
        return overrides

    def forward(self, inputs: torch.Tensor, positions: torch.Tensor, attention: text.Attention,
                lora=None) -> torch.Tensor:
        return text.decode(inputs, positions, self.weights.text, self.config.text, self.rope, attention, lora)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return text.lm_head(hidden, self.weights.text).float()

    @property
    def name(self) -> str:
        return "Moondream 3" if self.config.is_moondream3 else "Moondream 2"

    def ends_object_list(self, token: int, hidden: torch.Tensor) -> bool:
        """Whether point/detect stops instead of decoding another object. Moondream 2 stops when the chosen token
        is EOS; Moondream 3 chooses between EOS and the coordinate token only, by their logits."""
        tok = self.config.tokenizer
        if not self.config.is_moondream3:
            return token == tok.eos_id
        ids = torch.tensor([tok.eos_id, tok.coord_id], device=hidden.device)
        eos, coord = text.lm_head_rows(hidden, self.weights.text, ids).float().tolist()
        return eos > coord

    # --- region heads ---
    def coordinate(self, hidden: torch.Tensor) -> torch.Tensor:
        return region.coordinate_from_logits(region.decode_coordinate(hidden, self.weights.region))

    def coordinate_embedding(self, coord: torch.Tensor) -> torch.Tensor:
        return region.encode_coordinate(coord.reshape(1).to(self.dtype), self.weights.region)

    def size(self, hidden: torch.Tensor) -> torch.Tensor:
        """[dim] -> float32 [2] (width, height) as a fraction of the image."""
        return region.size_from_logits(region.decode_size(hidden, self.weights.region))

    def size_embedding(self, size: torch.Tensor) -> torch.Tensor:
        return region.encode_size(size.reshape(2).to(self.dtype), self.weights.region)
