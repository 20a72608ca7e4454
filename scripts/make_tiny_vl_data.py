"""Make configs/vl_tiny/ (committed; rerun to remake): a tiny Step-3.7 processor folder and the
image-caption set the VL recipe trains on.

- ``processor/``: what ``AutoProcessor.from_pretrained`` reads for Step-3.7 (``Step3p7Processor``:
  its image processor, tokenizer and chat template), tiny. The tokenizer is byte-level (256 byte
  tokens, no merges) plus ChatML's <|endoftext|> / <|im_start|> / <|im_end|> and Step-3.7's image
  tokens <im_patch> (the placeholder the image features replace, id 259), <patch_start>,
  <patch_end>, <patch_newline>, <im_start>, <im_end>: 265 ids. The image processor is the release's
  (CLIP mean and std, bilinear) at small sizes: a 112 x 112 global view (4 placeholders: 112 / (14
  x 4) squared) and 56 x 56 local crops (1 placeholder each). The chat template is ChatML over
  transformers' content lists, an image part rendered as <im_patch> (the processor expands it),
  the assistant turns in {% generation %} blocks (so transformers' own assistant mask is there to
  compare against).
- ``captions.jsonl`` + ``images/``: 384 drawn shapes with their captions
  (``mcore_ext.data.shapes``, seed 0), and ``mismatched.jsonl``: the same captions with pictures
  of another shape and colour.

Needs transformers (and, to check the folder loads, torchvision and Pillow):

    .venv/bin/python scripts/make_tiny_vl_data.py [--output configs/vl_tiny]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from make_tiny_chat_data import byte_level_tokenizer  # noqa: E402  (this script's folder)
from mcore_ext.data import shapes  # noqa: E402

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<im_patch>", "<patch_start>",
           "<patch_end>", "<patch_newline>", "<im_start>", "<im_end>"]
_PARTS = ("{% for part in parts %}{% if part['type'] == 'image' %}<im_patch>"
          "{% else %}{{ part['text'] }}{% endif %}{% endfor %}<|im_end|>\n")
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}"
    "{% set parts = [{'type': 'text', 'text': message['content']}] %}"
    "{% else %}{% set parts = message['content'] %}{% endif %}"
    "{% if message['role'] == 'assistant' %}{% generation %}" + _PARTS + "{% endgeneration %}"
    "{% else %}" + _PARTS + "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GLOBAL_SIZE, CROP_SIZE = 112, 56


def make_processor(folder: str) -> None:
    from transformers import Step3p7ImageProcessor, Step3p7Processor

    tokenizer = byte_level_tokenizer(SPECIAL)
    images = Step3p7ImageProcessor(size={"height": GLOBAL_SIZE, "width": GLOBAL_SIZE},
                                   patch_size=CROP_SIZE)
    Step3p7Processor(image_processor=images, tokenizer=tokenizer,
                     chat_template=TEMPLATE).save_pretrained(folder)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=os.path.join("configs", "vl_tiny"))
    parser.add_argument("--count", type=int, default=384)
    args = parser.parse_args(argv)
    make_processor(os.path.join(args.output, "processor"))
    shapes.write_set(args.output, args.count, seed=0)
    shapes.write_set(args.output, args.count, seed=0, name="mismatched.jsonl", mismatch=True)


if __name__ == "__main__":
    main()
