"""
Scenes: an offline segmentation dataset, generated deterministically from Fashion-MNIST.

Each scene is a size x size grey image: a random texture (a sinusoidal grating, smooth blobs and fine
noise) with 2-4 Fashion-MNIST items pasted at random places; later items occlude earlier ones. The
mask labels every pixel: 0 = background, 1 + c = a pixel copied from an item of Fashion-MNIST class c.
The image-level label is the class of the item with the most visible pixels (for k-NN / linear probes
when training on scenes). Train scenes use Fashion-MNIST train items, val scenes its test items.

    python data/scenes/prepare.py                      # writes data/scenes/train.pt and val.pt
    python data/scenes/prepare.py --n_train=2000 --seed=1

Each file is a dict of tensors readable with torch.load(weights_only=True): images uint8 (N, 1, S, S),
masks uint8 (N, S, S), labels int64 (N,), placements int64 (N, max_items, 3) holding (item index,
top, left) in paste order, -1 where a scene has fewer items; plus classes, size, seed.
The training scripts build the files themselves when they are missing (data/images.py calls build_scenes).
"""

import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the repo root
import common  # noqa: E402
from common import UsageError, configure  # noqa: E402
from data import images  # noqa: E402

data_dir = "data"  # Fashion-MNIST is looked up here (see data/images.py); scenes go to data_dir/scenes
n_train = 10000  # scenes in train.pt
n_val = 2000  # scenes in val.pt
size = 64  # scene side in pixels (Fashion-MNIST items are 28 x 28)
min_items = 2  # items per scene, at least ...
max_items = 4  # ... and at most
threshold = 10  # item pixels >= this value (0..255) are pasted; the rest of its 28 x 28 square is not
seed = 0  # the scenes are a pure function of it

SCENE_ITEM = 28  # Fashion-MNIST items are 28 x 28
SCENE_CLASSES = ["background"] + images.FASHION_CLASSES


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
    fm = images.load_images("fashion_mnist", data_dir)
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


if __name__ == "__main__":
    configure(globals())
    build_scenes(data_dir, n_train, n_val, size, min_items, max_items, threshold, seed)
