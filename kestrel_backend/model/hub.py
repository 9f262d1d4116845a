"""Where a checkpoint comes from: a local path, or the Hugging Face Hub through huggingface_hub."""

from __future__ import annotations

from pathlib import Path

# The official repositories (the Moondream 3 ones are gated: HF_TOKEN must hold a token with access).
# moondream3.1-9B-A2B is a single model.safetensors in Kestrel's layout, its experts in FP8 (model/weights.py).
MODELS = {"moondream2": "vikhyatk/moondream2", "moondream3-preview": "moondream/moondream3-preview",
          "moondream3.1-9B-A2B": "moondream/moondream3.1-9B-A2B"}
# Repositories whose tokenizer lives in a repository of its own.
TOKENIZERS = {"moondream/moondream3-preview": "moondream/starmie-v1",
              "moondream/moondream3.1-9B-A2B": "moondream/starmie-v1"}
CHECKPOINT_PATTERNS = ["*.safetensors", "config.json", "tokenizer.json"]


def resolve_checkpoint(model: str, revision: str | None = None, cache_dir: str | None = None) -> Path:
    """Download (or reuse from the HF cache) a checkpoint folder. HF_TOKEN / HF_HOME / HF_HUB_OFFLINE apply."""
    from huggingface_hub import snapshot_download

    repo_id = MODELS.get(model, model)
    return Path(snapshot_download(repo_id=repo_id, revision=revision, cache_dir=cache_dir,
                                  allow_patterns=CHECKPOINT_PATTERNS))


def resolve_tokenizer(model: str, cache_dir: str | None = None) -> Path | None:
    """The folder of the model's tokenizer.json where its repository keeps none (else None)."""
    repo_id = TOKENIZERS.get(MODELS.get(model, model))
    if repo_id is None:
        return None
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id=repo_id, cache_dir=cache_dir, allow_patterns=["tokenizer.json"]))


SEG_REFINER = "moondream/SegHeadRefiner"  # Moondream 3's segment refiner head (gated like the model: HF_TOKEN)


def resolve_seg_refiner(cache_dir: str | None = None) -> Path:
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(repo_id=SEG_REFINER, filename="model.pt", cache_dir=cache_dir))
