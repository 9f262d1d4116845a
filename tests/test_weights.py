from pathlib import Path

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


def _hub_cache(cache: Path, repo_id: str, files: list[Path], monkeypatch) -> Path:
    """A repository's snapshot in a Hugging Face cache laid out as the hub leaves it (offline from then on)."""
    import shutil

    import huggingface_hub.constants as hc

    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for file in files:
        shutil.copy(file, snapshot / file.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    return snapshot


def test_checkpoint_from_a_local_huggingface_cache(tiny_dir, tmp_path, monkeypatch):
    """The hub path is real huggingface_hub code, pointed at a cache laid out as the hub leaves it."""
    from kestrel_backend.model.hub import resolve_checkpoint, resolve_tokenizer

    snapshot = _hub_cache(tmp_path, "vikhyatk/moondream2",
                          [tiny_dir / n for n in ("config.json", "model.safetensors", "tokenizer.json")], monkeypatch)
    folder = resolve_checkpoint("moondream2", cache_dir=str(tmp_path))
    assert folder == snapshot and resolve_tokenizer("moondream2", cache_dir=str(tmp_path)) is None
    model = Moondream.from_checkpoint(folder)
    assert model.config.text.dim == 128 and model.tokenizer is not None


def test_moondream3_from_the_hub_takes_its_tokenizer_from_its_own_repository(tiny_dir, tmp_path, monkeypatch):
    """moondream3-preview keeps no tokenizer.json: it comes from moondream/starmie-v1."""
    from kestrel_backend.model.hub import resolve_checkpoint, resolve_tokenizer

    md3 = tiny_dir.parent / "md3-tiny"
    _hub_cache(tmp_path, "moondream/moondream3-preview", [md3 / "config.json", md3 / "model.safetensors"], monkeypatch)
    _hub_cache(tmp_path, "moondream/starmie-v1", [tiny_dir / "tokenizer.json"], monkeypatch)
    folder = resolve_checkpoint("moondream3-preview", cache_dir=str(tmp_path))
    model = Moondream.from_checkpoint(folder, tokenizer_dir=resolve_tokenizer("moondream3-preview", str(tmp_path)))
    assert model.config.is_moondream3 and model.tokenizer is not None


def test_moondream3_config_and_checkpoint_errors_name_the_tensor(tiny_dir, tmp_path):
    """Moondream 3 is told from its Hugging Face config.json alone (no flag); a missing expert tensor or a tau matrix
    of the wrong shape fails with the tensor's name; an unknown MoE key is refused."""
    folder = tiny_dir.parent / "md3-tiny"
    config = MoondreamConfig.from_file(folder / "config.json")
    assert config.is_moondream3 and config.text.tau_attn and config.region.decoder == "linear"
    assert (config.text.moe.n_experts, config.text.moe.n_experts_per_tok, config.text.max_context) == (8, 3, 32768)
    assert not MoondreamConfig.from_file(tiny_dir / "config.json").is_moondream3
    raw = load_file(str(folder / "model.safetensors"))
    missing = {k: v for k, v in raw.items() if k != "model.text.blocks.2.mlp.fc2.weight"}
    save_file(missing, str(tmp_path / "missing.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'text\.blocks\.2\.mlp\.fc2\.weight'"):
        load_state(tmp_path / "missing.safetensors", config)
    bad = {**raw, "model.text.blocks.0.attn.tau.wq": raw["model.text.blocks.0.attn.tau.wq"][:, :10].contiguous()}
    save_file(bad, str(tmp_path / "bad.safetensors"))
    with pytest.raises(CheckpointError, match=r"tensor 'text\.blocks\.0\.attn\.tau\.wq' has shape \(2, 10\)"):
        load_state(tmp_path / "bad.safetensors", config)
    with pytest.raises(ValueError, match="unknown text moe keys"):
        MoondreamConfig.from_dict({"model_type": "moondream3", "config": {"text": {"moe": {"experts": 4}}}})


def test_kestrel_moondream3_checkpoint_with_fp8_experts_loads(tiny_dir, tmp_path):
    """Kestrel's Moondream 3 files (model_fp8.pt): legacy names, tau's two matrices as one, experts in FP8 with a
    scale per output row. Every tensor equals the current layout's, the experts their FP8 values times the scales;
    kept in FP8 (on a GPU) each expert's weights are the same; the family is told from the names; an FP8 weight
    without its scale is refused by name."""
    from kestrel_backend.model.legacy_layout import to_fp8, to_kestrel_layout
    from kestrel_backend.model.weights import build_weights, checkpoint_family, is_expert_weight, is_moe_layer

    md3 = tiny_dir.parent / "md3-tiny"
    config = MoondreamConfig.from_file(md3 / "config.json")
    raw = load_file(str(md3 / "model.safetensors"))
    kestrel = to_kestrel_layout(raw, config.text.n_layers)
    expected = {}
    for name, tensor in raw.items():
        if is_expert_weight(name, tensor):
            fp8, scale = to_fp8(tensor)
            expected[name.removeprefix("model.")] = fp8.float() * scale[..., None]
    folder = tmp_path / "kestrel"
    folder.mkdir()
    torch.save(kestrel, folder / "model_fp8.pt")
    assert checkpoint_family(folder) == "moondream3" and checkpoint_family(tiny_dir) == "moondream2"

    current, loaded = load_state(md3 / "model.safetensors", config), load_state(folder, config)
    moe_layers = [i for i in range(config.text.n_layers) if is_moe_layer(config.text, i)]
    assert current.keys() == loaded.keys()
    for name in current:
        want = expected.get(name, current[name])
        assert torch.equal(loaded[name], want), name
    one_file = tmp_path / "moondream3.1"  # (moondream3.1-9B-A2B's file: the same layout as one model.safetensors)
    one_file.mkdir()
    save_file({k: t.contiguous() for k, t in kestrel.items()}, str(one_file / "model.safetensors"))
    assert checkpoint_family(one_file) == "moondream3"
    from_safetensors = load_state(one_file, config)
    assert all(torch.equal(from_safetensors[k], loaded[k]) for k in loaded) and from_safetensors.keys() == loaded.keys()
    assert 0 < (loaded["text.blocks.2.mlp.fc1.weight"] - current["text.blocks.2.mlp.fc1.weight"]).abs().max() < 0.1

    # kept FP8 (as on a GPU): the experts' FP8 weights and scales, each expert's weights those dequantised at load
    kept = load_state(folder, config, keep_fp8=True)
    assert kept["text.blocks.2.mlp.fc1.weight"].dtype == torch.float8_e4m3fn
    scales = {f"text.blocks.{i}.mlp.fc{j}.weight_scale" for i in moe_layers for j in (1, 2)}
    assert kept.keys() - loaded.keys() == scales
    moe = build_weights(kept, config, torch.float32, "cpu").text.blocks[2].moe
    assert moe.fc1.dtype == torch.float8_e4m3fn and moe.fc2_scale.shape == moe.fc2.shape[:2]
    for e in range(moe.fc1.shape[0]):
        fc1, fc2 = moe.expert(e, torch.float32)
        assert torch.equal(fc1, loaded["text.blocks.2.mlp.fc1.weight"][e])
        assert torch.equal(fc2, loaded["text.blocks.2.mlp.fc2.weight"][e])

    both = build_weights(kept, config, torch.float32, "cpu", wide_experts=True).text.blocks[2].moe  # (=both)
    assert both.fc1.dtype == torch.float8_e4m3fn and both.fc1_scale is not None
    assert torch.equal(both.fc1_wide, loaded["text.blocks.2.mlp.fc1.weight"])
    assert torch.equal(both.fc2_wide, loaded["text.blocks.2.mlp.fc2.weight"])
    assert moe.fc1_wide is None

    del kestrel["text_model.transformer.h.2.moe_quant.down_scale"]
    torch.save(kestrel, folder / "model_fp8.pt")
    with pytest.raises(CheckpointError, match=r"'text\.blocks\.2\.mlp\.fc2\.weight' is FP8 but has no scale"):
        load_state(folder, config)
