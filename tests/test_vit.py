"""train_vit.py: the helpers in process (augmentation, batches, loss, LAMB, schedule) and the script as a user runs
it, on a generated dataset. Fast tier: those and one tiny training. Slow tier (-m slow): learning, exact resume, DDP
and CPU processes, Fashion-MNIST and the imagefolder path. GPU tier (-m gpu): the CPU default on a CUDA GPU."""

import json
import os
import re
import socket
import statistics
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import common
import configurator
import nanolap
import train_vit
from common import load_checkpoint, load_model
from conftest import ENV, ROOT, result, run, run_here, spoil_weights_at
import data
from data import augment, folders, images

SCRIPT = "train_vit.py"

# a short run on the generated dataset that learns (no label-changing flips of the random patterns)
PLAIN = ["--dataset=synthetic", "--val_subset=256", "--batch_size=64", "--epochs=3", "--log_interval=8",
         "--eval_interval=32", "--crop_padding=0", "--hflip=False"]
# a tiny run with every random path on (crop, flip, 3-Augment, mixup/cutmix, erasing, drop-path): for exact resume
HEAVY = ["--dataset=synthetic", "--train_subset=512", "--val_subset=256", "--batch_size=32", "--epochs=2",
         "--log_interval=1", "--drop_path=0.1", "--three_augment=True", "--mixup=0.8", "--cutmix=1.0",
         "--random_erasing=0.25", "--crop_padding=2", "--hflip=True"]
RESULT_KEYS = ["n_lap", "params", "seed", "dataset", "steps", "seconds", "val_acc", "val_loss", "epochs", "img_per_s",
               "data_wait", "machine"]


def step_losses(stdout):
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"step (\d+)/\d+ \| loss (\S+)", stdout)}


def accuracy(ckpt, x, y):
    """The checkpoint's model on uint8 images, normalised with the mean/std the checkpoint carries."""
    model = load_model(ckpt).eval()
    x = (x.float() / 255 - torch.tensor(ckpt["mean"]).view(1, -1, 1, 1)) / torch.tensor(ckpt["std"]).view(1, -1, 1, 1)
    with torch.no_grad():
        return (model(x).argmax(-1) == y).float().mean().item()

# ----------------------------------------------------------------------------- fast: one tiny training


def test_tiny_training_on_cpu(tmp_path):
    """--device=cpu trains; the RESULT line, log.jsonl and the checkpoint contract analyze.py relies on."""
    p = run(SCRIPT, "--device=cpu", "--dataset=synthetic", "--train_subset=256", "--val_subset=128", "--batch_size=64",
            "--epochs=2", "--log_interval=2", "--eval_interval=4", f"--out_dir={tmp_path}", check=True)
    r = result(p.stdout)
    assert list(r) == RESULT_KEYS and r["n_lap"] == "4" and r["dataset"] == "synthetic" and r["epochs"] == "2"
    assert open(tmp_path / "result.txt").read().split()[1:4] == p.stdout.split("RESULT ")[1].split()[:3]
    assert "on cpu in float32, 1 process" in p.stdout and "4 steps/epoch, 2 epochs = 8 steps" in p.stdout
    assert re.search(r"^step 2/8 \| loss \S+ \| lr \S+ \| [\d,]+ img/s \| ep 0.50 \| data \S+% \| eta", p.stdout, re.M)
    windows = [int(v.replace(",", "")) for v in re.findall(r"\| ([\d,]+) img/s \|", p.stdout)]  # the first: warm-up
    assert len(windows) == 4 and abs(int(r["img_per_s"]) - sum(windows[1:]) / 3) <= 1, (windows, r["img_per_s"])
    records = [json.loads(l) for l in open(tmp_path / "log.jsonl")]
    assert [rec["step"] for rec in records] == [0, 4, 8]  # step 0, every eval_interval steps, the last
    assert r["machine"] == common.machine_name("cpu") and all(rec["machine"] == r["machine"] for rec in records)
    ckpt = load_checkpoint(str(tmp_path / "ckpt.pt"))
    assert {"kind", "model_config", "model", "config", "optimizer", "scaler", "step", "steps_per_epoch",
            "best_val_acc", "val_acc", "val_loss", "classes", "mean", "std"} <= set(ckpt)
    assert ckpt["kind"] == "vit" and ckpt["step"] == 8 and ckpt["steps_per_epoch"] == 4
    assert ckpt["config"]["dataset"] == "synthetic" and ckpt["config"]["device"] == "cpu"
    assert ckpt["classes"][0] == "pattern0" and len(ckpt["mean"]) == len(ckpt["std"]) == 1
    assert ckpt["best_val_acc"] >= ckpt["val_acc"] == pytest.approx(float(r["val_acc"]), abs=1e-4)
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]
    x, y = images.load_images("synthetic")["val"]
    assert accuracy(ckpt, x[:128], y[:128]) == pytest.approx(float(r["val_acc"]), abs=1e-4)


def test_num_workers_default_fits_the_machine():
    assert 1 <= train_vit.num_workers <= os.cpu_count()  # not 8 on a 2-core laptop

# ----------------------------------------------------------------------------- fast: helpers in process


PAPER_RECIPE = dict(bce_loss=True, label_smoothing=0.1, mixup=0.8, cutmix=1.0, three_augment=True, color_jitter=0.3,
                    random_erasing=0.0, qk_norm=True, layerscale=1e-6, lr=2e-3, weight_decay=0.05, warmup_epochs=5.0,
                    grad_clip=1.0, min_lr=1e-6, epochs=300)
VIT_B = dict(n_layer=12, n_embd=768, n_head=12, patch_size=16, img_size=192, n_lap=12, layerscale=1e-6)


@pytest.mark.parametrize("path, model", [
    ("config/vit_cifar10.py", dict(n_layer=6, n_embd=192, n_head=6, patch_size=4, img_size=32, n_lap=6,
                                   num_classes=10)),
    ("config/vit_deit3_b.py", dict(VIT_B, num_classes=1000)),
    ("config/vit_cifar100.py", dict(VIT_B, num_classes=100))])
def test_config_files_name_options_and_make_a_model(path, model):
    """Each config parses against train_vit.py's options and builds the model it promises; the paper's two
    (ImageNet-1k, CIFAR-100) carry the author's recipe at a global batch of 2048 on 8 processes and say where
    every value comes from."""
    options = {k: v for k, v in vars(train_vit).items() if k.islower() and not k.startswith("_")
               and (v is None or isinstance(v, (bool, int, float, str, list)))}
    config = configurator.parse_args(options, [os.path.join(ROOT, path)])
    assert config["compile_model"] and config["three_augment"] and config["mixup"] == 0.8
    native = 224 if config["dataset"] == "imagefolder" else 32  # train_vit.py's img_size=0
    cfg = configurator.config_from_options(config, "vit", img_size=config["img_size"] or native, in_chans=3,
                                            num_classes=model["num_classes"])
    assert cfg.qk_norm and cfg.pooling == "cls" and {k: getattr(cfg, k) for k in model} == model
    with torch.device("meta"):  # the shapes without allocating ViT-B's weights
        params = sum(p.numel() for p in nanolap.build_model(cfg).parameters())
    if path == "config/vit_cifar10.py":
        return
    assert 85e6 < params < 87e6, "ViT-B/16 has about 86M parameters"
    assert {k: config[k] for k in PAPER_RECIPE} == PAPER_RECIPE and not config["simple_random_crop"]
    assert config["batch_size"] * config["grad_accum"] * 8 == 2048
    values = [l for l in open(os.path.join(ROOT, path)) if re.match(r"\w+ = ", l)]
    assert values and all(re.search(r"  # (paper|author|ours)\b", l) for l in values), "every value names its source"


def test_batches_do_not_depend_on_the_process_split():
    """Global batch 16 as 2 micro-steps of 8 in one process = 2 processes of 8: chunk micro * world + rank is the
    same images; a resumed epoch continues the same order; validation shards cover the set once."""
    x, y = torch.arange(64, dtype=torch.uint8).view(64, 1, 1, 1), torch.arange(64)
    args = dict(epoch=3, steps_per_epoch=4, batch_size=8, seed=0, device="cpu")
    one = [b[1] for b in train_vit.train_batches((x, y), first_step=0, grad_accum=2, rank=0, world=1, **args)]
    ranks = [[b[1] for b in train_vit.train_batches((x, y), first_step=0, grad_accum=1, rank=r, world=2, **args)]
             for r in (0, 1)]
    assert len(one) == 8 and all(torch.equal(one[2 * s + r], ranks[r][s]) for s in range(4) for r in (0, 1))
    assert sorted(torch.cat(one).tolist()) == list(range(64)), "one epoch sees every image once"
    assert all(torch.equal(b[0].flatten(), b[1].to(torch.uint8)) for b in train_vit.train_batches(
        (x, y), first_step=0, grad_accum=2, rank=0, world=1, **args)), "images and labels stay paired"
    tail = [b[1] for b in train_vit.train_batches((x, y), first_step=2, grad_accum=2, rank=0, world=1, **args)]
    assert all(torch.equal(a, b) for a, b in zip(one[4:], tail)) and len(tail) == 4
    other = [b[1] for b in train_vit.train_batches((x, y), first_step=0, grad_accum=2, rank=0, world=1,
                                                   **{**args, "epoch": 4})]
    assert not torch.equal(torch.cat(one), torch.cat(other)), "every epoch has its own order"
    shards = [b[1] for r in range(3) for b in train_vit.val_batches((x, y), 5, r, 3, "cpu")]
    assert torch.equal(torch.cat(shards), y) and max(len(s) for s in shards) == 5


def test_mixup_cutmix_targets():
    torch.manual_seed(0)
    x, y = torch.rand(16, 3, 32, 32), torch.randint(0, 10, (16,))
    for mixup, cutmix in ((0.8, 0.0), (0.0, 1.0), (0.8, 1.0)):
        xm, t = augment.make_mixer(mixup, cutmix, 10)(x.clone(), y)
        assert xm.shape == x.shape and t.shape == (16, 10)
        assert torch.allclose(t.sum(1), torch.ones(16)), "soft targets must sum to 1"
        # every image is mixed with its neighbour in the batch, and the target weights say how much
        lam, differ = t[torch.arange(16), y], y != y.roll(1, 0)
        assert torch.allclose(lam[differ] + t[torch.arange(16), y.roll(1, 0)][differ], torch.ones(int(differ.sum())))
        if mixup and not cutmix:
            other = x.roll(1, 0)
            expected = lam.view(-1, 1, 1, 1) * x + (1 - lam.view(-1, 1, 1, 1)) * other
            same = y == y.roll(1, 0)
            assert torch.allclose(xm[~same], expected[~same], atol=1e-5)
        if cutmix and not mixup:  # each pixel comes from one of the two images
            other = x.roll(1, 0)
            assert ((xm == x) | (xm == other)).all()
    assert augment.make_mixer(0.0, 0.0, 10) is None


def test_three_augment_and_crop():
    torch.manual_seed(0)
    x = torch.rand(64, 3, 32, 32)
    out = augment.three_augment(x, jitter=0.0)
    assert out.shape == x.shape and out.min() >= 0 and out.max() <= 1
    gray = (out[:, 0] == out[:, 1]).all(dim=(1, 2)) & (out[:, 1] == out[:, 2]).all(dim=(1, 2))
    solarised = ((out - (1 - x)).abs() < 1e-6).any(dim=(1, 2, 3)) & ~gray
    assert 5 < gray.sum() < 40 and solarised.sum() > 5, "each op should be drawn for about a third of the images"
    assert augment.three_augment(x, jitter=0.3).shape == x.shape
    # a blur with tiny sigma is the identity; blurring keeps the mean and lowers the variance
    assert torch.allclose(augment.gaussian_blur(x, torch.full((64,), 0.1)), x, atol=1e-4)
    blurred = augment.gaussian_blur(x, torch.full((64,), 2.0))
    assert blurred.std() < 0.5 * x.std() and abs(blurred.mean() - x.mean()) < 1e-2
    # a random crop of a zero-padded image is a shifted window of it
    u8 = (torch.rand(8, 1, 28, 28) * 255).to(torch.uint8)
    crop, padded = augment.random_crop(u8, 2), F.pad(u8, (2, 2, 2, 2))
    for k in range(8):
        assert any(torch.equal(crop[k], padded[k, :, i:i + 28, j:j + 28]) for i in range(5) for j in range(5))


def test_color_jitter_order_is_random_per_image(monkeypatch):
    """torchvision's ColorJitter applies its ops in a random order, and so does 3-Augment's jitter, per image.
    With brightness x1.5 (clipping at 1) and contrast x0.5 the two orders differ, and both must occur."""
    x = (0.2 + 0.7 * torch.rand(1, 3, 8, 8, generator=torch.Generator().manual_seed(0))).expand(64, -1, -1, -1)
    B, g = len(x), torch.Generator().manual_seed(1)
    # the rand source, in the order color_jitter draws: apply (< p), brightness u (1 + 0.5 (2u - 1) = 1.5),
    # contrast u (0.5), then the order of the two ops per image
    draws = iter([torch.zeros(B), torch.ones(B), torch.zeros(B), torch.rand(B, 2, generator=g)])
    out = augment.color_jitter(x, [0.5, 0.5, 0.0, 0.0], 1.0, lambda *shape: next(draws))
    def one(name, f, v):  # one colour op at strength f for every image
        return augment.adjust(v, name, torch.full((B,), f))

    b_then_c = one("contrast", 0.5, one("brightness", 1.5, x))
    c_then_b = one("brightness", 1.5, one("contrast", 0.5, x))
    assert not torch.allclose(b_then_c[0], c_then_b[0], atol=1e-3), "the test needs orders that differ"
    first = ((out - b_then_c).abs() < 1e-6).flatten(1).all(1)
    second = ((out - c_then_b).abs() < 1e-6).flatten(1).all(1)
    assert (first | second).all() and 10 < first.sum() < 54, "each image takes one order; both occur"
    calls = []  # and 3-Augment's jitter is this one: brightness, contrast, saturation, every image
    monkeypatch.setattr(augment, "color_jitter", lambda v, strengths, p, rand: calls.append((strengths, p)) or v)
    augment.three_augment(x, 0.3)
    assert calls == [([0.3, 0.3, 0.3, 0.0], 1.0)]


def test_to_unit_resizes_bicubically():
    """Small datasets at another model resolution are resized on the device as DeiT/timm resize: bicubic with
    antialiasing (checked up- and downwards), kept in [0, 1]; at the native size nothing is resized."""
    x = (torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 255).to(torch.uint8)
    for size in (56, 24):
        out, u = augment.to_unit(x, size), x.float() / 255
        bicubic = F.interpolate(u, size=(size, size), mode="bicubic", antialias=True)
        bilinear = F.interpolate(u, size=(size, size), mode="bilinear", antialias=True)
        assert torch.allclose(out, bicubic.clamp(0, 1), atol=1e-6) and out.min() >= 0 and out.max() <= 1
        assert (out - bilinear).abs().max() > 0.05
    assert torch.equal(augment.to_unit(x, 32), x.float() / 255)


def test_imagefolder_crops_and_bicubic_resizing(tmp_path):
    """Image folders: RandomResizedCrop (scale 0.08-1, bicubic) by default, as for ImageNet-1k; with
    simple_random_crop DeiT-III's crop for ImageNet-21k: a bicubic resize of the short side, then a random window
    with 4 px of reflect padding. Validation: bicubic resize to img_size / 0.875, centre crop."""
    from PIL import Image
    from torchvision.transforms import v2
    g = torch.Generator().manual_seed(0)
    for split in ("train", "val"):
        os.makedirs(tmp_path / split / "a")
        Image.fromarray((torch.rand(40, 48, 3, generator=g) * 255).to(torch.uint8).numpy()).save(
            tmp_path / split / "a" / "0.png")
    pil = {s: Image.open(tmp_path / s / "a" / "0.png").convert("RGB") for s in ("train", "val")}
    def resize(split, size, mode):  # torchvision's own resize of the split's image
        return v2.functional.pil_to_tensor(v2.functional.resize(pil[split], size, mode))

    bicubic, bilinear = v2.InterpolationMode.BICUBIC, v2.InterpolationMode.BILINEAR
    padded = v2.functional.pad(resize("train", 32, bicubic), [4], padding_mode="reflect")  # (3, 40, 46)
    windows = padded.unfold(1, 32, 1).unfold(2, 32, 1)  # (3, 9, 15, 32, 32): every 32 x 32 window
    def in_windows(crop):  # is the crop one of the 32 x 32 windows of the padded image?
        return bool((windows == crop[:, None, None]).all(0).all(-1).all(-1).any())

    torch.manual_seed(0)
    for simple in (False, True):
        train_set, val_set = folders.imagefolder_datasets(str(tmp_path), 32, hflip=False, simple_random_crop=simple)
        crops = [train_set[0][0] for _ in range(8)]
        assert [in_windows(c) for c in crops] == [simple] * 8, "SRC: windows of the resized image; RRC: zooms"
        assert len({c.float().mean().item() for c in crops}) > 1, "a new random crop every time"
    rrc = folders.imagefolder_datasets(str(tmp_path), 32)[0].transform.transforms[0]
    assert isinstance(rrc, v2.RandomResizedCrop) and rrc.scale == (0.08, 1.0) and rrc.interpolation == bicubic
    val = val_set[0][0]  # (3, 32, 32)
    assert torch.equal(val, v2.functional.center_crop(resize("val", 36, bicubic), [32, 32]))
    assert not torch.equal(val, v2.functional.center_crop(resize("val", 36, bilinear), [32, 32]))


def test_random_erasing():
    torch.manual_seed(0)
    x = torch.full((2000, 2, 28, 28), 7.0)
    out = augment.random_erasing(x, 0.25)
    erased = out != 7.0
    hit = erased.any(dim=(1, 2, 3))
    assert abs(hit.float().mean().item() - 0.25) < 0.03, "about p of the images get a box"
    for k in hit.nonzero().flatten()[:200].tolist():
        rows, cols = erased[k, 0].any(1).nonzero().flatten(), erased[k, 0].any(0).nonzero().flatten()
        h, w = rows[-1] - rows[0] + 1, cols[-1] - cols[0] + 1
        box = torch.zeros(28, 28, dtype=torch.bool)
        box[rows[0]:rows[0] + h, cols[0]:cols[0] + w] = True
        assert torch.equal(erased[k, 0], box) and torch.equal(erased[k, 1], box), "one rectangle, every channel"
        assert 0.02 * 784 - 28 <= h * w <= 784 / 3 + 28, "area within the scale range (up to rounding)"
    area = erased[hit].float().mean(dim=(1, 2, 3))
    assert abs(area.mean().item() - (0.02 + 1 / 3) / 2) < 0.02, "areas uniform in scale"
    noise = out[erased]
    assert abs(noise.mean().item()) < 0.05 and abs(noise.std().item() - 1) < 0.05, "filled with N(0, 1)"
    assert torch.equal(augment.random_erasing(x, 0.0), x)


def test_augment_pipeline_is_seeded_and_normalises():
    """Resume relies on this: the same global seed gives the same augmented batch and targets."""
    x, y = (torch.rand(16, 1, 28, 28) * 255).to(torch.uint8), torch.randint(0, 10, (16,))
    mixer = augment.make_mixer(0.8, 1.0, 10)
    mean = torch.tensor(0.5)
    std = torch.tensor(0.25)
    outs = []
    for seed in (123, 123, 124):
        torch.manual_seed(seed)
        outs.append(train_vit.augment_batch(x, y, 28, mean, std, mixer, True, crop_padding=2, hflip=True,
                                            rand_augment=2, three_augment=True, random_erasing=0.5))
    assert outs[0][0].shape == (16, 1, 28, 28) and outs[0][1].shape == (16, 10)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert not torch.equal(outs[0][0], outs[2][0])
    plain, labels = train_vit.augment_batch(x, y, 28, mean, std)  # nothing random: only scaling and normalising
    assert torch.equal(labels, y) and torch.allclose(plain, (x.float() / 255 - 0.5) / 0.25)
    assert train_vit.augment_batch(x, y, 56, mean, std)[0].shape == (16, 1, 56, 56)


def test_losses():
    torch.manual_seed(0)
    logits, y = torch.randn(8, 5), torch.randint(0, 5, (8,))
    hard = train_vit.compute_loss(logits, y, 0.1)
    soft = train_vit.compute_loss(logits, F.one_hot(y, 5).float(), 0.1)
    assert hard.item() == pytest.approx(soft.item(), abs=1e-6)
    assert hard.item() == pytest.approx(F.cross_entropy(logits, y, label_smoothing=0.1).item(), abs=1e-6)
    bce = train_vit.compute_loss(logits, y, 0.0, bce=True)
    assert bce.item() == pytest.approx(F.binary_cross_entropy_with_logits(logits, F.one_hot(y, 5).float()).item())


def bce_target(logits, y, smoothing):
    """The target compute_loss gives BCE, read back from the gradient: d mean BCE / dz = (sigmoid(z) - t) / (B K)."""
    z = logits.clone().requires_grad_()
    train_vit.compute_loss(z, y, smoothing, bce=True).backward()
    return torch.sigmoid(logits) - z.grad * logits.numel()


def test_bce_targets_are_timm_mixup_targets():
    """The first author's runs: timm's mixup_target (smooth each one-hot to 1 - s + s/K and s/K, then mix with lam)
    under BCE, not DeiT-III's hard 1 for every mixed class. Two images, K = 4, lam = 0.7, s = 0.1: on = 0.925,
    off = 0.025, so 0.7 * 0.925 + 0.3 * 0.025 = 0.655 and 0.3 * 0.925 + 0.7 * 0.025 = 0.295."""
    torch.manual_seed(0)
    logits = torch.randn(2, 4)
    y = torch.tensor([1, 3])
    lam = 0.7
    mixed = lam * F.one_hot(y, 4).float() + (1 - lam) * F.one_hot(y.roll(1, 0), 4).float()  # as make_mixer pairs
    expected = torch.tensor([[0.025, 0.655, 0.025, 0.295], [0.025, 0.295, 0.025, 0.655]])
    assert torch.allclose(bce_target(logits, mixed, 0.1), expected, atol=1e-5)
    assert torch.allclose(bce_target(logits, y, 0.1), torch.tensor([[0.025, 0.925, 0.025, 0.025],
                                                                     [0.025, 0.025, 0.025, 0.925]]), atol=1e-5)
    # the real mixer: lam read back from the images (zeros mixed with ones), targets as timm's formula
    # (y.flip(0) is timm's partner, the same as make_mixer's neighbour for two images)
    xm, t = augment.make_mixer(0.8, 0.0, 4)(torch.stack([torch.zeros(3, 4, 4), torch.ones(3, 4, 4)]), y)
    lam = 1 - xm[0].mean()
    def smooth(labels):  # label smoothing 0.1 over 4 classes
        return F.one_hot(labels, 4).float() * 0.9 + 0.025

    assert torch.allclose(bce_target(logits, t, 0.1), lam * smooth(y) + (1 - lam) * smooth(y.flip(0)), atol=1e-5)


def test_build_optimizers_decays_weight_matrices_only():
    model = nanolap.build_model(nanolap.make_config("vit-cpu"))
    (opt,) = train_vit.build_optimizers(model, lr=1e-3, weight_decay=0.05, betas=(0.9, 0.99), device="cpu")
    decay, no_decay = opt.param_groups
    assert isinstance(opt, torch.optim.AdamW) and decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"]) and decay["betas"] == (0.9, 0.99)
    no_decay_ids = {id(p) for p in no_decay["params"]}
    assert id(model.pos_embed) in no_decay_ids and id(model.cls_token) in no_decay_ids
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_lr_schedule(monkeypatch):
    # get_lr reads the options and the run's lengths, module globals: warm-up step s trains at (s + 1) / 10 of the peak
    for name, value in dict(lr=1e-3, min_lr=1e-5, warmup_iters=10, max_iters=100).items():
        monkeypatch.setattr(train_vit, name, value, raising=False)
    lrs = [train_vit.get_lr(s) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:])) and lrs[-1] == pytest.approx(1e-5, abs=1e-6)


def test_evaluate_counts_accuracy_and_loss():
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3))
    x, y = (torch.rand(10, 1, 2, 2) * 255).to(torch.uint8), torch.randint(0, 3, (10,))
    mean, std = torch.tensor(0.5).view(1, 1, 1, 1), torch.tensor(0.2).view(1, 1, 1, 1)
    with torch.no_grad():
        logits = model((x.float() / 255 - 0.5) / 0.2)
    acc, loss = train_vit.evaluate(model, train_vit.val_batches((x, y), 3, 0, 1, "cpu"), 2, mean, std)
    assert acc == pytest.approx((logits.argmax(-1) == y).float().mean().item())
    assert loss == pytest.approx(F.cross_entropy(logits, y).item(), rel=1e-5)

@pytest.mark.slow  # importing torch's compiler takes seconds
def test_evaluate_compiles_no_second_graph_for_a_shorter_last_batch():
    """10 images in batches of 4: the last batch of 2 is padded to 4, so a compiled model traces one graph (an epoch's
    end of the CPU default, 10,000 images in batches of 1,024, left 784 and compiled a second one)."""
    torch._dynamo.reset()
    graphs = []

    def counting_backend(graph, example_inputs):
        graphs.append([tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)])
        return graph.forward

    model = torch.compile(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3)), backend=counting_backend)
    x, y = (torch.rand(10, 1, 2, 2) * 255).to(torch.uint8), torch.randint(0, 3, (10,))
    mean, std = torch.tensor(0.5).view(1, 1, 1, 1), torch.tensor(0.2).view(1, 1, 1, 1)
    acc, loss = train_vit.evaluate(model, train_vit.val_batches((x, y), 4, 0, 1, "cpu"), 2, mean, std)
    assert len(graphs) == 1 and 0 <= acc <= 1 and loss > 0, graphs


# ----------------------------------------------------------------------------- slow: learning, resume, processes


@pytest.fixture(scope="module")
def heavy_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("heavy")
    return out, run(SCRIPT, *HEAVY, f"--out_dir={out}", check=True).stdout


@pytest.mark.slow
def test_end_to_end_synthetic_learns(tmp_path):
    (tmp_path / "ckpt.pt").write_text("an earlier run")
    stdout = run(SCRIPT, *PLAIN, f"--out_dir={tmp_path}", check=True).stdout
    r = result(stdout)
    assert float(r["val_acc"]) > 0.6, "10 generated classes: the ViT should learn well above chance (0.1)"
    records = [json.loads(l) for l in open(tmp_path / "log.jsonl")]
    assert [rec["step"] for rec in records] == [0, 32, 64, 96]
    aside = [d for d in os.listdir(tmp_path) if d.startswith("previous-")]
    assert len(aside) == 1 and (tmp_path / aside[0] / "ckpt.pt").read_text() == "an earlier run"


@pytest.mark.slow
def test_resume_is_exact(heavy_run, tmp_path):
    out_full, stdout_full = heavy_run
    out = tmp_path / "resumed"
    first = run(SCRIPT, *HEAVY, f"--out_dir={out}", "--stop_at_step=21", check=True)  # stops in the middle of epoch 2
    assert "RESULT" not in first.stdout and "stopped at step 21" in first.stdout
    ckpt = load_checkpoint(str(out / "ckpt.pt"))
    assert ckpt["step"] == 21 and 0 < ckpt["seconds"] < 1000
    common.save_checkpoint({**ckpt, "seconds": 1000.0}, str(out / "ckpt.pt"))  # as if the first piece took 1000 s
    # a resume that would change the steps per epoch, or the model, is refused in one line (and changes nothing)
    for args, message in ((["--batch_size=16"], "the checkpoint has 16 steps per epoch, this run 32"),
                          (["--n_lap=0"], "--resume continues a run exactly: it cannot change the model, data or schedule (--n_lap=0"),
                          (["--epochs=3"], "or schedule (--epochs=3 (checkpoint: 2)). To train longer")):
        p = run(SCRIPT, f"--out_dir={out}", "--resume", *args)
        assert p.returncode == 1 and message in p.stderr and "Traceback" not in p.stderr, p.stderr
    second = run(SCRIPT, f"--out_dir={out}", "--resume", check=True)  # the rest of the config comes from the checkpoint
    full, resumed = step_losses(stdout_full), {**step_losses(first.stdout), **step_losses(second.stdout)}
    assert len(full) == 32 and resumed == full, "a resumed run must repeat the uninterrupted losses exactly"
    assert result(second.stdout)["val_acc"] == result(stdout_full)["val_acc"]
    assert float(result(second.stdout)["seconds"]) >= 1000, "a resumed run's seconds count its earlier pieces"
    a, b = load_checkpoint(str(out_full / "ckpt.pt")), load_checkpoint(str(out / "ckpt.pt"))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


@pytest.mark.slow
def test_nonfinite_loss_stops_and_keeps_checkpoint(tmp_path):
    out = tmp_path / "nan"
    run(SCRIPT, *HEAVY, f"--out_dir={out}", "--stop_at_step=5", check=True)
    ckpt_bytes = open(out / "ckpt.pt", "rb").read()
    # an infinite learning rate (1e999 is a float literal for inf) wrecks the weights in step 5, whose loss, computed
    # before the update, is finite: the next step's loss is not, and the progress line after it stops the run
    p = run(SCRIPT, f"--out_dir={out}", "--resume", "--lr=1e999")
    assert p.returncode != 0 and "error: non-finite loss nan at step 6" in p.stderr and "Traceback" not in p.stderr
    assert open(out / "ckpt.pt", "rb").read() == ckpt_bytes, "the last good checkpoint must survive"


def test_non_finite_weights_are_never_saved(tmp_path, monkeypatch):
    """Under float16 a step's gradient norm is the scaler's 0, so a weight that the last step before a checkpoint made
    non-finite (its loss was still finite) shows only in the weights: the optimizer step of step 3 writes an inf here,
    and the checkpoint of the evaluation at step 4 is not written."""
    calls = spoil_weights_at(monkeypatch, 4)
    with pytest.raises(FloatingPointError, match="non-finite weights after step 3: stopped before they are saved"):
        run_here(SCRIPT, "--dataset=synthetic", "--train_subset=64", "--val_subset=64", "--batch_size=16", "--epochs=2",
                 "--log_interval=100", "--eval_interval=4", "--cpu_procs=1", f"--out_dir={tmp_path}")
    assert len(calls) == 4 and not os.path.exists(tmp_path / "ckpt.pt")


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
    """Two gloo processes with batch 32 each = one process with batch 64 (no augmentation randomness), and plain
    python with --cpu_procs=2 (which starts the same processes through torchrun) saves the same weights bit for bit."""
    args = ["--dataset=synthetic", "--train_subset=512", "--val_subset=256", "--epochs=1", "--crop_padding=0",
            "--hflip=False", "--drop_path=0.0", "--random_erasing=0", "--log_interval=4"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train_vit.py", *args,
           "--batch_size=32", f"--out_dir={tmp_path / 'ddp'}"]
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "global batch 64 = 32 x 1 accum x 2 process(es)" in p.stdout
    single = run(SCRIPT, *args, "--batch_size=64", f"--out_dir={tmp_path / 'single'}", check=True)
    a, b = result(p.stdout), result(single.stdout)
    assert float(a["val_loss"]) == pytest.approx(float(b["val_loss"]), abs=2e-3)
    la, lb = step_losses(p.stdout), step_losses(single.stdout)
    assert la.keys() == lb.keys() and all(abs(float(la[k]) - float(lb[k])) < 2e-3 for k in la)
    spawned = run(SCRIPT, *args, "--cpu_procs=2", "--device=cpu", "--batch_size=32", f"--out_dir={tmp_path / 'spawned'}",
                  check=True)
    same = ("val_acc", "val_loss", "params", "n_lap", "epochs")
    assert [result(spawned.stdout)[k] for k in same] == [a[k] for k in same] and step_losses(spawned.stdout) == la
    weights = [common.load_checkpoint(str(tmp_path / name / "ckpt.pt"))["model"] for name in ("ddp", "spawned")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


@pytest.mark.slow
def test_spawned_processes_stop_together_on_error(tmp_path):
    """--cpu_procs=2: a failure inside the processes ends the run with one clear message, no hang."""
    p = run(SCRIPT, *PLAIN, "--cpu_procs=2", "--lr=1e999", f"--out_dir={tmp_path}", timeout=60)
    assert p.returncode != 0 and "error: non-finite loss" in p.stderr and "Traceback" not in p.stderr, p.stderr

# ----------------------------------------------------------------------------- bad input in one line

BAD_INPUTS = {  # checked in this process with one CPU process (the shell cases below show the line itself)
    "unknown dataset": (["--dataset=mnist"], "--dataset='mnist': choose one of fashion_mnist, cifar10"),
    "wrong path": (["--dataset=imagefolder", "--data_dir=/nonexistent/nowhere"], "is not a directory"),
    "n_lap > n_head": (["--dataset=synthetic", "--n_lap=5"], "at most n_head=4 Laplacian heads"),
    "per-layer list length": (["--dataset=synthetic", "--n_lap=[1,2]"], "has 2 entries but n_layer=4"),
    "wrong type": (["--lr=fast"], "--lr='fast' has type str, expected float"),
    "unknown key": (["--learning_rate=0.1"], "unknown option --learning_rate"),
    "old option name": (["--compile=True"], "unknown option --compile"),
    "resume without checkpoint": (["--out_dir=/nonexistent/empty", "--resume"], "--resume: no checkpoint"),
    "old optimizer option": (["--optimizer_name=lamb"], "unknown option --optimizer_name"),
    "not a ViT preset": (["--dataset=synthetic", "--preset=gpt-tiny"], "--preset='gpt-tiny': choose one of"),
    "erasing not a probability": (["--random_erasing=1.5"], "--random_erasing=1.5: must lie in [0, 1]"),
    "no epochs": (["--epochs=0"], "--epochs=0: must be at least 1"),
    "batch too large": (["--dataset=synthetic", "--train_subset=8"], "is larger than the 8 training images"),
    "bad dtype": (["--dataset=synthetic", "--dtype=half"], "--dtype='half': choose auto"),
    "bad device": (["--device=tpu"], "--device='tpu': choose auto, cpu"),
}
if not torch.cuda.is_available():
    BAD_INPUTS["cuda without CUDA"] = (["--device=cuda"], "--device=cuda: this machine has no CUDA device")


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_messages(name, tmp_path):
    args, message = BAD_INPUTS[name]
    with pytest.raises((common.UsageError, OSError), match=re.escape(message)):  # `error: <message>` in a shell
        run_here(SCRIPT, f"--out_dir={tmp_path}/o", "--cpu_procs=1", *args)


def test_an_offline_download_gives_up_instead_of_hanging(tmp_path, monkeypatch):
    """Without Fashion-MNIST on disk, the fallback download must fail in one error when the server goes silent (a
    dropped connection offline), not wait forever, and leave no folder behind. The fake server accepts and never
    answers; the fake dataset makes its folder and downloads as torchvision does, through urllib without a timeout of
    its own."""
    import threading
    import time
    import urllib.request

    import torchvision.datasets
    server = socket.create_server(("127.0.0.1", 0))
    def accept():  # a connection kept open and silent for 10 s (without a timeout the test fails then, not never)
        connection, _ = server.accept()
        time.sleep(10)
        connection.close()

    threading.Thread(target=accept, daemon=True).start()

    class SilentFashionMNIST:
        def __init__(self, root, train=True, download=False):
            os.makedirs(os.path.join(root, "FashionMNIST", "raw"), exist_ok=True)
            urllib.request.urlopen(f"http://127.0.0.1:{server.getsockname()[1]}/train-images-idx3-ubyte.gz").read()

    monkeypatch.setattr(torchvision.datasets, "FashionMNIST", SilentFashionMNIST)
    monkeypatch.setattr(images, "DEBIAN_FASHION", str(tmp_path / "no-debian-package"))
    monkeypatch.setattr(data, "DOWNLOAD_TIMEOUT", 0.5)
    t0 = time.time()
    with pytest.raises(common.UsageError, match="download failed .*timed out"):
        images.load_images("fashion_mnist", str(tmp_path / "nodata"))
    assert time.time() - t0 < 5 and socket.getdefaulttimeout() is None  # gave up; the process's default is back
    assert not (tmp_path / "nodata").exists()  # not even an empty nodata/fashion_mnist/
    server.close()


# ----------------------------------------------------------------------------- slow: real data, imagefolder


@pytest.mark.slow
def test_fashion_mnist_smoke(tmp_path):
    """Without --data_dir: the run names the folder it read (data/fashion_mnist, else the Debian package's)."""
    p = run(SCRIPT, "--train_subset=4096", "--val_subset=1000", "--epochs=2", "--batch_size=128", "--log_interval=8",
            f"--out_dir={tmp_path}", check=True)
    assert "data: fashion_mnist 4096 train / 1000 val images, 1x28x28, 10 classes" in p.stdout
    folder = re.search(r"^read fashion_mnist from (.+)$", p.stdout, re.M)
    assert folder and os.path.isfile(os.path.join(ROOT, folder[1], "train-images-idx3-ubyte.gz")), p.stdout[:2000]
    r = result(p.stdout)
    assert float(r["val_acc"]) > 0.5 and r["dataset"] == "fashion_mnist"
    assert load_checkpoint(str(tmp_path / "ckpt.pt"))["classes"] == images.FASHION_CLASSES


CPU_DEFAULT_VAL_ACC = (0.9015, 0.8956, 0.9001)  # RESULTS.md: `python train_vit.py` on a 2-core CPU, seeds 0, 1, 2


@pytest.mark.gpu
def test_the_cpu_default_on_a_gpu_lands_among_the_cpu_seeds(tmp_path):
    """The CPU default to its end on a GPU, in one process of batch 256 (the global batch of the CPU's 2 x 128) and in
    float32 as the CPU seeds ran (TF32 matmuls): its accuracy lies within 3 standard deviations of theirs. About a
    minute on an H200; Fashion-MNIST must be on disk (data/fashion_mnist or the Debian package's folder)."""
    done = subprocess.run([sys.executable, SCRIPT, "--device=cuda", "--batch_size=256", "--dtype=float32",
                           f"--out_dir={tmp_path}"], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    mean = statistics.mean(CPU_DEFAULT_VAL_ACC)
    sd = statistics.stdev(CPU_DEFAULT_VAL_ACC)
    assert mean - 3 * sd <= float(result(done.stdout)["val_acc"]) <= mean + 3 * sd


@pytest.mark.slow
def test_imagefolder(tmp_path):
    from PIL import Image
    g = torch.Generator().manual_seed(0)
    for split, n in (("train", 12), ("val", 4)):
        for k, cls in enumerate(("bright", "dark")):
            os.makedirs(tmp_path / "imgs" / split / cls)
            for i in range(n):
                level = 200 if k == 0 else 40
                img = (torch.rand(40, 40, 3, generator=g) * 50 + level).clamp(0, 255).to(torch.uint8).numpy()
                Image.fromarray(img).save(tmp_path / "imgs" / split / cls / f"{i}.png")
    p = run(SCRIPT, "--dataset=imagefolder", f"--data_dir={tmp_path / 'imgs'}", "--img_size=32", "--patch_size=8",
            "--batch_size=8", "--epochs=2", "--num_workers=1", "--three_augment=True", "--rand_augment=1",
            "--simple_random_crop=True", "--mixup=0.8", "--log_interval=1", f"--out_dir={tmp_path / 'out'}", check=True)
    assert "data: imagefolder 24 train / 8 val images, 3x32x32, 2 classes" in p.stdout
    assert "3 steps/epoch, 2 epochs = 6 steps" in p.stdout
    ckpt = load_checkpoint(str(tmp_path / "out" / "ckpt.pt"))
    assert ckpt["classes"] == ["bright", "dark"] and ckpt["mean"] == pytest.approx(folders.IMAGENET_MEAN)
    # the script's validation (resize, centre crop, ImageNet normalisation) is the one a user would redo
    _, val_set = folders.imagefolder_datasets(str(tmp_path / "imgs"), 32)
    x, y = torch.stack([val_set[i][0] for i in range(8)]), torch.tensor([val_set[i][1] for i in range(8)])
    assert accuracy(ckpt, x, y) == pytest.approx(float(result(p.stdout)["val_acc"]), abs=1e-4)
