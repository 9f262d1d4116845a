"""RuntimeConfig: engine settings from env vars and config.pbtxt parameters, validated at start.

Env vars win over parameters. Every error names the variable, so a bad value fails the model
load with a message an operator can act on.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from pathlib import Path

from .model.config import FP8_EXPERT_MODES

TINY_CHECKPOINT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "md2-tiny"
DTYPES = ("float32", "bfloat16", "float16")
# KESTREL_PREFIX_AHEAD's default (-1) by model and batch: on for a mixture of experts from PREFIX_AHEAD_MIN_BATCH slots
# (H100, Kestrel's method, Moondream 3: chain of thought 4 and 9% faster at batch 64 and 16, direct 1 to 2%; at batch
# 4 direct 17% slower, at 1 2%; Moondream 2, dense, 1 to 3% slower at 16 and 64, so off there)
PREFIX_AHEAD_MOE = 4
PREFIX_AHEAD_MIN_BATCH = 16


def usable_cpus(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """CPUs this process may use: those it may run on (a container's cpuset), fewer where a CPU quota (a container's
    CPU limit: cgroup v2's cpu.max, v1's cpu.cfs_quota_us) allows less."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # (not on Linux)
        cpus = os.cpu_count() or 4
    quota = _cpu_quota(cgroup)
    return max(1, min(cpus, math.ceil(quota))) if quota else cpus


def _cpu_quota(cgroup: Path) -> float | None:
    """CPUs' worth of time the cgroup may use (quota over period), or None: no quota, or none readable."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]  # cgroup v2: "max 100000" or "200000 100000"
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((cgroup / "cpu" / "cpu.cfs_quota_us").read_text())  # cgroup v1: -1 without a quota
        period = int((cgroup / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class RuntimeConfig:
    model_path: str = ""  # local checkpoint folder or file
    model: str = ""  # hub name, e.g. moondream2 (downloaded through huggingface_hub)
    revision: str = ""
    device: str = ""  # cuda or cpu; empty: cuda when available
    dtype: str = ""  # empty: bfloat16 on cuda, float32 on cpu
    max_batch_size: int = 32
    max_step_tokens: int = 16384  # new work a step takes on: prompt tokens to prefill, an image to encode counted as
    # the text tokens of equal matmul work (0: no limit; a request larger than this runs in a step of its own)
    batch_step_tokens: int = 2048  # the budget for batch lines (SETTINGS.priority batch) while people's requests are
    # about (one in the last 2 s): a person's request then waits for a shorter step in flight (0: max_step_tokens)
    admit_group: int = 0  # while more requests wait than there are free slots, admit none until this many slots
    # are free (0: as slots free): fewer, larger prefill steps, each reading every weight once
    mixed_steps: int = 1  # a step that admits requests decodes the running ones in its prefill forward (one read of
    # every weight a step, not two); 0: a decode step of its own after the prefill
    prefix_ahead: int = -1  # under a backlog, once this many waiting requests' images are encoded, their prefixes
    # are prefilled together ahead of admission, into the prefix cache (0: off, each prefilled as its request joins;
    # -1: PREFIX_AHEAD_MOE for a mixture of experts, whose prefill steps read every expert, with at least
    # PREFIX_AHEAD_MIN_BATCH slots, else off: see resolved_prefix_ahead)
    max_queue: int = 256
    page_size: int = 16
    kv_pages: int = 0  # 0: enough for max_batch_size full contexts
    max_context: int = 0  # 0: the model's context
    image_cache_size: int = 64
    prefix_cache_size: int = 64  # image prefixes whose KV pages outlive their request (0: off)
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 50_000_000
    max_objects: int = 150
    chaos_fail_after_steps: int = 0  # chaos testing: every step after this many fails (0: off)
    adapter_dir: str = ""  # LoRA adapters: <id>/final.pt, <id>.safetensors or <id>/*.safetensors
    max_adapters: int = 32  # adapters kept loaded on the device (LRU)
    max_adapter_rank: int = 32  # the device pool holds KESTREL_MAX_ADAPTERS slots of this rank
    image_workers: int = 0  # threads decoding and cropping images (0: from the machine's CPU count)
    seg_refiner_path: str = ""  # Moondream 3's segment refiner: model.pt (or a folder holding it)
    fp8_experts: str = "widen"  # FP8 experts (Kestrel's Moondream 3 files) on a GPU: widen (to dtype, at load),
    # fp8 (kept FP8: 8 GB less, faster steps of many rows, slower one-row steps and prefills) or both (8 GB more than
    # widen: FP8 in steps of 2 to 128 tokens, widened elsewhere); PERFORMANCE.md has the figures
    vision_fp8: int = 0  # 1: the vision encoder's qkv, fc1 and fc2 matmuls in FP8 (GPUs with FP8 tensor cores, bf16
    # models); README says what it costs in accuracy and gains in speed
    prefill_fp8: int = 0  # 1: the text model's qkv, fc1 and fc2 matmuls in FP8 in steps of 256 tokens or more (image
    # prefills; dense blocks only; same GPUs and models as vision_fp8); README says what it costs and gains
    vision_stream: int = 0  # 1: the image path on a CUDA stream of its own, beside the steps (runtime/vision_stream.py;
    # PERFORMANCE.md has the figures)
    drain_timeout_s: int = 25  # a stopping server lets admitted requests run this long (below tritonserver's
    # --exit-timeout-secs, 30 by default), then ends the rest with an error

    ENV = {
        "model_path": "KESTREL_MODEL_PATH", "model": "KESTREL_MODEL", "revision": "KESTREL_REVISION",
        "device": "KESTREL_DEVICE", "dtype": "KESTREL_DTYPE", "max_batch_size": "KESTREL_MAX_BATCH_SIZE",
        "max_step_tokens": "KESTREL_MAX_STEP_TOKENS", "batch_step_tokens": "KESTREL_BATCH_STEP_TOKENS",
        "admit_group": "KESTREL_ADMIT_GROUP",
        "mixed_steps": "KESTREL_MIXED_STEPS", "prefix_ahead": "KESTREL_PREFIX_AHEAD",
        "max_queue": "KESTREL_MAX_QUEUE", "page_size": "KESTREL_PAGE_SIZE", "kv_pages": "KESTREL_KV_PAGES",
        "max_context": "KESTREL_MAX_CONTEXT", "image_cache_size": "KESTREL_IMAGE_CACHE_SIZE",
        "prefix_cache_size": "KESTREL_PREFIX_CACHE_SIZE",
        "max_image_bytes": "KESTREL_MAX_IMAGE_BYTES", "max_image_pixels": "KESTREL_MAX_IMAGE_PIXELS",
        "max_objects": "KESTREL_MAX_OBJECTS", "chaos_fail_after_steps": "KESTREL_CHAOS_FAIL_AFTER_STEPS",
        "adapter_dir": "KESTREL_ADAPTER_DIR", "max_adapters": "KESTREL_MAX_ADAPTERS",
        "max_adapter_rank": "KESTREL_MAX_ADAPTER_RANK", "image_workers": "KESTREL_IMAGE_WORKERS",
        "seg_refiner_path": "KESTREL_SEG_REFINER_PATH", "drain_timeout_s": "KESTREL_DRAIN_TIMEOUT_S",
        "fp8_experts": "KESTREL_FP8_EXPERTS", "vision_fp8": "KESTREL_VISION_FP8",
        "prefill_fp8": "KESTREL_PREFILL_FP8", "vision_stream": "KESTREL_VISION_STREAM",
    }

    @classmethod
    def from_sources(cls, env: dict | None = None, parameters: dict | None = None,
                     instance: tuple[str, int] | None = None) -> "RuntimeConfig":
        """parameters: config.pbtxt `parameters` keyed by the same names as the env vars. instance: Triton's
        (model_instance_kind, model_instance_device_id): a KIND_GPU instance's engine runs on its own GPU."""
        env = os.environ if env is None else env
        parameters = parameters or {}
        values = {}
        for f in fields(cls):
            var = cls.ENV[f.name]
            raw = env.get(var) or parameters.get(var)
            if raw in (None, ""):
                continue
            if f.type == "int":
                try:
                    values[f.name] = int(raw)
                except ValueError:
                    raise ConfigError(f"{var} must be an integer, got {raw!r}") from None
            else:
                values[f.name] = str(raw)
        if instance is not None and instance[0] == "GPU":
            if values.get("device", "cuda") not in ("cuda", f"cuda:{instance[1]}"):
                raise ConfigError(f"KESTREL_DEVICE={values['device']} contradicts this instance's instance_group: "
                                  f"KIND_GPU on GPU {instance[1]}")
            values["device"] = f"cuda:{instance[1]}"
        config = cls(**values)
        config.validate()
        return config

    def resolved_prefix_ahead(self, mixture_of_experts: bool) -> int:
        """prefix_ahead, its default (-1) resolved for a model with or without experts."""
        if self.prefix_ahead >= 0:
            return self.prefix_ahead
        return PREFIX_AHEAD_MOE if mixture_of_experts and self.max_batch_size >= PREFIX_AHEAD_MIN_BATCH else 0

    def validate(self) -> None:
        positive = ["max_batch_size", "max_queue", "page_size", "image_cache_size", "max_image_bytes",
                    "max_image_pixels", "max_objects", "max_adapters", "max_adapter_rank"]
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{self.ENV[name]} must be at least 1, got {getattr(self, name)}")
        for name in ("kv_pages", "max_context", "prefix_cache_size", "chaos_fail_after_steps", "image_workers",
                     "drain_timeout_s", "max_step_tokens", "batch_step_tokens", "admit_group", "mixed_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{self.ENV[name]} must be 0 or positive, got {getattr(self, name)}")
        if self.prefix_ahead < -1:
            raise ConfigError(f"KESTREL_PREFIX_AHEAD must be -1 (by model), 0 or positive, got {self.prefix_ahead}")
        for name in ("vision_fp8", "prefill_fp8"):
            if getattr(self, name) not in (0, 1):
                raise ConfigError(f"{self.ENV[name]} must be 0 or 1, got {getattr(self, name)}")
        if self.fp8_experts not in FP8_EXPERT_MODES:
            raise ConfigError(f"KESTREL_FP8_EXPERTS must be one of {', '.join(FP8_EXPERT_MODES)}, "
                              f"got {self.fp8_experts!r}")
        if self.vision_stream not in (0, 1):
            raise ConfigError(f"KESTREL_VISION_STREAM must be 0 or 1, got {self.vision_stream}")
        if self.device not in ("", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"KESTREL_DEVICE must be cuda or cpu, got {self.device!r}")
        if self.dtype not in ("",) + DTYPES:
            raise ConfigError(f"KESTREL_DTYPE must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.adapter_dir and not Path(self.adapter_dir).is_dir():
            raise ConfigError(f"KESTREL_ADAPTER_DIR {self.adapter_dir!r} is not a folder")
        if self.model_path and not Path(self.model_path).exists():
            raise ConfigError(f"KESTREL_MODEL_PATH {self.model_path!r} does not exist")
        if self.seg_refiner_path and not Path(self.seg_refiner_path).exists():
            raise ConfigError(f"KESTREL_SEG_REFINER_PATH {self.seg_refiner_path!r} does not exist")

    @property
    def uses_tiny_checkpoint(self) -> bool:
        return not self.model_path and not self.model

    def checkpoint(self) -> Path:
        if self.model_path:
            return Path(self.model_path)
        if self.model:
            from .model.hub import resolve_checkpoint

            return resolve_checkpoint(self.model, self.revision or None)
        return TINY_CHECKPOINT

    def tokenizer_dir(self) -> Path | None:
        """Where the tokenizer is, if not beside the weights: a hub model's own tokenizer repository (Moondream 3)."""
        if self.model_path or not self.model:
            return None
        from .model.hub import resolve_tokenizer

        return resolve_tokenizer(self.model)

    def seg_refiner(self) -> Path | None:
        """Moondream 3's segment refiner weights: KESTREL_SEG_REFINER_PATH, else (a model from the hub) its own
        download, moondream/SegHeadRefiner; a local model without the variable has none (coarse outlines)."""
        if self.seg_refiner_path:
            return Path(self.seg_refiner_path)
        if self.model_path or not self.model:
            return None
        from .model.hub import resolve_seg_refiner

        return resolve_seg_refiner()

    def image_worker_count(self) -> int:
        """Threads for image decode and cropping: KESTREL_IMAGE_WORKERS, else a third of the CPUs this process may
        use (usable_cpus: its cpuset and CPU limit), 2 to 8. More took the CPUs from the engine thread, whose
        launches then kept the GPU waiting (H100 machine of 16 CPUs, a burst of chart queries at batch 64: 80 req/s
        with 14 threads, 106 with 4 to 6)."""
        return self.image_workers or max(2, min(8, usable_cpus() // 3))

    def torch_device(self) -> str:
        import torch

        return self.device or ("cuda" if torch.cuda.is_available() else "cpu")

    def torch_dtype(self):
        import torch

        name = self.dtype or ("bfloat16" if self.torch_device().startswith("cuda") else "float32")
        return getattr(torch, name)
