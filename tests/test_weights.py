import pytest
import torch
from safetensors.torch import load_file, save_file

from kestrel_backend.model.config import MoondreamConfig
from kestrel_backend.model.moondream import Moondream
from kestrel_backend.model.weights import CheckpointError, load_state


@pytest.fixture(scope="module")
def config(tiny_dir):
    return MoondreamConfig.from_file(tiny_dir / "config.json")


@pytest.fixture(scope="module")
def raw(tiny_dir):
    return load_file(str(tiny_dir / "model.safetensors"))


def test_both_layouts_and_pt_give_identical_tensors(tiny_dir, config, raw, tmp_path):
    current = load_state(tiny_dir / "model.safetensors", config)
    legacy = load_state(tiny_dir / "legacy" / "model.safetensors", config)
    torch.save(load_file(str(tiny_dir / "legacy" / "model.safetensors")), tmp_path / "model.pt")
    pt = load_state(tmp_path / "model.pt", config)
    assert current.keys() == legacy.keys() == pt.keys()
    for k in current:
        assert torch.equal(current[k], legacy[k]) and torch.equal(current[k], pt[k]), k


def test_sharded_folder_loads(config, raw, tmp_path):
    names = sorted(raw)
    save_file({k: raw[k] for k in names[:100]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({k: raw[k] for k in names[100:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    assert len(load_state(tmp_path, config)) == len(raw)


def test_missing_tensor_is_named(config, raw, tmp_path):
    broken = dict(raw)
    del broken["model.text.blocks.1.mlp.fc2.bias"]
    save_file(broken, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'text\.blocks\.1\.mlp\.fc2\.bias'"):
        load_state(tmp_path / "model.safetensors", config)


def test_wrong_shape_is_named(config, raw, tmp_path):
    broken = dict(raw)
    broken["model.vision.blocks.3.attn.qkv.weight"] = torch.zeros(5, 64, dtype=torch.bfloat16)
    save_file(broken, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'vision\.blocks\.3\.attn\.qkv\.weight' has shape \(5, 64\), expected \(192, 64\)"):
        load_state(tmp_path / "model.safetensors", config)


def test_extra_tensor_is_named(config, raw, tmp_path):
    broken = dict(raw)
    broken["model.text.blocks.9.ln.weight"] = torch.zeros(128, dtype=torch.bfloat16)
    save_file(broken, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'text\.blocks\.9\.ln\.weight'"):
        load_state(tmp_path / "model.safetensors", config)


def test_unknown_legacy_tensor_is_named(config, tiny_dir, tmp_path):
    legacy = load_file(str(tiny_dir / "legacy" / "model.safetensors"))
    legacy["text_model.transformer.rotary.inv_freq"] = torch.zeros(16)
    save_file(legacy, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'text_model\.transformer\.rotary\.inv_freq'"):
        load_state(tmp_path / "model.safetensors", config)


def test_garbage_file_is_named(config, tmp_path):
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"this is not a checkpoint")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot read checkpoint file"):
        load_state(bad, config)


def test_wrong_file_type_and_missing_path(config, tmp_path):
    (tmp_path / "weights.txt").write_text("hello")
    with pytest.raises(CheckpointError, match=r"weights\.txt: unsupported weight file type"):
        load_state(tmp_path / "weights.txt", config)
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors or \*\.pt weight file"):
        load_state(tmp_path, config)
    with pytest.raises(CheckpointError, match=r"does-not-exist: checkpoint path does not exist"):
        load_state(tmp_path / "does-not-exist", config)


def test_config_with_unknown_key_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"unknown text keys \['depth'\]"):
        MoondreamConfig.from_dict({"text": {"depth": 3}})


def test_checkpoint_from_a_local_huggingface_cache(tiny_dir, tmp_path, monkeypatch):
    """The hub path is real huggingface_hub code, pointed at a cache laid out as the hub leaves it."""
    import shutil

    from kestrel_backend.model.hub import resolve_checkpoint

    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--vikhyatk--moondream2"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        shutil.copy(tiny_dir / name, snapshot / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    folder = resolve_checkpoint("moondream2", cache_dir=str(tmp_path))
    assert folder == snapshot
    model = Moondream.from_checkpoint(folder)
    assert model.config.text.dim == 128 and model.tokenizer is not None
