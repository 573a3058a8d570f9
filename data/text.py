"""
Text data: the on-disk format of the token datasets and its readers (train_gpt.py, analyze.py), the
tokenizers, and writing a dataset (the text prepare scripts; the Shakespeare corpus is data/shakespeare_char's).

Format (nanoGPT's, with JSON instead of pickle so that reading metadata never executes code):
    data/<name>/train.bin, val.bin   flat uint16 token ids
    data/<name>/meta.json            {"vocab_size", "tokenizer": "char" | "gpt2", "chars" (char),
                                      "encoding", "eot_token" (gpt2), "token_bytes", "source", "corpus"
                                      (corpus_name), counts}
token_bytes[i] is the UTF-8 length of token i (0 for special tokens such as <|endoftext|>): bits per
byte weighs every predicted token by the bytes of text it stands for.
"""

import json
import math
import os

import numpy as np

import torch

import common
from common import UsageError
from data import download_timeout

DATASETS = ("shakespeare_char", "shakespeare", "fineweb_edu")  # each made by data/<name>/prepare.py

# -----------------------------------------------------------------------------
# reading a prepared dataset: tokens, metadata, tokenizers, batches


def _prepared(data_dir, dataset, filename):
    path = os.path.join(data_dir, dataset, filename)
    if not os.path.isfile(path):
        script = os.path.join("data", dataset, "prepare.py")
        fix = (f"prepare it first: python {script}" if dataset in DATASETS else
               f"known datasets: {', '.join(DATASETS)} (each made by python data/<name>/prepare.py)")
        raise UsageError(f"{path} not found: dataset {dataset!r} is not prepared in {data_dir}; {fix}")
    return path


def load_meta(data_dir, dataset):
    """The dataset's meta.json: vocab_size, tokenizer ('char' or 'gpt2'), chars or encoding, token_bytes."""
    with open(_prepared(data_dir, dataset, "meta.json"), encoding="utf-8") as f:
        return json.load(f)


def load_tokens(data_dir, dataset, split):
    """The token ids of a split ('train' or 'val') as a read-only uint16 memmap."""
    return np.memmap(_prepared(data_dir, dataset, f"{split}.bin"), dtype=np.uint16, mode="r")


def hold_out(tokens, fraction):
    """A selection split, for choosing hyperparameters without the validation split: (the first 1 - fraction of the
    training tokens, to train on; the last fraction, to evaluate in place of the validation split). fraction 0: (tokens,
    None). No training window reaches into the held-out tokens: the two are separate arrays."""
    if not fraction:
        return tokens, None
    cut = len(tokens) - round(fraction * len(tokens))
    return tokens[:cut], tokens[cut:]


def tiktoken_encoding(name="gpt2"):
    """A tiktoken Encoding by name; tiktoken downloads its vocabulary on first use, then caches it."""
    import tiktoken
    try:
        with download_timeout():
            return tiktoken.get_encoding(name)
    except Exception as e:
        reason = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise UsageError(f"tiktoken could not load the {name!r} vocabulary ({reason}). tiktoken downloads it from "
                         f"openaipublic.blob.core.windows.net on first use and caches it (TIKTOKEN_CACHE_DIR): "
                         f"connect to the internet once, or use the character-level data/shakespeare_char") from None


def token_byte_lengths(enc):
    """UTF-8 bytes of every token id of a tiktoken Encoding; 0 for special tokens and unused ids."""
    special = {enc.encode_single_token(t) for t in enc.special_tokens_set}
    out = []
    for i in range(enc.n_vocab):
        try:
            out.append(0 if i in special else len(enc.decode_single_token_bytes(i)))
        except KeyError:  # an id between the ordinary and the special tokens
            out.append(0)
    return out


class Tokenizer:
    """encode(text) -> ids, decode(ids) -> text, and token_bytes[i] = UTF-8 length of token i (0 for
    special tokens such as <|endoftext|>), the weights of bits per byte. GPT-2 BPE loads tiktoken's
    vocabulary only when text is encoded or decoded: training needs just meta["token_bytes"]."""

    def __init__(self, meta, encoding=None):
        self.kind, self.vocab_size = meta["tokenizer"], meta["vocab_size"]
        if self.kind == "char":
            self.chars = meta["chars"]
            self.stoi = {c: i for i, c in enumerate(self.chars)}
            computed = [len(c.encode("utf-8")) for c in self.chars]
        elif self.kind == "gpt2":
            self.encoding_name, self._enc = meta.get("encoding", "gpt2"), encoding
            computed = None
        else:
            raise UsageError(f"meta.json: unknown tokenizer {self.kind!r}; expected 'char' or 'gpt2'")
        self.token_bytes = list(meta["token_bytes"]) if "token_bytes" in meta else computed
        if self.token_bytes is None:
            self.token_bytes = token_byte_lengths(self.enc)

    @property
    def enc(self):
        if self._enc is None:
            self._enc = tiktoken_encoding(self.encoding_name)
        return self._enc

    def encode(self, text):
        if self.kind == "char":
            unknown = sorted(set(text) - set(self.stoi))
            if unknown:
                raise UsageError(f"the text has characters outside the vocabulary: {''.join(unknown)!r}")
            return [self.stoi[c] for c in text]
        return self.enc.encode(text, allowed_special="all")

    def decode(self, ids):
        ids = [i for i in ids if i < self.vocab_size]  # never emitted by a trained model: padded vocabulary rows
        return "".join(self.chars[i] for i in ids) if self.kind == "char" else self.enc.decode(ids)


def get_tokenizer(meta, encoding=None):
    """The tokenizer of a dataset's meta dict; `encoding` supplies a tiktoken Encoding directly."""
    return Tokenizer(meta, encoding)


def model_vocab_size(vocab_size):
    """BPE vocabularies are padded to a multiple of 64 for fast matmuls (50257 -> 50304); small
    character vocabularies stay exact."""
    return vocab_size if vocab_size <= 1024 else 64 * math.ceil(vocab_size / 64)


def windows(tokens, starts, block_size, device):
    """Inputs x and next-token targets y (B, block_size) from windows of block_size + 1 tokens."""
    w = torch.from_numpy(np.stack([tokens[s:s + block_size + 1] for s in starts]).astype(np.int64))
    x, y = w[:, :-1], w[:, 1:]
    return common.to_device(x, device), common.to_device(y, device)


def load_windows(data_dir, dataset, T, max_samples, holdout=0.0):
    """Up to max_samples windows (n, T) and their next-token targets, evenly spread over the validation tokens (a run
    trained with --holdout: over its held-out tokens)."""
    val = hold_out(load_tokens(data_dir, dataset, "train"), holdout)[1] if holdout else load_tokens(data_dir, dataset, "val")
    n = min(max_samples, (len(val) - 1) // T)
    if n < 1:
        raise UsageError(f"the validation split of {dataset!r} has {len(val)} tokens, fewer than one window of "
                         f"seq_len+1 = {T + 1}; pass a smaller --seq_len")
    return windows(val, [i * (len(val) - T - 1) // max(n - 1, 1) for i in range(n)], T, "cpu")


def token_names(data_dir, dataset, ids):
    """Readable names of token ids: the repr of each decoded token, or the ids when the tokenizer is unavailable."""
    try:
        tok = get_tokenizer(load_meta(data_dir, dataset))
        return [repr(tok.decode([i])) for i in ids]
    except Exception:  # names are a nicety (GPT-2 BPE needs tiktoken's downloaded vocabulary); ids are exact
        return [str(i) for i in ids]


def get_batch(tokens, seed, step, index, batch_size, block_size, device):
    """Micro-batch `index` of optimiser step `step`: random windows, a pure function of (seed, step,
    index); so a resumed run draws exactly the batches the uninterrupted one would have."""
    starts = np.random.default_rng([seed, step, index]).integers(0, len(tokens) - block_size, size=batch_size)
    return windows(tokens, starts, block_size, device)

# -----------------------------------------------------------------------------
# GPT-2 BPE (tiktoken)


def gpt2_encoding():
    """tiktoken's GPT-2 encoding (a clear UsageError when its vocabulary cannot be downloaded)."""
    return tiktoken_encoding("gpt2")


def bpe_meta(enc, **extra):
    return dict(vocab_size=enc.n_vocab, tokenizer="gpt2", encoding=enc.name, eot_token=enc.eot_token,
                token_bytes=token_byte_lengths(enc), **extra)

# -----------------------------------------------------------------------------
# writing a prepared dataset


def to_uint16(ids, vocab_size):
    if vocab_size > 65536:
        raise ValueError(f"vocab_size={vocab_size} does not fit in uint16 token files")
    return np.asarray(ids, dtype=np.uint16)


def write_dataset(out_dir, train_ids, val_ids, meta):
    """train.bin, val.bin (uint16) and meta.json into out_dir; prints the counts."""
    train = to_uint16(train_ids, meta["vocab_size"])
    val = to_uint16(val_ids, meta["vocab_size"])
    meta = dict(meta, train_tokens=len(train), val_tokens=len(val))
    for name, data in (("train.bin", train.tobytes()), ("val.bin", val.tobytes()),
                       ("meta.json", json.dumps(meta).encode("utf-8"))):
        with common.atomic_write(os.path.join(out_dir, name)) as f:
            f.write(data)
    print(f"vocab size: {meta['vocab_size']:,}")
    print(f"train has {len(train):,} tokens")
    print(f"val has {len(val):,} tokens")
    print(f"wrote {out_dir}/train.bin, val.bin, meta.json")
    return meta
