"""DINO's evaluations of a frozen backbone, kept apart from training as facebookresearch/dino keeps eval_knn.py and
eval_linear.py: the weighted k-NN on CLS features, a linear probe on the CLS tokens of the last blocks, a linear
segmentation probe on patch tokens (mIoU), and each one's raw-pixel baseline, what a probe reaches without a backbone.
The baselines read the images at most PIXEL_SIDE pixels on a side: cheap even for ImageNet's 224 x 224 x 3.
"""

import itertools
import math
import time
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F

import common
from common import print0

PIXEL_SIDE = 32  # the raw-pixel baselines' image side at most (a 28 px dataset keeps its 28)


@torch.no_grad()
def extract_features(model, x_uint8, mean, std, device, kind="cls", blocks=1, batch_size=256, ctx=nullcontext()):
    """Features of uint8 images (N, C, H, W): kind='cls' -> CLS of the last `blocks` blocks, each final-normed
    and concatenated (N, blocks * d) (DINO's get_intermediate_layers); 'patch' -> (N, h, w, d) patch tokens;
    'pixels' -> the normalised pixels themselves (N, C*S*S) at side S = min(H, PIXEL_SIDE), the baseline."""
    mean, std = (torch.tensor(v, device=device).view(1, -1, 1, 1) for v in (mean, std))
    out = []
    for i in range(0, len(x_uint8), batch_size):
        x = (x_uint8[i:i + batch_size].to(device).float() / 255 - mean) / std
        if kind == "pixels":
            side = min(x.shape[-1], PIXEL_SIDE)
            out.append(F.interpolate(x, size=side, mode="area").flatten(1).cpu() if side < x.shape[-1] else x.flatten(1).cpu())
            continue
        with ctx:
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

def knn_eval(backbone, eval_sets, mean, std, num_classes, k, temp, device, ctx=nullcontext()):
    """k-NN accuracy of the backbone's CLS features on eval_sets ((x, y) train, (x, y) val); None = raw pixels."""
    (xt, yt), (xv, yv) = eval_sets
    kind = "pixels" if backbone is None else "cls"
    ft, fv = (extract_features(backbone, x, mean, std, device=device, kind=kind, ctx=ctx) for x in (xt, xv))
    return knn_accuracy(ft, yt, fv, yv, num_classes=num_classes, k=k, temp=temp)

def train_linear(feats, labels, num_classes, steps, seed, batch_size=256, lr=3e-3, ignore_index=-100):
    """A linear layer on standardised frozen features: zero init, `steps` AdamW steps, cosine lr, cross-entropy.
    Returns the predictor: features -> logits."""
    g = torch.Generator().manual_seed(seed)
    mean, std = feats.mean(dim=0), feats.std(dim=0) + 1e-6
    clf = nn.Linear(feats.shape[1], num_classes)
    nn.init.zeros_(clf.weight)
    nn.init.zeros_(clf.bias)
    opt = torch.optim.AdamW(clf.parameters(), lr=lr, weight_decay=1e-4)
    batches = (idx for _ in itertools.count() for idx in torch.randperm(len(feats), generator=g).split(batch_size))
    for step, idx in zip(range(steps), batches):  # epochs of shuffled batches
        for group in opt.param_groups:
            group["lr"] = common.cosine_schedule(step, steps, lr, 0.0)
        loss = F.cross_entropy(clf((feats[idx] - mean) / std), labels[idx], ignore_index=ignore_index)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    @torch.no_grad()
    def predictor(f, chunk=4096):  # features -> logits
        return torch.cat([clf((f[i:i + chunk] - mean) / std) for i in range(0, len(f), chunk)])
    return predictor

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
    """Pixel mIoU of a linear probe on patch features (N, h, w, d) fit to majority patch labels, logits upsampled."""
    grid, d = train_f.shape[1], train_f.shape[-1]
    labels = patch_labels(train_m, grid, num_classes).flatten()
    predictor = train_linear(train_f.reshape(-1, d), labels, num_classes, steps=steps, seed=seed, batch_size=4096,
                             ignore_index=255)
    logits = predictor(val_f.reshape(-1, d)).view(len(val_f), grid, grid, num_classes).permute(0, 3, 1, 2)
    pred = F.interpolate(logits, size=val_m.shape[-2:], mode="bilinear", align_corners=False).argmax(dim=1)
    return miou(pred.flatten(), val_m.flatten(), num_classes)

def pixel_patches(x_uint8, mean, std, patch):
    """The normalised pixels of each patch, (N, h, w, C * patch * patch): the segmentation probe's baseline."""
    mean, std = (torch.tensor(v).view(1, -1, 1, 1) for v in (mean, std))
    pixels = (x_uint8.float() / 255 - mean) / std  # (N, C, S, S)
    return F.pixel_unshuffle(pixels, patch).permute(0, 2, 3, 1)

def evaluate_final(backbone, eval_sets, seg_sets, mean, std, num_classes, linear_blocks, probe_steps, seed, device,
                   ctx=nullcontext()):
    """Linear and segmentation probes and their raw-pixel baselines (seg_sets None: no segmentation)."""
    t0 = time.time()
    res = {}
    (xt, yt), (xv, yv) = eval_sets
    blocks = min(linear_blocks, backbone.config.n_layer)
    for key, model, kind in (("linear_acc", backbone, "cls"), ("linear_acc_pixels", None, "pixels")):
        ft, fv = (extract_features(model, x, mean, std, device=device, kind=kind, blocks=blocks, ctx=ctx) for x in (xt, xv))
        predictor = train_linear(ft, yt, num_classes, steps=probe_steps, seed=seed)
        res[key] = (predictor(fv).argmax(1) == yv).float().mean().item()
    print0(f"linear probe (CLS of the last {blocks} blocks, {len(xt)} train / {len(xv)} val images): "
           f"{res['linear_acc']:.4f} (raw pixels {res['linear_acc_pixels']:.4f}) | {time.time() - t0:.1f}s")
    if seg_sets is not None:
        t0 = time.time()
        (st, mt, classes), (sv, mv, _) = seg_sets
        patch = backbone.config.patch_size
        ft, fv = (extract_features(backbone, x, mean, std, device=device, kind="patch", ctx=ctx) for x in (st, sv))
        res["seg_miou"] = segmentation_miou(ft, mt, fv, mv, num_classes=len(classes), steps=probe_steps, seed=seed)
        pt, pv = (pixel_patches(x, mean, std, patch) for x in (st, sv))  # the baseline: raw pixels per patch
        res["seg_miou_pixels"] = segmentation_miou(pt, mt, pv, mv, num_classes=len(classes), steps=probe_steps, seed=seed)
        print0(f"segmentation probe ({len(classes)} classes, {len(st)} train / {len(sv)} val images of {st.shape[-1]}px): "
               f"mIoU {res['seg_miou']:.4f} (raw pixels {res['seg_miou_pixels']:.4f}) | {time.time() - t0:.1f}s")
    return res
