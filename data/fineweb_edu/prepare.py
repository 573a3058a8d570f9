"""
FineWeb-Edu in GPT-2 BPE tokens, for the paper's scale (it trains d20 on 11.2B FineWeb-Edu tokens).

Source: the FineWeb-Edu sample-10BT, pre-tokenised with GPT-2 BPE in llm.c's shard format, hosted at
huggingface.co/datasets/kjj0/finewebedu10B-gpt2 (the files modded-nanogpt's cached_finewebedu10B.py
fetches). Plain HTTPS downloads with urllib: no pyarrow, no huggingface_hub. Each shard holds 100M
tokens (~200 MB): finewebedu_val_000000.bin is the validation split, finewebedu_train_000001..099
the training split (9.9B tokens, ~20 GB in all). Every document starts with <|endoftext|>.

    python data/fineweb_edu/prepare.py --shards=1    # 100M training tokens: 0.4 GB download, 0.4 GB bins
    python data/fineweb_edu/prepare.py --shards=10   # 1B tokens: 2.2 GB download, 2.2 GB more for the bins
    python data/fineweb_edu/prepare.py --shards=99   # all 9.9B tokens: ~20 GB download, ~40 GB on disk
    python data/fineweb_edu/prepare.py --input_files=docs.jsonl --shard_size=10000000   # your own text

Downloads go to data/fineweb_edu/shards/, retry with exponential backoff, are written to a temporary
file and renamed once complete and checked: a rerun skips the finished shards, so an interrupted
download resumes (and --shards=20 after --shards=10 fetches only the new ten). Then train.bin (the
training shards in order) and val.bin are written next to this file, as for the other datasets.

--input_files tokenises local text instead (.jsonl files with one {"text": ...} object per line, or .txt
files holding one document each; comma-separated paths): documents are tokenised with GPT-2 BPE,
each preceded by <|endoftext|>, packed into shards of --shard_size tokens (the first shard is the
validation split, as in llm.c) and written in the same format.
"""

import glob
import json
import os
import sys
import time
import urllib.request

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repo root
import common  # noqa: E402
from common import UsageError  # noqa: E402
from configurator import configure  # noqa: E402
from data import text  # noqa: E402

BASE_URL = "https://huggingface.co/datasets/kjj0/finewebedu10B-gpt2/resolve/main"
MAX_SHARDS = 99  # finewebedu_train_000001.bin ... finewebedu_train_000099.bin
# llm.c's shard format: a header of HEADER_INTS int32 (MAGIC, VERSION, n_tokens, 0...), then uint16 tokens
MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256

shards = 1  # number of 100M-token training shards to download (1..99)
input_files = ""  # local text to tokenise instead (.jsonl / .txt, comma-separated, globs allowed)
shard_size = 100_000_000  # tokens per shard when tokenising --input_files
retries = 6  # download attempts per shard; the wait doubles after each failure
backoff = 2.0  # seconds before the first retry
out_dir = HERE  # where shards/, train.bin, val.bin and meta.json go

# -----------------------------------------------------------------------------
# llm.c shard files


def write_shard(path, tokens):
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:3] = MAGIC, VERSION, len(tokens)
    with common.atomic_write(path) as f:
        f.write(header.tobytes() + np.asarray(tokens, dtype=np.uint16).tobytes())


def read_shard(path):
    """The tokens of a shard as a uint16 memmap, after checking its header against the file size."""
    header = np.fromfile(path, dtype=np.int32, count=HEADER_INTS)
    if len(header) < HEADER_INTS or header[0] != MAGIC or header[1] != VERSION:
        raise ValueError(f"{path} is not an llm.c token shard (bad header)")
    expected = HEADER_INTS * 4 + 2 * int(header[2])
    if os.path.getsize(path) != expected:
        raise ValueError(f"{path} has {os.path.getsize(path)} bytes, its header promises {expected}")
    return np.memmap(path, dtype=np.uint16, mode="r", offset=HEADER_INTS * 4, shape=(int(header[2]),))

# -----------------------------------------------------------------------------
# downloading


def download(url, path, retries=6, backoff=2.0, timeout=60):
    """Fetch url to path unless a valid shard is already there. Temporary file, then rename."""
    if os.path.isfile(path):
        try:
            read_shard(path)
            return False
        except ValueError as e:  # only checked files are renamed into place: this one was damaged later
            print(f"  {e}; fetching it again")
            os.remove(path)
    for attempt in range(1, retries + 1):
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r, common.atomic_write(path) as f:
                total = int(r.headers.get("Content-Length") or 0)
                done = 0
                t0 = time.time()
                while chunk := r.read(1 << 20):
                    f.write(chunk)
                    done += len(chunk)
                    if total and (done == total or done % (32 << 20) < len(chunk)):
                        print(f"\r  {os.path.basename(path)}: {done / 1e6:.0f}/{total / 1e6:.0f} MB "
                              f"({done / 1e6 / max(time.time() - t0, 1e-9):.1f} MB/s)", end="", flush=True)
                print()
                f.flush()
                read_shard(f.name)  # a truncated or wrong file fails here (nothing is renamed) and is fetched again
            return True
        except (OSError, ValueError) as e:
            if attempt == retries:
                raise OSError(f"could not download {url} after {retries} attempts: {e}") from None
            wait = backoff * 2 ** (attempt - 1)
            print(f"  {url}: {e}; retry {attempt}/{retries - 1} in {wait:.0f}s")
            time.sleep(wait)


def download_shards(n_shards, shard_dir, retries, backoff):
    """The validation shard and the first n_shards training shards; returns (val_path, train_paths)."""
    names = ["finewebedu_val_000000.bin"] + [f"finewebedu_train_{i:06d}.bin" for i in range(1, n_shards + 1)]
    paths = [os.path.join(shard_dir, name) for name in names]
    for i, (name, path) in enumerate(zip(names, paths)):
        fetched = download(f"{BASE_URL}/{name}", path, retries, backoff)
        print(f"[{i + 1}/{len(names)}] {name}: {'downloaded' if fetched else 'already here, skipped'}")
    return paths[0], paths[1:]

# -----------------------------------------------------------------------------
# tokenising local text


def iter_documents(paths):
    """Documents from .jsonl files (one {"text": ...} per line) and .txt files (one document each)."""
    for path in paths:
        if path.endswith(".jsonl"):
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            yield json.loads(line)["text"]
                        except (json.JSONDecodeError, KeyError, TypeError):
                            raise UsageError(f'{path}:{n}: expected a JSON object with a "text" field') from None
        elif path.endswith(".txt"):
            with open(path, encoding="utf-8") as f:
                yield f.read()
        else:
            raise UsageError(f"--input_files: {path} is neither .jsonl nor .txt")


def tokenize_to_shards(docs, enc, shard_size, shard_dir):
    """Tokenise documents (each preceded by <|endoftext|>), pack them into shards of shard_size tokens
    (a document may continue in the next shard); the first shard is the validation split.
    Returns (val_path, train_paths)."""
    buf = np.empty(shard_size, dtype=np.uint16)
    fill = 0
    paths = []

    def flush():
        split = "val" if not paths else "train"
        paths.append(os.path.join(shard_dir, f"finewebedu_{split}_{len(paths):06d}.bin"))
        write_shard(paths[-1], buf[:fill])
        print(f"wrote {paths[-1]} ({fill:,} tokens)")

    for doc in docs:
        tokens = text.to_uint16([enc.eot_token] + enc.encode_ordinary(doc), enc.n_vocab)
        while len(tokens):
            take = min(shard_size - fill, len(tokens))
            buf[fill:fill + take] = tokens[:take]
            tokens = tokens[take:]
            fill += take
            if fill == shard_size:
                flush()
                fill = 0
    if fill:
        flush()
    if len(paths) < 2:
        raise UsageError(f"the input gave {len(paths)} shard(s) of --shard_size={shard_size} tokens; at least two "
                         f"are needed (validation + training): lower --shard_size")
    return paths[0], paths[1:]

# -----------------------------------------------------------------------------
# train.bin / val.bin


def concatenate(shard_paths, out_path):
    """Stream the tokens of the shards, in order, into one flat uint16 file (temporary file, rename)."""
    n = 0
    with common.atomic_write(out_path) as f:
        for path in shard_paths:
            tokens = read_shard(path)
            for i in range(0, len(tokens), 1 << 24):
                f.write(tokens[i:i + (1 << 24)].tobytes())
            n += len(tokens)
    return n


def assemble(val_shard, train_shards, out_dir, meta):
    """val.bin, train.bin and meta.json from shards; skipped when meta.json says they are up to date."""
    shards = [os.path.basename(p) for p in [val_shard] + train_shards]
    meta_path = os.path.join(out_dir, "meta.json")
    if os.path.isfile(meta_path):
        with open(meta_path) as f:
            old = json.load(f)
        sizes = [os.path.getsize(os.path.join(out_dir, s)) if os.path.isfile(os.path.join(out_dir, s)) else -1
                 for s in ("val.bin", "train.bin")]
        if old.get("shards") == shards and sizes == [2 * old["val_tokens"], 2 * old["train_tokens"]]:
            print(f"train.bin and val.bin already hold these {len(shards)} shards; nothing to do")
            return old
    n_val = concatenate([val_shard], os.path.join(out_dir, "val.bin"))
    n_train = concatenate(train_shards, os.path.join(out_dir, "train.bin"))
    meta = dict(meta, shards=shards, train_tokens=n_train, val_tokens=n_val)
    with common.atomic_write(meta_path) as f:
        f.write(json.dumps(meta).encode("utf-8"))
    print(f"vocab size: {meta['vocab_size']:,}")
    print(f"train has {n_train:,} tokens")
    print(f"val has {n_val:,} tokens")
    print(f"wrote {out_dir}/train.bin, val.bin, meta.json")
    return meta


if __name__ == "__main__":
    configure(globals())
    shard_dir = os.path.join(out_dir, "shards")
    if input_files:
        paths = [p for pattern in input_files.split(",") for p in sorted(glob.glob(pattern)) or [pattern]]
        missing = [p for p in paths if not os.path.isfile(p)]
        if missing:
            raise UsageError(f"--input_files: no such file: {', '.join(missing)}")
        if shard_size < 1:
            raise UsageError("--shard_size must be at least 1")
        enc = text.gpt2_encoding()
        source = f"--input_files={input_files} (GPT-2 BPE, shards of {shard_size:,} tokens)"
        val_shard, train_shards = tokenize_to_shards(iter_documents(paths), enc, shard_size, shard_dir)
    else:
        if not 1 <= shards <= MAX_SHARDS:
            raise UsageError(f"--shards={shards}: choose 1..{MAX_SHARDS} (100M training tokens each)")
        enc = text.gpt2_encoding()  # token byte lengths for bits per byte; fails early when offline
        print(f"downloading the validation shard and {shards} training shard(s) of 100M tokens "
              f"(~200 MB each) from {BASE_URL}")
        source = f"{BASE_URL} (FineWeb-Edu sample-10BT, GPT-2 BPE, llm.c shards)"
        val_shard, train_shards = download_shards(shards, shard_dir, retries, backoff)
    print(f"source: {source}")
    assemble(val_shard, train_shards, out_dir, text.bpe_meta(enc, source=source))
