"""--holdout, the selection split of all three scripts: a learning rate is chosen on the last fraction of the training
data, never on the validation data. Each script runs here on data whose held-out examples carry a mark of their own
(all-white images, a token id found nowhere else) and whose validation examples carry another; every batch the run
trains on and every batch it evaluates is recorded. Held out: never trained on, and the only data evaluated; the
validation data: never read into a batch."""

import json
import os

import numpy as np
import pytest
import torch

from conftest import run_here
from data import augment, images, text

HELD = 255  # every pixel of a held-out image
VAL = 254  # every pixel of a validation image; the kept training images stay at or below 200


def marked_images(monkeypatch, n_train=512, n_held=128, n_val=128):
    """images.load_images returns Fashion-MNIST-shaped data whose last n_held training images (a quarter) and every
    validation image are marked; the kept images are random in [0, 200]."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 201, (n_train, 1, 28, 28), dtype=torch.uint8, generator=g)
    x[n_train - n_held:] = HELD
    y = torch.randint(0, 10, (n_train,), generator=g)
    val = (torch.full((n_val, 1, 28, 28), VAL, dtype=torch.uint8), torch.randint(0, 10, (n_val,), generator=g))
    mean, std = images.pixel_stats(x)
    data = dict(train=(x, y), val=val, num_classes=10, classes=[str(i) for i in range(10)], mean=mean, std=std)
    monkeypatch.setattr(images, "load_images", lambda name, data_dir="data": data)
    return x[:n_train - n_held]


def marks(batch):  # the mark of every image of a uint8 batch (B, C, H, W): HELD, VAL, or 0 for a kept image
    flat = batch.flatten(1)
    return [int(row[0]) if (row == row[0]).all() and int(row[0]) in (HELD, VAL) else 0 for row in flat]


def test_the_vit_never_trains_on_its_held_out_images_and_evaluates_on_them_alone(tmp_path, monkeypatch):
    kept = marked_images(monkeypatch)
    seen = {True: [], False: []}  # training batches (gradients on), evaluation batches
    to_unit = augment.to_unit
    monkeypatch.setattr(augment, "to_unit", lambda x, size: seen[torch.is_grad_enabled()].extend(marks(x)) or to_unit(x, size))
    run_here("train_vit.py", "--holdout=0.25", "--epochs=2", "--batch_size=64", "--cpu_procs=1", "--log_interval=4",
             f"--out_dir={tmp_path}", "--device=cpu")
    assert len(seen[True]) == 2 * 384 and set(seen[True]) == {0}  # every kept image, each epoch; no other
    assert len(seen[False]) == 2 * 128 and set(seen[False]) == {HELD}  # the held-out images, each evaluation
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert ckpt["mean"] == pytest.approx(images.pixel_stats(kept)[0], rel=1e-6)  # normalised by the kept images alone
    assert "holdout=0.25" in (tmp_path / "result.txt").read_text()


def test_dino_never_trains_on_its_held_out_images_and_probes_on_them_alone(tmp_path, monkeypatch):
    marked_images(monkeypatch)
    trained, probed = [], []
    call = augment.MultiCrop.__call__
    monkeypatch.setattr(augment.MultiCrop, "__call__", lambda self, x, g: trained.extend(marks(x)) or call(self, x, g))
    load_eval = images.load_eval_images

    def spy(data, split, limit, size, num_workers=0):
        x, y = load_eval(data, split, limit, size, num_workers)
        probed.append((split, marks(x)))
        return x, y
    monkeypatch.setattr(images, "load_eval_images", spy)
    run_here("train_dino.py", "--holdout=0.25", "--epochs=1", "--batch_size=64", "--cpu_procs=1", "--n_layer=1",
             "--n_embd=32", "--out_dim=64", "--head_hidden=32", "--head_bottleneck=16", "--probe_steps=5",
             "--seg_dataset=none", "--eval_train=0", "--eval_val=0", f"--out_dir={tmp_path}", "--device=cpu")
    assert len(trained) == 384 and set(trained) == {0}
    assert [(split, len(m), set(m)) for split, m in probed] == [("train", 384, {0}), ("val", 128, {HELD})]


def test_the_gpt_never_trains_on_its_held_out_tokens_and_evaluates_on_them_alone(tmp_path, monkeypatch):
    """Token ids: the kept training text uses 0-5, the held-out last tenth id 6 alone, the validation split id 7."""
    folder = tmp_path / "marked"
    folder.mkdir()
    meta = dict(vocab_size=8, tokenizer="char", chars=list("abcdefgh"), token_bytes=[1] * 8, corpus="marked")
    (folder / "meta.json").write_text(json.dumps(meta))
    tokens = np.random.default_rng(0).integers(0, 6, 20_000).astype(np.uint16)
    tokens[-2_000:] = 6
    tokens.tofile(folder / "train.bin")
    np.full(5_000, 7, dtype=np.uint16).tofile(folder / "val.bin")
    batches, windows = [], []
    get_batch = text.get_batch
    monkeypatch.setattr(text, "get_batch", lambda *a, **k: batches.append(get_batch(*a, **k)) or batches[-1])
    cut = text.windows

    def spy(*args, **kwargs):  # the evaluation's windows (training draws its batches with gradients on)
        found = cut(*args, **kwargs)
        if not torch.is_grad_enabled():
            windows.append(found)
        return found
    monkeypatch.setattr(text, "windows", spy)
    run_here("train_gpt.py", "--holdout=0.1", f"--data_dir={tmp_path}", "--dataset=marked", "--max_iters=20",
             "--eval_interval=10", "--eval_iters=4", "--n_layer=1", "--n_embd=32", "--n_head=2", "--block_size=32",
             "--batch_size=4", "--max_new_tokens=0", "--cpu_procs=1", "--device=cpu", f"--out_dir={tmp_path}/run")
    trained = torch.cat([torch.cat([x, y], dim=1) for x, y in batches]).unique().tolist()
    assert len(batches) == 20 and max(trained) <= 5
    assert len(windows) == 3 * 4  # 3 evaluations (steps 0, 10, 20) of eval_iters batches each
    assert {t for x, y in windows for t in torch.cat([x, y]).unique().tolist()} == {6}
    assert "holdout=0.1" in open(os.path.join(tmp_path, "run", "result.txt")).read()
