"""Segment (Moondream 3): the object's box and outline as the model writes them, shaped as Kestrel's output.

The model answers with a coordinate pair and a size (the box: centre, width and height), then an SVG path as
text: one command letter or number per token, numbers in a 960-unit view box over the box (a "-" token negates
the number after it). The path is scaled to [0, 1] of the box; a path that does not parse is reported, not fatal.
"""

from __future__ import annotations

VIEWBOX = 960.0
COMMANDS = frozenset("MmLlHhVvCcSsQqTtAaZz")
LAST_SPECIAL_ID = 20  # ids up to this one are control tokens, never part of a path


def path_tokens(tokenizer, ids: list[int]) -> list[str]:
    """Each text token decoded on its own, trimmed; empty ones (spaces) and control ids dropped."""
    kept = [[i] for i in ids if i > LAST_SPECIAL_ID]
    if not kept:
        return []
    return [s.strip() for s in tokenizer.decode_batch(kept, skip_special_tokens=True) if s.strip()]


def parse_path(tokens: list[str]) -> list[str | tuple[int, int]]:
    """Commands, each followed by its (x, y) pairs; a trailing odd number is dropped. ValueError if the path does
    not start with a command or a token is neither a command nor an integer."""
    out: list[str | tuple[int, int]] = []
    i = 0
    while i < len(tokens):
        if tokens[i] not in COMMANDS:
            raise ValueError(f"SVG path token {tokens[i]!r} is not a path command")
        out.append(tokens[i])
        i += 1
        numbers = []
        while i < len(tokens) and tokens[i] not in COMMANDS:
            if tokens[i] == "-":
                if i + 1 == len(tokens):
                    break
                numbers.append(-int(tokens[i + 1]))
                i += 2
            else:
                numbers.append(int(tokens[i]))
                i += 1
        out.extend((numbers[j], numbers[j + 1]) for j in range(0, len(numbers) - 1, 2))
    return out


def _number(value: float) -> str:
    """At most 3 decimals, trailing zeros dropped (0.500 -> 0.5, 1.000 -> 1)."""
    return f"{value:.3f}".rstrip("0").rstrip(".")


def scaled_path(parsed: list[str | tuple[int, int]]) -> str:
    """The path in [0, 1] units of the box, items separated by spaces."""
    items = []
    for item in parsed:
        items.extend([item] if isinstance(item, str) else (_number(v / VIEWBOX) for v in item))
    return " ".join(items)


def _unit(v: float) -> float:
    return min(max(v, 0.0), 1.0)


def box_from(coords: list[float], sizes: list[tuple[float, float]]) -> dict | None:
    """The first coordinate pair as the centre and the first size, clipped to the image."""
    if len(coords) < 2 or not sizes:
        return None
    cx, cy = _unit(coords[0]), _unit(coords[1])
    half_w, half_h = _unit(sizes[0][0]) / 2, _unit(sizes[0][1]) / 2
    return {"x_min": max(cx - half_w, 0.0), "x_max": min(cx + half_w, 1.0),
            "y_min": max(cy - half_h, 0.0), "y_max": min(cy + half_h, 1.0)}


def coarse_segment(obj: str, tokenizer, text_ids: list[int], coords: list[float],
                   sizes: list[tuple[float, float]]) -> dict:
    """One segment as the model wrote it (Kestrel's keys). svg_path and bbox are the coarse ones until refined."""
    tokens = path_tokens(tokenizer, text_ids)
    segment = {"object": obj, "text": tokenizer.decode(text_ids).strip() if text_ids else "", "svg_path": "",
               "path_tokens": tokens, "token_ids": list(text_ids),
               "points": [{"x": _unit(coords[i]), "y": _unit(coords[i + 1])} for i in range(0, len(coords) - 1, 2)]}
    try:
        segment["svg_path"] = scaled_path(parse_path(tokens)) if tokens else ""
    except ValueError as e:
        segment["parse_error"] = str(e)
    segment["coarse_path"] = segment["svg_path"]
    box = box_from(coords, sizes)
    if box is not None:
        segment["bbox"], segment["coarse_bbox"] = box, dict(box)
    if sizes:
        segment["sizes"] = [{"width": _unit(w), "height": _unit(h)} for w, h in sizes]
    segment["refined"] = False
    return segment
