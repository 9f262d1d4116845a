"""Checkpoint loading: safetensors or .pt, in both official Moondream 2 tensor-name layouts, 4-bit or not,
and Moondream 3's.

Current layout: model.vision.blocks.N.*, model.text.blocks.N.*, model.region.*
Legacy layout:  vision_encoder.encoder.model.visual.*, text_model.transformer.h.N.*, region_model.*
Moondream 3 (current layout) adds model.text.blocks.N.attn.tau.{alpha,wq,wv}; its MoE layers hold
mlp.router.{weight,bias} and the experts' stacked mlp.fc1.weight [E, 2 * inner, dim] and mlp.fc2.weight
[E, dim, inner] (no biases); its region decoders are single Linears after model.region.ln.
Moondream 3 in the legacy layout (Kestrel's checkpoints: moondream3-preview's model_fp8.pt, moondream3.1's
model.safetensors) names its MoE tensors text_model.transformer.h.N.{gate, mlp.experts, mlp.output_experts}, holds
the experts in FP8 (e4m3) with a scale per output row (h.N.moe_quant.{up_scale, down_scale}: weight = fp8 * scale),
and tau as h.N.tau_alpha with h.N.tau_wqwv (or tau_wq and tau_wv).
Both are normalised to the current names (without "model."), FP8 experts dequantised, checked against the shapes
the config implies, and turned into plain tensors grouped in small dataclasses.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import FP8_EXPERT_MODES, MoondreamConfig
from .legacy_layout import FP8_SCALE, is_expert_weight, is_legacy_layout, legacy_to_current, split_tau
from ..kernels.packed import PackedWeight


log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint file is unreadable or its tensors do not match the config."""


@dataclass
class Linear:
    weight: torch.Tensor
    bias: torch.Tensor


@dataclass
class LayerNorm:
    weight: torch.Tensor
    bias: torch.Tensor


@dataclass
class MLP:
    fc1: Linear
    fc2: Linear


@dataclass
class VisionBlock:
    ln1: LayerNorm
    qkv: Linear
    proj: Linear
    ln2: LayerNorm
    mlp: MLP


@dataclass
class VisionWeights:
    patch_emb: Linear  # in-dim zero-padded to a multiple of 8 (vision.embed_patches says why)
    pos_emb: torch.Tensor
    blocks: list[VisionBlock]
    post_ln: LayerNorm
    proj_mlp: MLP
    bias_sums: torch.Tensor  # float32 [2 * layers + 1, dim]: row i sums the first i residual biases (proj, fc2, ...)
    fp8: list | None = None  # per block, Fp8Blocks: KESTREL_VISION_FP8 (vision.quantize_encoder)


@dataclass
class Fp8Blocks:
    """A block's matmuls kept in e4m3 too (kernels.fp8_linear.Fp8Weight; model/fp8.py)."""
    qkv: object
    fc1: object  # its rows, and so fc2's columns, padded with zeros to a multiple of fp8.FP8_FF_STEP
    fc1_bias: torch.Tensor  # padded alike
    fc2: object
    gelu_bound: tuple[float, float]  # (fc1's longest row, its largest bias): layer_norm_cuda bounds fc1's output


@dataclass
class Tau:
    """Moondream 3's per-head q and v scales: tanh(gelu(qkv) @ w^T) + 1 + sigmoid(alpha * log(pos + 1)) - 0.5."""

    alpha: torch.Tensor  # [heads]
    w: torch.Tensor  # [2 * heads, qkv_dim]: the checkpoint's wq then wv (one matmul for both)


@dataclass
class MoE:
    """Moondream 3's expert MLPs: each token goes to its top-k experts by router logit, weighted by the softmax
    of those k logits; an expert computes fc2(gelu(h) * (g + 1)) where fc1 gives [h, g]."""

    router: Linear  # [E, dim]
    fc1: torch.Tensor  # [E, 2 * inner, dim]
    fc2: torch.Tensor  # [E, dim, inner]
    top_k: int
    # Kestrel's FP8 checkpoints on a GPU: fc1 and fc2 stay FP8 (e4m3), weight = fp8 * the float32 scale of its row
    fc1_scale: torch.Tensor | None = None  # [E, 2 * inner]
    fc2_scale: torch.Tensor | None = None  # [E, dim]
    # KESTREL_FP8_EXPERTS=both: the same experts widened (fp8 * scale in dtype) beside the FP8 ones, for the steps
    # where reading FP8 is slower (long prefills, one-row decode steps: runtime.moe_kernels.experts_for)
    fc1_wide: torch.Tensor | None = None
    fc2_wide: torch.Tensor | None = None

    def expert(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's fc1 and fc2 weights in dtype (FP8 ones times their scales, in float32 first)."""
        def weight(w, scale):
            return w[e].to(dtype) if scale is None else (w[e].float() * scale[e, :, None]).to(dtype)

        return weight(self.fc1, self.fc1_scale), weight(self.fc2, self.fc2_scale)

    def widened(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """fc1 and fc2 of every expert in dtype, as expert() gives them (an expert at a time: no float32 copy of a
        whole layer)."""
        pairs = [self.expert(e, dtype) for e in range(self.fc1.shape[0])]
        return torch.stack([fc1 for fc1, _ in pairs]), torch.stack([fc2 for _, fc2 in pairs])


@dataclass
class TextBlock:
    ln: LayerNorm
    qkv: Linear
    proj: Linear
    mlp: MLP | None  # None in MoE layers
    out_bias: torch.Tensor  # proj.bias + mlp.fc2.bias: both land on the same residual (proj.bias alone with MoE)
    tau: Tau | None = None
    moe: MoE | None = None


@dataclass
class TextWeights:
    wte: torch.Tensor
    blocks: list[TextBlock]
    post_ln: LayerNorm
    lm_head: Linear
    fp8: list | None = None  # per block, Fp8Blocks or None (MoE blocks): KESTREL_PREFILL_FP8 (text.quantize_prefill)


@dataclass
class RegionWeights:
    coord_features: torch.Tensor
    coord_encoder: Linear
    coord_decoder: MLP | Linear  # Linear (after ln) on Moondream 3
    size_features: torch.Tensor
    size_encoder: Linear
    size_decoder: MLP | Linear
    ln: LayerNorm | None = None  # Moondream 3: normalises the hidden state before either decoder


@dataclass
class MoondreamWeights:
    vision: VisionWeights
    text: TextWeights
    region: RegionWeights


def expected_shapes(config: MoondreamConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a checkpoint in the current layout, with the shape the config implies."""
    t, v, r = config.text, config.vision, config.region
    shapes: dict[str, tuple[int, ...]] = {}

    def linear(name, n_in, n_out):
        shapes[f"{name}.weight"] = (n_out, n_in)
        shapes[f"{name}.bias"] = (n_out,)

    def norm(name, n):
        shapes[f"{name}.weight"] = (n,)
        shapes[f"{name}.bias"] = (n,)

    patch_dim = v.enc_patch_size * v.enc_patch_size * v.in_channels
    linear("vision.patch_emb", patch_dim, v.enc_dim)
    shapes["vision.pos_emb"] = (1, v.grid * v.grid, v.enc_dim)
    for i in range(v.enc_n_layers):
        b = f"vision.blocks.{i}"
        norm(f"{b}.ln1", v.enc_dim)
        linear(f"{b}.attn.qkv", v.enc_dim, 3 * v.enc_dim)
        linear(f"{b}.attn.proj", v.enc_dim, v.enc_dim)
        norm(f"{b}.ln2", v.enc_dim)
        linear(f"{b}.mlp.fc1", v.enc_dim, v.enc_ff_dim)
        linear(f"{b}.mlp.fc2", v.enc_ff_dim, v.enc_dim)
    norm("vision.post_ln", v.enc_dim)
    linear("vision.proj_mlp.fc1", 2 * v.enc_dim, v.proj_inner_dim)
    linear("vision.proj_mlp.fc2", v.proj_inner_dim, v.proj_out_dim)

    shapes["text.wte"] = (t.vocab_size, t.dim)
    qkv_dim = t.dim + 2 * t.n_kv_heads * t.head_dim
    for i in range(t.n_layers):
        b = f"text.blocks.{i}"
        norm(f"{b}.ln", t.dim)
        linear(f"{b}.attn.qkv", t.dim, qkv_dim)
        linear(f"{b}.attn.proj", t.dim, t.dim)
        if t.tau_attn:
            shapes[f"{b}.attn.tau.alpha"] = (t.n_heads,)
            shapes[f"{b}.attn.tau.wq"] = (t.n_heads, qkv_dim)
            shapes[f"{b}.attn.tau.wv"] = (t.n_heads, qkv_dim)
        if is_moe_layer(t, i):
            linear(f"{b}.mlp.router", t.dim, t.moe.n_experts)
            shapes[f"{b}.mlp.fc1.weight"] = (t.moe.n_experts, 2 * t.moe.expert_inner_dim, t.dim)
            shapes[f"{b}.mlp.fc2.weight"] = (t.moe.n_experts, t.dim, t.moe.expert_inner_dim)
        else:
            linear(f"{b}.mlp.fc1", t.dim, t.ff_dim)
            linear(f"{b}.mlp.fc2", t.ff_dim, t.dim)
    norm("text.post_ln", t.dim)
    linear("text.lm_head", t.dim, t.vocab_size)

    shapes["region.coord_features"] = (1, r.coord_feat_dim // 2)
    linear("region.coord_encoder", r.coord_feat_dim, r.dim)
    shapes["region.size_features"] = (2, r.size_feat_dim // 2)
    linear("region.size_encoder", r.size_feat_dim, r.dim)
    if r.decoder == "linear":
        norm("region.ln", r.dim)
        linear("region.coord_decoder", r.dim, r.coord_out_dim)
        linear("region.size_decoder", r.dim, r.size_out_dim)
    else:
        linear("region.coord_decoder.fc1", r.dim, r.inner_dim)
        linear("region.coord_decoder.fc2", r.inner_dim, r.coord_out_dim)
        linear("region.size_decoder.fc1", r.dim, r.inner_dim)
        linear("region.size_decoder.fc2", r.inner_dim, r.size_out_dim)
    return shapes


def is_moe_layer(config, layer: int) -> bool:
    return config.moe is not None and layer >= config.moe.start_layer


def normalise_names(tensors: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """Map either official layout onto the current names (no "model." prefix)."""
    tensors = {k.replace("._orig_mod", ""): v for k, v in tensors.items()}
    if not is_legacy_layout(tensors):
        return {k.removeprefix("model."): v for k, v in tensors.items()}
    out = {}
    for name, tensor in tensors.items():
        current = legacy_to_current(name)
        if current is None:
            raise CheckpointError(f"{source}: unexpected tensor '{name}' in legacy-layout checkpoint")
        if current.endswith("_features"):
            tensor = tensor.T  # legacy stores the Fourier frequency matrices transposed
        out[current] = tensor
    return out


def checkpoint_files(path: str | Path) -> list[Path]:
    """The weight files of a checkpoint: a file, or every *.safetensors (else *.pt) in a folder."""
    path = Path(path)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.pt"))
        if files:
            return files
        raise CheckpointError(f"{path}: no *.safetensors or *.pt weight file in this folder")
    raise CheckpointError(f"{path}: checkpoint path does not exist")


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        if path.suffix in (".pt", ".pth", ".bin"):
            # mmap: a large file's pages are read as its tensors are used, and are not a second copy in memory
            try:
                tensors = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # (a file in torch's old format cannot be mapped)
                tensors = torch.load(str(path), map_location="cpu", weights_only=True)
            if not isinstance(tensors, dict):
                raise CheckpointError(f"{path}: expected a dict of tensors")
            return tensors
    except CheckpointError:
        raise
    except Exception as e:  # corrupt or foreign files: name the file
        raise CheckpointError(f"{path}: cannot read checkpoint file ({type(e).__name__}: {e})") from e
    raise CheckpointError(f"{path}: unsupported weight file type '{path.suffix}' (use .safetensors or .pt)")


PACKED_PARTS = ("packed", "scale", "zero_point")


def dequantize(packed: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, shape) -> torch.Tensor:
    """A 4-bit weight back to bf16, with the reference's operations in its order: each packed row holds a
    group's high nibbles in its first half of rows' worth, low nibbles in the second; (q - zero) * scale."""
    step = packed.shape[0]
    w = torch.empty((2 * step, packed.shape[1]), dtype=torch.bfloat16, device=packed.device)
    w[:step] = (packed & 0b11110000) >> 4
    w[step:] = packed & 0b00001111
    w.sub_(zero_point.float()).mul_(scale.float())  # (the reference holds both as float32 parameters)
    return w.reshape(shape)


def _dequantize_state(state: dict[str, torch.Tensor], expected: dict, config: MoondreamConfig, source: str,
                      keep_packed: bool = False) -> None:
    """Replace every `<linear>.weight.{packed,scale,zero_point}` triple by its dequantised weight (keep_packed: the
    text blocks' by a PackedWeight, which the GPU's decode step reads as it is)."""
    for name in sorted(n for n in state if n.endswith(".weight.packed")):
        base = name.removesuffix(".packed")
        group = config.region.group_size if base.startswith("region.") else config.text.group_size
        if base not in expected or group is None:
            raise CheckpointError(f"{source}: packed 4-bit tensor '{name}' but config.json gives no group_size for it"
                                  if base in expected else f"{source}: unexpected tensor '{name}'")
        parts = {p: state.pop(f"{base}.{p}", None) for p in PACKED_PARTS}
        missing = [p for p, t in parts.items() if t is None]
        if missing:
            raise CheckpointError(f"{source}: missing tensor '{base}.{missing[0]}'")
        shape = expected[base]
        n_groups = shape[0] * shape[1] // group
        want = {"packed": (n_groups // 2, group), "scale": (n_groups, 1), "zero_point": (n_groups, 1)}
        for p, t in parts.items():
            if tuple(t.shape) != want[p] or (p == "packed") != (t.dtype == torch.uint8):
                raise CheckpointError(f"{source}: tensor '{base}.{p}' has shape {tuple(t.shape)} ({t.dtype}), "
                                      f"expected {want[p]}" + (" uint8" if p == "packed" else ""))
        if keep_packed and base.startswith("text.blocks."):
            state[base] = PackedWeight.from_checkpoint(parts["packed"], parts["scale"], parts["zero_point"], shape)
        else:
            state[base] = dequantize(parts["packed"], parts["scale"], parts["zero_point"], shape)


def _dequantize_fp8(state: dict[str, torch.Tensor], source: str, dtype: torch.dtype, keep_experts: bool) -> None:
    """Replace every FP8 weight and its scale per output row by weight * scale in dtype, one tensor at a time; with
    keep_experts the experts' FP8 weights stay, their scales beside them as float32 [E, rows]."""
    for name in [n for n, t in state.items() if t.dtype == torch.float8_e4m3fn]:
        scale = state.pop(name + FP8_SCALE, None)
        if scale is None:
            raise CheckpointError(f"{source}: tensor '{name}' is FP8 but has no scale ('{name}{FP8_SCALE}', "
                                  "moe_quant.up_scale or down_scale in the checkpoint)")
        weight = state[name]
        if scale.numel() != weight.shape[0] * weight.shape[1]:
            raise CheckpointError(f"{source}: tensor '{name}{FP8_SCALE}' has shape {tuple(scale.shape)}, expected "
                                  f"{tuple(weight.shape[:2])} (one scale a row of {tuple(weight.shape)})")
        scale = scale.float().reshape(weight.shape[:2])
        if keep_experts and is_expert_weight(name, weight):
            state[name + FP8_SCALE] = scale
        else:
            state[name] = (weight.float() * scale[..., None]).to(dtype)
    for name in [n for n in state if n.endswith(FP8_SCALE)]:
        if state.get(name.removesuffix(FP8_SCALE), torch.empty(0)).dtype != torch.float8_e4m3fn:
            raise CheckpointError(f"{source}: unexpected tensor '{name}' (a scale whose weight is not FP8)")


def load_state(path: str | Path, config: MoondreamConfig, keep_packed: bool = False,
               dtype: torch.dtype = torch.float32, keep_fp8: bool = False) -> dict[str, torch.Tensor]:
    """Read, normalise and validate every tensor (4-bit ones dequantised, or with keep_packed the text blocks' kept
    4-bit: PackedWeight; FP8 ones dequantised to dtype, or with keep_fp8 the experts' kept FP8 with their scales as
    '<name>_scale'); errors name the tensor and the file."""
    state: dict[str, torch.Tensor] = {}
    files = checkpoint_files(path)
    for file in files:
        for name, tensor in normalise_names(read_tensors(file), str(file)).items():
            state[name] = tensor
    source = ", ".join(str(f) for f in files)
    expected = expected_shapes(config)
    _dequantize_fp8(state, source, dtype, keep_fp8)
    split_tau(state)
    _dequantize_state(state, expected, config, source, keep_packed)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"{source}: missing tensor '{missing[0]}'" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    extra = sorted(set(state) - set(expected) - {name + FP8_SCALE for name in expected})
    if extra:
        raise CheckpointError(f"{source}: unexpected tensor '{extra[0]}'" + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise CheckpointError(f"{source}: tensor '{name}' has shape {tuple(state[name].shape)}, expected {shape}")
    return state


def build_weights(state: dict[str, torch.Tensor], config: MoondreamConfig,
                  dtype: torch.dtype, device: str | torch.device, wide_experts: bool = False) -> MoondreamWeights:
    """wide_experts: FP8 experts also get a widened copy in dtype (MoE.fc1_wide, fc2_wide)."""
    def t(name):
        return state[name].to(device=device, dtype=dtype).contiguous()

    def linear(name):
        return Linear(t(f"{name}.weight"), t(f"{name}.bias"))

    def norm(name):
        return LayerNorm(t(f"{name}.weight"), t(f"{name}.bias"))

    def mlp(name):
        return MLP(linear(f"{name}.fc1"), linear(f"{name}.fc2"))

    def experts(name):  # -> (weight in dtype, None) or (FP8 weight, its float32 scales)
        if state[name].dtype != torch.float8_e4m3fn:
            return t(name), None
        return state[name].to(device).contiguous(), state[name + FP8_SCALE].to(device).contiguous()

    patch_emb = linear("vision.patch_emb")
    vision_blocks = [VisionBlock(norm(f"vision.blocks.{i}.ln1"), linear(f"vision.blocks.{i}.attn.qkv"),
                                 linear(f"vision.blocks.{i}.attn.proj"), norm(f"vision.blocks.{i}.ln2"),
                                 mlp(f"vision.blocks.{i}.mlp")) for i in range(config.vision.enc_n_layers)]
    vision = VisionWeights(
        patch_emb=Linear(_pad_columns(patch_emb.weight, 8), patch_emb.bias),
        pos_emb=t("vision.pos_emb"),
        blocks=vision_blocks,
        post_ln=norm("vision.post_ln"),
        proj_mlp=mlp("vision.proj_mlp"),
        bias_sums=_residual_bias_sums(vision_blocks),
    )
    def text_block(i):
        b, tc = f"text.blocks.{i}", config.text
        tau = None
        if tc.tau_attn:
            tau = Tau(t(f"{b}.attn.tau.alpha"), torch.cat([t(f"{b}.attn.tau.wq"), t(f"{b}.attn.tau.wv")]))
        if is_moe_layer(tc, i):
            (fc1, fc1_scale), (fc2, fc2_scale) = experts(f"{b}.mlp.fc1.weight"), experts(f"{b}.mlp.fc2.weight")
            moe = MoE(linear(f"{b}.mlp.router"), fc1, fc2, tc.moe.n_experts_per_tok, fc1_scale, fc2_scale)
            if wide_experts and fc1_scale is not None:
                moe.fc1_wide, moe.fc2_wide = moe.widened(dtype)
            proj = linear(f"{b}.attn.proj")
            return TextBlock(norm(f"{b}.ln"), linear(f"{b}.attn.qkv"), proj, None, proj.bias, tau, moe)
        block = _text_block(norm(f"{b}.ln"), linear(f"{b}.attn.qkv"), linear(f"{b}.attn.proj"), mlp(f"{b}.mlp"))
        block.tau = tau
        return block

    text = TextWeights(
        wte=t("text.wte"),
        blocks=[text_block(i) for i in range(config.text.n_layers)],
        post_ln=norm("text.post_ln"),
        lm_head=linear("text.lm_head"),
    )
    decoder = linear if config.region.decoder == "linear" else mlp
    region = RegionWeights(
        coord_features=t("region.coord_features"), coord_encoder=linear("region.coord_encoder"),
        coord_decoder=decoder("region.coord_decoder"), size_features=t("region.size_features"),
        size_encoder=linear("region.size_encoder"), size_decoder=decoder("region.size_decoder"),
        ln=norm("region.ln") if config.region.decoder == "linear" else None,
    )
    return MoondreamWeights(vision, text, region)


def _pad_columns(weight: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = -weight.shape[1] % multiple
    return torch.nn.functional.pad(weight, (0, pad)) if pad else weight


def _residual_bias_sums(blocks: list[VisionBlock]) -> torch.Tensor:
    """The biases of the encoder's residual adds (proj then fc2, layer by layer) summed up to each add, in
    float32: on the GPU the output GEMMs leave their biases out and each layer norm adds the sum back."""
    biases = torch.stack([bias.float() for block in blocks for bias in (block.proj.bias, block.mlp.fc2.bias)])
    return torch.cat([torch.zeros_like(biases[:1]), biases.cumsum(0)])


def _text_block(ln: LayerNorm, qkv: Linear, proj: Linear, mlp: MLP) -> TextBlock:
    return TextBlock(ln, qkv, proj, mlp, out_bias=proj.bias + mlp.fc2.bias)


def load_weights(path: str | Path, config: MoondreamConfig, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", fp8_experts: str = "widen") -> MoondreamWeights:
    """On a GPU the text blocks' 4-bit weights stay 4-bit (the decode step reads them packed). FP8 experts (Kestrel's
    files) on a GPU: widen (dequantised once, as elsewhere), fp8 (kept FP8: the expert kernels read them and their
    scales) or both (FP8 and widened copies: each step reads the faster)."""
    if fp8_experts not in FP8_EXPERT_MODES:
        raise ValueError(f"fp8_experts must be one of {', '.join(FP8_EXPERT_MODES)}, got {fp8_experts!r}")
    on_gpu = torch.device(device).type == "cuda"
    if fp8_experts != "widen" and on_gpu and torch.cuda.get_device_capability(device) < (8, 9):
        log.warning("KESTREL_FP8_EXPERTS=%s: this GPU has no FP8 (e4m3) conversions (before Ada); experts widened",
                    fp8_experts)
        fp8_experts = "widen"
    keep = on_gpu and fp8_experts != "widen"
    state = load_state(path, config, on_gpu, dtype, keep_fp8=keep)
    return build_weights(state, config, dtype, device, wide_experts=keep and fp8_experts == "both")


def checkpoint_family(path: str | Path) -> str:
    """moondream3 or moondream2, from the tensor names (for a checkpoint without config.json: Kestrel's files)."""
    for file in checkpoint_files(path):
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(file), "pt") as f:
                names = list(f.keys())
        else:
            names = list(read_tensors(file))
        if any("tau" in name for name in names):
            return "moondream3"
    return "moondream2"


def random_state(config: MoondreamConfig, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                 seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors of a checkpoint (current layout) of the right shapes, scaled so activations stay sane."""
    gen = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name, shape in expected_shapes(config).items():
        scale = 1.0 / (shape[-1] ** 0.5) if len(shape) >= 2 and name.endswith(("weight", "wq", "wv")) else 0.02
        state[name] = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).mul_(scale).to(dtype)
        if re.search(r"(ln\d?|post_ln)\.weight$", name):
            state[name].fill_(1.0)
    return state


def random_weights(config: MoondreamConfig, dtype: torch.dtype = torch.bfloat16,
                   device: str | torch.device = "cpu", seed: int = 0) -> MoondreamWeights:
    """Random weights of the right shapes (for speed tests and smoke tests, never for answers)."""
    return build_weights(random_state(config, dtype, device, seed), config, dtype, device)
