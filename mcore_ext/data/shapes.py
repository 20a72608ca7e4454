"""A tiny image-caption set drawn here, no download: one coloured shape on a plain background per
picture, its caption naming the colour and the shape ("A red circle."), written as a JSONL file of
conversations in transformers' content-list form plus the PNGs it names (paths relative to the
JSONL file, as ``data.source: chat`` reads them).

    python -m mcore_ext.data.shapes OUT [--count 384] [--seed 0] [--mismatched]

Each picture is a circle, a square or a triangle in red, green, blue or yellow (the 12 pairs in
turn, so every class is equally common and every split of the file holds all of them), on a
white, grey or black background, of one of three sizes, at a random place, on a canvas of
112 x 112, 112 x 56 or 56 x 112 pixels (the elongated ones give the Step-3.7 processor of
configs/vl_tiny local crops besides the global view). The same seed always gives the same
conversations and the same pixels; the PNGs are written by a small encoder of our own (zlib and
numpy), so no imaging library is needed to make them.

Only the picture tells the answer: the question does not name the shape or colour. A model that
learns the set must learn it through the images; ``--mismatched`` writes the same conversations
with every picture swapped for one whose shape and colour both differ from its caption (the
control of that claim: a model that reads the pictures does worse on it).
"""

import argparse
import json
import os
import random
import struct
import zlib

import numpy

SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220),
           "yellow": (230, 200, 40)}
BACKGROUNDS = {"white": (245, 245, 245), "grey": (128, 128, 128), "black": (16, 16, 16)}
CANVASES = ((112, 112), (112, 112), (112, 56), (56, 112))  # (width, height): square twice as often
SIZES = (0.18, 0.26, 0.34)  # the shape's half-extent, a share of the canvas's short side
QUESTIONS = ("What is in the picture?", "Describe the image.", "What do you see?")


def draw(shape: str, colour, background, width: int, height: int, radius: float, cx: float,
         cy: float) -> numpy.ndarray:
    """[height, width, 3] uint8: ``shape`` of half-extent ``radius`` centred at (cx, cy) in
    ``colour`` on ``background`` (hard edges, pixel centres tested)."""
    y, x = numpy.mgrid[0:height, 0:width] + 0.5
    if shape == "circle":
        inside = (x - cx) ** 2 + (y - cy) ** 2 <= radius ** 2
    elif shape == "square":
        inside = (abs(x - cx) <= radius) & (abs(y - cy) <= radius)
    elif shape == "triangle":  # apex up: half-width grows from 0 at the top to radius at the base
        inside = ((y >= cy - radius) & (y <= cy + radius)
                  & (abs(x - cx) <= (y - cy + radius) / 2))
    else:
        raise ValueError(f"unknown shape {shape!r} (expected one of {', '.join(SHAPES)})")
    image = numpy.empty((height, width, 3), dtype=numpy.uint8)
    image[:] = background
    image[inside] = colour
    return image


def png_bytes(image: numpy.ndarray) -> bytes:
    """The PNG file of a [height, width, 3] uint8 image (8-bit RGB, no filter, zlib level 9)."""
    height, width, channels = image.shape
    if channels != 3 or image.dtype != numpy.uint8:
        raise ValueError(f"expected [height, width, 3] uint8, got {image.shape} {image.dtype}")
    rows = numpy.concatenate([numpy.zeros((height, 1), numpy.uint8),  # filter type 0 per row
                              image.reshape(height, width * 3)], axis=1)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bits, RGB
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(rows.tobytes(), 9)) + chunk(b"IEND", b""))


def read_png(data: bytes) -> numpy.ndarray:
    """The pixels of a PNG that ``png_bytes`` wrote ([height, width, 3] uint8): for checking
    the set without an imaging library (8-bit RGB, filter type 0 only)."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG file")
    at, idat, width = 8, b"", None
    while at < len(data):
        (length,), kind = struct.unpack(">I", data[at:at + 4]), data[at + 4:at + 8]
        body = data[at + 8:at + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour_type = struct.unpack(">IIBB", body[:10])
            if (depth, colour_type) != (8, 2):
                raise ValueError("only 8-bit RGB PNGs are read here")
        elif kind == b"IDAT":
            idat += body
        at += 12 + length
    rows = numpy.frombuffer(zlib.decompress(idat), numpy.uint8).reshape(height, 1 + width * 3)
    if rows[:, 0].any():
        raise ValueError("only filter type 0 is read here")
    return rows[:, 1:].reshape(height, width, 3).copy()


def pictures(count: int, seed: int = 0):
    """``count`` dicts: shape, colour, background, width, height, radius, cx, cy, question: the
    12 (shape, colour) pairs in turn, the rest drawn from ``random.Random(seed)``."""
    rng = random.Random(seed)
    colours = list(COLOURS)
    for index in range(count):
        width, height = rng.choice(CANVASES)
        radius = rng.choice(SIZES) * min(width, height)
        yield {"shape": SHAPES[index % len(SHAPES)],
               "colour": colours[index // len(SHAPES) % len(colours)],
               "background": rng.choice(list(BACKGROUNDS)), "width": width, "height": height,
               "radius": radius,
               "cx": rng.uniform(radius + 1, width - radius - 1),
               "cy": rng.uniform(radius + 1, height - radius - 1),
               "question": rng.choice(QUESTIONS)}


def caption(picture: dict) -> str:
    return f"A {picture['colour']} {picture['shape']}."


def conversation(image_path: str, question: str, answer: str) -> dict:
    """One JSONL record: the picture and the question from the user, the caption answered."""
    return {"messages": [
        {"role": "user", "content": [{"type": "image", "path": image_path},
                                     {"type": "text", "text": question}]},
        {"role": "assistant", "content": [{"type": "text", "text": answer}]}]}


def mismatched(items: list) -> list:
    """For each picture, the index of the next one (cyclically) whose shape and colour both
    differ from it: the pictures of ``--mismatched``."""
    chosen = []
    for i, item in enumerate(items):
        for step in range(1, len(items)):
            other = items[(i + step) % len(items)]
            if other["shape"] != item["shape"] and other["colour"] != item["colour"]:
                chosen.append((i + step) % len(items))
                break
        else:
            raise ValueError("no picture of another shape and colour to swap in")
    return chosen


def write_set(output: str, count: int = 384, seed: int = 0, name: str = "captions.jsonl",
              mismatch: bool = False) -> str:
    """Draws the set into ``output`` (``images/NNNN.png`` and the JSONL file ``name``); returns
    the JSONL file's path. ``mismatch``: every caption with another class's picture."""
    items = list(pictures(count, seed))
    os.makedirs(os.path.join(output, "images"), exist_ok=True)
    paths = []
    for index, item in enumerate(items):
        path = f"images/{index:04d}.png"
        image = draw(item["shape"], COLOURS[item["colour"]], BACKGROUNDS[item["background"]],
                     item["width"], item["height"], item["radius"], item["cx"], item["cy"])
        with open(os.path.join(output, path), "wb") as f:
            f.write(png_bytes(image))
        paths.append(path)
    if mismatch:
        paths = [paths[j] for j in mismatched(items)]
    jsonl = os.path.join(output, name)
    with open(jsonl, "w") as f:
        for item, path in zip(items, paths):
            f.write(json.dumps(conversation(path, item["question"], caption(item))) + "\n")
    return jsonl


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", help="folder to write images/ and the JSONL file into")
    parser.add_argument("--count", type=int, default=384)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default=None,
                        help="the JSONL file's name (captions.jsonl; mismatched.jsonl with "
                             "--mismatched)")
    parser.add_argument("--mismatched", action="store_true",
                        help="every caption with a picture of another shape and colour")
    args = parser.parse_args(argv)
    name = args.name or ("mismatched.jsonl" if args.mismatched else "captions.jsonl")
    path = write_set(args.output, args.count, args.seed, name, args.mismatched)
    print(f"[data] {path}: {args.count} pictures with their captions")


if __name__ == "__main__":
    main()
