"""Make the tiny chat tokenizer and conversations of configs/sft_tiny/ (committed; rerun to remake).

The tokenizer is byte-level (256 byte tokens, no merges) plus ChatML's <|im_start|> / <|im_end|>
and <|endoftext|>, with a ChatML chat template: small, and rendered like a released model's.
The conversations are arithmetic questions and their answers (single- and multi-turn, some with a
system prompt, some as prompt / completion): a tiny model learns them in tens of steps.

    .venv/bin/python scripts/make_tiny_chat_data.py [--output configs/sft_tiny]
"""

import argparse
import json
import os
import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_level_tokenizer(special: list, **kwargs) -> PreTrainedTokenizerFast:
    """256 byte tokens (no merges) and ``special`` after them, ChatML's end and pad tokens;
    ``kwargs`` go to ``PreTrainedTokenizerFast`` (the chat template)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(special)
    return PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        bos_token=None, unk_token=None, **kwargs)


def make_tokenizer(folder: str) -> None:
    byte_level_tokenizer(SPECIAL, chat_template=TEMPLATE).save_pretrained(folder)


def conversations(count: int, seed: int = 0):
    rng = random.Random(seed)
    for index in range(count):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        kind = index % 4
        if kind == 0:
            yield {"prompt": f"What is {a} + {b}?", "completion": f"{a} + {b} = {a + b}."}
            continue
        messages = []
        if kind == 1:
            messages.append({"role": "system", "content": "You add numbers."})
        messages += [{"role": "user", "content": f"Add {a} and {b}."},
                     {"role": "assistant", "content": f"{a} + {b} = {a + b}."}]
        if kind == 3:
            messages += [{"role": "user", "content": f"And {a} - {b}?"},
                         {"role": "assistant", "content": f"{a} - {b} = {a - b}."}]
        yield {"messages": messages}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=os.path.join("configs", "sft_tiny"))
    parser.add_argument("--conversations", type=int, default=256)
    args = parser.parse_args(argv)
    make_tokenizer(os.path.join(args.output, "tokenizer"))
    with open(os.path.join(args.output, "chat.jsonl"), "w") as f:
        for record in conversations(args.conversations):
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
