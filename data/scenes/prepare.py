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
The training scripts build the files themselves when they are missing (data/images.py does the work).
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the repo root
from configurator import configure  # noqa: E402
from data.images import build_scenes  # noqa: E402

data_dir = "data"  # Fashion-MNIST is looked up here (see data/images.py); scenes go to data_dir/scenes
n_train = 10000  # scenes in train.pt
n_val = 2000  # scenes in val.pt
size = 64  # scene side in pixels (Fashion-MNIST items are 28 x 28)
min_items = 2  # items per scene, at least ...
max_items = 4  # ... and at most
threshold = 10  # item pixels >= this value (0..255) are pasted; the rest of its 28 x 28 square is not
seed = 0  # the scenes are a pure function of it

if __name__ == "__main__":
    configure(globals())
    build_scenes(data_dir, n_train, n_val, size, min_items, max_items, threshold, seed)
