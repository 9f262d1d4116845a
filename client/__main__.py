"""python -m client SKILL --url localhost:8001 --image PATH [--stream]   (SKILL: any of the table of skills,
kestrel_backend/skills/catalog.py: query, caption, detect, point, segment, chat)
python -m client batch run|submit|status|wait|results|abort ...   (the gateway's Batch API: client/batch.py)
python -m client detect --image cat.jpg --object cat --draw cat-boxes.png   (the answer drawn: client/draw.py)
python -m client gaze --image people.jpg --eye 0.41,0.33 --draw gaze.png   (Moondream 2; --face for the box form)

chat: --messages '[{"role": "user", "content": "What is this?"}]' (the image, if given, joins the first user
message)."""

import argparse
import json
import sys
from pathlib import Path

from kestrel_backend.skills.catalog import SKILLS

from . import MoondreamClient, MoondreamError
from .draw import DRAWN, draw


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["batch"]:  # the Batch API, through the gateway (client/batch.py)
        from .batch import main as batch_main
        return batch_main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m client")
    p.add_argument("skill", choices=list(SKILLS))
    p.add_argument("--url", default="localhost:8001")
    p.add_argument("--image")
    p.add_argument("--question")
    p.add_argument("--object")
    p.add_argument("--length")
    p.add_argument("--messages", help="chat: a JSON list of OpenAI-style messages")
    p.add_argument("--eye", help="gaze: the eye, x,y in [0, 1]")
    p.add_argument("--face", help="gaze: the face's box, x_min,y_min,x_max,y_max in [0, 1] (the more accurate form)")
    p.add_argument("--reasoning", action="store_true", default=None)
    p.add_argument("--settings", help="JSON object, e.g. '{\"max_tokens\": 64}'")
    p.add_argument("--stream", action="store_true")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--draw", metavar="PNG", help="detect, point, segment: write the image with the answer drawn on it")
    a = p.parse_args(argv)
    if a.draw and (a.skill not in DRAWN or not a.image or a.stream):
        p.error(f"--draw takes {', '.join(DRAWN)} with --image, not streamed")
    kw = dict(image=Path(a.image).read_bytes() if a.image else None, question=a.question, object=a.object,
              length=a.length, reasoning=a.reasoning, settings=json.loads(a.settings) if a.settings else None)
    if a.skill == "gaze":
        if (a.eye is None) == (a.face is None):
            p.error("gaze takes --eye x,y or --face x_min,y_min,x_max,y_max")
        kw["spatial_refs"] = [[float(v) for v in (a.eye or a.face).split(",")]]
    if a.stream and not SKILLS[a.skill].streams:
        p.error(f"{a.skill} does not stream")
    if SKILLS[a.skill].text == "messages":
        kw["messages"] = json.loads(a.messages or "[]")
        if kw["image"] is not None:  # the image joins the first user message, as an index into IMAGE
            first = next((m for m in kw["messages"] if m.get("role") == "user"), None)
            if first is not None:
                content = first["content"] if isinstance(first["content"], list) else \
                    [{"type": "text", "text": first["content"]}]
                first["content"] = [{"type": "image", "index": 0}] + content
    c = MoondreamClient(a.url, timeout=a.timeout)
    try:
        if a.stream:
            for body in c.stream(a.skill, **kw):
                if body.get("completed"):
                    print(body.get("chunk", ""), flush=True)
                    print(json.dumps(body, ensure_ascii=False))
                else:
                    print(body["chunk"], end="", flush=True)
        else:
            body = c.answer(a.skill, **kw)
            print(json.dumps(body, ensure_ascii=False))
            if a.draw:
                ref = (kw.get("spatial_refs") or [[]])[0]  # (gaze's arrow starts at the eye, or the face's centre)
                start = ref[:2] if len(ref) == 2 else [(ref[0] + ref[2]) / 2, (ref[1] + ref[3]) / 2] if ref else None
                draw(kw["image"], a.skill, {**body, "from": start}).save(a.draw)
    except MoondreamError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
