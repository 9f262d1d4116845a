"""Check this implementation against golden outputs of the reference implementation.

    python -m kestrel_backend.parity tests/fixtures/md2-tiny

One line per case (PASS/FAIL, max abs diff), then "N passed, M failed"; exit 0 only if all pass.
Tolerances (float32): logits and embeddings within 1e-4 relative to the largest reference value,
identical crop tiling and pixels, identical greedy tokens, coordinates within 1e-4. Segment (Moondream 3):
identical coarse paths, boxes and coarse masks; refined masks differing in at most 0.001% of the pixels (the
head's own sigmoid mask within 1e-5), the refined box equal, and our outline of the refined mask drawn back covering
it (IoU at least 0.99).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import torch

from .images import decode_image
from .model.image_crops import overlap_crops
from .model.lora import build_adapter, read_adapter_tensors
from .model.moondream import Moondream
from .model.weights import load_state
from .model.seg_refiner import RefinerHead
from .runtime.segment_refiner import SegmentRefiner
from .skills.chat import chat_prompt, parse_messages
from .skills import gaze
from .skills.generation import Prompt, ReasoningThenAnswer, RegionGeneration, SegmentGeneration, TextGeneration
from .skills.prompts import caption_prompt, query_prompt, region_prompt, spatial_refs_start
from .skills.segment import coarse_segment
from .skills.settings import Settings
from .skills.single import run_single

REL_TOL = 1e-4
COORD_TOL = 1e-4
SOFT_MASK_TOL = 1e-5  # the refiner head's sigmoid mask (measured: 2.3e-6)
MASK_DIFF_TOL = 1e-5  # fraction of a refined mask's pixels that may differ (float rounding at the 0.5 threshold)
OUTLINE_IOU = 0.99  # the outline runs a quarter pixel inside the mask's edges (measured 0.994 to 0.996)


def _rel_diff(ours: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    diff = float(np.max(np.abs(ours.astype(np.float64) - ref.astype(np.float64))))
    return diff, diff / max(float(np.max(np.abs(ref))), 1e-12)


class Checker:
    def __init__(self, folder: Path):
        self.folder = folder
        self.cases = json.loads((folder / "cases.json").read_text())["cases"]
        self.arrays = np.load(folder / "golden.npz")
        self.model = Moondream.from_checkpoint(folder / "model.safetensors", dtype=torch.float32)
        self._images: dict[str, np.ndarray] = {}
        self._embeddings: dict[str, torch.Tensor] = {}
        self._adapters: dict = {}

    def adapter(self, case):
        """The case's LoRA adapter (a reference final.pt, relative to the fixture folder), or None."""
        rel = case.get("adapter")
        if rel is not None and rel not in self._adapters:
            path = self.folder / rel
            self._adapters[rel] = build_adapter(path.parent.name, read_adapter_tensors([path]), self.model.config.text,
                                                max_rank=1024, dtype=self.model.dtype, device=self.model.device)
        return self._adapters.get(rel)

    def image(self, rel: str) -> np.ndarray:
        if rel not in self._images:
            self._images[rel] = decode_image((self.folder / rel).read_bytes())
        return self._images[rel]

    def embedding(self, rel: str) -> torch.Tensor:
        if rel not in self._embeddings:
            with torch.inference_mode():
                self._embeddings[rel] = self.model.encode_image(self.image(rel))
        return self._embeddings[rel]

    def run(self, case: dict) -> tuple[bool, str]:
        return getattr(self, f"check_{case['kind']}")(case)

    def check_crops(self, case):
        v = self.model.config.vision
        crops, tiling = overlap_crops(self.image(case["image"]), v.crop_size, v.enc_patch_size, v.overlap_margin, v.max_crops)
        ref = self.arrays[case["crops"]]
        if list(tiling) != case["tiling"] or crops.shape != ref.shape:
            return False, f"tiling {tiling} shape {crops.shape}, expected {case['tiling']} {ref.shape}"
        diff = int(np.max(np.abs(crops.astype(np.int16) - ref.astype(np.int16))))
        return diff == 0, f"tiling {tiling}, max abs diff {diff}"

    def check_image_embedding(self, case):
        diff, rel = _rel_diff(self.embedding(case["image"]).float().cpu().numpy(), self.arrays[case["embedding"]])
        return rel <= REL_TOL, f"max abs diff {diff:.3g} (rel {rel:.3g})"

    def _prompt(self, case, ids, overrides=None):
        if ids != case["prompt_ids"]:
            raise AssertionError(f"prompt ids {ids} differ from the reference's {case['prompt_ids']}")
        image = self.embedding(case["image"]) if case["image"] else None
        return Prompt(ids, image, overrides)

    def _compare_text(self, case, gen, first_logits, tokens):
        diff, rel = _rel_diff(first_logits.cpu().numpy(), self.arrays[case["logits"]][0])
        ok = rel <= REL_TOL and tokens == case["tokens"]
        msg = f"logits max abs diff {diff:.3g} (rel {rel:.3g}), tokens {'equal' if tokens == case['tokens'] else 'DIFFER'}"
        return ok, msg

    def check_query(self, case):
        tok = self.model.config.tokenizer
        settings = Settings(temperature=0.0, max_tokens=case["max_tokens"])
        reasoning = case.get("reasoning", False)
        refs, has_image = case.get("spatial_refs") or [], case["image"] is not None
        overrides = self.model.spatial_ref_overrides(refs, spatial_refs_start(tok, has_image)) if refs else None
        prompt = self._prompt(case, query_prompt(tok, case["question_ids"], has_image, reasoning, refs), overrides)
        gen = ReasoningThenAnswer(tok, settings, self.model) if reasoning else TextGeneration(tok, settings)
        logits = run_single(self.model, prompt, gen, self.adapter(case))
        ok, msg = self._compare_text(case, gen, logits, gen.tokens)
        if reasoning:
            same = gen.reasoning_tokens == case["reasoning_tokens"]
            ok, msg = ok and same, msg + f", reasoning tokens {'equal' if same else 'DIFFER'}"
        return ok, msg

    def check_chat(self, case):
        """A conversation rendered as Kestrel renders it (its prompt ids must be the ones the reference prefilled),
        then greedy decoding on the single-request path. No logits are recorded for these cases."""
        tok = self.model.config.tokenizer
        images = chat_images(case)  # (each image part's bytes here is its file's name: embedded by name below)
        messages = parse_messages(case["messages"], [name.encode() for name in images])
        ids, later = chat_prompt(tok, messages, lambda t: self.model.tokenizer.encode(t).ids, case["reasoning"],
                                 self.model.config.text.prefix_attn - 1)
        prompt = self._prompt(case, ids)
        if later:  # the conversation's other images: their rows in place of the placeholders, a block each
            rows = {index: self.embedding(name.decode()) for name, index in later}
            prompt = Prompt(ids, prompt.image_embedding, rows,
                            tuple((index, index + len(emb)) for index, emb in rows.items()))
        settings = Settings(temperature=0.0, max_tokens=case["max_tokens"])
        gen = ReasoningThenAnswer(tok, settings, self.model) if case["reasoning"] else TextGeneration(tok, settings)
        run_single(self.model, prompt, gen)
        same = gen.tokens == case["tokens"] and \
            (not case["reasoning"] or gen.reasoning_tokens == case["reasoning_tokens"])
        return same, f"prompt ids equal, tokens {'equal' if same else 'DIFFER'}"

    def check_caption(self, case):
        tok = self.model.config.tokenizer
        gen = TextGeneration(tok, Settings(temperature=0.0, max_tokens=case["max_tokens"]))
        logits = run_single(self.model, self._prompt(case, caption_prompt(tok, case["length"])), gen, self.adapter(case))
        return self._compare_text(case, gen, logits, gen.tokens)

    def _check_region(self, case, skill, key):
        tok = self.model.config.tokenizer
        gen = RegionGeneration(tok, Settings(max_objects=case["max_objects"]), self.model, with_size=skill == "detect")
        logits = run_single(self.model, self._prompt(case, region_prompt(tok, skill, case["object_ids"])), gen,
                            self.adapter(case))
        diff, rel = _rel_diff(logits.cpu().numpy(), self.arrays[case["logits"]][0])
        ref = case[key]
        if len(gen.objects) != len(ref):
            return False, f"{len(gen.objects)} objects, expected {len(ref)}"
        cdiff = max((abs(o[k] - r[k]) for o, r in zip(gen.objects, ref) for k in r), default=0.0)
        return rel <= REL_TOL and cdiff <= COORD_TOL, f"logits rel {rel:.3g}, coordinates max abs diff {cdiff:.3g}"

    def check_point(self, case):
        return self._check_region(case, "point", "points")

    def check_detect(self, case):
        return self._check_region(case, "detect", "objects")

    def check_gaze(self, case):
        """The eye form: the prompt's ids, the first step's logits and the point (or none); the face form: twenty eye
        points drawn as the reference drew them (its seed), on the image and its mirror image, and their mean. A case
        may raise the LM head's bias for one token (an answer of end of text, which random weights rarely give)."""
        shift = case.get("lm_head_bias_shift")
        bias = self.model.weights.text.lm_head.bias
        kept = bias.detach().clone()
        if shift is not None:
            with torch.no_grad():
                bias[shift["token"]] += shift["by"]
        try:
            if "face" in case:
                return self._check_gaze_face(case)
            logits, point = self._gaze_at(case, self.embedding(case["image"]), case["eye"])
        finally:
            with torch.no_grad():
                bias.copy_(kept)
        diff, rel = _rel_diff(logits.cpu().numpy(), self.arrays[case["logits"]][0])
        ok = rel <= REL_TOL and _same_point(point, case["gaze"])
        return ok, f"logits rel {rel:.3g}, gaze {point} against {case['gaze']}"

    def _gaze_at(self, case, image_embedding, eye):
        ids, at = gaze.gaze_prompt(lambda text: self.model.tokenizer.encode(text).ids)
        if ids != case["prompt_ids"]:
            raise AssertionError(f"prompt ids {ids} differ from the reference's {case['prompt_ids']}")
        overrides = self.model.spatial_ref_overrides([gaze.eye_ref(eye)], at)
        gen = RegionGeneration(self.model.config.tokenizer, Settings(max_objects=1), self.model, with_size=False)
        logits = run_single(self.model, Prompt(ids, image_embedding, overrides), gen)
        return logits, gen.objects[0] if gen.objects else None

    def _check_gaze_face(self, case):
        plain = self.embedding(case["image"])
        with torch.inference_mode():
            mirror = self.model.encode_image(np.ascontiguousarray(self.image(case["image"])[:, ::-1]))
        face = tuple(case["face"][k] for k in ("x_min", "y_min", "x_max", "y_max"))
        found = []
        for x, y, flipped in gaze.eye_samples(face, random.Random(case["seed"])):
            _, point = self._gaze_at(case, mirror if flipped else plain, (x, y))
            if point is not None:
                found.append((1 - point["x"] if flipped else point["x"], point["y"]))
        mean = gaze.mean_gaze(found)
        return _same_point(mean, case["gaze"]), f"gaze {mean} against {case['gaze']} ({len(found)} of 20 found)"

    def refiner(self) -> SegmentRefiner:
        if not hasattr(self, "_refiner"):
            head = RefinerHead.load(self.folder / "seg_refiner", self.model.device, self.model.dtype)
            self._refiner = SegmentRefiner(self.model, head, executor=None)
        return self._refiner

    def check_segment(self, case):
        """Decoding: logits, tokens, coordinates and sizes; then the result as in check_segment_finalize."""
        tok = self.model.config.tokenizer
        gen = SegmentGeneration(tok, Settings(temperature=0.0, max_tokens=case["max_tokens"]), self.model)
        logits = run_single(self.model, self._prompt(case, region_prompt(tok, "segment", case["object_ids"])), gen)
        ok, msg = self._compare_text(case, gen, logits, gen.tokens)
        _, coords, sizes = split_stream(case["stream"])
        cdiff = max([abs(a - b) for a, b in zip(gen.coords, coords)] +
                    [abs(a - b) for s, r in zip(gen.sizes, sizes) for a, b in zip(s, r)], default=0.0)
        same = len(gen.coords) == len(coords) and len(gen.sizes) == len(sizes) and cdiff <= COORD_TOL
        ok2, msg2 = self._check_segment_output(case, gen.text_ids, gen.coords, gen.sizes)
        return ok and same and ok2, f"{msg}, coordinates and sizes max abs diff {cdiff:.3g}; {msg2}"

    def check_segment_finalize(self, case):
        """A decoded stream (text ids, ["c", coordinate], ["s", width, height]) -> the skill's result."""
        return self._check_segment_output(case, *split_stream(case["stream"]))

    def _check_segment_output(self, case, text_ids, coords, sizes):
        from .skills import segment_masks

        ref = case["output"]["segments"][0]
        ours = coarse_segment(ref["object"], self.model.tokenizer, text_ids, coords, sizes)
        keys = [k for k in ref if k not in ("svg_path", "bbox", "parse_error")]
        bad = [k for k in keys if not json_close(ours.get(k), ref[k])]
        if ("parse_error" in ours) != ("parse_error" in ref):
            bad.append("parse_error")
        image = self.image(case["image"])
        h, w = image.shape[:2]
        notes = []
        if "mask_coarse" in case:
            coarse = segment_masks.path_mask(ours["coarse_path"], ours["coarse_bbox"], w, h)
            same = np.array_equal(coarse, unpack_mask(self.arrays[case["mask_coarse"]], h, w))
            bad += [] if same else ["coarse mask"]
            notes.append(f"coarse mask {'equal' if same else 'DIFFERS'} ({int(coarse.sum())} px)")
        masks = self.refiner().refined_mask(image, ours["svg_path"], ours["bbox"]) if ours["svg_path"] and \
            "bbox" in ours else None
        soft, refined = masks if masks is not None else (None, None)
        if "refiner_soft" in case:
            diff = float(np.max(np.abs(soft - self.arrays[case["refiner_soft"]])))
            bad += [] if diff <= SOFT_MASK_TOL else ["refiner's mask"]
            notes.append(f"refiner's 378 px mask max abs diff {diff:.3g}")
        if "mask_refined" in case:
            expected = unpack_mask(self.arrays[case["mask_refined"]], h, w)
            if refined is None:
                return False, "no refined mask, the reference refined it"
            differ = int(np.count_nonzero(refined != expected))
            box = segment_masks.mask_box(refined)
            drawn = segment_masks.path_mask(segment_masks.outline(refined, box), box, w, h)
            iou = np.logical_and(drawn, refined).sum() / max(np.logical_or(drawn, refined).sum(), 1)
            bad += [] if differ <= MASK_DIFF_TOL * refined.size else ["refined mask"]
            bad += [] if json_close(box, ref["bbox"]) else ["refined bbox"]
            bad += [] if iou >= OUTLINE_IOU else ["outline"]
            notes.append(f"refined mask {differ} px differ of {int(expected.sum())}, outline IoU {iou:.3f}")
        elif refined is not None and refined.any():
            bad.append("refined (the reference kept the coarse result)")
        elif ours["svg_path"] != ref["svg_path"] or not json_close(ours.get("bbox"), ref.get("bbox")):
            bad.append("svg_path/bbox")
        return not bad, (f"DIFFER: {', '.join(bad)}; " if bad else "equal keys; ") + ", ".join(notes)

    def check_legacy_layout(self) -> tuple[bool, str]:
        config = self.model.config
        current = load_state(self.folder / "model.safetensors", config)
        legacy = load_state(self.folder / "legacy", config)
        bad = [k for k in current if not torch.equal(current[k], legacy[k])]
        return not bad, f"{len(current)} tensors, {len(bad)} differ" + (f" (first: {bad[0]})" if bad else "")


def _same_point(ours: dict | None, ref: dict | None) -> bool:
    if ours is None or ref is None:
        return ours is None and ref is None
    return abs(ours["x"] - ref["x"]) <= COORD_TOL and abs(ours["y"] - ref["y"]) <= COORD_TOL


def json_close(a, b) -> bool:
    """Equal JSON values, floats within COORD_TOL."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(json_close(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) <= COORD_TOL
    return a == b


def unpack_mask(bits: np.ndarray, h: int, w: int) -> np.ndarray:
    """A golden mask (bit-packed, row-major) as an h x w {0, 1} array."""
    return np.unpackbits(bits)[:h * w].reshape(h, w)


def split_stream(stream: list) -> tuple[list[int], list[float], list[tuple[float, float]]]:
    """A segment case's decoded stream -> (text ids, coordinates, sizes): ints, ["c", v] and ["s", w, h] items."""
    marked = [v for v in stream if isinstance(v, list)]
    return ([v for v in stream if isinstance(v, int)], [v[1] for v in marked if v[0] == "c"],
            [tuple(v[1:]) for v in marked if v[0] == "s"])


def chat_images(case: dict) -> list[str]:
    """A chat case's images, in the order its messages' image parts index them: `images`, or its one `image`."""
    return case.get("images") or ([case["image"]] if case["image"] else [])


def submit_case(engine, folder: Path, case: dict):
    """A golden text or region case through an InferenceEngine (its adapter, adapters/<id>/final.pt, by id: the
    engine's KESTREL_ADAPTER_DIR must be the folder's adapters/): -> the coroutine of its EngineResult."""
    image = (folder / case["image"]).read_bytes() if case["image"] else None
    kind = case["kind"]
    adapter = {"adapter": Path(case["adapter"]).parent.name} if case.get("adapter") else {}
    text = {"temperature": 0, "max_tokens": case.get("max_tokens"), **adapter}
    if kind == "query":
        return engine.submit_tokens("query", image, case["question_ids"], text, reasoning=case.get("reasoning", False),
                                    spatial_refs=case.get("spatial_refs"))
    if kind == "caption":
        return engine.submit_tokens("caption", image, case["prompt_ids"], text)
    if kind == "chat":
        attached = [(folder / name).read_bytes() for name in chat_images(case)]
        return engine.chat(parse_messages(case["messages"], attached), case["reasoning"], False, text)
    if kind == "segment":
        return engine.submit_tokens("segment", image, case["object_ids"], {"max_tokens": case["max_tokens"]})
    if kind == "gaze":  # (not the cases that change the model's weights)
        face = case.get("face")
        refs = [[face[k] for k in ("x_min", "y_min", "x_max", "y_max")]] if face else [case["eye"]]
        return engine.gaze(image, refs, {"seed": case["seed"]} if face else None)
    return engine.submit_tokens(kind, image, case["object_ids"], {"max_objects": case["max_objects"], **adapter})


def result_matches(engine, case: dict, result) -> bool:
    """An engine's result against the case's golden tokens (decoded) or coordinates (clamped to [0, 1])."""
    tok = engine.model.tokenizer
    if case["kind"] == "chat":
        message = result.output["message"]
        return message["content"] == tok.decode(case["tokens"]) and \
            (not case["reasoning"] or message["reasoning"] == tok.decode(case["reasoning_tokens"]))
    if case["kind"] in ("query", "caption"):
        same = result.output["answer" if case["kind"] == "query" else "caption"] == tok.decode(case["tokens"])
        if case.get("reasoning"):
            same = same and result.output["reasoning"]["text"] == tok.decode(case["reasoning_tokens"])
        return same
    if case["kind"] == "segment":  # (the golden decode cases' outlines do not parse: nothing to refine)
        got, want = result.output["segments"][0], case["output"]["segments"][0]
        return result.finish_reason == case["finish_reason"] and ("parse_error" in got) == ("parse_error" in want) \
            and all(json_close(got.get(k), want[k]) for k in want if k not in ("object", "parse_error"))
    if case["kind"] == "gaze":
        return _same_point(result.output["gaze"], case["gaze"])
    key = "points" if case["kind"] == "point" else "objects"
    got = result.output[key]
    return len(got) == len(case[key]) and all(abs(o[k] - min(1.0, max(0.0, g[k]))) <= COORD_TOL
                                              for o, g in zip(got, case[key]) for k in g)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m kestrel_backend.parity FIXTURE_DIR", file=sys.stderr)
        return 2
    folder = Path(argv[0])
    checker = Checker(folder)
    results = []
    for case in checker.cases:
        try:
            ok, msg = checker.run(case)
        except Exception as e:  # a crash is a failed case, not a crashed run
            ok, msg = False, f"error: {type(e).__name__}: {e}"
        results.append(ok)
        print(f"{'PASS' if ok else 'FAIL'} {case['name']}: {msg}", flush=True)
    if (folder / "legacy").is_dir():
        ok, msg = checker.check_legacy_layout()
        results.append(ok)
        print(f"{'PASS' if ok else 'FAIL'} legacy_layout: {msg}")
    passed = sum(results)
    print(f"{passed} passed, {len(results) - passed} failed")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
