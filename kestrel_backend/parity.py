"""Check this implementation against golden outputs of the reference implementation.

    python -m kestrel_backend.parity tests/fixtures/md2-tiny

One line per case (PASS/FAIL, max abs diff), then "N passed, M failed"; exit 0 only if all pass.
Tolerances (float32): logits and embeddings within 1e-4 relative to the largest reference value,
identical crop tiling and pixels, identical greedy tokens, coordinates within 1e-4.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

from .images import decode_image
from .model.image_crops import overlap_crops
from .model.lora import build_adapter, read_adapter_tensors
from .model.moondream import Moondream
from .model.weights import load_state
from .skills.generation import Prompt, ReasoningThenAnswer, RegionGeneration, TextGeneration
from .skills.prompts import caption_prompt, query_prompt, region_prompt, spatial_refs_start
from .skills.settings import Settings
from .skills.single import run_single

REL_TOL = 1e-4
COORD_TOL = 1e-4


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

    def check_legacy_layout(self) -> tuple[bool, str]:
        config = self.model.config
        current = load_state(self.folder / "model.safetensors", config)
        legacy = load_state(self.folder / "legacy", config)
        bad = [k for k in current if not torch.equal(current[k], legacy[k])]
        return not bad, f"{len(current)} tensors, {len(bad)} differ" + (f" (first: {bad[0]})" if bad else "")


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
    return engine.submit_tokens(kind, image, case["object_ids"], {"max_objects": case["max_objects"], **adapter})


def result_matches(engine, case: dict, result) -> bool:
    """An engine's result against the case's golden tokens (decoded) or coordinates (clamped to [0, 1])."""
    tok = engine.model.tokenizer
    if case["kind"] in ("query", "caption"):
        same = result.output["answer" if case["kind"] == "query" else "caption"] == tok.decode(case["tokens"])
        if case.get("reasoning"):
            same = same and result.output["reasoning"]["text"] == tok.decode(case["reasoning_tokens"])
        return same
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
