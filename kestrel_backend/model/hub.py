"""Where a checkpoint comes from: a local path, or the Hugging Face Hub through huggingface_hub."""

from __future__ import annotations

from pathlib import Path

# The official repository and the file patterns a Moondream 2 checkpoint needs.
MODELS = {"moondream2": "vikhyatk/moondream2"}
CHECKPOINT_PATTERNS = ["*.safetensors", "config.json", "tokenizer.json"]


def resolve_checkpoint(model: str, revision: str | None = None, cache_dir: str | None = None) -> Path:
    """Download (or reuse from the HF cache) a checkpoint folder. HF_TOKEN / HF_HOME / HF_HUB_OFFLINE apply."""
    from huggingface_hub import snapshot_download

    repo_id = MODELS.get(model, model)
    folder = snapshot_download(repo_id=repo_id, revision=revision, cache_dir=cache_dir,
                               allow_patterns=CHECKPOINT_PATTERNS)
    return Path(folder)
