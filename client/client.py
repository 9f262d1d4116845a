"""Seed-style test client: runs every skill the server's model has (segment only on Moondream 3) against a server.

    python client/client.py --url localhost:8001 --image PATH
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from client import MoondreamClient, MoondreamError  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="localhost:8001")
    p.add_argument("--image", required=True)
    a = p.parse_args()
    image = Path(a.image).read_bytes()
    c = MoondreamClient(a.url)
    print("query:", json.dumps(c.query("What is in this image?", image=image, settings={"max_tokens": 32})))
    print("caption:", json.dumps(c.caption(image, "short", settings={"max_tokens": 32})))
    print("caption (stream): ", end="")
    for body in c.stream("caption", image=image, settings={"max_tokens": 32}):
        print(body["chunk"], end="", flush=True)
    print()
    print("detect:", json.dumps(c.detect(image, "face")))
    print("point:", json.dumps(c.point(image, "eye")))
    chat = [{"role": "user", "content": [{"type": "image", "index": 0}, {"type": "text", "text": "What is it?"}]}]
    print("chat:", json.dumps(c.chat(chat, image, settings={"max_tokens": 32})))
    try:
        print("segment:", json.dumps(c.segment(image, "face", settings={"max_tokens": 64})))
    except MoondreamError as e:  # (Moondream 2 has no segment)
        print("segment:", e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
