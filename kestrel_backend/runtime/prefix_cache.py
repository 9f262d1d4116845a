"""KV pages of prompts, kept after their request ends and shared by later requests whose prompt starts alike.

Keyed page by page: a page's key hashes the key of the page before it and what its positions hold (a token id, an
image's row, or a one-off embedding such as a spatial ref's), so one key names the whole prompt up to the end of its
page, and the adapter, which changes every layer's k/v, is the first key's seed. An image's rows attend to each other,
so a page of them is only the same where the whole image is: the image's digest stands for each of its rows. A
request takes the longest run of its leading pages found here and prefills only the rest (a question after a cached
image, the new turn of a conversation). Pages stay held (least recently used first out, a run's later pages before
its earlier ones) until the cache is over capacity or admission needs pages that no sequence holds; a page that a
running sequence shares is freed when it ends."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Collection, Sequence
from itertools import groupby

from .kv_cache import PagedKVCache


def page_keys(seed: str, units: Sequence, page_size: int) -> list[str]:
    """The keys of the whole pages of a prompt whose positions hold `units` (hashable), in order. A page is hashed as
    its runs of equal units (an image prefix's page is one run), which names the same contents as unit by unit."""
    keys, key, page, filled = [], seed, [], 0
    for unit, run in groupby(units):
        n = len(list(run))
        while n:
            take = min(n, page_size - filled)
            page.append((unit, take))
            filled, n = filled + take, n - take
            if filled == page_size:
                key = hashlib.blake2b(repr((key, page)).encode(), digest_size=16).hexdigest()
                keys.append(key)
                page, filled = [], 0
    return keys


class PrefixCache:
    def __init__(self, cache: PagedKVCache, capacity: int):
        """capacity: pages held at most (0: off)."""
        self.cache = cache
        self.capacity = capacity
        self._pages: OrderedDict[str, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pages)

    def holds(self, keys: Sequence[str]) -> bool:
        return all(key in self._pages for key in keys)

    def lookup(self, keys: Sequence[str]) -> list[int]:
        """The pages of the longest run of `keys` from the first that is here."""
        pages = []
        for key in keys:
            page = self._pages.get(key)
            if page is None:
                break
            pages.append(page)
        self._touch(keys[:len(pages)])
        return pages

    def insert(self, keys: Sequence[str], table: Sequence[int]) -> None:
        """Keep the pages of a prompt just written into `table` (a sequence's pages), one a key; pages already here
        under their key stay as they are (same keys, same k/v)."""
        if self.capacity == 0:
            return
        for key, page in zip(keys, table):
            if key not in self._pages:
                self.cache.retain([page])
                self._pages[key] = page
        self._touch(keys)
        while len(self._pages) > self.capacity:
            self.cache.release([self._pages.popitem(last=False)[1]])

    def _touch(self, keys: Sequence[str]) -> None:
        """Most recently used, a run's earlier pages after its later ones: eviction takes the ends of runs first."""
        for key in reversed(keys):
            self._pages.move_to_end(key)

    def reclaim(self, pages_needed: int, keep: Collection[str] = ()) -> None:
        """Let go of the least recently used pages (not those of `keep`) until `pages_needed` pages are free or none
        is left; those still shared by a running sequence free their pages when it ends."""
        if self.cache.pages_free >= pages_needed:
            return
        victims, freed = [], 0
        for key, page in self._pages.items():  # (least recently used first; stops once enough would be free)
            if key in keep:
                continue
            victims.append(key)
            freed += self.cache.holders(page) == 1
            if self.cache.pages_free + freed >= pages_needed:
                break
        for key in victims:
            self.cache.release([self._pages.pop(key)])

    @property
    def idle_pages(self) -> int:
        """Pages held by this cache alone (no running sequence shares them): free for the taking."""
        return sum(self.cache.holders(p) == 1 for p in self._pages.values())
