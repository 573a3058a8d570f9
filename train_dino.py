"""
DINO: self-supervised ViTs with Laplacian heads, from a laptop CPU to many GPUs.

    python train_dino.py                                   # CPU default: Fashion-MNIST, 0.2M-parameter ViT
    python train_dino.py --n_lap=0                         # the attention-only baseline
    python train_dino.py --eval_only=out-dino/ckpt.pt      # k-NN, linear and segmentation probes of a checkpoint
    torchrun --standalone --nproc_per_node=8 train_dino.py config/dino_vits16_imagenet.py --data_dir=/imagenet

DINO (Caron et al. 2021, facebookresearch/dino) in five lines: a student ViT sees 2 global and several
small local crops of each image; a teacher ViT, an exponential moving average of the student, sees only
the 2 global crops; the student learns to predict the teacher's softmax over out_dim prototypes
(cross-entropy between every teacher view and every other student view). Centring the teacher's
outputs (a running mean is subtracted) and sharpening them (a low temperature) pull in opposite
directions, and together they keep the networks from collapsing to a constant.

Evaluation, always on the frozen teacher backbone:
  k-NN          L2-normalised CLS features, cosine similarity, k = 20 neighbours voting with weight
                exp(sim / 0.07) (DINO's eval_knn.py); at step 0 and every eval_interval steps. The bank
                and the test images are fixed random subsets (eval_train, eval_val) of the train and val splits.
  linear        a linear classifier on frozen features (CLS of the last linear_blocks blocks), at the end.
  segmentation  a linear classifier on frozen patch tokens, trained on each patch's majority pixel
                label; its logits are upsampled to pixels and scored by mIoU. Data: generated scenes
                (data/scenes/prepare.py, offline) or Oxford-IIIT Pet masks (--seg_dataset=pets, online).
Raw pixels (normalised as the network sees them) go through the same three probes (knn_acc_pixels, ...).

Where this differs from facebookresearch/dino, and why:
  - Multi-crop runs batched on the training device, each image with its own random parameters drawn
    from a torch.Generator seeded by (seed, step): torchvision.transforms.v2 called per image cost
    ~100 ms per image for 8 crops on a busy 2-core CPU, more than the model, and a seeded generator makes
    resume exact. The kernels follow torchvision.transforms.v2.functional (tests/test_dino.py checks
    them against it). Crop boxes are continuous (clamped, not rejection-sampled); imagefolder images are
    first resized to a square with transforms.v2 in the loader workers, so crops come from that square.
  - Schedules (lr, weight decay, teacher momentum and temperature) are functions of the step, and
    epochs may be fractional, so short CPU runs get meaningful warm-ups.
  - The linear probe trains on cached features without augmentation (DINO: 100 epochs with crops).
  - The CPU default departs from DINO's ViT-S values where short runs on 28 px images did better (each
    is commented below); config/dino_vits16_imagenet.py keeps DINO's.
  - Runs with plain `python` on one CPU or GPU; torchrun gives DDP (no SyncBatchNorm: the ViT has none), and so
    does --cpu_procs=N on a CPU without torchrun (N single-threaded processes, train_vit.py's launcher).
"""

import importlib.util
import math
import os
import sys
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from nanolap import (DINOHead, UsageError, ViT, all_reduce_mean, check_finite, format_time, load_checkpoint,
                     make_config, parse_args, rng_state, run_main, save_checkpoint, set_rng_state,
                     setup_distributed, teardown_distributed, append_jsonl, clean_state_dict, Config, PRESETS)
from train_vit import launch_cpu_processes, load_images, print_param_checksum, spawns_cpu_processes

# -----------------------------------------------------------------------------
# default config: the CPU default (Fashion-MNIST, 2 cores); config/dino_vits16_imagenet.py is the paper's ViT-S/16.
# Override with --key=value or a config file of `key = value` lines. Lengths are in epochs (fractions allowed).

DEFAULTS = dict(
    # I/O
    out_dir="out-dino",
    eval_interval=500,  # steps between k-NN evaluations and checkpoints
    log_interval=50,  # steps between progress lines
    eval_only="",  # path to a checkpoint: run the probes on its backbone, print RESULT, exit
    resume=False,  # continue out_dir/ckpt.pt exactly where it stopped
    max_steps=-1,  # stop after this step as if interrupted (the schedules still span `epochs`); -1 = run to the end
    seed=0,
    # data
    dataset="fashion_mnist",  # fashion_mnist | cifar10 | cifar100 | scenes | imagefolder (data_dir/train, data_dir/val)
    data_dir="data",
    train_limit=0,  # train on N images of the train split (a fixed random subset); 0 = all
    num_workers=8,  # imagefolder: decoding processes
    imagefolder_base=256,  # imagefolder: images are resized to this square before cropping
    # model: a nanolap preset plus overrides (None = the preset's value)
    model="vit-tiny",  # 4 layers, 4 heads, 1 channel
    n_layer=None,
    n_head=None,
    n_embd=64,
    patch_size=7,  # 28 px -> 4 x 4 patches: 3x fewer tokens than patch 4, and faster k-NN gains per CPU-second
    n_lap=2,  # Laplacian heads per layer (int or per-layer list); 0 = standard attention
    drop_path=0.0,  # stochastic depth of the student (DINO ViT-S: 0.1; it slowed this 0.2M-parameter model)
    # DINO head and loss
    out_dim=4096,  # prototypes (DINO: 65536 on ImageNet)
    head_hidden=256,  # DINO: 2048
    head_bottleneck=64,  # DINO: 256
    norm_last_layer=True,  # fix the norm of each prototype of the weight-normalised last layer at 1 (DINO default)
    student_temp=0.1,
    warmup_teacher_temp=0.01,  # teacher temperature at step 0 (DINO: 0.04); lower it if the loss does not decrease
    teacher_temp=0.025,  # after warmup_teacher_temp_epochs (DINO ViT-S: 0.07; 0.04 here lost 0.6 points of k-NN)
    warmup_teacher_temp_epochs=0.3,
    center_momentum=0.9,
    momentum_teacher=0.99,  # EMA momentum at step 0, cosine to 1 (DINO: 0.996 for long runs with batch 1024)
    # multi-crop augmentation (for 1-channel images, saturation, hue and grayscale are skipped)
    global_size=28,  # side of the 2 global crops (the backbone's img_size)
    global_scale=[0.25, 1.0],  # crop area range, as a fraction of the image (DINO: [0.4, 1.0] with local crops)
    # number of local crops; 0 disables multi-crop (then widen global_scale). DINO: 8 of 96 px at 224 px.
    # At 28 px a local crop of 14 px is 4 patches: in equal CPU time, 4 of them cost 1.6 points of k-NN
    local_crops=0,
    local_size=14,
    local_scale=[0.1, 0.4],  # DINO: [0.05, 0.4]; at 28 px a 5% crop is a 6 x 6 blob
    jitter=[0.4, 0.4, 0.2, 0.1],  # colour jitter strengths: brightness, contrast, saturation, hue
    jitter_p=0.8,
    grayscale_p=0.2,
    blur_sigma=[0.1, 0.5],  # Gaussian blur sigma range in pixels (DINO: 0.1-2 at 224 px)
    solarize_p=0.2,  # on the second global crop
    # optimisation
    epochs=6.0,  # 13 minutes on our 2 cores
    batch_size=64,  # images per step, summed over processes
    lr=0.002,  # peak learning rate for batch 256, scaled linearly with batch_size (DINO ViT-S: 0.0005)
    min_lr=1e-6,
    warmup_epochs=0.05,
    weight_decay=0.04,  # cosine schedule from weight_decay to weight_decay_end (DINO)
    weight_decay_end=0.4,
    clip_grad=3.0,  # clip each parameter's gradient norm to this (DINO); 0 = off
    freeze_last_layer=0.0,  # epochs in which the head's last layer gets no update (DINO: 1; in 1-epoch tests it cost k-NN)
    dtype="float32",  # float32 | bfloat16 | float16 (autocast; float16 uses a GradScaler)
    compile=False,  # torch.compile the backbones
    cpu_procs=2,  # CPU without torchrun: train data-parallel in this many single-threaded processes, which share
    # batch_size (train_vit.py's launcher); 1 = in this process. On our 2 cores: 390 img/s, one process 350
    # evaluation
    eval_train=10000,  # labelled train images for the k-NN bank and the linear probe; 0 = all
    eval_val=5000,  # val images for k-NN and linear accuracy; 0 = all
    knn_k=20,
    knn_temp=0.07,
    linear_blocks=4,  # the linear probe reads the CLS tokens of the last n blocks (DINO ViT-S: 4)
    probe_steps=2000,  # AdamW steps of the linear probes (on cached, standardised features)
    seg_dataset="scenes",  # scenes (offline) | pets (Oxford-IIIT Pet, downloads) | none
    seg_size=56,  # segmentation images are resized to seg_size x seg_size (a multiple of patch_size)
    seg_train=1000,  # segmentation probe train / val images
    seg_val=500,
    collapse_std=0.01,  # warn when the teacher's output std across the batch falls below this
)
# keys that may differ between a run and its resumption
RESUME_FREE = ("out_dir", "eval_interval", "log_interval", "resume", "max_steps", "num_workers", "compile",
               "eval_only", "cpu_procs")  # a resume is exact with the same number of processes
DATASETS = ("fashion_mnist", "cifar10", "cifar100", "scenes", "imagefolder")

# -----------------------------------------------------------------------------
# data: every dataset yields uint8 images (N, C, H, W) and int64 labels; crops are made on the device


def _scenes_module():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "scenes", "prepare.py")
    spec = importlib.util.spec_from_file_location("scenes_prepare", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_scenes(data_dir, split):
    """data_dir/scenes/{split}.pt, generated (and written) by data/scenes/prepare.py when missing."""
    path = os.path.join(data_dir, "scenes", f"{split}.pt")
    if not os.path.isfile(path):
        print(f"{path} is missing: generating the scenes (python data/scenes/prepare.py does the same)")
        return _scenes_module().build(data_dir)[split]
    return torch.load(path, weights_only=True)


def _imagefolder(data_dir, split, base):
    from torchvision import datasets
    from torchvision.transforms import v2
    root = os.path.join(data_dir, split)
    if not os.path.isdir(root):
        raise UsageError(f"--dataset=imagefolder expects class folders in {root} (data_dir/train and data_dir/val, "
                         f"ImageNet layout); set --data_dir")
    resize = v2.Compose([v2.ToImage(), v2.RGB(), v2.Resize(base, antialias=True), v2.CenterCrop(base)])
    return datasets.ImageFolder(root, transform=resize)


def eval_indices(n, limit):
    """A fixed random subset of n items (the same for every run and seed); limit 0 = all, in a fixed order."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1234))
    return perm[:limit] if 0 < limit < n else perm


def load_dataset(config):
    """dict(train=(x, y), val=(x, y), num_classes, mean, std) for the in-memory datasets; imagefolder: the
    ImageFolder objects (decoded lazily) in place of tensors."""
    name, data_dir = config["dataset"], config["data_dir"]
    if name not in DATASETS:
        raise UsageError(f"unknown dataset {name!r}; choose one of {DATASETS}")
    if name in ("fashion_mnist", "cifar10", "cifar100"):
        return load_images(name, data_dir)
    if name == "scenes":
        split = {s: load_scenes(data_dir, s) for s in ("train", "val")}
        x = split["train"]["images"].float().div_(255)
        return dict(train=(split["train"]["images"], split["train"]["labels"]),
                    val=(split["val"]["images"], split["val"]["labels"]), num_classes=len(split["train"]["classes"]) - 1,
                    mean=x.mean(dim=(0, 2, 3)).tolist(), std=x.std(dim=(0, 2, 3)).tolist())
    train, val = (_imagefolder(data_dir, s, config["imagefolder_base"]) for s in ("train", "val"))
    # ImageNet statistics: computing them would mean decoding the whole folder
    return dict(train=train, val=val, num_classes=len(train.classes), mean=[0.485, 0.456, 0.406],
                std=[0.229, 0.224, 0.225])


def _decode(folder, indices, size, num_workers):
    """Decode folder[indices] into uint8 (N, 3, size, size) with a DataLoader (imagefolder evaluation)."""
    from torchvision.transforms import v2
    subset = torch.utils.data.Subset(folder, indices.tolist())
    loader = torch.utils.data.DataLoader(subset, batch_size=256, num_workers=num_workers)
    xs, ys = [], []
    for x, y in loader:
        xs.append(v2.functional.resize(x, [size, size], antialias=True))
        ys.append(y)
    return torch.cat(xs), torch.cat(ys)


def load_eval_images(config, split="val", data=None):
    """The run's evaluation images: (x uint8 (N, C, H, W), y int64 (N,)), the fixed subset of `split` that
    the k-NN and linear probes use (eval_val / eval_train images), at the backbone's resolution
    (global_size). No side effects besides reading (or, for scenes, generating) the dataset.
    analyze.py imports this with a checkpoint's ckpt["config"]."""
    config = {**DEFAULTS, **config}
    data = load_dataset(config) if data is None else data
    limit = config["eval_val"] if split == "val" else config["eval_train"]
    if config["dataset"] == "imagefolder":
        idx = eval_indices(len(data[split]), limit or 10000)  # a whole ImageNet does not fit in memory
        return _decode(data[split], idx, config["global_size"], config["num_workers"])
    x, y = data[split]
    idx = eval_indices(len(x), limit)
    x, size = x[idx], config["global_size"]
    if x.shape[-1] != size:  # e.g. 64 px scenes for a 28 px backbone: evaluate at the training resolution
        from torchvision.transforms import v2
        x = v2.functional.resize(x, [size, size], antialias=True)
    return x, y[idx]


def load_segmentation(config, split, in_chans):
    """(images uint8 (N, in_chans, S, S), masks int64 (N, S, S) with 255 = ignore, class names)."""
    from torchvision.transforms import v2
    name, size = config["seg_dataset"], config["seg_size"]
    n = config["seg_train"] if split == "train" else config["seg_val"]
    if name == "scenes":
        s = load_scenes(config["data_dir"], split)
        x, m, classes = s["images"][:n], s["masks"][:n].long(), s["classes"]
    elif name == "pets":
        from torchvision.datasets import OxfordIIITPet
        root = os.path.join(config["data_dir"], "oxford_pets")
        try:
            ds = OxfordIIITPet(root, split="trainval" if split == "train" else "test",
                               target_types=["segmentation", "binary-category"], download=True)
        except Exception as e:
            raise UsageError(f"Oxford-IIIT Pet is not in {root} and the download failed ({e}); "
                             f"use --seg_dataset=scenes offline")
        xs, ms = [], []
        for i in eval_indices(len(ds), n).tolist():
            img, (trimap, species) = ds[i]
            xs.append(v2.functional.resize(v2.functional.pil_to_tensor(img), [size, size], antialias=True))
            t = v2.functional.resize(v2.functional.pil_to_tensor(trimap), [size, size],
                                     interpolation=v2.InterpolationMode.NEAREST)[0].long()
            # trimap: 1 = pet, 2 = background, 3 = border (ignored)
            ms.append(torch.where(t == 1, 1 + species, torch.where(t == 2, 0, 255)))
        x, m, classes = torch.stack(xs), torch.stack(ms), ["background", "cat", "dog"]
    else:
        raise UsageError(f"unknown seg_dataset {name!r}; choose scenes, pets or none")
    if x.shape[-1] != size:
        x = v2.functional.resize(x, [size, size], antialias=True)
        m = F.interpolate(m[:, None].float(), size=(size, size), mode="nearest")[:, 0].long()
    if x.shape[1] != in_chans:  # grey scenes for an RGB backbone, RGB pets for a grey one
        x = x.expand(-1, 3, -1, -1) if in_chans == 3 else v2.functional.rgb_to_grayscale(x)
    return x.contiguous(), m, classes


def batch_indices(n, batch_size, step, seed, rank=0, world_size=1):
    """Image indices of this process's share of `step`: epoch e visits a permutation seeded by (seed, e),
    so any step can be recomputed after a resume."""
    steps_per_epoch = n // batch_size
    epoch, i = divmod(step, steps_per_epoch)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
    per_rank = batch_size // world_size
    start = i * batch_size + rank * per_rank
    return perm[start:start + per_rank]

# -----------------------------------------------------------------------------
# multi-crop augmentation, batched: every image gets its own crop, flip, jitter, grayscale, blur, solarisation


def _rgb_to_gray(x):  # (B, 3, H, W) -> (B, 1, H, W), ITU-R 601 weights as torchvision
    return (0.2989 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]).unsqueeze(1)


def adjust_hue(x, shift):
    """Rotate the hue of RGB images x (B, 3, H, W) in [0, 1] by shift (B,) turns, through HSV."""
    r, g, b = x.unbind(1)
    maxc, minc = x.amax(1), x.amin(1)
    chroma = maxc - minc
    gray = chroma == 0
    sat = chroma / torch.where(gray, torch.ones_like(maxc), maxc)
    c = torch.where(gray, torch.ones_like(chroma), chroma)
    rc, gc, bc = (maxc - r) / c, (maxc - g) / c, (maxc - b) / c
    hue = torch.where(maxc == r, bc - gc, torch.where(maxc == g, 2.0 + rc - bc, 4.0 + gc - rc))
    hue = torch.where(gray, torch.zeros_like(hue), hue)
    hue = (hue / 6.0 + 1.0 + shift.view(-1, 1, 1)) % 1.0
    # back to RGB: channel n takes v - v*s*clamp(min(k, 4 - k), 0, 1) with k = (n + 6h) mod 6, n = 5, 3, 1
    k = (torch.tensor([5.0, 3.0, 1.0], device=x.device).view(1, 3, 1, 1) + 6 * hue.unsqueeze(1)) % 6
    return maxc.unsqueeze(1) * (1 - sat.unsqueeze(1) * torch.minimum(k, 4 - k).clamp(0, 1))


def gaussian_blur(x, sigma):
    """Blur each image of x (B, C, H, W) with its own sigma (B,) (0 = untouched): a separable kernel of
    2 * ceil(3 * max sigma) + 1 taps (capped by the image size) with reflect padding, as torchvision."""
    B, C, H, W = x.shape
    radius = min(math.ceil(3 * float(sigma.max())), H - 1, W - 1)
    if radius < 1:
        return x
    t = torch.arange(-radius, radius + 1, device=x.device, dtype=x.dtype)
    kernel = torch.exp(-0.5 * (t / sigma.clamp_min(1e-6).view(-1, 1)) ** 2)  # (B, K)
    kernel = kernel / kernel.sum(dim=1, keepdim=True)
    kernel = kernel.repeat_interleave(C, dim=0)  # (B*C, K): one kernel per image and channel
    y = F.pad(x.reshape(1, B * C, H, W), (radius, radius, radius, radius), mode="reflect")
    y = F.conv2d(y, kernel.view(B * C, 1, -1, 1), groups=B * C)
    y = F.conv2d(y, kernel.view(B * C, 1, 1, -1), groups=B * C)
    return y.view(B, C, H, W)


def resized_crop(x, x0, y0, w, h, size, flip=None):
    """Crop box (x0, y0, w, h) (pixels, (B,) each, may be fractional) of every image, resized bilinearly to
    size x size and mirrored where flip (B,) is True: one affine grid_sample for the whole batch."""
    B, C, H, W = x.shape
    mirror = 1.0 if flip is None else torch.where(flip, -1.0, 1.0)
    theta = torch.zeros(B, 2, 3, device=x.device)  # output [-1, 1]^2 -> the box in input coordinates
    theta[:, 0, 0], theta[:, 0, 2] = mirror * w / W, (2 * x0 + w) / W - 1
    theta[:, 1, 1], theta[:, 1, 2] = h / H, (2 * y0 + h) / H - 1
    grid = F.affine_grid(theta, [B, C, size, size], align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


class MultiCrop:
    """DINO's augmentation for a batch of uint8 images -> [global crops (2B, C, G, G), local crops (nB, C, L, L)],
    normalised. Global crop 1: blur always; global crop 2: blur p=0.1, solarise p=solarize_p; local crops:
    blur p=0.5 (facebookresearch/dino). Crops of one image are B apart: global crop 2 of image i is row B + i."""

    def __init__(self, config, channels, mean, std):
        self.c, self.rgb = config, channels == 3
        self.mean = torch.tensor(mean).view(1, -1, 1, 1)
        self.std = torch.tensor(std).view(1, -1, 1, 1)

    def __call__(self, images, generator):
        x = images.float() / 255  # (B, C, H, W)
        c, B = self.c, x.shape[0]
        views = [self.view(x, c["global_size"], c["global_scale"], 1.0, 0.0, generator),
                 self.view(x, c["global_size"], c["global_scale"], 0.1, c["solarize_p"], generator)]
        crops = [torch.cat(views)]
        if c["local_crops"]:
            xl = x.repeat(c["local_crops"], 1, 1, 1)  # (nB, C, H, W): local crop j of image i is row j*B + i
            crops.append(self.view(xl, c["local_size"], c["local_scale"], 0.5, 0.0, generator))
        mean, std = self.mean.to(x.device), self.std.to(x.device)
        return [(v - mean) / std for v in crops]

    def view(self, x, size, scale, blur_p, solarize_p, g):
        """One random view of every image: crop + resize + flip, colour jitter, grayscale, blur, solarise."""
        B, C, H, W = x.shape
        rand = lambda *shape: torch.rand(*shape, generator=g).to(x.device)
        # RandomResizedCrop: area fraction in `scale`, aspect ratio log-uniform in [3/4, 4/3], then
        # a bilinear resize (and the horizontal flip) in one grid_sample
        area = H * W * (scale[0] + (scale[1] - scale[0]) * rand(B))
        ratio = torch.exp(math.log(3 / 4) + math.log(16 / 9) * rand(B))
        w = torch.sqrt(area * ratio).clamp(max=W)
        h = torch.sqrt(area / ratio).clamp(max=H)
        x0, y0 = (W - w) * rand(B), (H - h) * rand(B)
        x = resized_crop(x, x0, y0, w, h, size, flip=rand(B) < 0.5)
        x = self.color_jitter(x, rand)
        if self.rgb and self.c["grayscale_p"]:
            x = torch.where((rand(B) < self.c["grayscale_p"]).view(B, 1, 1, 1), _rgb_to_gray(x).expand_as(x), x)
        lo, hi = self.c["blur_sigma"]
        sigma = torch.where(rand(B) < blur_p, lo + (hi - lo) * rand(B), torch.zeros(B, device=x.device))
        x = gaussian_blur(x, sigma)
        if solarize_p:
            x = torch.where((rand(B) < solarize_p).view(B, 1, 1, 1) & (x >= 0.5), 1 - x, x)
        return x

    def color_jitter(self, x, rand):
        """torchvision's ColorJitter per image: each op with its own factor, in a random order per image."""
        B = x.shape[0]
        strength = dict(zip(("brightness", "contrast", "saturation", "hue"), self.c["jitter"]))
        if not self.rgb:  # one channel: saturation and hue do not exist
            strength["saturation"] = strength["hue"] = 0
        ops = [(name, s) for name, s in strength.items() if s > 0]
        if not ops or not self.c["jitter_p"]:
            return x
        apply = rand(B) < self.c["jitter_p"]
        # factors uniform in [max(0, 1 - s), 1 + s], hue shifts in [-s, s] (as torchvision)
        factors = [s * (2 * rand(B) - 1) if name == "hue" else (1 + s * (2 * rand(B) - 1)).clamp(min=0)
                   for name, s in ops]
        order = rand(B, len(ops)).argsort(dim=1)  # a random permutation of the ops for every image
        for position in range(len(ops)):
            for j, ((name, _), f) in enumerate(zip(ops, factors)):
                chosen = apply & (order[:, position] == j)
                if chosen.any():
                    x = torch.where(chosen.view(B, 1, 1, 1), self.adjust(x, name, f), x)
        return x

    def adjust(self, x, name, f):
        f4 = f.view(-1, 1, 1, 1)
        if name == "brightness":
            return (x * f4).clamp(0, 1)
        if name == "contrast":  # blend with the mean grey level of the image
            gray = _rgb_to_gray(x) if self.rgb else x
            return (f4 * x + (1 - f4) * gray.mean(dim=(1, 2, 3), keepdim=True)).clamp(0, 1)
        if name == "saturation":  # blend with the grey image
            return (f4 * x + (1 - f4) * _rgb_to_gray(x)).clamp(0, 1)
        return adjust_hue(x, f)

# -----------------------------------------------------------------------------
# DINO: multi-crop wrapper, loss and centring, teacher EMA, schedules


class DINO(nn.Module):
    """Backbone + DINO head. Each crop resolution goes through the backbone as one batch (DINO's
    MultiCropWrapper); the head sees the CLS features of all crops."""

    def __init__(self, backbone, head):
        super().__init__()
        self.backbone, self.head = backbone, head

    def forward(self, crops):  # list of (n_i * B, C, S_i, S_i) -> (sum n_i * B, out_dim)
        return self.head(torch.cat([self.backbone(x) for x in crops]))


def dino_loss(student_out, teacher_out, center, student_temp, teacher_temp, n_global=2):
    """Mean over pairs (teacher view t, student view s != t) of the cross-entropy
    H(softmax((teacher_t - center) / teacher_temp), softmax(student_s / student_temp)), averaged over images.
    student_out (n_crops * B, K) with the global crops first; teacher_out (n_global * B, K)."""
    n_crops = student_out.shape[0] // (teacher_out.shape[0] // n_global)
    log_p = F.log_softmax(student_out / student_temp, dim=-1).chunk(n_crops)
    q = F.softmax((teacher_out - center) / teacher_temp, dim=-1).detach().chunk(n_global)
    total, terms = 0.0, 0
    for t in range(n_global):
        for s in range(n_crops):
            if s != t:  # never compare a view with itself
                total = total + torch.sum(-q[t] * log_p[s], dim=-1).mean()
                terms += 1
    return total / terms


@torch.no_grad()
def update_center(center, teacher_out, momentum, device="cpu"):
    """EMA of the teacher's mean output over the whole (all-process) batch."""
    batch_mean = all_reduce_mean(teacher_out.float().mean(dim=0, keepdim=True), device).to(center)
    return center * momentum + batch_mean * (1 - momentum)


@torch.no_grad()
def ema_update(teacher, student, momentum):
    """teacher <- momentum * teacher + (1 - momentum) * student, parameter by parameter."""
    t_params, s_params = list(teacher.parameters()), list(student.parameters())
    torch._foreach_mul_(t_params, momentum)
    torch._foreach_add_(t_params, s_params, alpha=1 - momentum)


def cosine_schedule(step, total, start, end, warmup=0, warmup_start=0.0):
    """DINO's schedule: linear from warmup_start to start over `warmup` steps, then a half cosine to `end`."""
    if step < warmup:
        return warmup_start + (start - warmup_start) * step / warmup
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    return end + 0.5 * (start - end) * (1 + math.cos(math.pi * progress))


def param_groups(model):
    """DINO: weight decay on weights, none on biases and 1-d parameters (norms, LayerScale)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if name.endswith(".bias") or p.ndim == 1 else decay).append(p)
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def clip_gradients(model, clip):
    """DINO clips every parameter's gradient to norm `clip` separately (not one global norm)."""
    for p in model.parameters():
        if p.grad is not None:
            norm = p.grad.norm()
            p.grad.mul_(torch.clamp(clip / (norm + 1e-6), max=1.0))


def cancel_last_layer_grads(head, epoch, freeze_epochs):
    """In the first freeze_epochs epochs the head's last layer gets no update (its gradient is dropped)."""
    if epoch < freeze_epochs:
        for p in head.last_layer_params():
            p.grad = None


@torch.no_grad()
def teacher_stats(teacher_out, center, temp):
    """Collapse diagnostics: std across the batch of the centred teacher outputs (mean over dims; 0 = every
    image gives the same output) and the mean entropy of the teacher's softmax / log(K) (1 = uniform)."""
    t = teacher_out.float() - center
    p = F.softmax(t / temp, dim=-1)
    entropy = -(p * torch.log(p + 1e-12)).sum(-1).mean() / math.log(p.shape[-1])
    return t.std(dim=0).mean().item(), entropy.item()

# -----------------------------------------------------------------------------
# evaluation: k-NN, linear probe, segmentation probe (all on frozen features)


@torch.no_grad()
def extract_features(model, images, mean, std, device, kind="cls", blocks=1, batch_size=256, dtype=None):
    """Features of uint8 images (N, C, H, W): kind='cls' -> CLS of the last `blocks` blocks, each final-normed
    and concatenated (N, blocks * d) (DINO's get_intermediate_layers); 'patch' -> (N, h, w, d) patch tokens;
    'pixels' -> the normalised pixels themselves (N, C*H*W), the baseline."""
    mean = torch.tensor(mean, device=device).view(1, -1, 1, 1)
    std = torch.tensor(std, device=device).view(1, -1, 1, 1)
    out = []
    for i in range(0, len(images), batch_size):
        x = (images[i:i + batch_size].to(device).float() / 255 - mean) / std
        if kind == "pixels":
            out.append(x.flatten(1).cpu())
            continue
        with torch.autocast(torch.device(device).type, dtype=dtype, enabled=dtype is not None):
            if kind == "patch":
                t = model.forward_features(x)[:, 1:]  # (B, h*w, d)
                side = int(math.isqrt(t.shape[1]))
                out.append(t.float().reshape(len(x), side, side, -1).cpu())
            else:
                layers = model.forward_features(x, all_layers=True)[:-1]  # after block 1, ..., block L
                cls = [model.norm(h)[:, 0] for h in layers[-blocks:]]  # final-normed, as DINO's probes
                out.append(torch.cat(cls, dim=-1).float().cpu())
    return torch.cat(out)


@torch.no_grad()
def knn_accuracy(train_f, train_y, test_f, test_y, num_classes, k=20, temp=0.07, chunk=1000):
    """Weighted k-NN (DINO's eval_knn.py): cosine similarity on L2-normalised features, the k nearest
    training images vote for their class with weight exp(similarity / temp). Returns top-1 accuracy."""
    train_f, test_f = F.normalize(train_f, dim=1), F.normalize(test_f, dim=1)
    correct = 0
    for i in range(0, len(test_f), chunk):
        sim, idx = (test_f[i:i + chunk] @ train_f.T).topk(min(k, len(train_f)), dim=1)  # (n, k)
        votes = torch.zeros(len(idx), num_classes).scatter_add_(1, train_y[idx], (sim / temp).exp())
        correct += (votes.argmax(dim=1) == test_y[i:i + chunk]).sum().item()
    return correct / len(test_f)


def knn_probe(backbone, eval_sets, data, c, device, dtype, pixels=False):
    """k-NN accuracy of the backbone's CLS features (or, with pixels=True, of the raw pixels) on the eval sets."""
    (xt, yt), (xv, yv) = eval_sets["eval_train"], eval_sets["eval_val"]
    kind = "pixels" if pixels else "cls"
    ft, fv = (extract_features(backbone, x, data["mean"], data["std"], device, kind, dtype=dtype) for x in (xt, xv))
    return knn_accuracy(ft, yt, fv, yv, data["num_classes"], c["knn_k"], c["knn_temp"])


def _train_linear(feats, labels, num_classes, steps, seed, batch_size=256, lr=3e-3, ignore_index=-100):
    """A linear layer on standardised frozen features: zero init, `steps` AdamW steps, cosine lr, cross-entropy."""
    g = torch.Generator().manual_seed(seed)
    mean, std = feats.mean(dim=0), feats.std(dim=0) + 1e-6
    clf = nn.Linear(feats.shape[1], num_classes)
    nn.init.zeros_(clf.weight)
    nn.init.zeros_(clf.bias)
    opt = torch.optim.AdamW(clf.parameters(), lr=lr, weight_decay=1e-4)
    step = 0
    while step < steps:
        for idx in torch.randperm(len(feats), generator=g).split(batch_size):
            if step == steps:
                break
            for group in opt.param_groups:
                group["lr"] = cosine_schedule(step, steps, lr, 0.0)
            loss = F.cross_entropy(clf((feats[idx] - mean) / std), labels[idx], ignore_index=ignore_index)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
    return lambda f: clf((f - mean) / std)


@torch.no_grad()
def _predict(predict, feats, chunk=4096):
    return torch.cat([predict(feats[i:i + chunk]) for i in range(0, len(feats), chunk)])


def linear_accuracy(train_f, train_y, val_f, val_y, num_classes, steps, seed=0):
    predict = _train_linear(train_f, train_y, num_classes, steps, seed)
    return (_predict(predict, val_f).argmax(dim=1) == val_y).float().mean().item()


def patch_labels(masks, grid, num_classes, ignore=255):
    """Majority pixel label of every patch: masks (N, S, S) -> (N, grid, grid); all-ignore patches -> ignore."""
    N, S, _ = masks.shape
    p = S // grid
    onehot = F.one_hot(torch.where(masks == ignore, num_classes, masks), num_classes + 1)  # (N, S, S, K+1)
    counts = onehot[..., :num_classes].reshape(N, grid, p, grid, p, num_classes).sum(dim=(2, 4))
    return torch.where(counts.sum(-1) > 0, counts.argmax(-1), ignore)


def miou(pred, target, num_classes, ignore=255):
    """Mean intersection over union over the classes present in the prediction or the target."""
    keep = target != ignore
    confusion = torch.bincount(target[keep] * num_classes + pred[keep], minlength=num_classes ** 2)
    confusion = confusion.view(num_classes, num_classes).double()
    inter, union = confusion.diag(), confusion.sum(0) + confusion.sum(1) - confusion.diag()
    return (inter[union > 0] / union[union > 0]).mean().item()


def segmentation_miou(train_f, train_m, val_f, val_m, num_classes, steps, seed=0):
    """Linear probe on patch features (N, h, w, d) trained on majority patch labels; logits are upsampled
    bilinearly to the pixel masks (N, S, S) and scored by mIoU at pixel level."""
    grid, d = train_f.shape[1], train_f.shape[-1]
    labels = patch_labels(train_m, grid, num_classes).flatten()
    predict = _train_linear(train_f.reshape(-1, d), labels, num_classes, steps, seed, batch_size=4096,
                            ignore_index=255)
    logits = _predict(predict, val_f.reshape(-1, d)).view(len(val_f), grid, grid, num_classes).permute(0, 3, 1, 2)
    pred = F.interpolate(logits, size=val_m.shape[-2:], mode="bilinear", align_corners=False).argmax(dim=1)
    return miou(pred.flatten(), val_m.flatten(), num_classes)

# -----------------------------------------------------------------------------
# the run


def check_config(c):
    """Clear errors for settings that would otherwise fail deep inside torch, or silently do the wrong thing."""
    if c["model"] not in PRESETS or PRESETS[c["model"]]["model"] != "vit":
        raise UsageError(f"--model={c['model']!r}: choose a ViT preset, one of "
                         f"{sorted(k for k, v in PRESETS.items() if v['model'] == 'vit')}")
    for key in ("global_scale", "local_scale", "blur_sigma"):
        lo_hi = c[key]
        if len(lo_hi) != 2 or not 0 <= lo_hi[0] <= lo_hi[1] or (key != "blur_sigma" and not 0 < lo_hi[1] <= 1):
            raise UsageError(f"--{key}={lo_hi}: expected [low, high] with 0 <= low <= high"
                             + ("" if key == "blur_sigma" else " <= 1"))
    if len(c["jitter"]) != 4 or min(c["jitter"]) < 0 or c["jitter"][3] > 0.5:
        raise UsageError(f"--jitter={c['jitter']}: expected [brightness, contrast, saturation, hue] >= 0, hue <= 0.5")
    positive = ("epochs", "batch_size", "lr", "student_temp", "teacher_temp", "warmup_teacher_temp", "out_dim",
                "head_hidden", "head_bottleneck", "global_size", "local_size", "eval_interval", "log_interval",
                "knn_k", "knn_temp", "probe_steps", "linear_blocks", "cpu_procs")
    for key in positive:
        if not c[key] > 0:
            raise UsageError(f"--{key}={c[key]} must be positive")
    for key in ("momentum_teacher", "center_momentum", "jitter_p", "grayscale_p", "solarize_p"):
        if not 0 <= c[key] <= 1:
            raise UsageError(f"--{key}={c[key]} must lie in [0, 1]")
    for key in ("local_crops", "train_limit", "eval_train", "eval_val", "seg_train", "seg_val", "warmup_epochs",
                "freeze_last_layer", "weight_decay", "weight_decay_end", "clip_grad", "min_lr"):
        if c[key] < 0:
            raise UsageError(f"--{key}={c[key]} must not be negative")
    if c["dtype"] not in ("float32", "bfloat16", "float16"):
        raise UsageError(f"--dtype={c['dtype']!r}: choose float32, bfloat16 or float16")
    if c["seg_dataset"] not in ("scenes", "pets", "none"):
        raise UsageError(f"--seg_dataset={c['seg_dataset']!r}: choose scenes, pets or none")
    if c["resume"] and c["eval_only"]:
        raise UsageError("--resume and --eval_only exclude each other")
    if not c["eval_only"]:
        backbone_config(c, in_chans=1)  # model settings fail here, before any data is loaded


def backbone_config(c, in_chans, drop_path=0.0):
    cfg = make_config(c["model"], n_layer=c["n_layer"], n_head=c["n_head"], n_embd=c["n_embd"],
                      patch_size=c["patch_size"], n_lap=c["n_lap"], img_size=c["global_size"], in_chans=in_chans,
                      num_classes=0, drop_path=drop_path)
    sizes = ["global_size"] + (["local_size"] if c["local_crops"] else [])  # an unused size is not checked
    sizes += ["seg_size"] if c["seg_dataset"] != "none" else []
    for key in sizes:
        if c[key] % cfg.patch_size:
            raise UsageError(f"--{key}={c[key]} is not a multiple of the patch size {cfg.patch_size}")
    return cfg


def evaluate_final(backbone, c, data, feats, seg_sets, device, dtype, num_classes, log):
    """Linear and segmentation probes (and their raw-pixel baselines) at the end of a run or on a checkpoint."""
    t0, res = time.time(), {}
    mean, std = data["mean"], data["std"]
    (xt, yt), (xv, yv) = feats["eval_train"], feats["eval_val"]
    blocks = min(c["linear_blocks"], backbone.config.n_layer)
    ft, fv = (extract_features(backbone, x, mean, std, device, "cls", blocks, dtype=dtype) for x in (xt, xv))
    res["linear_acc"] = linear_accuracy(ft, yt, fv, yv, num_classes, c["probe_steps"], c["seed"])
    pt, pv = (extract_features(None, x, mean, std, device, "pixels") for x in (xt, xv))
    res["linear_acc_pixels"] = linear_accuracy(pt, yt, pv, yv, num_classes, c["probe_steps"], c["seed"])
    log(f"linear probe (CLS of the last {blocks} blocks, {len(xt)} train / {len(xv)} val images): "
        f"{res['linear_acc']:.4f} (raw pixels {res['linear_acc_pixels']:.4f}) | {time.time() - t0:.1f}s")
    if seg_sets is not None:
        t0 = time.time()
        (st, mt, classes), (sv, mv, _) = seg_sets
        K, P = len(classes), backbone.config.patch_size
        ft, fv = (extract_features(backbone, x, mean, std, device, "patch", dtype=dtype) for x in (st, sv))
        res["seg_miou"] = segmentation_miou(ft, mt, fv, mv, K, c["probe_steps"], c["seed"])
        # baseline: the same probe on the raw pixels of each patch
        to_patches = lambda x: F.pixel_unshuffle(extract_features(None, x, mean, std, device, "pixels")
                                                 .view(x.shape), P).permute(0, 2, 3, 1)
        res["seg_miou_pixels"] = segmentation_miou(to_patches(st), mt, to_patches(sv), mv, K, c["probe_steps"],
                                                   c["seed"])
        log(f"segmentation probe ({c['seg_dataset']}, {K} classes, {len(st)} train / {len(sv)} val images of "
            f"{c['seg_size']}px): mIoU {res['seg_miou']:.4f} (raw pixels {res['seg_miou_pixels']:.4f}) | "
            f"{time.time() - t0:.1f}s")
    return res


def main(argv=None):
    c = parse_args(DEFAULTS, argv)
    check_config(c)
    if not c["eval_only"] and spawns_cpu_processes(c["cpu_procs"], "auto"):
        return launch_cpu_processes(main, sys.argv[1:] if argv is None else argv, c["cpu_procs"])
    rank, local_rank, world_size, device = setup_distributed()
    master = rank == 0
    log = print if master else (lambda *a, **k: None)
    try:
        run(c, rank, world_size, device, master, log)
    finally:
        teardown_distributed()


def run(c, rank, world_size, device, master, log):
    device_type = torch.device(device).type
    dtype = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}[c["dtype"]]
    if c["eval_only"]:
        return eval_only(c, device, dtype, log)
    ckpt_path = os.path.join(c["out_dir"], "ckpt.pt")
    ckpt = None
    if c["resume"]:
        if not os.path.isfile(ckpt_path):
            raise UsageError(f"--resume: there is no checkpoint at {ckpt_path} (check --out_dir)")
        ckpt = load_checkpoint(ckpt_path, map_location="cpu")
        changed = [f"{k}: {ckpt['config'].get(k)!r} -> {v!r}" for k, v in c.items()
                   if k not in RESUME_FREE and ckpt["config"].get(k) != v]
        if changed:
            raise UsageError(f"--resume: the settings differ from the checkpoint's ({'; '.join(changed)}); "
                             f"resume with the same settings, or start a new run in another --out_dir")
        if len(ckpt["rng"]) != world_size:  # each process's random state is saved, and needed
            n = len(ckpt["rng"])
            raise UsageError(f"--resume: {ckpt_path} was written by {n} process(es), this run has {world_size}; "
                             f"resume with {n} (--cpu_procs={n} on a CPU, or torchrun --nproc_per_node={n})")
    log("config: " + " ".join(f"{k}={v!r}" for k, v in c.items()))
    torch.manual_seed(c["seed"])  # the same initial weights in every process

    # ---- data
    data = load_dataset(c)
    imagefolder = c["dataset"] == "imagefolder"
    x_train = data["train"] if imagefolder else data["train"][0]
    n_train = len(x_train)
    if c["train_limit"]:
        n_train = min(n_train, c["train_limit"])
    if c["batch_size"] % world_size:
        raise UsageError(f"--batch_size={c['batch_size']} is not divisible by the {world_size} processes")
    if c["batch_size"] > n_train:
        raise UsageError(f"--batch_size={c['batch_size']} is larger than the {n_train} training images")
    in_chans = 3 if imagefolder else x_train.shape[1]
    steps_per_epoch = n_train // c["batch_size"]
    total_steps = max(1, round(c["epochs"] * steps_per_epoch))
    end_step = total_steps if c["max_steps"] < 0 else min(c["max_steps"], total_steps)
    eval_sets = {s: load_eval_images(c, s.split("_")[1], data) for s in ("eval_train", "eval_val")}
    num_classes = data["num_classes"]
    seg_sets = None
    if master and c["seg_dataset"] != "none":  # loaded now: a missing dataset fails before training, not after
        seg_sets = [load_segmentation(c, s, in_chans) for s in ("train", "val")]
    multicrop = MultiCrop(c, in_chans, data["mean"], data["std"])
    subset = eval_indices(len(x_train), c["train_limit"]) if c["train_limit"] else None
    loader = None

    def get_batch(step):
        """This process's uint8 images of `step`."""
        nonlocal loader
        if not imagefolder:
            idx = batch_indices(n_train, c["batch_size"], step, c["seed"], rank, world_size)
            return x_train[idx if subset is None else subset[idx]]
        # imagefolder: decode the rest of the epoch in worker processes (v2 Resize + CenterCrop)
        if loader is None or step % steps_per_epoch == 0:
            batches = [batch_indices(n_train, c["batch_size"], s, c["seed"], rank, world_size)
                       for s in range(step, (step // steps_per_epoch + 1) * steps_per_epoch)]
            batches = [(b if subset is None else subset[b]).tolist() for b in batches]
            loader = iter(torch.utils.data.DataLoader(x_train, batch_sampler=batches, num_workers=c["num_workers"],
                                                      pin_memory=device_type == "cuda"))
        return next(loader)[0].as_subclass(torch.Tensor)

    # ---- student and teacher
    s_cfg, t_cfg = backbone_config(c, in_chans, c["drop_path"]), backbone_config(c, in_chans)
    make_head = lambda: DINOHead(s_cfg.n_embd, c["out_dim"], c["head_hidden"], c["head_bottleneck"],
                                 norm_last_layer=c["norm_last_layer"])
    student = DINO(ViT(s_cfg), make_head()).to(device)
    teacher = DINO(ViT(t_cfg), make_head()).to(device)
    teacher.load_state_dict(student.state_dict())  # the same start
    teacher.requires_grad_(False)
    teacher.eval()
    center = torch.zeros(1, c["out_dim"], device=device)
    optimizer = torch.optim.AdamW(param_groups(student), lr=0.0, fused=device_type in ("cuda", "cpu"))
    scaler = torch.amp.GradScaler(device_type, enabled=dtype == torch.float16)
    log(f"backbone: {s_cfg.n_layer} layers, {s_cfg.n_head} heads ({t_cfg.lap_schedule()} Laplacian per layer), "
        f"d={s_cfg.n_embd}, patch {s_cfg.patch_size}, {student.backbone.num_params():,} params; DINO head "
        f"{sum(p.numel() for p in student.head.parameters()):,} params; {n_train} images, {steps_per_epoch} "
        f"steps/epoch, {total_steps} steps; "
        + (f"{c['local_crops']} local crops of {c['local_size']}px" if c["local_crops"] else "no local crops"))
    start_step, knn_init = 0, None
    if ckpt is not None:
        student.load_state_dict(clean_state_dict(ckpt["student"]))
        teacher.load_state_dict(clean_state_dict(ckpt["teacher"]))
        center = ckpt["center"].to(device)
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_step, knn_init = ckpt["step"], ckpt.get("knn_acc_init")
        log(f"resumed from {ckpt_path} at step {start_step}")
    elif master:
        os.makedirs(c["out_dir"], exist_ok=True)
        if os.path.exists(os.path.join(c["out_dir"], "log.jsonl")):
            os.remove(os.path.join(c["out_dir"], "log.jsonl"))  # a fresh run starts a fresh log
    torch.manual_seed(c["seed"] + 1 + rank)  # drop path differs between processes
    train_student = student
    if world_size > 1:
        train_student = nn.parallel.DistributedDataParallel(student, device_ids=[int(device.split(":")[1])]
                                                            if device.startswith("cuda") else None)
    if ckpt is not None:
        set_rng_state(ckpt["rng"][rank])
    if c["compile"]:
        student.backbone.compile()
        teacher.backbone.compile()

    # ---- schedules: visible functions of the step
    lr_peak = c["lr"] * c["batch_size"] / 256  # DINO's linear scaling rule
    warmup_steps = round(c["warmup_epochs"] * steps_per_epoch)
    temp_warmup_steps = round(c["warmup_teacher_temp_epochs"] * steps_per_epoch)
    get_lr = lambda step: cosine_schedule(step, total_steps, lr_peak, c["min_lr"], warmup_steps)
    get_wd = lambda step: cosine_schedule(step, total_steps, c["weight_decay"], c["weight_decay_end"])
    get_momentum = lambda step: cosine_schedule(step, total_steps, c["momentum_teacher"], 1.0)

    def get_teacher_temp(step):  # linear warm-up, then constant
        if step >= temp_warmup_steps:
            return c["teacher_temp"]
        return c["warmup_teacher_temp"] + (c["teacher_temp"] - c["warmup_teacher_temp"]) * step / temp_warmup_steps

    log_path = os.path.join(c["out_dir"], "log.jsonl")
    pixels_knn = knn_probe(None, eval_sets, data, c, device, dtype, pixels=True) if master else None

    def save(step):
        """Everything a resume needs, written atomically by the first process."""
        rngs = [rng_state()]
        if world_size > 1:  # every process's RNG (drop path), so that DDP resume is exact too
            rngs = [None] * world_size
            dist.all_gather_object(rngs, rng_state())
        if master:
            save_checkpoint(dict(kind="dino", model_config=asdict(t_cfg), model=teacher.backbone.state_dict(),
                                 config=c, student=student.state_dict(), teacher=teacher.state_dict(),
                                 center=center.cpu(), optimizer=optimizer.state_dict(), scaler=scaler.state_dict(),
                                 step=step, epoch=step / steps_per_epoch, rng=rngs, knn_acc_init=knn_init), ckpt_path)

    # ---- training loop
    t_start, t_last, images_seen, loss_sum, n_loss = time.time(), time.time(), 0, 0.0, 0
    knn_acc, t_std, t_ent, last_loss = None, float("nan"), float("nan"), float("nan")
    step = start_step
    while True:
        if (step % c["eval_interval"] == 0 or step == end_step) and not (ckpt is not None and step == start_step):
            t0 = time.time()
            if master:
                knn_acc = knn_probe(teacher.backbone, eval_sets, data, c, device, dtype)
                knn_init = knn_acc if step == 0 else knn_init
                record = dict(step=step, epoch=round(step / steps_per_epoch, 4), knn_acc=knn_acc,
                              knn_acc_pixels=pixels_knn, loss=last_loss, teacher_std=t_std, teacher_entropy=t_ent,
                              seconds=round(time.time() - t_start, 1))
                append_jsonl(log_path, record)
                log(f"eval step {step}: knn_acc {knn_acc:.4f} (step 0: {knn_init:.4f}, raw pixels {pixels_knn:.4f}; "
                    f"{len(eval_sets['eval_train'][0])} train / {len(eval_sets['eval_val'][0])} val images) | "
                    f"{time.time() - t0:.1f}s")
            save(step)
            if world_size > 1:
                dist.barrier()
            t_last += time.time() - t0  # evaluation time does not count against img/s
        if step >= end_step:
            break

        epoch = step // steps_per_epoch
        lr, wd, momentum, teacher_temp = get_lr(step), get_wd(step), get_momentum(step), get_teacher_temp(step)
        for i, group in enumerate(optimizer.param_groups):
            group["lr"] = lr
            if i == 0:  # only the weights are decayed
                group["weight_decay"] = wd
        images = get_batch(step).to(device, non_blocking=True)
        # the augmentation of a step is a pure function of (seed, step, rank): resume is exact
        generator = torch.Generator().manual_seed(c["seed"] * 1_000_003 + step * 1009 + rank)
        crops = multicrop(images, generator)
        with torch.autocast(device_type, dtype=dtype, enabled=dtype is not None):
            with torch.no_grad():
                teacher_out = teacher(crops[:1]).float()  # only the global crops go through the teacher
            student_out = train_student(crops).float()
        loss = dino_loss(student_out, teacher_out, center, c["student_temp"], teacher_temp)
        check_finite(loss.item(), step)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        if c["clip_grad"]:
            clip_gradients(student, c["clip_grad"])
        cancel_last_layer_grads(student.head, epoch, c["freeze_last_layer"])
        scaler.step(optimizer)
        scaler.update()
        ema_update(teacher, student, momentum)
        if (step + 1) % c["log_interval"] == 0 or step + 1 == end_step:
            t_std, t_ent = teacher_stats(teacher_out, center, teacher_temp)
        center = update_center(center, teacher_out, c["center_momentum"], device)

        step += 1
        images_seen += c["batch_size"]
        loss_sum, n_loss, last_loss = loss_sum + loss.item(), n_loss + 1, loss.item()
        if step % c["log_interval"] == 0 or step == end_step:
            dt = time.time() - t_last
            ips = images_seen / max(dt, 1e-9)
            eta = (end_step - step) * c["batch_size"] / max(ips, 1e-9)
            log(f"step {step}/{total_steps} | ep {step / steps_per_epoch:.2f} | loss {loss_sum / n_loss:.4f} | "
                f"lr {lr:.2e} | wd {wd:.3f} | mom {momentum:.5f} | t_temp {teacher_temp:.4f} | t_std {t_std:.4f} | "
                f"t_ent {t_ent:.3f} | {ips:.0f} img/s | ETA {format_time(eta)}")
            if t_std < c["collapse_std"] and step > warmup_steps:
                log(f"warning: the teacher's outputs barely differ across images (std {t_std:.2e} < collapse_std="
                    f"{c['collapse_std']}): DINO may be collapsing. t_ent near 0 means one prototype for every image "
                    f"(centring too weak: center_momentum < 1, a higher teacher_temp); near 1 a uniform teacher "
                    f"(sharpen: a lower teacher_temp). A lower lr or a higher momentum_teacher also help.")
            t_last, images_seen, loss_sum, n_loss = time.time(), 0, 0.0, 0

    if world_size > 1:
        print_param_checksum([*student.parameters(), *teacher.parameters()], rank, world_size)

    # ---- final probes
    if end_step < total_steps:
        log(f"stopped at step {end_step} of {total_steps} (--max_steps); resume with --resume")
        return
    if master:
        res = dict(knn_acc=knn_acc, knn_acc_init=knn_init, knn_acc_pixels=pixels_knn)
        res.update(evaluate_final(teacher.backbone, c, data, eval_sets, seg_sets, device, dtype, num_classes, log))
        append_jsonl(log_path, dict(step=end_step, **res))
        res.update(n_lap=c["n_lap"], steps=end_step, params=student.backbone.num_params(),
                   seconds=int(time.time() - t_start))
        print(result_line(res))


def eval_only(c, device, dtype, log):
    """Probe any nanolap ViT checkpoint (DINO teacher backbone or a supervised ViT) on its training data."""
    ckpt = load_checkpoint(c["eval_only"])
    if Config(**ckpt["model_config"]).model != "vit":
        raise UsageError(f"{c['eval_only']} holds a {ckpt['model_config']['model']} model; the probes need a ViT")
    from nanolap import load_model
    backbone = load_model(ckpt).to(device).eval()
    trained = ckpt.get("config", {})
    data_keys = ("dataset", "data_dir", "train_limit", "imagefolder_base")  # what the backbone was trained on
    run_cfg = {**c, **{k: trained[k] for k in data_keys if k in trained}, "global_size": backbone.config.img_size}
    data = load_dataset(run_cfg)
    eval_sets = {s: load_eval_images(run_cfg, s.split("_")[1], data) for s in ("eval_train", "eval_val")}
    res = dict(knn_acc=knn_probe(backbone, eval_sets, data, run_cfg, device, dtype),
               knn_acc_pixels=knn_probe(None, eval_sets, data, run_cfg, device, dtype, pixels=True))
    if ckpt.get("knn_acc_init") is not None:
        res["knn_acc_init"] = ckpt["knn_acc_init"]
    log(f"{c['eval_only']} (step {ckpt.get('step')}): knn_acc {res['knn_acc']:.4f} (raw pixels "
        f"{res['knn_acc_pixels']:.4f})")
    seg_sets = None
    if c["seg_dataset"] != "none":
        seg_sets = [load_segmentation(run_cfg, s, backbone.config.in_chans) for s in ("train", "val")]
    res.update(evaluate_final(backbone, run_cfg, data, eval_sets, seg_sets, device, dtype,
                              data["num_classes"], log))
    print(result_line(res))


def result_line(res):
    fmt = lambda v: f"{v:.4f}" if isinstance(v, float) else str(v).replace(" ", "")
    return "RESULT " + " ".join(f"{k}={fmt(v)}" for k, v in res.items())


if __name__ == "__main__":
    run_main(main)
