"""One-shot local run without Triton: python -m kestrel_backend.cli query --image cat.jpg --question "..."."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from .images import decode_image
from .model.moondream import Moondream
from .skills.generation import Prompt, RegionGeneration, TextGeneration
from .skills.prompts import caption_prompt, query_prompt, region_prompt
from .skills.settings import Settings
from .skills.single import run_single

TINY = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "md2-tiny"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kestrel_backend.cli")
    p.add_argument("skill", choices=["query", "caption", "point", "detect"])
    p.add_argument("--model-path", default=str(TINY), help="checkpoint folder (default: tiny random test checkpoint)")
    p.add_argument("--image")
    p.add_argument("--question", default="")
    p.add_argument("--object", default="")
    p.add_argument("--length", default="normal")
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args(argv)

    model = Moondream.from_checkpoint(args.model_path, dtype=torch.float32)
    if model.tokenizer is None:
        print(f"{args.model_path}: no tokenizer.json", file=sys.stderr)
        return 2
    tok = model.config.tokenizer
    settings = Settings(temperature=0.0, max_tokens=args.max_tokens, max_objects=20)
    with torch.inference_mode():
        embedding = model.encode_image(decode_image(Path(args.image).read_bytes())) if args.image else None
    if args.skill == "query":
        ids = query_prompt(tok, model.tokenizer.encode(args.question).ids, embedding is not None, False)
        gen = TextGeneration(tok, settings)
    elif args.skill == "caption":
        ids, gen = caption_prompt(tok, args.length), TextGeneration(tok, settings)
    else:
        ids = region_prompt(tok, args.skill, model.tokenizer.encode(" " + args.object).ids)
        gen = RegionGeneration(tok, settings, model, with_size=args.skill == "detect")
    run_single(model, Prompt(ids, embedding), gen)
    out = {"finish_reason": gen.finish_reason}
    out.update({"objects": gen.objects} if isinstance(gen, RegionGeneration) else {"text": model.tokenizer.decode(gen.tokens)})
    print(json.dumps(out, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
