"""Seed-style test client: runs every skill against a server.  python client/client.py --url localhost:8001 --image PATH"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from client import MoondreamClient  # noqa: E402


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
    return 0


if __name__ == "__main__":
    sys.exit(main())
