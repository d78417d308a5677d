"""Procedurally drawn images for vision-language RL: count the shapes in a picture. No I/O (PNG bytes in memory).

A ``size`` x ``size`` white image is cut into a 4 x 4 grid; 1 to ``MAX_SHAPES`` cells each get a circle, square or
triangle in one of six colours, jittered inside its cell. The prompt is ``<image>`` followed by the question; the
answer is the count. A picture belongs to the ``train`` or the ``eval`` split by a hash of its layout, so the
splits never share one whatever the seed, and each split is deterministic per seed.
"""

from __future__ import annotations

import hashlib
import io
import random

from services.builder.datasets.task import Task

SPLITS = ("train", "eval")
MAX_SHAPES = 5
GRID = 4
DEFAULT_SIZE = 32
MIN_SIZE = 4 * GRID
EVAL_MODULUS = 10
KINDS = ("circle", "square", "triangle")
COLOURS = ((220, 40, 40), (40, 160, 40), (40, 70, 220), (230, 170, 20), (150, 50, 180), (20, 170, 190))
QUESTION = "How many shapes?"
GRADING = {"verifier": "math", "extract": "last_number"}

# (cell, kind, colour, dx, dy) per shape
Layout = tuple[tuple[int, int, int, int, int], ...]


def draw_layout(rng: random.Random, size: int) -> Layout:
    count = rng.randint(1, MAX_SHAPES)
    cells = sorted(rng.sample(range(GRID * GRID), count))
    slack = max(size // GRID // 4, 0)
    return tuple((c, rng.randrange(len(KINDS)), rng.randrange(len(COLOURS)),
                  rng.randint(-slack, slack), rng.randint(-slack, slack)) for c in cells)


def render(layout: Layout, size: int) -> bytes:
    """The layout as PNG bytes."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    cell = size // GRID
    r = max(cell * 3 // 8, 2)
    for c, kind, colour, dx, dy in layout:
        cx, cy = (c % GRID) * cell + cell // 2 + dx, (c // GRID) * cell + cell // 2 + dy
        box = (cx - r, cy - r, cx + r, cy + r)
        fill = COLOURS[colour]
        if KINDS[kind] == "circle":
            pen.ellipse(box, fill=fill)
        elif KINDS[kind] == "square":
            pen.rectangle(box, fill=fill)
        else:
            pen.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def split_of(layout: Layout) -> str:
    digest = hashlib.sha256(repr(layout).encode()).digest()
    return "eval" if int.from_bytes(digest[:8], "big") % EVAL_MODULUS == 0 else "train"


def make_task(layout: Layout, size: int, index: int, split: str) -> Task:
    return Task(task_id=f"shapes-{split}-{index}", prompt=f"<image>{QUESTION}", answer=str(len(layout)),
                metadata=dict(GRADING), images=(render(layout, size),))


def generate_split(split: str, num: int, seed: int, size: int = DEFAULT_SIZE) -> list[Task]:
    """``num`` distinct pictures of ``split``, deterministic per ``seed``."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    if size < MIN_SIZE:
        raise ValueError(f"image size must be >= {MIN_SIZE}, got {size}")
    rng = random.Random(f"shapes/{split}/{seed}")
    seen: set[Layout] = set()
    tasks: list[Task] = []
    for _ in range(50 * max(num, 1) + 10_000):
        if len(tasks) == num:
            return tasks
        layout = draw_layout(rng, size)
        if layout in seen or split_of(layout) != split:
            continue
        seen.add(layout)
        tasks.append(make_task(layout, size, len(tasks), split))
    if len(tasks) < num:
        raise ValueError(f"num={num} is more than split {split!r} can supply")
    return tasks
