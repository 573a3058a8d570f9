"""
Supervised ViTs with Laplacian heads (DeiT-III recipe), from a laptop CPU to many GPUs.
Work in progress: the data section below is shared with train_dino.py and analyze.py.
"""

import gzip
import os

import torch

from nanolap import UsageError

# -----------------------------------------------------------------------------
# data

FASHION_FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
                 "val": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}
DEBIAN_FASHION = "/usr/share/datasets/fashion-mnist"  # apt-get install dataset-fashion-mnist
IMAGE_DATASETS = ("fashion_mnist", "cifar10", "cifar100")


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
                         f"Fix: apt-get install -y dataset-fashion-mnist, or copy the four *-ubyte.gz files into {root}")
    return os.path.join(root, "FashionMNIST", "raw")


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
    else:
        from torchvision import datasets
        cls = datasets.CIFAR10 if name == "cifar10" else datasets.CIFAR100
        try:
            sets = {s: cls(root, train=(s == "train"), download=True) for s in ("train", "val")}
        except Exception as e:
            raise UsageError(f"{name} is not in {root} and the download failed ({e}).\n"
                             f"Fix: connect to the internet once, or put the extracted python-version archive in {root}")
        split = {s: (torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous(), torch.tensor(ds.targets))
                 for s, ds in sets.items()}
        classes = sets["train"].classes
    x = split["train"][0].float().div_(255)
    mean, std = x.mean(dim=(0, 2, 3)).tolist(), x.std(dim=(0, 2, 3)).tolist()
    return dict(train=split["train"], val=split["val"], num_classes=len(classes), classes=classes, mean=mean, std=std)
