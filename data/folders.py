"""ImageNet-style folders, root/train/<class>/*.jpg and root/val/<class>/*.jpg, read lazily: torchvision datasets whose
DataLoader workers decode (and, for training, crop and flip) the images; the rest of the augmentation runs batched on
the device (data/augment.py)."""

import os

import torch

from common import UsageError

IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def check_folders(path):
    for split in ("train", "val"):
        if not os.path.isdir(os.path.join(path, split)):
            raise UsageError(f"imagefolder: {os.path.join(path, split)} is not a directory. Pass --data_dir=<folder> "
                             f"holding train/ and val/, each with one sub-folder of images per class (ImageNet layout)")


def imagefolder_datasets(path, img_size, hflip=True, rand_augment=0, rand_magnitude=9, simple_random_crop=False):
    """ImageNet-style folders path/train/<class>/*.jpg and path/val/<class>/*.jpg as torchvision datasets
    that decode, crop and flip in DataLoader workers and return uint8 (3, img_size, img_size) tensors.
    Training crop: random resized crop (scale 0.08-1), as DeiT-III and the first author on ImageNet-1k; with
    simple_random_crop DeiT-III's crop for ImageNet-21k (resize the short side, random crop with 4 pixels of
    reflect padding). Validation: resize to img_size/0.875, centre crop. Every resize is bicubic, as in DeiT
    (timm's train.py draws bilinear or bicubic per image by default). The photometric part of 3-Augment, mixup
    and cutmix run batched on the device."""
    from torchvision import datasets
    from torchvision.transforms import v2
    check_folders(path)
    bicubic = v2.InterpolationMode.BICUBIC
    if simple_random_crop:
        crop = [v2.Resize(img_size, bicubic, antialias=True),
                v2.RandomCrop(img_size, padding=4, padding_mode="reflect")]
    else:
        crop = [v2.RandomResizedCrop(img_size, scale=(0.08, 1.0), interpolation=bicubic, antialias=True)]
    randaug = [v2.RandAugment(rand_augment, rand_magnitude)] if rand_augment else []
    flip = [v2.RandomHorizontalFlip()] if hflip else []
    train_tf = v2.Compose(crop + flip + randaug + [v2.PILToTensor()])
    val_tf = v2.Compose([v2.Resize(int(img_size / 0.875), bicubic, antialias=True), v2.CenterCrop(img_size),
                         v2.PILToTensor()])
    return (datasets.ImageFolder(os.path.join(path, "train"), train_tf),
            datasets.ImageFolder(os.path.join(path, "val"), val_tf))


def imagefolder_squares(path, base=256):
    """DINO's folders: every image decoded (in DataLoader workers) and resized to a base x base square, from
    which the multi-crop augmentation cuts its views on the device. Returns dict(train=ImageFolder,
    val=ImageFolder, num_classes, classes, mean, std) like load_images, with ImageNet's statistics (computing
    them would mean decoding the whole folder)."""
    from torchvision import datasets
    from torchvision.transforms import v2
    check_folders(path)
    square = v2.Compose([v2.ToImage(), v2.RGB(), v2.Resize(base, antialias=True), v2.CenterCrop(base)])
    out = {split: datasets.ImageFolder(os.path.join(path, split), transform=square) for split in ("train", "val")}
    classes = out["train"].classes
    return dict(out, num_classes=len(classes), classes=classes, mean=IMAGENET_MEAN, std=IMAGENET_STD)


def decode_folder(folder, indices, size, num_workers):
    """folder[indices] as uint8 (N, 3, size, size) and labels, decoded by a DataLoader (evaluation sets)."""
    from torchvision.transforms import v2
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(folder, indices.tolist()), batch_size=256,
                                         num_workers=num_workers)
    xs, ys = [], []
    for x, y in loader:
        xs.append(v2.functional.resize(x, [size, size], antialias=True))
        ys.append(y)
    return torch.cat(xs), torch.cat(ys)
