import os
from pathlib import Path

import pytest

TINY = Path(__file__).parent / "fixtures" / "md2-tiny"
SHARED_TINY = Path(__file__).parents[2] / "shared" / "fixtures" / "md2-tiny"


def fixture_dirs() -> list[Path]:
    return [p for p in (TINY, SHARED_TINY) if (p / "cases.json").exists()]


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return TINY


@pytest.fixture(scope="session")
def tiny_model():
    import torch

    from kestrel_backend.model.moondream import Moondream

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    return Moondream.from_checkpoint(TINY, dtype=torch.float32)
