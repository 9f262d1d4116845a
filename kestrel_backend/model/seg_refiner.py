"""Moondream 3's segmentation refiner: an HQ-SAM-style head (weights: Hugging Face `moondream/SegHeadRefiner`,
`model.pt`, its tensors under "head") that turns a coarse mask of an object into a sharper one.

Input: one 378 px crop around the object, as the vision encoder sees it (its final features and the residual stream
after block EARLY_LAYER), and the coarse mask at 378 px. The head proposes NUM_MASKS masks with a predicted IoU each;
the best one, through a sigmoid, is the next round's coarse mask, ROUNDS times. Written over the checkpoint's own
tensor names; the widths come from the tensors, the head counts are the architecture's.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

EARLY_LAYER = 8
ROUNDS = 5
HEADS, UP_HEADS = 8, 4  # attention heads of the two-way blocks; of the last attention at the upsampled width
GRID = 27  # 378 px / 14 px patches


class RefinerHead:
    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.t = tensors
        self.num_masks, self.dim = self._get("mask_tokens").shape
        self.enc_dim = self._get("image_proj.weight").shape[1]
        self.blocks = sorted({int(k.split(".")[1]) for k in tensors if k.startswith("transformer_blocks.")})
        for name in _required_names(len(self.blocks), self.num_masks):
            self._get(name)

    @classmethod
    def load(cls, path: str | Path, device, dtype) -> "RefinerHead":
        """path: `model.pt` (the published file: {"head": tensors}), a safetensors file of the same names, or a
        folder holding either."""
        path = Path(path)
        if path.is_dir():
            found = [path / n for n in ("model.pt", "model.safetensors") if (path / n).exists()]
            if not found:
                raise ValueError(f"{path}: no model.pt or model.safetensors (the segment refiner's weights)")
            path = found[0]
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            tensors = load_file(str(path))
        else:
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
            tensors = checkpoint.get("head", checkpoint) if isinstance(checkpoint, dict) else None
            if not isinstance(tensors, dict):
                raise ValueError(f"{path}: not a segment refiner checkpoint (expected a dict of tensors under 'head')")
        return cls({k: v.to(device=device, dtype=dtype) for k, v in tensors.items()})

    def _get(self, name: str) -> torch.Tensor:
        if name not in self.t:
            raise ValueError(f"segment refiner weights: missing tensor {name}")
        return self.t[name]

    # --- building blocks over the checkpoint's names ---
    def _linear(self, x, name):
        return F.linear(x, self.t[f"{name}.weight"], self.t[f"{name}.bias"])

    def _ln(self, x, name):
        return F.layer_norm(x, (x.shape[-1],), self.t[f"{name}.weight"], self.t[f"{name}.bias"])

    def _ln2d(self, x, name):  # layer norm over channels of [B, C, H, W]
        return self._ln(x.permute(0, 2, 3, 1), name).permute(0, 3, 1, 2)

    def _conv(self, x, name, **kw):
        return F.conv2d(x, self.t[f"{name}.weight"], self.t[f"{name}.bias"], **kw)

    def _group_norm(self, x, name, groups):
        return F.group_norm(x, groups, self.t[f"{name}.weight"], self.t[f"{name}.bias"])

    def _attention(self, q, k, v, name, heads):
        """Multi-head attention with one packed q/k/v input projection and an output projection."""
        wq, wk, wv = self.t[f"{name}.in_proj_weight"].chunk(3)
        bq, bk, bv = self.t[f"{name}.in_proj_bias"].chunk(3)
        split = lambda x: x.unflatten(-1, (heads, -1)).transpose(1, 2)  # noqa: E731  [B, N, D] -> [B, h, N, D/h]
        out = F.scaled_dot_product_attention(split(F.linear(q, wq, bq)), split(F.linear(k, wk, bk)),
                                             split(F.linear(v, wv, bv)))
        return self._linear(out.transpose(1, 2).flatten(2), f"{name}.out_proj")

    def _mlp(self, x, name, layers):
        """Linear layers with GELU between them (the Sequential's indices 0, 2, 4, ...)."""
        for i in range(layers):
            x = self._linear(x, f"{name}.{2 * i}")
            x = F.gelu(x) if i < layers - 1 else x
        return x

    # --- the head ---
    def _mask_embedding(self, mask):
        """Coarse mask [B, 1, 378, 378] -> [B, dim, 27, 27]: four stride-2 convolutions, then resized."""
        d = self.dim
        x = mask
        for i, groups in enumerate((1, min(8, d // 8), min(16, d // 4), min(32, d)), start=1):
            x = self._conv(x, f"mask_encoder.conv{i}.0", stride=2, padding=1)
            x = F.gelu(self._group_norm(x, f"mask_encoder.conv{i}.1", groups))
        return F.interpolate(x, size=(GRID, GRID), mode="bilinear", align_corners=False)

    def _image(self, final, early):
        """Final and early features [B, 729, enc_dim] -> fused image tokens [B, dim, 27, 27]."""
        b = final.shape[0]
        img = self._conv(final.view(b, GRID, GRID, self.enc_dim).permute(0, 3, 1, 2), "image_proj")
        e = F.gelu(self._ln(self._linear(early, "hq_fusion.early_proj.0"), "hq_fusion.early_proj.1"))
        x = torch.cat([e.transpose(1, 2).reshape(b, self.dim, GRID, GRID), img], dim=1)
        x = F.gelu(self._group_norm(self._conv(x, "hq_fusion.fusion.0"), "hq_fusion.fusion.1", 32))
        return F.gelu(self._group_norm(self._conv(x, "hq_fusion.fusion.3", padding=1), "hq_fusion.fusion.4", 32))

    def _two_way(self, i, tokens, img, tokens_pe, img_pe):
        """Tokens attend to themselves and to the image, then the image attends to the tokens."""
        n = f"transformer_blocks.{i}"
        q = tokens + tokens_pe
        tokens = self._ln(tokens + self._attention(q, q, tokens, f"{n}.output_self_attn", HEADS), f"{n}.norm1")
        tokens = self._ln(tokens + self._attention(tokens + tokens_pe, img + img_pe, img,
                                                   f"{n}.cross_attn_token_to_image", HEADS), f"{n}.norm2")
        tokens = self._ln(tokens + self._mlp(tokens, f"{n}.mlp", 2), f"{n}.norm3")
        img = self._ln(img + self._attention(img + img_pe, tokens + tokens_pe, tokens,
                                             f"{n}.cross_attn_image_to_token", HEADS), f"{n}.norm4")
        return tokens, img

    def _upsample(self, x):
        """[B, dim, 27, 27] -> [B, dim/8, 216, 216]: three rounds of 2x transposed conv and 3x3 conv."""
        for i in (0, 6, 12):
            x = F.conv_transpose2d(x, self.t[f"upsample.{i}.weight"], self.t[f"upsample.{i}.bias"], stride=2)
            x = F.gelu(self._ln2d(x, f"upsample.{i + 1}.norm"))
            x = F.gelu(self._ln2d(self._conv(x, f"upsample.{i + 3}", padding=1), f"upsample.{i + 4}.norm"))
        return x

    def __call__(self, final, early, mask):
        """-> (mask logits [B, NUM_MASKS, H, W] at the mask's size, predicted IoU [B, NUM_MASKS])."""
        b, size = final.shape[0], mask.shape[-2:]
        img = self._image(final, early) + self._mask_embedding(mask)
        img_tokens = img.flatten(2).transpose(1, 2)
        img_pe = self.t["image_pe"].flatten(2).transpose(1, 2).expand(b, -1, -1)
        tokens = torch.cat([self.t["mask_tokens"], self.t["iou_token"]])[None].expand(b, -1, -1)
        tokens_pe = self.t["output_pe"][None].expand(b, -1, -1)
        for i in self.blocks:
            tokens, img_tokens = self._two_way(i, tokens, img_tokens, tokens_pe, img_pe)
        tokens = self._ln(tokens + self._attention(tokens + tokens_pe, img_tokens + img_pe, img_tokens,
                                                   "final_token_to_image", HEADS), "final_norm")
        up = self._upsample(img_tokens.transpose(1, 2).reshape(b, self.dim, GRID, GRID))
        up_tokens = up.flatten(2).transpose(1, 2)
        q = self._linear(tokens[:, :self.num_masks], "final_q_proj")
        q = q + self._attention(self._ln(q, "final_norm_up"), up_tokens, up_tokens, "final_attn_up", UP_HEADS)
        weights = torch.stack([self._mlp(q[:, i], f"mask_mlps.{i}", 3) for i in range(self.num_masks)], dim=1)
        masks = torch.einsum("bmc,bchw->bmhw", weights, up)
        iou = self._mlp(tokens[:, self.num_masks], "iou_head", 3)
        return F.interpolate(masks, size=size, mode="bilinear", align_corners=False), iou

    def refine(self, final, early, mask):
        """ROUNDS rounds, each on the last round's best mask (by predicted IoU) through a sigmoid: -> [B, H, W]."""
        for _ in range(ROUNDS):
            masks, iou = self(final, early, mask)
            mask = masks[torch.arange(masks.shape[0]), iou.argmax(dim=1)].sigmoid()[:, None]
        return mask[:, 0]


def _required_names(blocks: int, masks: int) -> list[str]:
    wb = lambda n: [f"{n}.weight", f"{n}.bias"]  # noqa: E731
    attn = lambda n: [f"{n}.in_proj_weight", f"{n}.in_proj_bias", *wb(f"{n}.out_proj")]  # noqa: E731
    names = ["image_pe", "iou_token", "output_pe", *wb("image_proj"), *wb("hq_fusion.early_proj.0"),
             *wb("hq_fusion.early_proj.1"), *wb("hq_fusion.fusion.0"), *wb("hq_fusion.fusion.1"),
             *wb("hq_fusion.fusion.3"), *wb("hq_fusion.fusion.4"), *attn("final_token_to_image"), *wb("final_norm"),
             *wb("final_q_proj"), *attn("final_attn_up"), *wb("final_norm_up")]
    for i in range(1, 5):
        names += wb(f"mask_encoder.conv{i}.0") + wb(f"mask_encoder.conv{i}.1")
    for i in range(blocks):
        n = f"transformer_blocks.{i}"
        names += attn(f"{n}.output_self_attn") + attn(f"{n}.cross_attn_token_to_image")
        names += attn(f"{n}.cross_attn_image_to_token") + wb(f"{n}.mlp.0") + wb(f"{n}.mlp.2")
        names += [x for k in range(1, 5) for x in wb(f"{n}.norm{k}")]
    for i in (0, 6, 12):
        names += wb(f"upsample.{i}") + wb(f"upsample.{i + 1}.norm") + wb(f"upsample.{i + 3}") + wb(f"upsample.{i + 4}.norm")
    for i in range(masks):
        names += [x for k in (0, 2, 4) for x in wb(f"mask_mlps.{i}.{k}")]
    names += [x for k in (0, 2, 4) for x in wb(f"iou_head.{k}")]
    return names
