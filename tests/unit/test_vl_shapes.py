"""The image-caption set the repository draws itself (``mcore_ext.data.shapes``, issue 55): the
committed configs/vl_tiny set is what the script makes from its seed; every caption names the
colour and the shape its picture shows, and the mismatched control's pictures differ from their
captions in both. The pictures are judged from their pixels alone (an independent reading: the
shape's colour, and how much of its bounding box it fills: a square all of it, a circle pi / 4,
a triangle half), not from the generator's own record of what it drew.
"""

import json
from pathlib import Path

import numpy

from mcore_ext.data import shapes

ROOT = Path(__file__).resolve().parents[2]
SET = ROOT / "configs" / "vl_tiny"


def _seen(png: bytes) -> tuple:
    """(colour name, shape name) read off a picture's pixels."""
    image = shapes.read_png(png).astype(int)
    background = image[0, 0]  # every shape keeps a pixel's margin from the border
    inside = (image != background).any(axis=2)
    rows, cols = numpy.flatnonzero(inside.any(axis=1)), numpy.flatnonzero(inside.any(axis=0))
    fill = inside.sum() / ((rows[-1] - rows[0] + 1) * (cols[-1] - cols[0] + 1))
    colour = {tuple(c) for c in image[inside]}
    assert len(colour) == 1, colour  # one flat colour, hard edges
    (drawn,) = colour
    name = next(n for n, c in shapes.COLOURS.items() if tuple(c) == drawn)
    shape = "square" if fill > 0.93 else "circle" if fill > 0.65 else "triangle"
    return name, shape


def _records(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _pairs(path: Path) -> list:
    """(seen in the picture, the caption's words) per record."""
    pairs = []
    for record in _records(path):
        user, answer = record["messages"]
        picture = (path.parent / user["content"][0]["path"]).read_bytes()
        words = answer["content"][0]["text"].rstrip(".").split()[1:]  # "A red circle." -> 2
        pairs.append((_seen(picture), tuple(words)))
    return pairs


def test_the_committed_set_is_what_the_script_draws_from_its_seed(tmp_path):
    """The same seed: the same conversations byte for byte and the same pixels (compared
    decoded: another zlib could pack the same pixels into other bytes)."""
    shapes.main([str(tmp_path), "--count", "384"])  # the command docs/training.md gives
    shapes.main([str(tmp_path), "--count", "384", "--mismatched"])
    for name in ("captions.jsonl", "mismatched.jsonl"):
        assert (tmp_path / name).read_text() == (SET / name).read_text(), name
    committed = sorted(p.name for p in (SET / "images").iterdir())
    assert committed == sorted(p.name for p in (tmp_path / "images").iterdir())
    assert len(committed) == 384
    for name in committed:
        assert numpy.array_equal(shapes.read_png((SET / "images" / name).read_bytes()),
                                 shapes.read_png((tmp_path / "images" / name).read_bytes()))


def test_every_caption_names_what_its_picture_shows_and_the_control_never_does():
    pairs = _pairs(SET / "captions.jsonl")
    assert all(seen == said for seen, said in pairs), [p for p in pairs if p[0] != p[1]][:3]
    assert len({said for _, said in pairs}) == 12  # every colour with every shape
    control = _pairs(SET / "mismatched.jsonl")
    assert [said for _, said in control] == [said for _, said in pairs]  # the same captions
    assert all(seen[0] != said[0] and seen[1] != said[1] for seen, said in control)
    sizes = {shapes.read_png(p.read_bytes()).shape[:2] for p in (SET / "images").iterdir()}
    assert sizes == {(112, 112), (56, 112), (112, 56)}  # square and elongated canvases
