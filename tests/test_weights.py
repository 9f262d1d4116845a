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


def _kestrel_name(name: str, tensor: torch.Tensor) -> str:
    """A current-layout Moondream 3 tensor's name in Kestrel's checkpoints (its legacy layout)."""
    name = name.removeprefix("model.")
    visual = "vision_encoder.encoder.model.visual."
    fixed = {"vision.patch_emb.": visual + "patch_embed.linear.", "vision.pos_emb": visual + "pos_embed",
             "vision.post_ln.": visual + "norm.", "vision.proj_mlp.": "vision_encoder.projection.mlp.",
             "text.wte": "text_model.transformer.embd.wte.weight", "text.post_ln.": "text_model.lm_head.ln.",
             "text.lm_head.": "text_model.lm_head.linear.",
             "region.coord_features": "region_model.coordinate_features.weight",
             "region.size_features": "region_model.size_features.weight",
             "region.coord_encoder.": "region_model.coordinate_encoder.",
             "region.size_encoder.": "region_model.size_encoder.",
             "region.coord_decoder.": "region_model.coordinate_head.",
             "region.size_decoder.": "region_model.size_head.",
             "region.ln.": "region_model.ln."}
    for old, new in fixed.items():
        if name.startswith(old):
            return new + name[len(old):]
    kind, _, index, rest = name.split(".", 3)
    if kind == "vision":
        for old, new in {"ln1.": "norm1.", "ln2.": "norm2."}.items():
            rest = rest.replace(old, new)
        return f"{visual}blocks.{index}.{rest}"
    parts = {"attn.qkv.": "mixer.Wqkv.", "attn.proj.": "mixer.out_proj.", "mlp.router.": "gate.",
             "attn.tau.alpha": "tau_alpha"}
    if ".mlp.fc" in name and tensor.dim() == 3:  # the experts
        parts = {"mlp.fc1.weight": "mlp.experts.weight", "mlp.fc2.weight": "mlp.output_experts.weight"}
    for old, new in parts.items():
        rest = rest.replace(old, new)
    return f"text_model.transformer.h.{index}.{rest}"


def test_kestrel_moondream3_checkpoint_with_fp8_experts_loads(tiny_dir, tmp_path):
    """Kestrel's Moondream 3 files (model_fp8.pt): legacy names, tau's two matrices as one, experts in FP8 with a
    scale per output row. Every tensor equals the current layout's, the experts their FP8 values times the scales;
    the family is told from the names; an FP8 weight without its scale is refused by name."""
    from kestrel_backend.model.weights import checkpoint_family

    md3 = tiny_dir.parent / "md3-tiny"
    config = MoondreamConfig.from_file(md3 / "config.json")
    raw = load_file(str(md3 / "model.safetensors"))
    kestrel, expected = {}, {}
    for name, tensor in raw.items():
        if ".attn.tau.w" in name:
            continue
        if name.endswith("_features"):
            tensor = tensor.T.contiguous()
        if ".mlp.fc" in name and tensor.dim() == 3:  # the experts, in FP8
            scale = tensor.float().abs().amax(dim=-1) / 448.0
            fp8 = (tensor.float() / scale[..., None]).to(torch.float8_e4m3fn)
            expected[name.removeprefix("model.")] = fp8.float() * scale[..., None]
            layer = name.split(".")[3]
            kind = "up_scale" if ".fc1." in name else "down_scale"
            kestrel[f"text_model.transformer.h.{layer}.moe_quant.{kind}"] = scale
            tensor = fp8
        kestrel[_kestrel_name(name, tensor)] = tensor
    for i in range(config.text.n_layers):
        wq, wv = raw[f"model.text.blocks.{i}.attn.tau.wq"], raw[f"model.text.blocks.{i}.attn.tau.wv"]
        kestrel[f"text_model.transformer.h.{i}.tau_wqwv"] = torch.cat([wq, wv])
    folder = tmp_path / "kestrel"
    folder.mkdir()
    torch.save(kestrel, folder / "model_fp8.pt")
    assert checkpoint_family(folder) == "moondream3" and checkpoint_family(tiny_dir) == "moondream2"

    current, loaded = load_state(md3 / "model.safetensors", config), load_state(folder, config)
    assert current.keys() == loaded.keys()
    for name in current:
        want = expected.get(name, current[name])
        assert torch.equal(loaded[name], want), name
    assert 0 < (loaded["text.blocks.2.mlp.fc1.weight"] - current["text.blocks.2.mlp.fc1.weight"]).abs().max() < 0.1

    del kestrel["text_model.transformer.h.2.moe_quant.down_scale"]
    torch.save(kestrel, folder / "model_fp8.pt")
    with pytest.raises(CheckpointError, match=r"'text\.blocks\.2\.mlp\.fc2\.weight' is FP8 but has no scale"):
        load_state(folder, config)
