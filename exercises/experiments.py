"""
What the experiment exercises train and read, for exercises/check.py: the analyses of your runs that analyze.py wrote
(exercises 5 and 8), a trained ViT's tokens (exercise 7), a small image model trained inside a check (exercises 6 and
10) and its heads' smoothing (exercise 10). The checks themselves, what they compare and what they print as a verdict,
are the sections of check.py, which call these helpers by name (experiments.train_variant). Like check.py, this module
imports no script: the measures come from geometry.py, the images from data/.
"""

import glob
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: nanolap, data
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import common  # noqa: E402
import geometry  # noqa: E402
from data import augment, images  # noqa: E402
from nanolap import build_model, make_config  # noqa: E402

# ---- the model's input (exercises 6, 7 and 10) -------------------------------------------------------------------

def normalised(imgs, model, data):
    """uint8 images -> the model's normalised input (as training sees it, without augmentation); data holds the
    dataset's per-channel mean and std."""
    mean = torch.tensor(data["mean"]).view(1, -1, 1, 1)
    std = torch.tensor(data["std"]).view(1, -1, 1, 1)
    return (augment.to_unit(imgs, model.config.img_size) - mean) / std

# ---- your runs: their analyses (exercises 5 and 8) and a trained ViT's tokens (exercise 7) ---------------------

def read_comparison(out, kind):
    """The analyses of the `kind` runs in OUT/analysis/<run>/analysis.json, as `python analyze.py OUT/run1 OUT/run2`
    writes them."""
    path = os.path.join(out, "analysis")
    found = sorted(glob.glob(os.path.join(glob.escape(path), "*", "analysis.json")))
    if not found:
        print(f"FAIL: no analyses in {path}; train the two runs and analyse them first (exercises/README.md)")
        return None
    runs = [analysis for analysis in map(json.load, map(open, found)) if analysis.get("kind") == kind]
    if len(runs) < 2:
        print(f"FAIL: {path} holds {len(runs)} analysed {kind} run(s); analyse both runs in one analyze.py command")
        return None
    settings = runs[0]["settings"]
    print(f"from {path} ({settings['n_samples']} validation sequences per run, {settings['tokens']})")
    return runs


def trained_tokens(run, max_samples, seed):
    """Final-norm patch tokens (N, T, d) of the validation images that `analyze.py RUN --max_samples=N` measures, and
    analyze.py's spectrum of them in RUN/analysis/analysis.json (None without the file)."""
    ckpt = common.load_checkpoint(os.path.join(run, "ckpt.pt"))
    model = common.load_model(ckpt).eval()
    x, _, _, mean, std = images.eval_images(ckpt, max_samples, seed)
    tokens = []
    with torch.no_grad():
        for i in range(0, len(x), 64):
            tokens.append(model.forward_features(normalised(x[i:i + 64], model, dict(mean=mean, std=std)))[:, 1:])
    path = os.path.join(run, "analysis", "analysis.json")
    stored = json.load(open(path))["spectrum"] if os.path.isfile(path) else None
    return torch.cat(tokens), stored

# ---- a small image model trained inside a check (exercises 6 and 10) ---------------------------------------------

HEAD_PARAMETERS = ("gate_logit", "lam")  # exercise 6's gates and exercise 10's lambdas: a learning rate of their own


def train_image_model(model, data, steps, batch_size, lr, head_lr, val_images, seed):
    """AdamW on random training batches of data (images.load_images; no augmentation), cosine learning rates; the
    HEAD_PARAMETERS get their own learning rate and no weight decay, which would pull them back to their start. Returns
    the accuracy on the first val_images validation images."""
    x, y = data["train"]
    xv, yv = data["val"]
    heads = [p for n, p in model.named_parameters() if n.endswith(HEAD_PARAMETERS)]
    rest = [p for n, p in model.named_parameters() if not n.endswith(HEAD_PARAMETERS)]
    groups = [dict(params=rest, lr=lr, weight_decay=0.05), dict(params=heads, lr=head_lr, weight_decay=0.0)]
    optimizer = torch.optim.AdamW(groups) if steps else None  # --steps=0 evaluates the initial model
    g = torch.Generator().manual_seed(seed)
    t0 = time.time()
    model.train()
    for step in range(1, steps + 1):
        for group, peak in zip(optimizer.param_groups, (lr, head_lr)):  # cosine decay to 0
            group["lr"] = peak * 0.5 * (1 + math.cos(math.pi * (step - 1) / steps))
        i = torch.randint(0, len(y), (batch_size,), generator=g)
        loss = F.cross_entropy(model(normalised(x[i], model, data)), y[i])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == steps:
            print(f"  step {step}/{steps} | loss {loss.item():.4f} | {time.time() - t0:.0f}s")
    model.eval()
    with torch.no_grad():
        xv, yv = xv[:val_images], yv[:val_images]
        correct = sum((model(normalised(xv[i:i + 500], model, data)).argmax(-1) == yv[i:i + 500]).sum().item()
                      for i in range(0, len(yv), 500))
    return correct / len(yv)


def train_variant(variant, build, heads, steps, batch_size, lr, head_lr, dataset, data_dir, val_images, seed):
    """Train a mean-pooling vit-cpu on dataset (train_image_model) and print its validation accuracy; heads: `variant`
    (the exercise's heads: build(cfg) makes the model), 'attention' or 'laplacian' (nanolap's, every head of that
    type). Returns the model and the data."""
    if heads not in (variant, "attention", "laplacian"):
        raise common.UsageError(f"--heads={heads!r}: choose {variant}, attention or laplacian")
    torch.manual_seed(seed)
    data = images.load_images(dataset, data_dir)
    n_lap = 4 if heads == "laplacian" else 0  # the exercise's heads: their own parameters decide
    cfg = make_config("vit-cpu", pooling="mean", num_classes=data["num_classes"], n_lap=n_lap)
    model = build(cfg) if heads == variant else build_model(cfg)
    print(f"training a vit-cpu with {heads} heads on {dataset}: {steps} steps of {batch_size} images")
    acc = train_image_model(model, data, steps, batch_size, lr, head_lr, val_images, seed)
    print(f"  val_acc {acc:.4f} on {min(val_images, len(data['val'][1]))} validation images")
    return model, data

# ---- its heads' smoothing (exercise 10) ---------------------------------------------------------------------------

@torch.no_grad()
def head_rho(model, imgs):
    """Per block, every head's first-order change rho_h of the within-image variance of the patch tokens of imgs
    (normalised images), as analyze.py reports it: geometry.py's per-head analysis. Negative: the head smooths them."""
    stats = [(geometry.VarChange(), geometry.VarChange()) for _ in model.blocks]
    geometry.update_heads(model, model.embed(imgs), None, stats, geometry.patch_tokens)
    return [torch.tensor(layer["rho"]) for layer in geometry.head_results(model, stats)["layers"]]
