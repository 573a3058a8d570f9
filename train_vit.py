"""
Supervised ViTs with Laplacian heads: the paper's first experiment (DeiT-III recipe), from a laptop CPU
to many GPUs. One flat script; the model and the shared helpers live in nanolap.py.

    python train_vit.py                                   # CPU default: Fashion-MNIST, all 4 heads Laplacian
    python train_vit.py --n_lap=0                         # the same ViT with attention heads only
    python train_vit.py --n_lap=[0,2,4,4]                 # a per-layer schedule
    python train_vit.py config/vit_cifar10.py             # GPU: CIFAR-10, vit-small, DeiT-III ingredients
    torchrun --nproc_per_node=8 train_vit.py config/vit_deit3_b.py --data_dir=/data/imagenet   # the paper
    python train_vit.py --resume                          # continue out_dir/ckpt.pt exactly where it stopped

Options are `--key=value` (Python literals, checked against the defaults below) and config files of plain
`key = value` lines, applied in command-line order. With --resume the checkpoint's config is the base and
the options on the command line go on top (e.g. --epochs=20 stretches the schedule to 20 epochs).

Scaling with torchrun: batch_size is per process and per micro-step, so one optimizer step sees
batch_size * grad_accum * world_size images (printed as "global batch"). lr is the learning rate at that
global batch; nothing is rescaled behind your back. To reproduce a run on more processes, keep the global
batch (divide batch_size or grad_accum by the number of processes) and keep lr. To use a larger global
batch, scale lr linearly with it (DeiT: lr = 5e-4 * global_batch / 512) and keep warmup in epochs.
The data order depends only on (seed, epoch), not on how the global batch is split over processes, and
every micro-batch draws its augmentation and drop-path randomness from a seed of (seed, epoch, step, chunk).
Multi-node: torchrun's standard flags (--nnodes, --node_rank, --master_addr, --master_port).

On a CPU without torchrun the script starts cpu_procs (default 2) single-threaded processes itself and
trains data-parallel in them (launch_cpu_processes below): for a model this small, PyTorch's threads
hardly help (one process: ~1,300 img/s with 1 or 2 threads on our 2-core machine; two processes: ~2,100).
The global batch is then batch_size * cpu_procs; --cpu_procs=1 trains in this process.
"""

import gzip
import json
import math
import multiprocessing
import os
import re
import socket
import sys
import threading
import time
from contextlib import nullcontext
from dataclasses import asdict
from types import SimpleNamespace

# CPU threads that wait by sleeping, not spinning: on a shared machine spinning OpenMP threads steal the cores
# they wait for (measured here: 5x slower with 2 threads when another process was busy). Must precede torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
import torch.nn.functional as F

from nanolap import (PRESETS, UsageError, all_reduce_mean, append_jsonl, build_model, check_finite, format_time,
                     load_checkpoint, make_config, parse_args, peak_flops, rng_state, run_main,
                     save_checkpoint, set_rng_state, setup_distributed, teardown_distributed)

# -----------------------------------------------------------------------------
# default config: the CPU recipe. Fashion-MNIST, vit-cpu (vit-tiny narrowed to d 64, with 7x7 patches: 16 + 1
# tokens), every head Laplacian, random erasing, 18 epochs in 2 processes of 128 images: 9m18s and 90.15% on
# 2 idle CPU cores

_before = set(globals())
# I/O
out_dir = "out-vit"  # ckpt.pt and log.jsonl go here
log_interval = 100  # optimizer steps between progress lines
ckpt_interval = 0  # also checkpoint every this many steps (0: only after each epoch's eval)
resume = False  # continue from out_dir/ckpt.pt, exactly where it stopped
stop_at_step = 0  # stop with a checkpoint after this step (the schedule still spans all epochs); 0 = never
# data
dataset = "fashion_mnist"  # fashion_mnist | cifar10 | cifar100 | imagefolder | synthetic (generated, for tests)
data_dir = "data"  # small datasets: data/<dataset>; imagefolder: the folder holding train/ and val/
train_subset = 0  # use only the first N training images (0 = all): smoke tests
val_subset = 0  # evaluate on the first N validation images (0 = all)
img_size = 0  # model resolution; 0 = the dataset's own (imagefolder: 224). Small datasets are resized on device
num_workers = 8  # imagefolder: DataLoader worker processes per process (decoding and crops)
# model (None = the preset's value)
preset = "vit-cpu"  # vit-cpu (vit-tiny at d 64, patch 7), vit-tiny (4 layers, d 96, 4 heads, patch 4), vit-small, vit-b
n_lap = 4  # Laplacian heads per layer: 0..n_head, or a per-layer list like [0,2,4,4]
n_layer = None
n_head = None
n_embd = None
patch_size = None
mlp_ratio = None  # MLP hidden width / n_embd (4.0 in every preset)
pooling = "mean"  # 'cls' token or 'mean' of the patch tokens (12 CPU epochs: mean 89.18%, cls 89.12%)
drop_path = 0.1  # stochastic depth, rising linearly to this value in the last block (DeiT-III: 0.1-0.4). The
# CPU default's 18 epochs without random erasing: 89.89% with 0.1, 89.28% with 0 (overfits after epoch 15)
layerscale = None  # LayerScale init (DeiT-III: 1e-6); 0.0 = off
qk_norm = None  # normalise queries and keys per head (the paper's ViTs: True)
# augmentation (on the device, per image, batched)
crop_padding = 0  # random crop after zero-padding by this many pixels (CIFAR: 4); imagefolder: random resized crop
hflip = False  # random horizontal flip (off: Fashion-MNIST items share one orientation; 12 CPU epochs, mean
# pooling: 89.57% without, 89.18% with flips. Turn it on for natural images and long runs)
three_augment = False  # DeiT-III 3-Augment: per image one of grayscale / solarize / blur, then colour jitter
color_jitter = 0.3  # 3-Augment's brightness/contrast/saturation strength
rand_augment = 0  # RandAugment: number of ops per image (0 = off; timm's rand-m9-n2 is 2)
rand_magnitude = 9  # RandAugment magnitude (0-30)
random_erasing = 0.25  # probability per image of erasing a random rectangle with noise (DeiT: 0.25; DeiT-III: 0).
# The CPU default's 18 epochs, seeds 0/1/2: 90.15/89.56/90.01% with 0.25, 89.81/89.56/89.88% with 0; 89.79% with
# 0.5 (seed 0)
mixup = 0.0  # mixup alpha (DeiT-III: 0.8); 0 = off
cutmix = 0.0  # cutmix alpha (DeiT-III: 1.0); with both on, each batch uses one of the two
label_smoothing = 0.1
bce_loss = False  # DeiT-III: binary cross-entropy, every class present in a mixed image is a positive
# optimisation
optimizer = "adamw"  # adamw | lamb
epochs = 18
batch_size = 128  # per process and micro-step; global batch = batch_size * grad_accum * processes
grad_accum = 1  # micro-steps per optimizer step
lr = 3e-3  # peak learning rate at the global batch
min_lr = 1e-5  # the cosine schedule ends here
warmup_epochs = 0.5  # linear warmup from 0 (in epochs, so it survives changes of batch size)
weight_decay = 0.05  # on weight matrices only (not biases, norms, position embedding, CLS token)
beta1 = 0.9
beta2 = 0.999
grad_clip = 1.0  # clip the global gradient norm; 0 = off
# system
device = "auto"  # auto (cuda > mps > cpu; torchrun: one GPU per process) or e.g. 'cpu'
dtype = "bfloat16"  # autocast dtype on GPU: bfloat16 | float16 (with a grad scaler) | float32. CPU: float32
compile = False  # torch.compile the model (GPU: faster after a warm-up)
cpu_procs = 2  # CPU without torchrun: train data-parallel in this many single-threaded processes (1 = one
# process). On our 2-core machine 2 processes ran at 1.6x the images/s of one; 2 threads in one process at ~1.0x
cpu_threads = 1  # torch threads per process on a CPU; 0 = torch's default (one per core)
seed = 0
DEFAULTS = {k: v for k, v in globals().items() if k not in _before and k != "_before"}

# vit-cpu, this script's CPU model: vit-tiny with d 64 (1.8x faster than its 96 on a CPU, and in our tests as
# accurate after each epoch) and 7x7 patches (17 tokens instead of 50: ~3x faster than patch 4)
CPU_PRESET = ("vit-tiny", dict(n_embd=64, patch_size=7))

# -----------------------------------------------------------------------------
# data: small datasets as uint8 tensors (shared with train_dino.py and analyze.py)

FASHION_FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
                 "val": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}
DEBIAN_FASHION = "/usr/share/datasets/fashion-mnist"  # apt-get install dataset-fashion-mnist
IMAGE_DATASETS = ("fashion_mnist", "cifar10", "cifar100", "synthetic")
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def _read_idx(path):
    """An IDX file (MNIST format): big-endian magic with the number of dimensions, then the sizes."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    shape = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return torch.frombuffer(bytearray(data[4 + 4 * ndim:]), dtype=torch.uint8).reshape(shape)


def _fashion_mnist_dir(root):
    """data/fashion_mnist (also torchvision's FashionMNIST/raw layout), else the Debian package,
    else a torchvision download into data/fashion_mnist."""
    for d in (root, os.path.join(root, "FashionMNIST", "raw"), DEBIAN_FASHION):
        if all(os.path.isfile(os.path.join(d, f)) for pair in FASHION_FILES.values() for f in pair):
            return d
    try:
        from torchvision.datasets import FashionMNIST
        for train in (True, False):
            FashionMNIST(root, train=train, download=True)
    except Exception as e:
        raise UsageError(f"Fashion-MNIST is not in {root} or {DEBIAN_FASHION} and the download failed ({e}).\n"
                         f"Fix: apt-get install -y dataset-fashion-mnist, or copy the four *-ubyte.gz files "
                         f"into {root}")
    return os.path.join(root, "FashionMNIST", "raw")


def _synthetic(n_train=2048, n_val=512, num_classes=10):
    """A generated, learnable 10-class set of 1x28x28 images for tests and smoke runs (not a benchmark):
    each class is a fixed random 8x8 pattern upsampled to 32x32, each image a random 28x28 window of its
    class pattern plus noise."""
    g = torch.Generator().manual_seed(1234)
    templates = F.interpolate(torch.rand(num_classes, 1, 8, 8, generator=g), size=32, mode="bilinear")

    def make(n):
        y = torch.randint(0, num_classes, (n,), generator=g)
        i, j = torch.randint(0, 5, (2, n), generator=g).tolist()
        x = torch.stack([templates[c, :, a:a + 28, b:b + 28] for c, a, b in zip(y.tolist(), i, j)])
        x = 0.7 * x + 0.3 * torch.rand(n, 1, 28, 28, generator=g)
        return (x * 255).round().to(torch.uint8), y

    return dict(train=make(n_train), val=make(n_val), classes=[f"pattern{i}" for i in range(num_classes)])


def load_images(name, data_dir="data"):
    """A small image dataset as uint8 tensors, ready to live on the device.
    Returns dict(train=(x, y), val=(x, y), num_classes, classes, mean, std) with x (N, C, H, W) uint8,
    y (N,) int64, and the per-channel mean/std of the training images in [0, 1]."""
    if name not in IMAGE_DATASETS:
        raise UsageError(f"unknown dataset {name!r}; choose one of {IMAGE_DATASETS + ('imagefolder',)}")
    root = os.path.join(data_dir, name)
    if name == "fashion_mnist":
        d = _fashion_mnist_dir(root)
        split = {s: (_read_idx(os.path.join(d, fx))[:, None], _read_idx(os.path.join(d, fy)).long())
                 for s, (fx, fy) in FASHION_FILES.items()}
        classes = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                   "Ankle boot"]
    elif name == "synthetic":
        split = _synthetic()
        classes = split.pop("classes")
    else:
        from torchvision import datasets
        cls = datasets.CIFAR10 if name == "cifar10" else datasets.CIFAR100
        try:
            sets = {s: cls(root, train=(s == "train"), download=True) for s in ("train", "val")}
        except Exception as e:
            fetch = f"python -c \"from torchvision import datasets; datasets.{cls.__name__}('{root}', download=True)\""
            raise UsageError(f"{name} is not in {root} and the download failed ({e}).\n"
                             f"Fix: run `{fetch}` where there is internet and copy {root} here")
        split = {s: (torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous(), torch.tensor(ds.targets))
                 for s, ds in sets.items()}
        classes = sets["train"].classes
    x = split["train"][0].float().div_(255)
    mean, std = x.mean(dim=(0, 2, 3)).tolist(), x.std(dim=(0, 2, 3)).tolist()
    return dict(train=split["train"], val=split["val"], num_classes=len(classes), classes=classes, mean=mean, std=std)


def imagefolder_datasets(path, img_size, hflip=True, rand_augment=0, rand_magnitude=9, simple_crop=False):
    """ImageNet-style folders path/train/<class>/*.jpg and path/val/<class>/*.jpg as torchvision datasets
    that decode, crop and flip in DataLoader workers and return uint8 (3, img_size, img_size) tensors.
    Training crop: random resized crop (scale 0.08-1), or with simple_crop DeiT-III's simple random crop
    (resize, then a random crop with 4 pixels of reflect padding). Validation: resize to img_size/0.875,
    centre crop. The photometric part of 3-Augment, mixup and cutmix run batched on the device."""
    from torchvision import datasets
    from torchvision.transforms import v2
    for split in ("train", "val"):
        if not os.path.isdir(os.path.join(path, split)):
            raise UsageError(f"imagefolder: {os.path.join(path, split)} is not a directory. Pass --data_dir=<folder> "
                             f"holding train/ and val/, each with one sub-folder of images per class (ImageNet layout)")
    if simple_crop:
        crop = [v2.Resize(img_size, antialias=True), v2.RandomCrop(img_size, padding=4, padding_mode="reflect")]
    else:
        crop = [v2.RandomResizedCrop(img_size, scale=(0.08, 1.0), antialias=True)]
    randaug = [v2.RandAugment(rand_augment, rand_magnitude)] if rand_augment else []
    flip = [v2.RandomHorizontalFlip()] if hflip else []
    train_tf = v2.Compose(crop + flip + randaug + [v2.PILToTensor()])
    val_tf = v2.Compose([v2.Resize(int(img_size / 0.875), antialias=True), v2.CenterCrop(img_size), v2.PILToTensor()])
    return (datasets.ImageFolder(os.path.join(path, "train"), train_tf),
            datasets.ImageFolder(os.path.join(path, "val"), val_tf))

# -----------------------------------------------------------------------------
# augmentation on the device: batched, a different draw for every image, from the global RNG


def random_crop(x, pad):
    """Zero-pad by `pad` pixels, then crop back to the original size at a random offset per image."""
    B, C, H, W = x.shape
    xp = F.pad(x, (pad, pad, pad, pad))
    i = torch.randint(0, 2 * pad + 1, (B, 1), device=x.device) + torch.arange(H, device=x.device)  # (B, H) rows
    j = torch.randint(0, 2 * pad + 1, (B, 1), device=x.device) + torch.arange(W, device=x.device)  # (B, W) cols
    b = torch.arange(B, device=x.device).view(B, 1, 1, 1)
    c = torch.arange(C, device=x.device).view(1, C, 1, 1)
    return xp[b, c, i.view(B, 1, H, 1), j.view(B, 1, 1, W)]


def random_hflip(x):
    return torch.where(torch.rand(x.shape[0], 1, 1, 1, device=x.device) < 0.5, x.flip(3), x)


def random_erasing(x, p, scale=(0.02, 1 / 3), ratio=(0.3, 3.3)):
    """Random erasing (Zhong et al. 2017; DeiT's reprob, timm's mode 'pixel') on normalised images: with
    probability p an image gets one rectangle of scale * H * W pixels and a log-uniform aspect ratio, at a
    random place, filled with N(0, 1) noise. Boxes larger than the image are clamped (timm resamples)."""
    B, C, H, W = x.shape
    dev = x.device
    area = torch.empty(B, device=dev).uniform_(*scale) * H * W
    aspect = torch.empty(B, device=dev).uniform_(math.log(ratio[0]), math.log(ratio[1])).exp()
    h = (area * aspect).sqrt().round().clamp(1, H)
    w = (area / aspect).sqrt().round().clamp(1, W)
    top = (torch.rand(B, device=dev) * (H - h + 1)).floor()
    left = (torch.rand(B, device=dev) * (W - w + 1)).floor()
    rows, cols = torch.arange(H, device=dev), torch.arange(W, device=dev)
    in_rows = (rows >= top[:, None]) & (rows < (top + h)[:, None])  # (B, H)
    in_cols = (cols >= left[:, None]) & (cols < (left + w)[:, None])  # (B, W)
    erase = (torch.rand(B, device=dev) < p)[:, None, None] & in_rows[:, :, None] & in_cols[:, None, :]
    return torch.where(erase[:, None], torch.randn_like(x), x)


def grayscale(x):  # (B, C, H, W) in [0, 1] -> (B, 1, H, W)
    if x.shape[1] == 1:
        return x
    return (x * torch.tensor([0.299, 0.587, 0.114], device=x.device).view(1, 3, 1, 1)).sum(1, keepdim=True)


def gaussian_blur(x, sigma, radius=4):
    """Separable Gaussian blur with one sigma per image (B,), as grouped convolutions; radius 4 = 2 sigma_max."""
    B, C, H, W = x.shape
    d = torch.arange(-radius, radius + 1, device=x.device, dtype=x.dtype)
    k = torch.exp(-d ** 2 / (2 * sigma.view(B, 1) ** 2))
    k = (k / k.sum(1, keepdim=True)).repeat_interleave(C, 0)  # (B*C, 2r+1)
    y = F.pad(x.reshape(1, B * C, H, W), (radius, radius, 0, 0), mode="reflect")
    y = F.conv2d(y, k.view(B * C, 1, 1, -1), groups=B * C)
    y = F.pad(y, (0, 0, radius, radius), mode="reflect")
    return F.conv2d(y, k.view(B * C, 1, -1, 1), groups=B * C).view(B, C, H, W)


def three_augment(x, jitter):
    """DeiT-III's 3-Augment (photometric part) on floats in [0, 1]: per image one of grayscale,
    solarisation (invert pixels >= 128/255) or Gaussian blur (sigma in [0.1, 2]), chosen uniformly; then
    colour jitter with brightness, contrast and saturation factors in [1 - jitter, 1 + jitter] (this order)."""
    B = x.shape[0]
    choice = torch.randint(0, 3, (B, 1, 1, 1), device=x.device)
    x = torch.where(choice == 0, grayscale(x).expand_as(x), x)
    x = torch.where((choice == 1) & (x >= 128 / 255), 1 - x, x)
    x = torch.where(choice == 2, gaussian_blur(x, torch.empty(B, device=x.device).uniform_(0.1, 2.0)), x)
    if jitter:
        f = torch.empty(3, B, 1, 1, 1, device=x.device).uniform_(1 - jitter, 1 + jitter)
        x = (x * f[0]).clamp(0, 1)  # brightness
        x = (grayscale(x).mean(dim=(1, 2, 3), keepdim=True).lerp(x, f[1])).clamp(0, 1)  # contrast
        x = (grayscale(x).lerp(x, f[2])).clamp(0, 1)  # saturation
    return x


def rand_augment_groups(x, num_ops, magnitude, group=8):
    """torchvision's RandAugment on uint8 images. It draws one op sequence per call, so it is called on groups
    of `group` images: ops differ between groups and are shared inside one (1 would be per image, but slow)."""
    from torchvision.transforms import v2
    ra = v2.RandAugment(num_ops, magnitude)
    return torch.cat([ra(chunk) for chunk in x.split(group)])


def make_mixer(mixup, cutmix, num_classes):
    """torchvision.transforms.v2 MixUp / CutMix (one of them per batch, like timm) or None.
    Returns images mixed with a rolled copy of the batch and soft targets (B, num_classes) summing to 1."""
    if not (mixup or cutmix):
        return None
    from torchvision.transforms import v2
    mixers = ([v2.MixUp(alpha=mixup, num_classes=num_classes)] if mixup else []) + (
        [v2.CutMix(alpha=cutmix, num_classes=num_classes)] if cutmix else [])
    return mixers[0] if len(mixers) == 1 else v2.RandomChoice(mixers)


def to_unit(x, img_size):
    """uint8 images (B, C, H, W) -> floats in [0, 1] at img_size x img_size (resized only if needed)."""
    x = x.float().div_(255)
    if x.shape[-1] != img_size:
        x = F.interpolate(x, size=(img_size, img_size), mode="bilinear", antialias=True)
    return x


def augment(x, y, c, mixer, mean, std, geometric=True):
    """uint8 images (B, C, H, W) on the device -> normalised float images at c.img_size and targets:
    class indices (B,), or soft targets (B, K) when mixing. Randomness comes from the global RNG, which the
    training loop seeds per micro-batch. With geometric=False (imagefolder) the crop and flip were done by
    the DataLoader workers."""
    if geometric and c.crop_padding:
        x = random_crop(x, c.crop_padding)
    if geometric and c.hflip:
        x = random_hflip(x)
    if c.rand_augment and geometric:
        x = rand_augment_groups(x, c.rand_augment, c.rand_magnitude)
    x = to_unit(x, c.img_size)
    if c.three_augment:
        x = three_augment(x, c.color_jitter)
    if mixer is not None:
        x, y = mixer(x, y)
    x = (x - mean) / std
    if c.random_erasing:
        x = random_erasing(x, c.random_erasing)
    return x, y


# -----------------------------------------------------------------------------
# loss and optimizer


def compute_loss(logits, y, label_smoothing=0.0, bce=False):
    """Cross-entropy (or DeiT-III's binary cross-entropy) with label smoothing. y: class indices (B,)
    or soft targets (B, K) from mixup/cutmix."""
    logits = logits.float()
    K = logits.size(-1)
    if y.ndim == 1 and not bce:
        return F.cross_entropy(logits, y, label_smoothing=label_smoothing)
    t = F.one_hot(y, K).float() if y.ndim == 1 else y
    if bce:
        t = (t > 0).float()  # DeiT-III: each class present in a mixed image is a positive
    t = t * (1 - label_smoothing) + label_smoothing / K
    if bce:
        return F.binary_cross_entropy_with_logits(logits, t)
    return -(t * F.log_softmax(logits, dim=-1)).sum(-1).mean()


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2020, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes").
    Per tensor: u = m_hat / (sqrt(v_hat) + eps) + wd * w (Adam with decoupled weight decay), then
    w <- w - lr * (|w| / |u|) * u. The trust ratio |w| / |u| makes every layer move by about lr times its
    own norm, which is what lets DeiT-III train at batch 2048. Like timm, tensors without weight decay
    (biases, norms, embeddings) take the plain Adam step (trust ratio 1), and a zero norm means ratio 1."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            (beta1, beta2), wd = group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
                t, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(p.grad, 1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                update = (m / (1 - beta1 ** t)) / ((v / (1 - beta2 ** t)).sqrt() + group["eps"])
                if wd:
                    update.add_(p, alpha=wd)
                    w_norm, u_norm = p.norm(), update.norm()
                    trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
                    update.mul_(trust)
                p.add_(update, alpha=-group["lr"])


def make_optimizer(model, c, device):
    """AdamW or LAMB; weight decay on weight matrices only, as in DeiT (not on biases, norms, the position
    embedding or the CLS token)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 and name not in ("pos_embed", "cls_token") else no_decay).append(p)
    groups = [dict(params=decay, weight_decay=c.weight_decay), dict(params=no_decay, weight_decay=0.0)]
    if c.optimizer == "adamw":
        # the fused kernel: on a CPU 0.8 ms per vit-cpu step instead of the per-parameter loop's 4-5 ms
        return torch.optim.AdamW(groups, lr=c.lr, betas=(c.beta1, c.beta2),
                                 fused=torch.device(device).type in ("cuda", "cpu"))
    if c.optimizer == "lamb":
        return Lamb(groups, lr=c.lr, betas=(c.beta1, c.beta2))
    raise UsageError(f"unknown optimizer {c.optimizer!r}; choose adamw or lamb")

# -----------------------------------------------------------------------------
# training


def step_seed(*parts):
    """A seed from a tuple of ints, e.g. (seed, epoch) for the data order or (seed, epoch, step, chunk) for one
    micro-batch. Data order, augmentation, mixup and drop-path are then functions of the step, so a resumed
    run repeats an uninterrupted one exactly. (Python hashes tuples of ints the same in every process.)"""
    return hash(parts) & 0x7FFF_FFFF_FFFF_FFFF


def get_lr(step, c, warmup_steps, max_steps):
    """Linear warmup from 0 to c.lr over warmup_steps, then cosine decay to c.min_lr at max_steps."""
    if step < warmup_steps:
        return c.lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return c.min_lr + 0.5 * (c.lr - c.min_lr) * (1 + math.cos(math.pi * progress))


def spawns_cpu_processes(nprocs, device):
    """Should this run start nprocs CPU processes itself? When more than one is asked for, the run is not
    already one of torchrun's, and it trains on the CPU (--device=auto picks CUDA, then MPS, when present)."""
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available()
                                 and not torch.backends.mps.is_available())
    return nprocs > 1 and "RANK" not in os.environ and on_cpu


def print_param_checksum(params, rank, world):
    """Every process of a DDP run reports its weights: the ranks must agree exactly (the tests compare them)."""
    checksum = sum(p.double().sum().item() for p in params)
    print(f"rank {rank}/{world} param_checksum={checksum:.10e}", flush=True)


def read_param_checksums(text):
    """{rank: checksum string} from the lines print_param_checksum wrote (the ranks' output may interleave)."""
    return dict(re.findall(r"rank (\d+)/\d+ param_checksum=([-+0-9.]+e[-+]\d+)", text))


def launch_cpu_processes(main, argv, nprocs):
    """Data parallelism on one machine's CPU cores without torchrun: run main(argv) in `nprocs` spawned,
    single-threaded processes that form a gloo group (torchrun's variables, set here). For small models
    this beats threads: intra-op threads hardly speed up their small matrix products, processes do.
    If one process fails the others are stopped (they would wait for it forever); the exit code is its."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn = multiprocessing.get_context("spawn")
    procs = [spawn.Process(target=_cpu_process, args=(main, argv, rank, nprocs, port, os.getpid()))
             for rank in range(nprocs)]
    for p in procs:
        p.start()
    try:
        while not any(p.exitcode for p in procs) and any(p.is_alive() for p in procs):
            time.sleep(0.1)
    except KeyboardInterrupt:  # the processes got the same Ctrl-C; give them a moment to stop cleanly
        for p in procs:
            p.join(timeout=10)
    for p in procs:
        if p.is_alive():
            p.terminate()
        p.join()
    code = next((p.exitcode for p in procs if p.exitcode), 0)
    if code:
        sys.exit(code if code > 0 else 1)  # the failing process has said why


def _cpu_process(main, argv, rank, world_size, port, parent):
    def exit_with_parent():  # a killed launcher must not leave its processes training on
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(1)
    threading.Thread(target=exit_with_parent, daemon=True).start()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if rank == 0:
        return run_main(lambda: main(argv))
    try:
        main(argv)
    except (UsageError, KeyboardInterrupt):  # rank 0 meets the same mistake (or Ctrl-C) and reports it
        sys.exit(1)
    except FloatingPointError as e:
        sys.exit(f"error (process {rank}): {e}")


def resolve_config(argv=None):
    """Defaults <- config files and --key=value options. With --resume, the checkpoint's config is the base
    and the command line goes on top. Returns (config dict, checkpoint or None)."""
    config = parse_args(DEFAULTS, argv)
    ckpt = None
    if config["resume"]:
        path = os.path.join(config["out_dir"], "ckpt.pt")
        if not os.path.isfile(path):
            raise UsageError(f"--resume: no checkpoint at {path}; check --out_dir, or start without --resume")
        ckpt = load_checkpoint(path)
        base = {**DEFAULTS, **{k: v for k, v in ckpt["config"].items() if k in DEFAULTS},
                "resume": True, "out_dir": config["out_dir"]}
        config = parse_args(base, argv)
    return config, ckpt


def print_help():
    """--help: the docstring and the commented defaults block of this file, as written."""
    source = open(os.path.abspath(__file__)).read()
    start = source.index("_before = set(globals())") + len("_before = set(globals())")
    print(__doc__.strip() + "\n\noptions and their defaults:" + source[start:source.index("DEFAULTS = {")].rstrip())


def main(argv=None):
    t_start = time.time()
    if {"-h", "--help"} & set(sys.argv[1:] if argv is None else argv):
        return print_help()
    config, ckpt = resolve_config(argv)
    c = SimpleNamespace(**config)
    for key in ("epochs", "batch_size", "grad_accum", "cpu_procs"):
        if getattr(c, key) < 1:
            raise UsageError(f"--{key}={getattr(c, key)}: must be at least 1")
    if c.dtype not in ("bfloat16", "float16", "float32"):
        raise UsageError(f"--dtype={c.dtype!r}: choose bfloat16, float16 or float32")
    if not 0 <= c.random_erasing <= 1:
        raise UsageError(f"--random_erasing={c.random_erasing}: a probability, between 0 and 1")

    # ---- processes and device ----
    if spawns_cpu_processes(c.cpu_procs, c.device):
        return launch_cpu_processes(main, sys.argv[1:] if argv is None else argv, c.cpu_procs)
    rank, local_rank, world, device = setup_distributed()
    if c.device != "auto":
        if world > 1:
            raise UsageError("--device: leave it at 'auto' under torchrun (one GPU per process, else CPU)")
        device = c.device
    master = rank == 0
    device_type = "cuda" if str(device).startswith("cuda") else str(device)
    if device_type == "cpu" and c.cpu_threads:
        torch.set_num_threads(c.cpu_threads)
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    amp_dtype = getattr(torch, c.dtype) if device_type == "cuda" else torch.float32
    autocast = torch.autocast("cuda", dtype=amp_dtype) if amp_dtype != torch.float32 else nullcontext()
    log = print if master else (lambda *a, **k: None)

    # ---- data ----
    if c.dataset == "imagefolder":
        c.img_size = c.img_size or 224
        train_set, val_set = imagefolder_datasets(c.data_dir, c.img_size, c.hflip, c.rand_augment, c.rand_magnitude,
                                                  simple_crop=c.three_augment)
        # --train_subset/--val_subset: a fixed random subset (the folders are sorted by class)
        subset = lambda ds, n: torch.randperm(len(ds), generator=torch.Generator().manual_seed(0))[:n or len(ds)]
        train_index, val_index = subset(train_set, c.train_subset), subset(val_set, c.val_subset)
        n_train, n_val = len(train_index), len(val_index)
        classes, in_chans, mean, std = train_set.classes, 3, IMAGENET_MEAN, IMAGENET_STD
    else:
        data = load_images(c.dataset, c.data_dir)
        (train_x, train_y), (val_x, val_y) = data["train"], data["val"]
        if c.train_subset:
            train_x, train_y = train_x[:c.train_subset], train_y[:c.train_subset]
        if c.val_subset:
            val_x, val_y = val_x[:c.val_subset], val_y[:c.val_subset]
        # the whole dataset lives on the device as uint8; batches are gathered and augmented there
        train_x, train_y, val_x, val_y = (t.to(device) for t in (train_x, train_y, val_x, val_y))
        n_train, n_val = len(train_x), len(val_x)
        c.img_size = c.img_size or train_x.shape[-1]
        classes, in_chans, mean, std = data["classes"], train_x.shape[1], data["mean"], data["std"]
    num_classes = len(classes)
    mean = torch.tensor(mean, device=device).view(1, -1, 1, 1)
    std = torch.tensor(std, device=device).view(1, -1, 1, 1)
    global_batch = c.batch_size * c.grad_accum * world
    steps_per_epoch = n_train // global_batch
    if steps_per_epoch == 0:
        raise UsageError(f"the global batch ({global_batch} = batch_size * grad_accum * processes) is larger than "
                         f"the {n_train} training images; lower --batch_size")
    max_steps = c.epochs * steps_per_epoch
    warmup_steps = round(c.warmup_epochs * steps_per_epoch)

    def train_batches(epoch, first_step):
        """Micro-batches (uint8 images, labels) of this process from step first_step of the epoch on. The epoch's
        order is one seeded permutation; global batch s is cut into grad_accum * world chunks of batch_size,
        and chunk micro * world + rank belongs to this process's micro-step `micro`."""
        perm = torch.randperm(n_train, generator=torch.Generator().manual_seed(step_seed(c.seed, epoch)))
        chunks = [perm[s * global_batch + (m * world + rank) * c.batch_size:][:c.batch_size]
                  for s in range(first_step, steps_per_epoch) for m in range(c.grad_accum)]
        if c.dataset != "imagefolder":
            for idx in chunks:
                idx = idx.to(device)
                yield train_x[idx], train_y[idx]
        else:
            worker_seed = torch.Generator().manual_seed(step_seed(c.seed, epoch, first_step, rank))
            loader = torch.utils.data.DataLoader(train_set, batch_size=c.batch_size, generator=worker_seed,
                                                 sampler=train_index[torch.cat(chunks)].tolist(),
                                                 num_workers=c.num_workers, pin_memory=device_type == "cuda")
            for x, y in loader:
                yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    def val_batches(batch_size):
        """This process's contiguous shard of the validation set, unaugmented."""
        lo, hi = rank * n_val // world, (rank + 1) * n_val // world
        if c.dataset != "imagefolder":
            for i in range(lo, hi, batch_size):
                yield val_x[i:min(i + batch_size, hi)], val_y[i:min(i + batch_size, hi)]
        else:
            loader = torch.utils.data.DataLoader(val_set, batch_size=batch_size, sampler=val_index[lo:hi].tolist(),
                                                 num_workers=c.num_workers, pin_memory=device_type == "cuda")
            for x, y in loader:
                yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    # ---- model ----
    overrides = dict(n_lap=c.n_lap, n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd, patch_size=c.patch_size,
                     mlp_ratio=c.mlp_ratio, pooling=c.pooling, drop_path=c.drop_path, layerscale=c.layerscale,
                     qk_norm=c.qk_norm, img_size=c.img_size, in_chans=in_chans, num_classes=num_classes)
    vit_presets = ["vit-cpu"] + [name for name, p in PRESETS.items() if p["model"] == "vit"]
    if c.preset not in vit_presets:
        raise UsageError(f"--preset={c.preset!r}: choose one of {vit_presets}")
    base, extra = CPU_PRESET if c.preset == "vit-cpu" else (c.preset, {})
    model_config = make_config(base, **{**extra, **{k: v for k, v in overrides.items() if v is not None}})
    torch.manual_seed(c.seed)  # the same initial weights in every process
    raw_model = build_model(model_config).to(device)
    optimizer = make_optimizer(raw_model, c, device)
    scaler = torch.amp.GradScaler(device_type, enabled=amp_dtype == torch.float16)
    step, best_acc = 0, 0.0
    if ckpt is not None:
        if ckpt.get("kind") != "vit" or ckpt["model_config"] != asdict(model_config):
            raise UsageError(f"--resume: {c.out_dir}/ckpt.pt holds a different model; do not change model options "
                             f"on resume, or use a new --out_dir")
        raw_model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        step, best_acc = ckpt["step"], ckpt["best_val_acc"]
        set_rng_state(ckpt["rng"])
        if ckpt["steps_per_epoch"] != steps_per_epoch:
            raise UsageError(f"--resume: the checkpoint has {ckpt['steps_per_epoch']} steps per epoch, this run "
                             f"{steps_per_epoch}; keep the global batch and the dataset the same")
    model = torch.compile(raw_model) if c.compile else raw_model
    train_model = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP
        train_model = DDP(model, device_ids=[local_rank] if device_type == "cuda" else None)
    mixer = make_mixer(c.mixup, c.cutmix, num_classes)
    tokens = model_config.img_size ** 2 // model_config.patch_size ** 2 + 1
    flops_per_img = raw_model.flops_per_token(tokens) * tokens
    peak = peak_flops(device)

    log(f"config: {json.dumps(config)}")
    log(f"data: {c.dataset} {n_train} train / {n_val} val images, {in_chans}x{c.img_size}x{c.img_size}, "
        f"{num_classes} classes, on {device}, {world} process{'es' if world > 1 else ''}")
    log(f"model: {c.preset} {model_config.n_layer} layers, d {model_config.n_embd}, {model_config.n_head} heads, "
        f"patch {model_config.patch_size} ({tokens} tokens), Laplacian heads per layer {model_config.lap_schedule()}, "
        f"{raw_model.num_params():,} params")
    log(f"schedule: global batch {global_batch} = {c.batch_size} x {c.grad_accum} accum x {world} process(es), "
        f"{steps_per_epoch} steps/epoch, {c.epochs} epochs = {max_steps} steps, warmup {warmup_steps}, "
        f"{c.optimizer} lr {c.lr:g}" + (f"; resuming at step {step}" if ckpt else ""))

    @torch.no_grad()
    def evaluate():
        model.eval()
        sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
        for x, y in val_batches(4 * c.batch_size):
            with autocast:
                logits = model((to_unit(x, c.img_size) - mean) / std).float()
            sums += torch.stack([F.cross_entropy(logits, y, reduction="sum"), (logits.argmax(-1) == y).sum(),
                                 torch.tensor(len(y), device=device)]).double()
        model.train()
        sums = all_reduce_mean(sums, device) * world
        return (sums[1] / sums[2]).item(), (sums[0] / sums[2]).item()

    def save(step):
        if master:
            save_checkpoint(dict(kind="vit", model_config=asdict(model_config), model=raw_model.state_dict(),
                                 config=config, optimizer=optimizer.state_dict(), scaler=scaler.state_dict(),
                                 step=step, epoch=step // steps_per_epoch, steps_per_epoch=steps_per_epoch,
                                 best_val_acc=best_acc, val_acc=val_acc, val_loss=val_loss, rng=rng_state(),
                                 classes=list(classes), mean=mean.flatten().tolist(), std=std.flatten().tolist()),
                            os.path.join(c.out_dir, "ckpt.pt"))

    # ---- training loop ----
    if master:
        os.makedirs(c.out_dir, exist_ok=True)
    if step >= max_steps:
        log(f"nothing to train: the checkpoint is at step {step} of {max_steps} (raise --epochs to continue)")
    raw_model.train()
    batches, result = None, None
    t_log, data_time, loss_sum, img_count, steps_in_log = time.time(), 0.0, 0.0, 0, 0
    speeds, waits, data_events = [], [], []
    val_acc, val_loss = (ckpt["val_acc"], ckpt["val_loss"]) if ckpt else (float("nan"), float("nan"))
    while step < max_steps:
        epoch, step_in_epoch = divmod(step, steps_per_epoch)
        if batches is None:
            batches = train_batches(epoch, step_in_epoch)
        lr = get_lr(step, c, warmup_steps, max_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_accum = torch.zeros((), device=device)
        for micro in range(c.grad_accum):
            torch.manual_seed(step_seed(c.seed, epoch, step, micro * world + rank))
            # data time: on CPU the wall time of loading + augmenting; on GPU the time blocked on the
            # DataLoader plus the GPU time of the gather/augmentation kernels (CUDA events, no extra sync)
            t0 = time.time()
            if device_type == "cuda":
                data_events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
                data_events[-1][0].record()
            x, y = next(batches)
            t_wait = time.time() - t0
            x, y = augment(x, y, c, mixer, mean, std, geometric=c.dataset != "imagefolder")
            if device_type == "cuda":
                data_events[-1][1].record()
                data_time += t_wait
            else:
                data_time += time.time() - t0
            sync = micro == c.grad_accum - 1
            with (train_model.no_sync() if world > 1 and not sync else nullcontext()):
                with autocast:
                    logits = train_model(x)
                loss = compute_loss(logits, y, c.label_smoothing, c.bce_loss) / c.grad_accum
                scaler.scale(loss).backward()
            loss_accum += loss.detach()
        loss_value = all_reduce_mean(loss_accum, device)  # every process sees the same value and stops together
        check_finite(loss_value, step)
        if c.grad_clip:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(raw_model.parameters(), c.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        loss_sum, img_count, steps_in_log = loss_sum + loss_value, img_count + global_batch, steps_in_log + 1

        if step % c.log_interval == 0 or step == max_steps:
            dt = time.time() - t_log  # the loss .item() above has synchronised the GPU
            data_time += sum(a.elapsed_time(b) for a, b in data_events) / 1000
            data_events.clear()
            speed, wait = img_count / dt, data_time / dt
            speeds.append(speed)
            waits.append(wait)
            eta = (max_steps - step) * dt / steps_in_log
            mfu = f" | mfu {flops_per_img * speed / (peak * world):.1%}" if peak else ""
            log(f"epoch {epoch + 1}/{c.epochs} step {step}/{max_steps} | loss {loss_sum / steps_in_log:.4f} | "
                f"lr {lr:.2e} | {speed:.0f} img/s | data {wait:.1%}{mfu} | eta {format_time(eta)}")
            t_log, data_time, loss_sum, img_count, steps_in_log = time.time(), 0.0, 0.0, 0, 0
        epoch_end = step % steps_per_epoch == 0
        if epoch_end:
            batches = None
            t0 = time.time()
            val_acc, val_loss = evaluate()
            best_acc = max(best_acc, val_acc)
            log(f"eval epoch {step // steps_per_epoch}: val_acc {val_acc:.4f} val_loss {val_loss:.4f} "
                f"({time.time() - t0:.1f}s, {format_time(time.time() - t_start)} elapsed)")
            if master:
                append_jsonl(os.path.join(c.out_dir, "log.jsonl"), dict(
                    step=step, epoch=step // steps_per_epoch, val_acc=val_acc, val_loss=val_loss, lr=lr,
                    train_loss=loss_value, seconds=round(time.time() - t_start, 1)))
            t_log += time.time() - t0  # evaluation time is not training time
        if epoch_end or (c.ckpt_interval and step % c.ckpt_interval == 0) or step == c.stop_at_step:
            save(step)
        if step == c.stop_at_step and step < max_steps:
            log(f"stopped at step {step} (--stop_at_step); continue with --resume --out_dir={c.out_dir}")
            break
    else:
        seconds = time.time() - t_start
        n_lap_text = json.dumps(c.n_lap, separators=(",", ":"))
        result = (f"RESULT val_acc={val_acc:.4f} val_loss={val_loss:.4f} params={raw_model.num_params()} "
                  f"n_lap={n_lap_text} seconds={seconds:.1f} img_per_s={sum(speeds) / max(len(speeds), 1):.0f} "
                  f"data_wait={sum(waits) / max(len(waits), 1):.3f} dataset={c.dataset} epochs={c.epochs} "
                  f"seed={c.seed}")
    if world > 1:
        print_param_checksum(raw_model.parameters(), rank, world)
    if result:
        log(result)
    teardown_distributed()


if __name__ == "__main__":
    run_main(main)
