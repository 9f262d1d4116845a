"""The loaded LoRA adapters: found in a folder, read off the engine thread once, kept in an LRU on the device.

An adapter id names `<dir>/<id>/final.pt` (the reference's layout; the file may also be one of Kestrel's
checkpoints), `<dir>/<id>.safetensors` or `<dir>/<id>/*.safetensors`, looked for in KESTREL_ADAPTER_DIR, then in the
reference's own cache (`<HF hub cache>/md_variants`). Where neither has it and MOONDREAM_API_KEY is set, it is
downloaded from the Moondream API into the first of those folders as `<id>/final.pt`: a variant as the reference
does, an id `<finetune_id>@<step>` (Kestrel's) as Kestrel does, from the finetune's checkpoint through the download
link the API hands out. Requests in flight pin their adapter: only adapters no request holds are evicted. On a GPU
the adapters live in a LoraPool, where the decode step's kernels find each row's adapter by its slot.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import urllib.request
from collections import OrderedDict
from pathlib import Path

import torch

from ..errors import EngineOverloaded, InvalidRequest
from ..model.config import TextConfig
from ..model.lora import AdapterError, LoraAdapter, build_adapter, read_adapter_tensors
from .expert_lora_pool import ExpertLoraPool
from .lora_pool import LoraPool

log = logging.getLogger("kestrel.adapters")


def reference_cache_dir() -> Path:
    """Where the reference keeps downloaded variants: <HF hub cache>/md_variants."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]) / "md_variants"
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub" / "md_variants"
    return Path("~/.cache/huggingface/hub").expanduser() / "md_variants"


def adapter_files(folder: Path, adapter_id: str) -> list[Path]:
    """The files of adapter_id in folder, or [] when it is not there."""
    pt = folder / adapter_id / "final.pt"
    if pt.is_file():
        return [pt]
    single = folder / f"{adapter_id}.safetensors"
    if single.is_file():
        return [single]
    return sorted((folder / adapter_id).glob("*.safetensors")) if (folder / adapter_id).is_dir() else []


def download_adapter(adapter_id: str, folder: Path) -> Path:
    """The download from the Moondream API (needs MOONDREAM_API_KEY and network): a variant's file, or for
    `<finetune_id>@<step>` the finetune's checkpoint from the link that the API answers with (fetched without the
    key, as Kestrel does: the link carries its own authorisation)."""
    endpoint = os.environ.get("MOONDREAM_ENDPOINT", "https://api.moondream.ai")
    headers = {"User-Agent": "kestrel-triton", "X-Moondream-Auth": os.environ["MOONDREAM_API_KEY"]}
    if "@" in adapter_id:
        finetune, step = adapter_id.split("@", 1)
        link = f"{endpoint}/v1/tuning/finetunes/{finetune}/checkpoints/{step}/download"
        with urllib.request.urlopen(urllib.request.Request(link, headers=headers), timeout=60) as response:
            url = json.load(response)["url"]
        if not url.startswith(("https://", "http://")):
            raise ValueError(f"the API's download link is not a web address: {url[:80]!r}")
        request = urllib.request.Request(url, headers={"User-Agent": "kestrel-triton"})
    else:
        request = urllib.request.Request(f"{endpoint}/v1/variants/{adapter_id}/download", headers=headers)
    dest = folder / adapter_id / "final.pt"
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_suffix(".part")
    with urllib.request.urlopen(request, timeout=300) as response, open(partial, "wb") as f:
        shutil.copyfileobj(response, f)
    partial.rename(dest)
    return dest


class AdapterRegistry:
    def __init__(self, folder: str, max_loaded: int, max_rank: int, config: TextConfig, device, dtype, executor):
        self.folders = ([Path(folder)] if folder else []) + [reference_cache_dir()]
        self.max_loaded, self.max_rank = max_loaded, max_rank
        self.config, self.device, self.dtype = config, device, dtype
        self._executor = executor
        self._loaded: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        self._pins: dict[str, int] = {}
        self._loading: dict[str, asyncio.Future] = {}
        self.loads = 0
        self.pool: LoraPool | ExpertLoraPool | None = None  # on a GPU, made by ensure_pool (at start, or at the
        # first adapter): Moondream 3's also holds the experts' LoRA

    def ensure_pool(self) -> LoraPool | ExpertLoraPool | None:
        if self.pool is None and torch.device(self.device).type == "cuda":
            kind = ExpertLoraPool if self.config.moe is not None else LoraPool
            self.pool = kind(self.config, self.max_loaded, self.max_rank, self.device, self.dtype)
            log.info("adapter pool: %d slots of rank up to %d, %.1f MB each (%.2f GB in all)", self.max_loaded,
                     self.max_rank, self.pool.nbytes_per_slot / 1e6,
                     self.pool.nbytes_per_slot * (self.max_loaded + 1) / 1e9)
        return self.pool

    @property
    def pinned(self) -> int:
        """Requests holding an adapter: 0 once every request has ended."""
        return sum(self._pins.values())

    def loaded(self) -> list[str]:
        return list(self._loaded)

    async def acquire(self, adapter_id: str) -> LoraAdapter:
        """The adapter, loaded (once however many requests ask at the same time) and pinned. On the engine loop."""
        while adapter_id not in self._loaded:
            loading = self._loading.get(adapter_id)
            if loading is None:
                loading = self._loading[adapter_id] = asyncio.ensure_future(self._load_and_insert(adapter_id))
                loading.add_done_callback(lambda f: f.cancelled() or f.exception())  # (seen, if all waiters left)
            await asyncio.shield(loading)  # a cancelled request leaves the others' load be; its error is theirs
        self._loaded.move_to_end(adapter_id)
        self._pins[adapter_id] = self._pins.get(adapter_id, 0) + 1
        return self._loaded[adapter_id]

    async def _load_and_insert(self, adapter_id: str) -> None:
        try:
            adapter = await asyncio.get_running_loop().run_in_executor(self._executor, self._load, adapter_id)
            self._insert(adapter)
        finally:
            self._loading.pop(adapter_id, None)

    def release(self, adapter: LoraAdapter) -> None:
        self._pins[adapter.name] -= 1
        if not self._pins[adapter.name]:
            del self._pins[adapter.name]

    def _insert(self, adapter: LoraAdapter) -> None:
        """On the engine loop (the device copy stays in its stream order): evict, then place on the device."""
        while len(self._loaded) >= self.max_loaded:
            idle = next((name for name in self._loaded if name not in self._pins), None)
            if idle is None:
                raise EngineOverloaded(f"all {self.max_loaded} adapter slots (KESTREL_MAX_ADAPTERS) are held by "
                                       "requests in flight; retry later")
            evicted = self._loaded.pop(idle)
            if self.pool is not None:
                self.pool.release(evicted)
        self.loads += 1
        adapter.uid = self.loads
        pool = self.ensure_pool()
        if pool is not None:
            adapter = pool.place(adapter)
        self._loaded[adapter.name] = adapter
        experts = f", experts' rank {adapter.expert_rank}" if adapter.expert_rank else ""
        log.info("loaded adapter %s: rank %d%s, %.1f MB, on %s%s", adapter.name, adapter.rank, experts,
                 adapter.nbytes / 1e6, self.device, f" (slot {adapter.slot})" if pool is not None else "")

    def _find(self, adapter_id: str) -> list[Path]:
        for folder in self.folders:
            files = adapter_files(folder, adapter_id)
            if files:
                return files
        if os.environ.get("MOONDREAM_API_KEY"):
            try:
                return [download_adapter(adapter_id, self.folders[0])]
            except Exception as e:
                log.warning("adapter %s: download failed: %s: %s", adapter_id, type(e).__name__, e)
                why = "" if isinstance(e, OSError) else f" ({type(e).__name__}: {e})"  # (a file error names a path)
                raise InvalidRequest(f"adapter {adapter_id!r}: not found locally and its download failed{why}") from None
        # (the folders searched go to the log, not to the caller: no server path in an answer)
        log.info("adapter %s not found in %s", adapter_id, ", ".join(str(f) for f in self.folders))
        raise InvalidRequest(f"adapter {adapter_id!r} not found (an adapter is <id>/final.pt, <id>.safetensors or "
                             "<id>/*.safetensors in the server's adapter folders)")

    def _load(self, adapter_id: str) -> LoraAdapter:
        """Off the engine thread: find, read and check (in host memory, in the serving dtype)."""
        files = self._find(adapter_id)
        device = "cpu" if torch.device(self.device).type == "cuda" else self.device  # (_insert places it)
        try:
            return build_adapter(adapter_id, read_adapter_tensors(files), self.config, self.max_rank, self.dtype,
                                 device)
        except AdapterError as e:
            log.info("adapter %s (%s): %s", adapter_id, files[0].parent, e)
            raise InvalidRequest(f"adapter {adapter_id!r}: {e}") from None
