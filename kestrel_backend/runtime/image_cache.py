"""Image embeddings keyed by the content hash of the encoded bytes (bounded LRU)."""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch


def image_key(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class ImageCache:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict[str, torch.Tensor] = OrderedDict()

    def get(self, key: str) -> torch.Tensor | None:
        emb = self._items.get(key)
        if emb is not None:
            self._items.move_to_end(key)
        return emb

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def put(self, key: str, embedding: torch.Tensor) -> None:
        self._items[key] = embedding
        self._items.move_to_end(key)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)
