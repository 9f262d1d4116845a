"""The scheduler's parts that differ on a GPU: Triton prefill attention, CUDA graphs of prefill, decode and the
vision encoder, crops staged on the device. Each maker returns None (or the torch path) on the CPU."""

from __future__ import annotations

from ..model.moondream import Moondream
from ..model.weights import CheckpointError
from .attention import TorchPagedAttention
from .kv_cache import PagedKVCache


def make_attention(cache: PagedKVCache):
    """Attention for the flat (prefill) forwards: a Triton kernel for fresh sequences on a GPU."""
    if cache.k.device.type != "cuda":
        return TorchPagedAttention(cache)
    from .prefill_plan import PrefillAttention

    return PrefillAttention(cache)


def make_prefill_graphs(model: Moondream, cache: PagedKVCache, max_context: int, max_batch: int,
                        mixed_steps: bool = False, adapters=None):
    """CUDA graphs for prefill steps on a GPU; None elsewhere. A mixed step holds up to twice max_batch sequences:
    the running ones and the new ones that take the slots of those taking their last token in it (with graphs of
    max_batch, such steps ran eagerly: chain-of-thought bursts 6 to 27% slower)."""
    if model.device.type != "cuda":
        return None
    from .prefill_graphs import PrefillGraphs

    return PrefillGraphs(model, cache, max_context, 2 * max_batch if mixed_steps else max_batch, adapters)


def make_crop_encoder(model: Moondream):
    """CUDA graphs of the vision encoder on a GPU; None (eager) elsewhere."""
    if model.device.type != "cuda":
        return None
    from .vision_graphs import CropEncoderGraphs

    return CropEncoderGraphs(model)


def make_vision_stream(model: Moondream, on: bool):
    """The image path's own CUDA stream (runtime.vision_stream) on a GPU if on; None elsewhere."""
    if model.device.type != "cuda" or not on:
        return None
    from .vision_stream import VisionStream

    return VisionStream(model.device)


def make_crop_staging(model: Moondream):
    """Crops copied to the GPU ahead of their encode (runtime.crop_staging) on a GPU; None elsewhere."""
    if model.device.type != "cuda":
        return None
    from .crop_staging import CropStaging

    return CropStaging(model)


def check_kernel_shapes(cfg) -> None:
    """Refuse at load, with the widths named, a text model the GPU kernels cannot run (rather than failing inside
    Triton's compiler at the first step)."""
    from ..kernels.decode_kernels import shape_problems

    problems = shape_problems(cfg.dim, cfg.ff_dim, cfg.head_dim, cfg.rope_dim, cfg.vocab_size)
    if problems:
        raise CheckpointError(f"the GPU engine's kernels cannot serve this text model: {'; '.join(problems)} "
                              "(the CPU engine can: KESTREL_DEVICE=cpu)")


def make_decoder(model: Moondream, cache: PagedKVCache, max_batch: int, max_context: int, adapters=None):
    """CUDA graphs of the fused Triton decode kernels on a GPU; None (torch attention) elsewhere."""
    if model.device.type != "cuda":
        return None
    from .cuda_decode import CudaGraphDecoder

    check_kernel_shapes(model.config.text)

    return CudaGraphDecoder(model, cache, max_batch, max_context, adapters)
