"""Gaze (Moondream 2): where a person looks, from a point on their eye, as the reference's detect_gaze asks it.

The prompt after the image prefix is the text "\\n\\nPoint:", the eye's x and y as two coordinate embeddings, then
" gaze\\n\\n"; the answer is the region decoder's one point, or none when the model's first choice is end of text. The
eye is rounded to bfloat16 first, as the reference rounds it (its coordinate tensor is bfloat16).

With a face box instead of an eye, the answer is the reference's more accurate form: ten eye points drawn uniformly in
the box on the image and ten on the image mirrored left to right (each answer mirrored back), outliers dropped (a
point whose mean distance to its nearest points, itself included, is over twice the median of those means), and the
mean of the rest; no answer when fewer than ten of the twenty found one.
"""

from __future__ import annotations

import random
import statistics

import torch

BEFORE, AFTER = "\n\nPoint:", " gaze\n\n"
SAMPLES = 10  # eye points drawn in the face box, on the image and on its mirror image each
NEAREST, SPREAD = 2, 2.0  # the outlier test: distances to the 2 nearest (the point itself one of them), 2x the median


def gaze_prompt(encode) -> tuple[list[int], int]:
    """(the prompt's ids, with two placeholders for the eye's coordinates; the index of the first)."""
    before = encode(BEFORE)
    return before + [0, 0] + encode(AFTER), len(before)


def eye_ref(eye) -> tuple[float, float]:
    """The eye as the prompt's spatial reference: (x, y), each rounded to bfloat16 as the reference rounds it."""
    x, y = eye
    return float(torch.tensor(x, dtype=torch.bfloat16)), float(torch.tensor(y, dtype=torch.bfloat16))


def eye_samples(face: tuple[float, float, float, float], rng: random.Random) -> list[tuple[float, float, bool]]:
    """(x, y, mirrored) for each eye point asked: SAMPLES in the box, then SAMPLES on the mirror image (x mirrored), in
    the reference's order of draws (so that a seeded draw asks the same points)."""
    x_min, y_min, x_max, y_max = face
    plain = [(rng.uniform(x_min, x_max), rng.uniform(y_min, y_max), False) for _ in range(SAMPLES)]
    mirrored = [(1 - rng.uniform(x_min, x_max), rng.uniform(y_min, y_max), True) for _ in range(SAMPLES)]
    return plain + mirrored


def mean_gaze(points: list[tuple[float, float]]) -> dict | None:
    """The mean of the points that are not outliers; None when fewer than SAMPLES were found."""
    if len(points) < SAMPLES:
        return None
    spread = []
    for x, y in points:
        distances = sorted(((x - u) ** 2 + (y - v) ** 2) ** 0.5 for u, v in points)
        spread.append(sum(distances[:NEAREST]) / NEAREST)
    bound = SPREAD * statistics.median(spread)
    kept = [p for p, s in zip(points, spread) if s <= bound]
    return {"x": sum(p[0] for p in kept) / len(kept), "y": sum(p[1] for p in kept) / len(kept)}
