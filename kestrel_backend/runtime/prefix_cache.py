"""KV pages of image prefixes, kept after their request ends and shared by later requests on the same image.

An image prefix (BOS + the image's tokens) attends only to itself, so its k/v are the same for every request
on that image. A request whose image is here starts with those pages in its table and prefills only the
rest: the prefix's last, partly filled page and its prompt. The pages of a prefix stay held (LRU, by image
key) until the cache is over capacity or admission needs pages that no sequence holds."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

from .kv_cache import PagedKVCache


class PrefixCache:
    def __init__(self, cache: PagedKVCache, capacity: int):
        self.cache = cache
        self.capacity = capacity
        self._pages: OrderedDict[str, list[int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pages)

    def shareable(self, prefix_len: int) -> int:
        """Positions of a prefix that fill whole pages: the ones a request can take from here."""
        return prefix_len // self.cache.page_size * self.cache.page_size

    def __contains__(self, key: str) -> bool:
        return key in self._pages

    def lookup(self, key: str) -> list[int]:
        pages = self._pages.get(key, [])
        if pages:
            self._pages.move_to_end(key)
        return pages

    def insert(self, key: str, table: list[int], prefix_len: int) -> None:
        """Keep the whole pages of a prefix just written into `table` (a sequence's pages)."""
        pages = table[:self.shareable(prefix_len) // self.cache.page_size]
        if self.capacity == 0 or not pages or key in self._pages:
            return
        self.cache.retain(pages)
        self._pages[key] = pages
        while len(self._pages) > self.capacity:
            self.cache.release(self._pages.popitem(last=False)[1])

    def reclaim(self, pages_needed: int, keep: Collection[str] = ()) -> None:
        """Let go of the least recently used prefixes (not those in `keep`) until `pages_needed` pages are free or
        none is left; those still shared by a running sequence free their pages when it ends."""
        for key in [k for k in self._pages if k not in keep]:
            if self.cache.pages_free >= pages_needed:
                return
            self.cache.release(self._pages.pop(key))

    @property
    def idle_pages(self) -> int:
        """Pages held by this cache alone (no running sequence shares them): free for the taking."""
        return sum(self.cache.holders(p) == 1 for pages in self._pages.values() for p in pages)
