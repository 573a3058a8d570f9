"""Tests for train_dino.py and DINO's data (data/augment.py's multi-crop, data/images.py's scenes).
Fast tier: python -m pytest -q tests/test_dino.py; slow tier (resume, processes, collapse, bad inputs):
python -m pytest -q -m slow tests/test_dino.py"""

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torchvision.transforms.v2 import functional as TF

import common
import configurator
import optim
import probes
import train_dino as td
from common import load_checkpoint
from conftest import ENV, ROOT, SHORT_GROUP_TIMEOUT, result, run, run_here, torchrun_with
from data import augment, images
from nanolap import Config, DINOHead, ViT, make_config

SCRIPT = "train_dino.py"

# a tiny run: 256 images, 4 steps per epoch, seconds on a CPU
TINY = ["--n_layer=2", "--n_embd=32", "--n_head=2", "--n_lap=1", "--drop_path=0.2", "--out_dim=64", "--head_hidden=32",
        "--head_bottleneck=16", "--freeze_last_layer=1.0", "--train_subset=256", "--batch_size=64", "--local_crops=2",
        "--eval_train=256", "--eval_val=128", "--probe_steps=20", "--seg_dataset=none", "--log_interval=1",
        "--eval_interval=100"]


def losses(stdout):
    """{step: loss} from the progress lines (log_interval=1)."""
    return {int(m[0]): float(m[1]) for m in re.findall(r"^step (\d+)/\d+ .*?\| loss ([-+0-9.naninf]+)", stdout, re.M)}


@pytest.fixture(autouse=True)
def one_thread():
    """The tensors here are tiny: a second intra-op thread would only wait for a busy core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def options(**overrides):
    """train_dino's options (its lower-case literal globals) with some changed, as configure() returns them."""
    opts = {k: v for k, v in vars(td).items() if k.islower() and not k.startswith("_")
            and (v is None or isinstance(v, (bool, int, float, str, list)))}
    return {**opts, **overrides}

# ---- the DINO objective


def test_dino_loss_and_centering_by_hand():
    t_out = torch.tensor([[1.0, 0.0, -1.0], [0.5, 0.2, 0.1]])  # 2 global views of one image
    s_out = torch.tensor([[0.3, -0.2, 0.1], [0.0, 0.4, -0.4], [0.2, 0.2, -0.1]])  # 2 global + 1 local
    center = torch.tensor([[0.1, -0.1, 0.0]])
    s_temp, t_temp = 0.1, 0.5

    def softmax(v, temp):
        e = [math.exp(a / temp) for a in v]
        return [a / sum(e) for a in e]

    q = [softmax([a - c for a, c in zip(t, center[0].tolist())], t_temp) for t in t_out.tolist()]
    p = [softmax(s, s_temp) for s in s_out.tolist()]
    pairs = [(0, 1), (0, 2), (1, 0), (1, 2)]  # (teacher view, student view), never the same view
    expected = sum(-sum(qi * math.log(pi) for qi, pi in zip(q[t], p[s])) for t, s in pairs) / len(pairs)
    loss = td.dino_loss(s_out, t_out, center, s_temp, t_temp)
    assert loss.item() == pytest.approx(expected, rel=1e-5)

    new_center = td.update_center(center, t_out, 0.9)
    expected_center = [0.9 * c + 0.1 * (a + b) / 2 for c, a, b in zip(center[0].tolist(), *t_out.tolist())]
    assert new_center[0].tolist() == pytest.approx(expected_center, rel=1e-6)


def test_dino_loss_batches_and_views():
    """With B images, view v of image i is row v*B + i; the loss is a mean over images."""
    torch.manual_seed(0)
    B, K = 3, 5
    s_out = torch.randn(4 * B, K)
    t_out = torch.randn(2 * B, K)
    center = torch.randn(1, K)
    per_image = [td.dino_loss(s_out[i::B], t_out[i::B], center, 0.1, 0.04) for i in range(B)]
    assert td.dino_loss(s_out, t_out, center, 0.1, 0.04).item() == pytest.approx(sum(per_image).item() / B, rel=1e-5)


def tiny_dino():
    return td.DINO(ViT(make_config("vit-tiny", n_layer=1, n_embd=16, n_head=2, num_classes=0)), DINOHead(16, 32, 16, 8))


def test_ema_update_is_exact():
    teacher, student = tiny_dino(), tiny_dino()
    with torch.no_grad():  # dyadic values: m * t + (1 - m) * s is exact in float32
        for t, s in zip(teacher.parameters(), student.parameters()):
            t.copy_(torch.randint(-64, 64, t.shape) / 8.0)
            s.copy_(torch.randint(-64, 64, s.shape) / 8.0)
    before = [t.clone() for t in teacher.parameters()]
    student_before = [s.clone() for s in student.parameters()]
    td.ema_update(teacher, student, 0.75)
    for t, t0, s in zip(teacher.parameters(), before, student.parameters()):
        assert torch.equal(t, 0.75 * t0 + 0.25 * s)
    assert all(torch.equal(s, s0) for s, s0 in zip(student.parameters(), student_before))  # student untouched
    td.ema_update(teacher, student, 1.0)  # momentum 1: the teacher is frozen
    assert all(torch.equal(t, 0.75 * t0 + 0.25 * s) for t, t0, s in zip(teacher.parameters(), before,
                                                                          student.parameters()))
    td.ema_update(teacher, student, 0.0)  # momentum 0: the teacher becomes the student
    assert all(torch.equal(t, s) for t, s in zip(teacher.parameters(), student.parameters()))


def test_schedules(monkeypatch):
    # get_lr and get_teacher_temp read the options and the run's lengths, module globals
    for name, value in dict(lr=1.0, min_lr=0.0, warmup_iters=10, max_iters=110, warmup_teacher_temp=0.04,
                            teacher_temp=0.07, temp_warmup_iters=10).items():
        monkeypatch.setattr(td, name, value, raising=False)
    # DINO's learning rate: a linear warm-up from 0 at step 0, then a half cosine (its cosine_scheduler)
    assert td.get_lr(0) == 0.0 and td.get_lr(5) == 0.5 and td.get_lr(10) == 1.0
    assert td.get_lr(60) == pytest.approx(0.5) and td.get_lr(110) == 0.0
    cosine = common.cosine_schedule
    assert cosine(100, 100, 0.04, 0.4) == pytest.approx(0.4)  # weight decay rises 0.04 -> 0.4
    assert cosine(0, 100, 0.996, 1.0) == pytest.approx(0.996)  # teacher momentum -> 1
    # the teacher temperature: linear 0.04 -> 0.07 over 10 steps, then exactly constant
    assert td.get_teacher_temp(0) == 0.04 and td.get_teacher_temp(5) == pytest.approx(0.055)
    assert all(td.get_teacher_temp(s) == 0.07 for s in (10, 50, 100))


def test_frozen_last_layer_gets_no_update_in_epoch_0():
    torch.manual_seed(0)
    student = tiny_dino()
    (opt,) = td.build_optimizers(student, "cpu")
    for group in opt.param_groups:
        group.update(lr=1e-2, weight_decay=0.1 if group["weight_decay"] else 0.0)
    assert opt.param_groups[1]["weight_decay"] == 0.0 and all(p.ndim == 1 for p in opt.param_groups[1]["params"])
    crops = [torch.randn(8, 1, 28, 28), torch.randn(8, 1, 12, 12)]
    for epoch, should_change in ((0, False), (1, True)):
        before = {n: p.clone() for n, p in student.named_parameters()}
        loss = td.dino_loss(student(crops), torch.randn(8, 32), torch.zeros(1, 32), 0.1, 0.04)
        opt.zero_grad()
        loss.backward()
        td.cancel_last_layer_grads(student.head, epoch, freeze_epochs=1)
        opt.step()
        assert not torch.equal(before["backbone.patch_embed.weight"], student.backbone.patch_embed.weight)
        assert torch.equal(before["head.weight_v"], student.head.weight_v) != should_change
        assert torch.equal(before["head.weight_g"], student.head.weight_g)  # norm_last_layer: g stays 1


def test_clip_grad_clips_each_parameter():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    a.grad, b.grad = torch.tensor([3.0, 4.0]), torch.tensor([0.1, 0.0, 0.0])  # norms 5 and 0.1
    optim.clip_each_gradient([a, b], 1.0)
    assert a.grad.norm().item() == pytest.approx(1.0, rel=1e-5) and torch.equal(b.grad, torch.tensor([0.1, 0.0, 0.0]))


def clip_gradients_one_by_one(model, clip):
    """The reference: DINO's clip_gradients as a loop, one parameter at a time (as facebookresearch/dino writes it)."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(torch.clamp(clip / (p.grad.norm() + 1e-6), max=1.0))


def test_clip_grad_equals_the_loop_over_parameters():
    """A small DINO student with random gradients of norms from 0.01 to 100 around the clip of 1: the gradients under
    the clip stay as they were, those above are scaled to norm 1, each as the one-parameter-at-a-time loop does it."""
    torch.manual_seed(0)
    cfg = make_config("vit-cpu", n_layer=2, n_embd=32, n_head=2, num_classes=0)
    model = td.DINO(ViT(cfg), DINOHead(32, 64, 32, 16))
    params = [p for p in model.parameters() if p.requires_grad]
    for i, p in enumerate(params):
        p.grad = torch.randn_like(p) * 10.0 ** (i % 5 - 2) / (p.numel() ** 0.5)  # norms near 0.01, 0.1, 1, 10, 100
    before = [p.grad.clone() for p in params]
    norms = torch.stack([g.norm() for g in before])
    assert (norms < 0.5).sum() >= 5 and (norms > 2).sum() >= 5  # both sides of the clip
    reference = [g.clone() for g in before]
    for p, g in zip(params, reference):
        p.grad = g
    clip_gradients_one_by_one(model, 1.0)
    for p, g in zip(params, before):
        p.grad = g.clone()
    optim.clip_each_gradient(model.parameters(), 1.0)
    for p, g, want, norm in zip(params, before, reference, norms):
        torch.testing.assert_close(p.grad, want, rtol=1e-6, atol=1e-9)
        if norm < 1:  # under the clip: unchanged
            assert torch.equal(p.grad, g)
        else:
            assert p.grad.norm().item() == pytest.approx(1.0, rel=1e-5)

# ---- data order and augmentation


def test_batch_indices_split_an_epoch_between_processes():
    n = 20
    batch = 8
    seed = 3
    epoch0 = [torch.cat([td.batch_indices(n, batch, step, seed, rank, 2) for rank in (0, 1)]) for step in (0, 1)]
    assert all(len(b) == batch for b in epoch0)
    assert len(set(torch.cat(epoch0).tolist())) == 2 * batch  # no image twice in an epoch
    assert torch.equal(td.batch_indices(n, batch, 1, seed, 1, 2), epoch0[1][4:])  # recomputable: resume is exact
    assert not torch.equal(td.batch_indices(n, batch, 2, seed), td.batch_indices(n, batch, 0, seed))  # new epoch order
    assert not torch.equal(td.batch_indices(n, batch, 0, seed + 1), td.batch_indices(n, batch, 0, seed))


def test_batches_in_memory_are_pinned_for_a_gpu(monkeypatch):
    """On CUDA a non_blocking copy from pageable host memory waits for the GPU; from pinned memory it is queued like a
    kernel. Without CUDA pin_memory cannot run: here it hands back a marked copy, and every batch must be one."""
    pinned = []

    def pin(tensor):
        pinned.append(tensor.clone())
        return pinned[-1]

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    x = torch.arange(40, dtype=torch.uint8).view(10, 1, 2, 2)
    for pin_memory in (True, False):
        batches = list(td.epoch_batches(x, None, 10, 4, step=0, seed=0, rank=0, world=1, pin_memory=pin_memory))
        assert len(batches) == 2 and all(any(b is p for p in pinned) == pin_memory for b in batches)
    assert len(pinned) == 2


def test_multicrop_shapes_and_determinism():
    for channels, size in ((1, 28), (3, 32)):
        x = torch.randint(0, 256, (5, channels, size, size), dtype=torch.uint8)
        config = options(global_size=24, local_size=12, local_crops=3)
        mc = augment.MultiCrop(config, channels, [0.5] * channels, [0.25] * channels)
        crops = mc(x, torch.Generator().manual_seed(0))
        assert [tuple(c.shape) for c in crops] == [(10, channels, 24, 24), (15, channels, 12, 12)]
        again = mc(x, torch.Generator().manual_seed(0))
        other = mc(x, torch.Generator().manual_seed(1))
        assert all(torch.equal(a, b) for a, b in zip(crops, again))
        assert not torch.equal(crops[0], other[0])
        assert not torch.equal(crops[0][:5], crops[0][5:])  # the two global views differ
        lo, hi = (0 - 0.5) / 0.25, (1 - 0.5) / 0.25  # normalised range of [0, 1] pixels
        assert all(c.min() >= lo - 1e-5 and c.max() <= hi + 1e-5 for c in crops)


def test_batched_kernels_match_torchvision_v2():
    torch.manual_seed(0)
    x = torch.rand(3, 3, 20, 20)
    # crop + bicubic resize, clamped to [0, 1] (a downscale, and a whole-image upscale), with and without a flip;
    # bilinear misses these references by more than 0.1
    bicubic = dict(interpolation=TF.InterpolationMode.BICUBIC, antialias=False)
    boxes = torch.tensor([[2.0, 3.0, 16.0, 12.0], [0.0, 0.0, 20.0, 20.0], [4.0, 1.0, 14.0, 18.0]])
    x0, y0, w, h = boxes.unbind(1)
    flip = torch.tensor([False, True, False])
    out = augment.resized_crop(x, x0, y0, w, h, 10, flip)
    for i in (0, 2):  # inside the box; its outer 2 output pixels read beyond it, where torchvision repeats the edge
        ref = TF.resized_crop(x[i], int(y0[i]), int(x0[i]), int(h[i]), int(w[i]), [10, 10], **bicubic).clamp(0, 1)
        torch.testing.assert_close(out[i, :, 2:-2, 2:-2], ref[:, 2:-2, 2:-2], atol=1e-5, rtol=0)
    whole = TF.horizontal_flip(TF.resize(x[1], [10, 10], **bicubic)).clamp(0, 1)
    torch.testing.assert_close(out[1], whole, atol=1e-5, rtol=0)
    up = augment.resized_crop(x, torch.zeros(3), torch.zeros(3), torch.full((3,), 20.0), torch.full((3,), 20.0), 28)
    ref = TF.resize(x, [28, 28], **bicubic)
    torch.testing.assert_close(up, ref.clamp(0, 1), atol=1e-5, rtol=0)
    assert (F.interpolate(x, [28, 28], mode="bilinear") - ref.clamp(0, 1)).abs().max() > 0.1  # the test tells them apart
    assert ref.max() > 1 or ref.min() < 0  # bicubic overshoots; resized_crop clamps (as PIL's uint8 result)
    # per-image blur sigma, hue, brightness, contrast, saturation
    sigma = torch.tensor([0.7, 1.3, 0.0])
    blurred = augment.gaussian_blur(x, sigma)
    for i in (0, 1):
        torch.testing.assert_close(blurred[i], TF.gaussian_blur(x[i], [9, 9], [sigma[i].item()] * 2), atol=1e-5, rtol=0)
    assert torch.equal(blurred[2], x[2])
    shift = torch.tensor([0.1, -0.25, 0.4])
    hue = augment.adjust_hue(x, shift)
    for i in range(3):
        torch.testing.assert_close(hue[i], TF.adjust_hue(x[i], shift[i].item()), atol=1e-5, rtol=0)
    f = torch.tensor([0.6, 1.0, 1.4])
    for name, ref in (("brightness", TF.adjust_brightness), ("contrast", TF.adjust_contrast),
                      ("saturation", TF.adjust_saturation)):
        got = augment.adjust(x, name, f)
        for i in range(3):
            torch.testing.assert_close(got[i], ref(x[i], f[i].item()), atol=1e-5, rtol=0)
    grey = augment.adjust(x[:, :1], "contrast", f)
    for i in range(3):
        torch.testing.assert_close(grey[i], TF.adjust_contrast(x[i, :1], f[i].item()), atol=1e-5, rtol=0)

# ---- evaluation


def test_knn_probe_and_miou():
    train_f = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
    train_y = torch.tensor([0, 0, 1, 1])
    test_f = torch.tensor([[2.0, 0.1], [0.2, 3.0], [1.0, 1.2]])
    # k=2: the two nearest by cosine; [1, 1.2] is nearer class 1
    assert probes.knn_accuracy(train_f, train_y, test_f, torch.tensor([0, 1, 1]), 2, k=2) == 1.0
    assert probes.knn_accuracy(train_f, train_y, test_f, torch.tensor([0, 1, 0]), 2, k=2) == pytest.approx(2 / 3)
    pred, target = torch.tensor([0, 0, 1, 1, 2, 1]), torch.tensor([0, 1, 1, 1, 255, 2])
    # IoU class 0: 1/2, class 1: 2/4, class 2: 0/1 (the prediction 2 falls on an ignored pixel)
    assert probes.miou(pred, target, 3) == pytest.approx((1 / 2 + 2 / 4 + 0) / 3)
    assert probes.miou(torch.tensor([0, 1]), torch.tensor([0, 0]), 3) == pytest.approx((1 / 2 + 0) / 2)  # absent: skipped
    masks = torch.zeros(1, 4, 4, dtype=torch.long)
    masks[0, :2, :2] = 3
    masks[0, 0, 2] = 1  # a minority pixel in the top-right patch
    masks[0, 2:, 2:] = 255
    assert probes.patch_labels(masks, 2, 4).tolist() == [[[3, 0], [0, 255]]]


def test_segmentation_probe_learns_an_easy_task():
    torch.manual_seed(0)
    masks = torch.randint(0, 3, (40, 4, 4)).repeat_interleave(4, 1).repeat_interleave(4, 2)  # patch-constant
    feats = F.one_hot(masks[:, ::4, ::4], 3).float() + 0.1 * torch.randn(40, 4, 4, 3)
    assert probes.segmentation_miou(feats[:30], masks[:30], feats[30:], masks[30:], 3, steps=300) > 0.9


def test_extract_features_kinds():
    torch.manual_seed(0)
    backbone = ViT(make_config("vit-cpu", n_layer=3, num_classes=0)).eval()
    x = torch.randint(0, 256, (5, 1, 28, 28), dtype=torch.uint8)
    cls2 = probes.extract_features(backbone, x, [0.5], [0.25], "cpu", "cls", blocks=2, batch_size=2)
    with torch.no_grad():
        last = backbone((x.float() / 255 - 0.5) / 0.25)  # the final-normed CLS token
    assert cls2.shape == (5, 128) and torch.allclose(cls2[:, 64:], last, atol=1e-5)
    assert probes.extract_features(backbone, x, [0.5], [0.25], "cpu", "patch").shape == (5, 4, 4, 64)
    pixels = probes.extract_features(None, x, [0.5], [0.25], "cpu", "pixels")
    assert torch.allclose(pixels, ((x.float() / 255 - 0.5) / 0.25).flatten(1))
    big = torch.randint(0, 256, (3, 3, 224, 224), dtype=torch.uint8)  # ImageNet-sized: averaged down to 32 x 32
    pixels = probes.extract_features(None, big, [0.5] * 3, [0.25] * 3, "cpu", "pixels")
    expected = F.avg_pool2d((big.float() / 255 - 0.5) / 0.25, 7).flatten(1)
    assert pixels.shape == (3, 3 * 32 * 32) and torch.allclose(pixels, expected, atol=1e-5)

# ---- scenes


def test_scenes_are_deterministic_and_masks_match_the_items():
    g = torch.Generator().manual_seed(0)
    items = torch.zeros(20, 1, 28, 28, dtype=torch.uint8)
    items[:, :, 4:24, 6:22] = torch.randint(30, 256, (20, 1, 20, 16), generator=g, dtype=torch.uint8)
    labels = torch.arange(20) % 10
    a = images.make_scenes(items, labels, 12, seed=3, size=48)
    b = images.make_scenes(items, labels, 12, seed=3, size=48)
    c = images.make_scenes(items, labels, 12, seed=4, size=48)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["images"], c["images"])
    for i in range(12):
        mask, top = torch.zeros(48, 48, dtype=torch.uint8), torch.full((48, 48), -1)  # top: which placement
        for j, (idx, y, x) in enumerate(a["placements"][i].tolist()):
            if idx < 0:
                continue
            pasted = items[idx, 0] >= 10
            mask[y:y + 28, x:x + 28][pasted] = labels[idx] + 1
            top[y:y + 28, x:x + 28][pasted] = j
        assert torch.equal(a["masks"][i], mask)
        fg = top >= 0
        ys, xs = fg.nonzero().unbind(1)
        idx, oy, ox = a["placements"][i][top[fg]].unbind(1)
        assert torch.equal(a["images"][i, 0][fg], items[idx, 0, ys - oy, xs - ox])  # the items' own pixels
        counts = torch.bincount(mask.flatten().long(), minlength=11)[1:]
        assert a["labels"][i] == counts.argmax()  # the most visible item's class
        assert 2 <= (a["placements"][i, :, 0] >= 0).sum() <= 4

# ---- options

# facebookresearch/dino's "Boosting DINO performance" ViT-S command: main_dino.py's defaults and three flags; its lr,
# 0.0005 per 256 images, at its global batch of 1024 (batch_size: images per GPU, 128 on the 8 GPUs of the config)
DINO_BOOSTED = dict(teacher_temp=0.07, warmup_teacher_temp_epochs=30, norm_last_layer=False, warmup_teacher_temp=0.04,
                    student_temp=0.1, center_momentum=0.9, momentum_teacher=0.996, out_dim=65536, head_hidden=2048,
                    head_bottleneck=256, drop_path=0.1, lr=0.0005 * 1024 / 256, min_lr=1e-6, warmup_epochs=10,
                    weight_decay=0.04, weight_decay_end=0.4, clip_grad=3.0, freeze_last_layer=1, global_size=224,
                    global_scale=[0.4, 1.0], local_crops=8, local_size=96, local_scale=[0.05, 0.4],
                    jitter=[0.4, 0.4, 0.2, 0.1], jitter_p=0.8, grayscale_p=0.2, blur_sigma=[0.1, 2.0], solarize_p=0.2)


def test_imagenet_config_is_one_dino_recipe_on_vit_s16():
    """The ImageNet config parses against train_dino.py's options, builds DINO's ViT-S/16 (about 21.7M parameters),
    carries the boosted ViT-S recipe (not a mix of it and the vanilla one) at the paper's 50 epochs, and says where
    every value comes from."""
    path = os.path.join(ROOT, "config", "dino_vits16_imagenet.py")
    config = configurator.parse_args(options(), [path])
    cfg = configurator.config_from_options(config, "vit", img_size=config["global_size"], in_chans=3, num_classes=0)
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.patch_size, cfg.img_size) == (12, 384, 6, 16, 224)
    with torch.device("meta"):  # the shapes without allocating the weights
        params = sum(p.numel() for p in ViT(cfg).parameters())
    assert 21e6 < params < 22.5e6 and config["local_size"] % cfg.patch_size == 0
    assert {k: config[k] for k in DINO_BOOSTED} == DINO_BOOSTED
    assert config["epochs"] == 50 and config["n_lap"] in (1, 3, 5, 6) and config["dataset"] == "imagefolder"
    assert config["batch_size"] * 8 == 1024  # DINO's global batch on the 8 GPUs of the config's command
    values = [l for l in open(path) if re.match(r"\w+ = ", l)]
    assert values and all(re.search(r"  # (dino|paper|ours)\b", l) for l in values), "every value names its source"


# ---- whole runs (subprocesses)


def test_tiny_run_writes_result_log_and_checkpoint(tmp_path):
    """4 steps of a tiny model with local crops and drop path: the RESULT line, log.jsonl and the checkpoint
    contract that analyze.py and --resume rely on."""
    r = run(SCRIPT, *TINY, "--dataset=synthetic", "--epochs=1.0", f"--out_dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(losses(r.stdout)) == [1, 2, 3, 4] and all(math.isfinite(v) for v in losses(r.stdout).values())
    res = result(r.stdout)
    assert list(res) == ["n_lap", "params", "seed", "dataset", "steps", "seconds", "knn_acc", "knn_acc_init",
                         "knn_acc_pixels", "linear_acc", "linear_acc_pixels", "pixel_side", "machine"]
    assert res["pixel_side"] == "28"  # what the raw-pixel baselines read
    assert res["machine"] == common.machine_name("cpu")  # which machine trained it: floats differ between machines
    assert res["steps"] == "4" and res["n_lap"] == "1" and 0 <= float(res["knn_acc"]) <= 1
    assert open(tmp_path / "result.txt").read().strip() == [l for l in r.stdout.splitlines() if l.startswith("RESULT")][-1]
    records = [json.loads(line) for line in open(tmp_path / "log.jsonl")]
    assert [rec["step"] for rec in records] == [0, 4, 4] and "linear_acc" in records[-1]
    assert all(rec["machine"] == res["machine"] for rec in records)
    assert records[1]["knn_acc"] == pytest.approx(float(res["knn_acc"]), abs=1e-4)
    ckpt = load_checkpoint(str(tmp_path / "ckpt.pt"))
    assert {"kind", "model_config", "model", "config", "student", "teacher", "center", "optimizer", "scaler", "step",
            "epoch", "knn_acc_init"} <= set(ckpt)
    assert ckpt["kind"] == "dino" and ckpt["step"] == 4
    assert ckpt["config"]["preset"] == "vit-cpu" and ckpt["config"]["n_embd"] == 32 and ckpt["config"]["dataset"] == "synthetic"
    backbone = common.load_model(ckpt)  # the teacher backbone, as analyze.py loads it
    assert backbone.config.num_classes == 0 and backbone.config.drop_path == 0.0 and backbone.config.patch_size == 7
    assert all(torch.equal(v, ckpt["teacher"]["backbone." + k]) for k, v in ckpt["model"].items())


def training_step(frame):
    """The `step` of train_dino.py run in this process (run_here) as frame runs, inside its call stack: None outside it
    or before its training loop."""
    while frame is not None and not (frame.f_code.co_filename == os.path.join(ROOT, SCRIPT)
                                     and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    return None if frame is None else frame.f_globals.get("step")


HOST_READS = ("item", "__bool__", "__float__", "__int__", "tolist")  # each one waits for the GPU's queued work


def test_training_reads_values_on_the_host_only_at_progress_lines_and_evaluations(tmp_path, monkeypatch):
    """A GPU step queues its kernels and runs on; a tensor's value read on the host (.item(), float(t), `if t`, ...)
    waits for every one of them. Here 20 steps of a tiny run train in this process with progress lines every 5 steps
    and evaluations every 8, and every such read that the repository's own code makes is counted with the training
    step it came in (the script's `step` at that moment). Reads happen in the iterations that print a progress line
    (steps 4, 9, ...: their teacher statistics, then the loss after `step` has counted them) and at evaluations, never
    in between. data/augment.py reads numbers it draws on the CPU, which waits for nothing (it never reads a device
    tensor: test_augmentation_never_waits_for_the_device); a CPU run cannot tell those apart, so they are left out."""
    left_out = (os.path.join(ROOT, "tests") + os.sep, os.path.join(ROOT, "data", "augment.py"))
    reads = []

    def counted(name):
        original = getattr(torch.Tensor, name)

        def read(tensor, *args):
            caller = sys._getframe(1)
            where = caller.f_code.co_filename
            if where.startswith(ROOT + os.sep) and not where.startswith(left_out):
                reads.append((training_step(caller), name, f"{os.path.relpath(where, ROOT)}:{caller.f_lineno}"))
            return original(tensor, *args)
        return read

    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, counted(name))
    run_here(SCRIPT, *TINY, "--dataset=synthetic", "--epochs=5", "--log_interval=5", "--eval_interval=8",
             "--cpu_procs=1", f"--out_dir={tmp_path}")
    monkeypatch.undo()
    assert open(tmp_path / "result.txt").read().startswith("RESULT") and load_checkpoint(str(tmp_path / "ckpt.pt"))["step"] == 20
    end = 20
    logs = {s for s in range(end) if (s + 1) % 5 == 0 or s + 1 == end}  # the iterations that print a progress line
    evaluations = {s for s in range(end + 1) if s % 8 == 0 or s == end}
    allowed = logs | {s + 1 for s in logs} | evaluations
    in_training = [r for r in reads if r[0] is not None]
    stray = [r for r in in_training if r[0] not in allowed]
    assert not stray, f"host reads in steps that neither log nor evaluate: {stray[:10]} ({len(stray)} in all)"
    assert {5, 8, 10, 15, 20} <= {r[0] for r in in_training}  # the counting sees the progress lines and evaluations


def test_compiled_backbones_keep_one_static_graph_per_crop_size(tmp_path, monkeypatch):
    """Two crop sizes a step (2 x 64 global crops of 28 px, 2 x 64 local ones of 14 px): with --compile_model=True the
    student compiles one static graph for each, the teacher one for the global crops, all in step 0, and none after:
    not in 8 steps over two epochs (4 steps each, 32 of the 288 images left out: no smaller last batch), nor for the
    k-NN at steps 0, 3, 6 and 8 and the final linear and segmentation probes (56 px images), which read the uncompiled
    backbone; none has symbolic sizes (the old code compiled the local crops' graph dynamic). torch.compile is given
    a backend that records each graph (its image input, the step it came in) and runs it uncompiled: seconds. The
    checkpoint's names carry no torch.compile prefix."""
    from torch._dynamo.utils import counters
    graphs = []

    def recording_backend(gm, example_inputs):
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        image = next(x for name, x in zip(names, example_inputs) if "img" in name)
        symbolic = any(isinstance(x, torch.SymInt) for x in example_inputs) or any(
            isinstance(d, torch.SymInt) for x in example_inputs if isinstance(x, torch.Tensor) for d in x.shape)
        graphs.append((training_step(sys._getframe()), tuple(image.shape), symbolic))
        return gm.forward

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: compile_(model, backend=recording_backend, **kwargs))
    torch._dynamo.reset()
    counters.clear()
    try:
        run_here(SCRIPT, *TINY, "--dataset=synthetic", "--train_subset=288", "--epochs=2", "--log_interval=2",
                 "--eval_interval=3", "--seg_dataset=scenes", "--seg_train=40", "--seg_val=20", "--compile_model=True",
                 "--cpu_procs=1", f"--out_dir={tmp_path}")
        unique_graphs = counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    assert unique_graphs == len(graphs) == 3, graphs
    assert sorted(graphs) == [(0, (128, 1, 14, 14), False), (0, (128, 1, 28, 28), False), (0, (128, 1, 28, 28), False)]
    ckpt = load_checkpoint(str(tmp_path / "ckpt.pt"))
    assert ckpt["step"] == 8 and not [k for key in ("model", "student", "teacher") for k in ckpt[key] if "_orig_mod" in k]


@pytest.mark.slow
def test_resume_equals_uninterrupted_run_and_last_layer_freeze(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    a = run(SCRIPT, *TINY, "--epochs=2.0", f"--out_dir={full}")
    assert a.returncode == 0, a.stderr
    # the same run in three pieces: stop at step 1, resume to step 4 (the end of epoch 0), resume to the end
    # with nothing but --resume (the checkpoint's options are the base)
    b1 = run(SCRIPT, *TINY, "--epochs=2.0", "--stop_at_step=1", f"--out_dir={part}")
    assert b1.returncode == 0 and "stopped at step 1 (--stop_at_step)" in b1.stdout, b1.stderr
    at_1 = load_checkpoint(str(part / "ckpt.pt"))
    b4 = run(SCRIPT, "--stop_at_step=4", "--resume", f"--out_dir={part}")
    assert b4.returncode == 0, b4.stderr
    at_4 = load_checkpoint(str(part / "ckpt.pt"))
    assert 0 < at_4["seconds"] < 1000
    common.save_checkpoint({**at_4, "seconds": 1000.0}, str(part / "ckpt.pt"))  # as if the first pieces took 1000 s
    b8 = run(SCRIPT, "--resume", f"--out_dir={part}")
    assert b8.returncode == 0, b8.stderr
    assert "resumed from" in b8.stdout and "RESULT" in b8.stdout and "RESULT" in a.stdout
    la = losses(a.stdout)  # the uninterrupted run's, then the three pieces'
    l1 = losses(b1.stdout)
    l4 = losses(b4.stdout)
    l8 = losses(b8.stdout)
    assert sorted(la) == list(range(1, 9)) and sorted(l1) == [1] and sorted(l4) == [2, 3, 4] and sorted(l8) == [5, 6, 7, 8]
    assert la == {**l1, **l4, **l8}
    assert result(a.stdout)["knn_acc"] == result(b8.stdout)["knn_acc"]
    assert float(result(b8.stdout)["seconds"]) >= 1000, "a resumed run's seconds count its earlier pieces"
    ca, cb = load_checkpoint(str(full / "ckpt.pt")), load_checkpoint(str(part / "ckpt.pt"))
    assert ca["step"] == cb["step"] == 8
    for key in ("student", "teacher", "model"):
        assert all(torch.equal(ca[key][k], cb[key][k]) for k in ca[key])
    assert torch.equal(ca["center"], cb["center"])
    assert ca["optimizer"][0]["state"][0]["exp_avg"].equal(cb["optimizer"][0]["state"][0]["exp_avg"])
    # the last layer: frozen through epoch 0 (steps 0-3) while the rest trains, updated in epoch 1
    assert torch.equal(at_1["student"]["head.weight_v"], at_4["student"]["head.weight_v"])
    assert not torch.equal(at_1["student"]["backbone.patch_embed.weight"],
                           at_4["student"]["backbone.patch_embed.weight"])
    assert not torch.equal(at_4["student"]["head.weight_v"], cb["student"]["head.weight_v"])
    records = [json.loads(line) for line in open(full / "log.jsonl")]
    assert records[0]["step"] == 0 and "knn_acc" in records[0] and "linear_acc" in records[-1]
    # --eval_only probes the saved backbone on the same images: the run's own numbers
    e = run(SCRIPT, f"--eval_only={full / 'ckpt.pt'}", "--eval_train=256", "--eval_val=128", "--probe_steps=20",
                   "--seg_dataset=none", f"--out_dir={tmp_path / 'eval'}")
    assert e.returncode == 0, e.stderr
    for key in ("knn_acc", "knn_acc_init", "linear_acc", "linear_acc_pixels"):
        assert result(e.stdout)[key] == result(a.stdout)[key], key
    # a resume that changes the model is refused, naming what changed
    r = run(SCRIPT, "--resume", "--n_lap=0", f"--out_dir={part}")
    assert r.returncode != 0 and "--n_lap=0 (checkpoint: 1)" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_two_processes_stay_in_sync_and_resume_exactly(tmp_path):
    """torchrun with 2 gloo processes and plain python with --cpu_procs=2 (the same processes, started through
    torchrun) save the same student and teacher bit for bit; a 2-process resume repeats the uninterrupted run."""
    args = [*TINY, "--epochs=2.0", "--batch_size=32"]  # 2 x 32: TINY's global batch of 64
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "train_dino.py", *args, f"--out_dir={tmp_path / 'ddp'}"], cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    spawned = run(SCRIPT, *args, "--cpu_procs=2", f"--out_dir={tmp_path / 'spawned'}")
    assert spawned.returncode == 0, spawned.stderr
    assert losses(spawned.stdout) == losses(p.stdout) and sorted(losses(p.stdout)) == list(range(1, 9))
    part = tmp_path / "part"
    first = run(SCRIPT, *args, "--cpu_procs=2", "--stop_at_step=3", f"--out_dir={part}")
    rest = run(SCRIPT, *args, "--cpu_procs=2", "--resume", f"--out_dir={part}")
    assert first.returncode == 0 and rest.returncode == 0, first.stderr + rest.stderr
    assert {**losses(first.stdout), **losses(rest.stdout)} == losses(p.stdout)
    saved = [load_checkpoint(str(tmp_path / name / "ckpt.pt")) for name in ("ddp", "spawned", "part")]
    for key in ("student", "teacher"):
        assert all(torch.equal(saved[0][key][k], other[key][k]) for other in saved[1:] for k in saved[0][key])
    one = run(SCRIPT, *args, "--cpu_procs=1", "--resume", f"--out_dir={part}")  # another global batch
    assert one.returncode != 0 and "the checkpoint has 4 steps per epoch, this run 8" in one.stderr, one.stderr
    assert "Traceback" not in one.stderr


def teacher_outputs(out_dir):
    """The centred teacher outputs (256, out_dim) on val images."""
    ckpt = load_checkpoint(str(out_dir / "ckpt.pt"))
    cfg = ckpt["config"]
    teacher = td.DINO(ViT(Config(**ckpt["model_config"])), DINOHead(ckpt["model_config"]["n_embd"], cfg["out_dim"],
                                                                     cfg["head_hidden"], cfg["head_bottleneck"]))
    teacher.load_state_dict(ckpt["teacher"])
    data = images.load_images(cfg["dataset"], os.path.join(ROOT, cfg["data_dir"]))
    x, _ = images.load_eval_images(data, "val", cfg["eval_val"], cfg["global_size"])
    with torch.no_grad():
        return teacher([(x[:256].float() / 255 - data["mean"][0]) / data["std"][0]]) - ckpt["center"]


SHORT = ["--train_subset=512", "--epochs=5.0", "--eval_train=500", "--eval_val=250", "--probe_steps=20",
         "--seg_dataset=none", "--log_interval=10"]


@pytest.mark.slow
def test_short_run_does_not_collapse(tmp_path):
    """40 steps of the default model: early DINO has a nearly uniform teacher (the entropy falls over
    epochs), but its outputs must still tell images apart and its features must still hold the classes."""
    r = run(SCRIPT, *SHORT, f"--out_dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    assert "collapsing" not in r.stdout
    out = teacher_outputs(tmp_path)
    assert out.std(dim=0).mean() > 0.01  # images are told apart
    assert out.argmax(dim=1).unique().numel() >= 10  # many prototypes in use, not one for everything
    final = [json.loads(line) for line in open(tmp_path / "log.jsonl")][-1]
    assert final["knn_acc"] > 0.4  # chance is 0.1


@pytest.mark.slow
def test_collapse_is_detected(tmp_path):
    """Without centring (center_momentum=1 keeps the centre at 0) DINO collapses onto one prototype."""
    r = run(SCRIPT, *SHORT, "--center_momentum=1.0", "--lr=0.0025", f"--out_dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    assert "warning: the teacher's outputs barely differ across images" in r.stdout
    assert teacher_outputs(tmp_path).argmax(dim=1).unique().numel() <= 2


BAD_INPUTS = [
    (["--dataset=mnist"], "--dataset='mnist': choose one of fashion_mnist, cifar10"),
    (["--local_crops=2", "--local_size=12"], "--local_size=12 is not a multiple of the patch size 7"),
    (["--seg_size=50"], "--seg_size=50 is not a multiple of the patch size 7"),
    (["--n_lap=5"], "at most n_head=4 Laplacian heads"),
    (["--eval_only=/nonexistent/ckpt.pt"], "--eval_only: no checkpoint at /nonexistent/ckpt.pt"),
    (["--resume", "--out_dir=/nonexistent/run"], "--resume: no checkpoint at /nonexistent/run/ckpt.pt"),
    (["--lr=fast"], "--lr='fast' has type str"),
    (["--batchsize=64"], "unknown option --batchsize"),
    (["--global_scale=[0.4, 1.5]"], "--global_scale=[0.4, 1.5]: expected [low, high]"),
    (["--preset=gpt-tiny"], "--preset='gpt-tiny': choose one of"),
    (["--dtype=fp8"], "--dtype='fp8': choose auto, float32, bfloat16 or float16"),
    (["--stop_at_step=-1"], "--stop_at_step=-1: must be at least 0"),
    (["--lr=0.0"], "--lr=0.0: must be greater than 0"),
    (["--jitter_p=1.5"], "--jitter_p=1.5: must lie in [0, 1]"),
    (["--train_limit=100"], "unknown option --train_limit"),  # the old name of --train_subset
    (["--grad_clip=1.0"], "unknown option --grad_clip"),  # DINO's per-parameter rule has DINO's name, clip_grad
    (["--dataset=imagefolder", "--data_dir=/nonexistent"], "/nonexistent/train is not a directory"),
    (["--train_subset=100", "--batch_size=128"], "the global batch (128 = batch_size x 1 processes) is larger than the "
                                                 "100 training images"),
] + ([] if torch.cuda.is_available() else [(["--device=cuda"], "--device=cuda: this machine has no CUDA device")])


@pytest.mark.parametrize("args, message", BAD_INPUTS)
def test_bad_inputs_give_clear_errors(args, message, tmp_path):
    """In this process, with one CPU process; a shell shows `error: <message>`."""
    with pytest.raises((common.UsageError, OSError), match=re.escape(message)):
        run_here(SCRIPT, f"--out_dir={tmp_path}", "--cpu_procs=1", *args)


@pytest.mark.slow
def test_unused_sizes_are_not_checked(tmp_path):
    """Without local crops (or segmentation) their sizes play no part, so they need not fit the patch size."""
    r = run(SCRIPT, *TINY, "--local_crops=0", "--local_size=12", "--seg_size=50", "--epochs=1.0", "--stop_at_step=1",
                   f"--out_dir={tmp_path}")
    assert r.returncode == 0 and "stopped at step 1 (--stop_at_step)" in r.stdout, r.stderr


@pytest.mark.slow
def test_augmentation_never_waits_for_the_device():
    """No host sync in the augmentation, shown without CUDA: the images live on the meta device (shapes, no values),
    and a read of a device tensor's value on the host (.item(), `if tensor`, float(tensor)) is counted, and so is a
    copy of host data to the device other than common.to_device's (from pinned memory, without blocking, on a GPU).
    On a GPU each such read or copy waits for every kernel queued before it. Numbers drawn on the CPU may be read:
    that waits for nothing. The constants (MultiCrop's mean and std) are made on the device once, before."""
    import train_vit
    reads = []
    copies = []
    originals = {name: getattr(torch.Tensor, name) for name in ("item", "__bool__", "__float__", "to")}
    make_tensor = torch.tensor

    def counted(name, fallback):
        def read(t):
            if t.device.type == "cpu":
                return originals[name](t)
            reads.append(name)
            return fallback
        return read

    def copy(t, *args, **kwargs):
        frame = sys._getframe(1)
        device = kwargs.get("device", args[0] if args else None)
        if t.device.type == "cpu" and str(device) == "meta" and frame.f_code is not common.to_device.__code__:
            copies.append(f"{os.path.relpath(frame.f_code.co_filename, ROOT)}:{frame.f_lineno}")
        return originals["to"](t, *args, **kwargs)

    def tensor_of_numbers(data, *args, **kwargs):  # torch.tensor(numbers, device=...) copies them from the host
        if str(kwargs.get("device")) == "meta":
            frame = sys._getframe(1)
            copies.append(f"{os.path.relpath(frame.f_code.co_filename, ROOT)}:{frame.f_lineno}")
        return make_tensor(data, *args, **kwargs)

    torch.manual_seed(0)
    x = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8).to("meta")
    y = torch.randint(0, 10, (8,)).to("meta")
    mean, std = torch.full((1, 3, 1, 1), 0.5, device="meta"), torch.full((1, 3, 1, 1), 0.25, device="meta")
    multicrop = augment.MultiCrop(options(global_size=24, local_size=12, local_crops=2), 3, [0.5] * 3, [0.25] * 3,
                                  device="meta")
    for name, fallback in (("item", 0.5), ("__bool__", True), ("__float__", 0.5)):
        setattr(torch.Tensor, name, counted(name, fallback))
    torch.Tensor.to = copy
    torch.tensor = tensor_of_numbers
    try:
        crops = multicrop(x, torch.Generator().manual_seed(0))
        images, targets = train_vit.augment_batch(x, y, 32, mean, std, augment.make_mixer(0.8, 1.0, 10), crop_padding=4,
                                                  three_augment=True, color_jitter=0.3, random_erasing=0.25)
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        torch.tensor = make_tensor
    assert [c.device.type for c in crops] == ["meta", "meta"] and images.shape == (8, 3, 32, 32)
    assert reads == [], f"host reads of device tensors in the augmentation: {sorted(set(reads))}, {len(reads)} in all"
    assert copies == [], f"blocking copies to the device in the augmentation: {sorted(set(copies))}, {len(copies)} in all"


@pytest.mark.slow
@pytest.mark.parametrize("intervals", [["--log_interval=3", "--eval_interval=6"], ["--log_interval=100", "--eval_interval=3"]],
                         ids=["at a progress line", "at a checkpoint between progress lines"])
def test_a_non_finite_loss_stops_the_run_before_its_next_checkpoint(tmp_path, intervals):
    """The loss is read on the host only at progress lines and checkpoints: a NaN loss stops the run in one line that
    names the steps of the sum it spoilt, before any checkpoint holds their weights (a run checkpoints at its
    evaluations after step 0: none here). Progress lines every 3 steps find it there; every 100, the evaluation of
    step 3 finds it."""
    r = run(SCRIPT, *TINY, "--lr=1e38", *intervals, "--epochs=2", f"--out_dir={tmp_path}")
    assert r.returncode == 1 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert re.match(r"error: non-finite loss nan in steps (0-2|3-5): stopped before a checkpoint holds the weights of "
                    r"these steps\. .*; no checkpoint yet, nothing to resume", r.stderr), r.stderr
    assert not os.path.exists(tmp_path / "ckpt.pt")


def test_non_finite_weights_are_never_saved(tmp_path, monkeypatch):
    """Weights can turn non-finite in the last optimizer step before a checkpoint, whose loss has not been computed yet:
    the optimizer step of step 3 here writes an inf into a weight, and the checkpoint of step 4 (losses of steps 0 to
    3 finite) is not written; the one of step 2 stays."""
    step = torch.optim.AdamW.step
    calls = []

    def spoiling_step(self, *args, **kwargs):
        done = step(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == 4:  # the optimizer step of step 3
            with torch.no_grad():
                self.param_groups[0]["params"][0].view(-1)[0] = math.inf
        return done

    monkeypatch.setattr(torch.optim.AdamW, "step", spoiling_step)
    with pytest.raises(FloatingPointError) as stopped:
        run_here(SCRIPT, *TINY, "--dataset=synthetic", "--epochs=1", "--log_interval=100", "--eval_interval=2",
                 "--cpu_procs=1", f"--out_dir={tmp_path}")
    ckpt = load_checkpoint(str(tmp_path / "ckpt.pt"))
    assert ckpt["step"] == 2 and all(torch.isfinite(v).all() for v in ckpt["student"].values())
    assert str(stopped.value).startswith("non-finite weights after step 3: stopped before they are saved")


# the second process's local crops at step 1 are NaN: its loss is, and the first process's is not
NAN_CROPS_IN_PROCESS_1 = """
import os
import torch
from data import augment
crop = augment.MultiCrop.__call__
calls = []
def nan_crops(self, images, generator):
    crops = crop(self, images, generator)
    calls.append(1)
    if os.environ["RANK"] == "1" and len(calls) == 2:
        crops[1] = torch.full_like(crops[1], float("nan"))
    return crops
augment.MultiCrop.__call__ = nan_crops
"""


@pytest.mark.slow
def test_a_non_finite_loss_in_one_process_stops_every_process_together(tmp_path):
    """float16 in two processes, the second one's loss NaN at step 1: DDP averages its NaN gradients into both, the
    scaler skips the step in both, and the weights stay finite. The losses are summed over the processes before they
    are checked, so both stop at the progress line of step 2 and the first says so in one line (checked apart, the
    first went on alone and met a peer that had stopped)."""
    done = torchrun_with(SHORT_GROUP_TIMEOUT + NAN_CROPS_IN_PROCESS_1, "train_dino.py", *TINY, "--dataset=synthetic",
                         "--dtype=float16", "--log_interval=2", "--epochs=1", f"--out_dir={tmp_path}")
    assert done.returncode != 0
    assert re.search(r"error: non-finite loss nan in steps 0-1: stopped before a checkpoint", done.stderr), done.stderr[-3000:]


@pytest.mark.slow
def test_the_final_probes_keep_no_process_waiting(tmp_path):
    """The first process runs the final probes alone, after the processes have parted: here they take 8 s, longer than
    the group's timeout (5 s), and the run still ends with its RESULT line."""
    slow = SHORT_GROUP_TIMEOUT + ("import time, probes\nfinal = probes.evaluate_final\n"
                                  "probes.evaluate_final = lambda *a, **k: time.sleep(8) or final(*a, **k)\n")
    done = torchrun_with(slow, "train_dino.py", *TINY, "--dataset=synthetic", "--epochs=1.0", f"--out_dir={tmp_path}")
    assert done.returncode == 0 and done.stdout.count("RESULT ") == 1, done.stderr[-3000:]
    assert result(done.stdout)["pixel_side"] == "28"  # what the raw-pixel baselines read
