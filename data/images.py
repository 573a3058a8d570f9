"""
Image datasets as uint8 tensors (N, C, H, W) with int64 labels, small enough to live on the training
device: Fashion-MNIST, CIFAR-10/100, a generated `synthetic` set for tests, and `scenes`, Fashion-MNIST
items pasted on textured backgrounds with pixel masks (segmentation, and a harder k-NN task). ImageNet-style
folders are read lazily through torchvision. Fashion-MNIST is found in data/fashion_mnist, else the Debian
package dataset-fashion-mnist, else downloaded; CIFAR downloads on first use.
"""

import gzip
import math
import os

import torch
import torch.nn.functional as F

import common
from common import UsageError
from data import download_timeout, folders

FASHION_FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
                 "val": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}
FASHION_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                   "Ankle boot"]
DEBIAN_FASHION = "/usr/share/datasets/fashion-mnist"  # apt-get install dataset-fashion-mnist
DATASETS = ("fashion_mnist", "cifar10", "cifar100", "synthetic", "scenes")  # in memory; plus 'imagefolder'

# -----------------------------------------------------------------------------
# in-memory datasets

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
        with download_timeout(root):
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
    if name not in DATASETS:
        raise UsageError(f"unknown dataset {name!r}; choose one of {DATASETS + ('imagefolder',)}")
    root = os.path.join(data_dir, name)
    if name == "fashion_mnist":
        root = _fashion_mnist_dir(root)
        split = {s: (_read_idx(os.path.join(root, fx))[:, None], _read_idx(os.path.join(root, fy)).long())
                 for s, (fx, fy) in FASHION_FILES.items()}
        classes = FASHION_CLASSES
    elif name == "scenes":  # the image label: the item class with the most visible pixels
        s = {split: load_scenes(data_dir, split) for split in ("train", "val")}
        split = {k: (v["images"], v["labels"]) for k, v in s.items()}
        classes = FASHION_CLASSES
    elif name == "synthetic":
        split = _synthetic()
        classes = split.pop("classes")
    else:
        from torchvision import datasets
        cls = datasets.CIFAR10 if name == "cifar10" else datasets.CIFAR100
        try:
            with download_timeout(root):
                sets = {s: cls(root, train=(s == "train"), download=True) for s in ("train", "val")}
        except Exception as e:
            fetch = f"python -c \"from torchvision import datasets; datasets.{cls.__name__}('{root}', download=True)\""
            raise UsageError(f"{name} is not in {root} and the download failed ({e}).\n"
                             f"Fix: run `{fetch}` where there is internet and copy {root} here")
        split = {s: (torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous(), torch.tensor(ds.targets))
                 for s, ds in sets.items()}
        classes = sets["train"].classes
    if name != "synthetic":  # which folder a run read: Fashion-MNIST's may be the Debian package's, not data_dir's
        common.print0(f"read {name} from {root}")
    mean, std = pixel_stats(split["train"][0])
    return dict(train=split["train"], val=split["val"], num_classes=len(classes), classes=classes, mean=mean, std=std)


def pixel_stats(x):  # the per-channel mean and std of uint8 images (N, C, H, W), in [0, 1]
    x = x.float().div_(255)
    return x.mean(dim=(0, 2, 3)).tolist(), x.std(dim=(0, 2, 3)).tolist()


def hold_out(data, fraction):
    """A selection split, for choosing hyperparameters without the validation images: the last `fraction` of the
    training images become the evaluation split ("val"), the rest the training split, and the normalisation is the
    kept images' own. The validation images are not in it. fraction 0: data as it is."""
    if not fraction:
        return data
    x, y = data["train"]
    n = len(y) - round(fraction * len(y))
    if not 0 < n < len(y):
        raise UsageError(f"--holdout={fraction} of {len(y)} training images leaves one split empty; choose e.g. 0.1")
    mean, std = pixel_stats(x[:n])
    return dict(data, train=(x[:n], y[:n]), val=(x[n:], y[n:]), mean=mean, std=std)


def fixed_subset(n, limit, seed=1234):
    """Indices of a fixed random subset of n items, the same for every run (a --train_subset, the evaluation images;
    analyze.py passes its --seed); limit 0 (or >= n) = all, in a fixed random order."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return perm[:limit] if 0 < limit < n else perm


def load_eval_images(data, split, limit, size, num_workers=0):
    """The fixed evaluation subset of an in-memory split (limit images; 0 = all, see fixed_subset), resized
    to the backbone's resolution: (x uint8 (N, C, size, size), y int64 (N,)). DINO's k-NN and linear
    probes and analyze.py see the same images. An ImageFolder split (imagefolder_squares) is decoded by
    num_workers processes, at most 10000 images of it (a whole ImageNet does not fit in memory)."""
    if not isinstance(data[split], tuple):
        return folders.decode_folder(data[split], fixed_subset(len(data[split]), limit or 10000), size, num_workers)
    x, y = data[split]
    idx = fixed_subset(len(x), limit)
    x = x[idx]
    if x.shape[-1] != size:  # e.g. 64 px scenes for a 28 px backbone: evaluate at the training resolution
        from torchvision.transforms import v2
        x = v2.functional.resize(x, [size, size], antialias=True)
    return x, y[idx]

# -----------------------------------------------------------------------------
# the evaluation images of a run


def eval_images(ckpt, max_samples, seed):
    """A fixed random subset (at most max_samples, chosen by seed, sorted) of the images a run was evaluated on: a ViT's
    validation split, DINO's k-NN images (train_dino.py's eval_val at global_size). Returns (x uint8 (N, C, H, W),
    y (N,), class names, mean, std): the normalisation stored in the checkpoint, else the dataset's training
    statistics (folders: ImageNet's). analyze.py and the exercises measure these images."""
    cfg = ckpt.get("config", {})
    img_size = ckpt["model_config"]["img_size"]
    dataset = cfg.get("dataset")
    data_dir = cfg.get("data_dir", "data")
    workers = cfg.get("num_workers", 8)
    folder = dataset == "imagefolder"
    if ckpt["kind"] == "dino":  # exactly train_dino.py's evaluation images
        data = folders.imagefolder_squares(data_dir, cfg.get("imagefolder_base", 256)) if folder else load_images(dataset, data_dir)
        data = data if folder else hold_out(data, cfg.get("holdout", 0.0))
        x, y = load_eval_images(data, "val", cfg.get("eval_val", 5000), cfg.get("global_size", img_size), workers)
        idx = fixed_subset(len(x), min(max_samples, len(x)), seed).sort().values
    elif folder:  # decode only the analysed subset of the validation folder
        val = folders.imagefolder_datasets(data_dir, img_size)[1]
        data = dict(classes=val.classes, mean=folders.IMAGENET_MEAN, std=folders.IMAGENET_STD)
        x, y = folders.decode_folder(val, fixed_subset(len(val), min(max_samples, len(val)), seed).sort().values, img_size, workers)
        idx = slice(None)
    else:
        data = hold_out(load_images(dataset, data_dir), cfg.get("holdout", 0.0))
        x, y = data["val"]
        idx = fixed_subset(len(x), min(max_samples, len(x)), seed).sort().values
    return (x[idx], y[idx].long(), *(ckpt.get(k, data[k]) for k in ("classes", "mean", "std")))


# -----------------------------------------------------------------------------
# scenes: Fashion-MNIST items on textured backgrounds, with pixel masks (python data/scenes/prepare.py)

SCENE_ITEM = 28  # Fashion-MNIST items are 28 x 28
SCENE_CLASSES = ["background"] + FASHION_CLASSES


def textures(n, size, g):
    """n random backgrounds in [0, 240): a grating + smooth blobs + fine noise, each rescaled to its own grey band."""
    def u():  # one uniform number per texture, (n, 1, 1)
        return torch.rand(n, 1, 1, generator=g)

    yy, xx = torch.meshgrid(torch.arange(size, dtype=torch.float32), torch.arange(size, dtype=torch.float32),
                            indexing="ij")
    angle = u() * math.pi  # drawn in this order: a seed gives one texture
    period = 3 + 13 * u()
    phase = 2 * math.pi * u()
    grating = torch.sin(2 * math.pi / period * (xx * torch.cos(angle) + yy * torch.sin(angle)) + phase)
    blobs = F.interpolate(torch.rand(n, 1, 5, 5, generator=g), size=(size, size), mode="bicubic",
                          align_corners=False)[:, 0]
    noise = torch.rand(n, size, size, generator=g)
    t = u() * grating + 2 * u() * blobs + u() * noise
    lo, hi = t.amin(dim=(1, 2), keepdim=True), t.amax(dim=(1, 2), keepdim=True)
    t = (t - lo) / (hi - lo + 1e-6)  # [0, 1]
    return (100 * u() + (40 + 100 * u()) * t).round().to(torch.uint8)  # a band inside [0, 240)


def make_scenes(items, item_labels, n, seed, size=64, min_items=2, max_items=4, threshold=10):
    """n scenes from the item pool (items uint8 (M, 1, 28, 28), item_labels (M,)); a pure function of seed."""
    if size < SCENE_ITEM or not 1 <= min_items <= max_items:
        raise UsageError(f"scenes need size >= {SCENE_ITEM} and 1 <= min_items <= max_items (got size={size}, "
                         f"items {min_items}..{max_items})")
    g = torch.Generator().manual_seed(seed)
    images = textures(n, size, g).unsqueeze(1)  # (n, 1, size, size); the items are pasted on top
    masks = torch.zeros(n, size, size, dtype=torch.uint8)
    counts = torch.randint(min_items, max_items + 1, (n,), generator=g).tolist()
    picks = torch.randint(len(items), (n, max_items), generator=g)
    corners = torch.randint(size - SCENE_ITEM + 1, (n, max_items, 2), generator=g)
    placements = torch.cat([picks[..., None], corners], dim=-1)  # (n, max_items, 3): item, top, left
    for i, k in enumerate(counts):
        placements[i, k:] = -1
        for idx, top, left in placements[i, :k].tolist():
            item = items[idx, 0]
            pasted = item >= threshold  # (28, 28): the item's own pixels, not its black surround
            images[i, 0, top:top + SCENE_ITEM, left:left + SCENE_ITEM][pasted] = item[pasted]
            masks[i, top:top + SCENE_ITEM, left:left + SCENE_ITEM][pasted] = int(item_labels[idx]) + 1
    # the image label: the class with the most visible pixels
    K = len(SCENE_CLASSES)
    visible = torch.bincount((masks.view(n, -1).long() + K * torch.arange(n).view(n, 1)).flatten(), minlength=n * K)
    visible = visible.view(n, K)[:, 1:]  # (n, 10) pixels per item class
    labels = visible.argmax(dim=1)
    return dict(images=images, masks=masks, labels=labels, placements=placements)


def build_scenes(data_dir="data", n_train=10000, n_val=2000, size=64, min_items=2, max_items=4, threshold=10, seed=0,
          verbose=True):
    """Generate both splits and write data_dir/scenes/{train,val}.pt atomically; returns the two dicts."""
    fm = load_images("fashion_mnist", data_dir)
    out = {}
    for split, n, source, offset in (("train", n_train, fm["train"], 0), ("val", n_val, fm["val"], 1)):
        scenes = make_scenes(*source, n, seed * 2 + offset, size, min_items, max_items, threshold)
        scenes.update(classes=SCENE_CLASSES, size=size, seed=seed)
        path = os.path.join(data_dir, "scenes", f"{split}.pt")
        with common.atomic_write(path) as f:
            torch.save(scenes, f)
        if verbose:
            print(f"wrote {n} scenes of {size}x{size} to {path}")
        out[split] = scenes
    return out


def load_scenes(data_dir, split):
    """data_dir/scenes/{split}.pt, generated (and written) when missing, as python data/scenes/prepare.py does."""
    path = os.path.join(data_dir, "scenes", f"{split}.pt")
    if not os.path.isfile(path):
        print(f"{path} is missing: generating the scenes (python data/scenes/prepare.py does the same)")
        return build_scenes(data_dir)[split]
    return torch.load(path, weights_only=True)


def load_segmentation(name, data_dir, split, n, size, in_chans):
    """n images of a segmentation set ('scenes', offline, or 'pets', Oxford-IIIT Pet, downloads) resized to
    size x size: (images uint8 (n, in_chans, size, size), masks int64 (n, size, size) with 255 = ignore,
    class names)."""
    from torchvision.transforms import v2
    if name == "scenes":
        s = load_scenes(data_dir, split)
        x = s["images"][:n]
        m = s["masks"][:n].long()
        classes = s["classes"]
    elif name == "pets":
        from torchvision.datasets import OxfordIIITPet
        root = os.path.join(data_dir, "oxford_pets")
        try:
            with download_timeout(root):
                ds = OxfordIIITPet(root, split="trainval" if split == "train" else "test",
                                   target_types=["segmentation", "binary-category"], download=True)
        except Exception as e:
            raise UsageError(f"Oxford-IIIT Pet is not in {root} and the download failed ({e}); "
                             f"use --seg_dataset=scenes offline")
        xs, ms = [], []
        for i in fixed_subset(len(ds), n).tolist():
            img, (trimap, species) = ds[i]
            xs.append(v2.functional.resize(v2.functional.pil_to_tensor(img), [size, size], antialias=True))
            t = v2.functional.resize(v2.functional.pil_to_tensor(trimap), [size, size],
                                     interpolation=v2.InterpolationMode.NEAREST)[0].long()
            # trimap: 1 = pet, 2 = background, 3 = border (ignored)
            ms.append(torch.where(t == 1, 1 + species, torch.where(t == 2, 0, 255)))
        x = torch.stack(xs)
        m = torch.stack(ms)
        classes = ["background", "cat", "dog"]
    else:
        raise UsageError(f"unknown seg_dataset {name!r}; choose scenes, pets or none")
    if x.shape[-1] != size:
        x = v2.functional.resize(x, [size, size], antialias=True)
        m = F.interpolate(m[:, None].float(), size=(size, size), mode="nearest")[:, 0].long()
    if x.shape[1] != in_chans:  # grey scenes for an RGB backbone, RGB pets for a grey one
        x = x.expand(-1, 3, -1, -1) if in_chans == 3 else v2.functional.rgb_to_grayscale(x)
    return x.contiguous(), m, classes
