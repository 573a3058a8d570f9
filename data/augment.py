"""
Augmentation on the training device, batched: every image gets its own random draw, and nothing waits for
a DataLoader. Randomness comes from a `rand(*shape)` source (uniform [0, 1) numbers) or the global RNG, which
the training scripts seed per step, so a resumed run repeats an uninterrupted one exactly.

  supervised ViT (DeiT-III): random_crop, random_hflip, rand_augment_groups, three_augment, make_mixer,
                             random_erasing
  DINO:                      MultiCrop (random resized crops, flips, colour jitter, grayscale, blur, solarise)
The kernels follow torchvision.transforms.v2.functional; tests/test_dino.py checks them against it.
"""

import math

import torch
import torch.nn.functional as F

import common

# -----------------------------------------------------------------------------
# kernels


def grayscale(x):
    """(B, 3, H, W) -> (B, 1, H, W) with ITU-R 601 weights, as torchvision; one channel stays as it is."""
    if x.shape[1] == 1:
        return x
    return (0.2989 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]).unsqueeze(1)


def gaussian_blur(x, sigma):
    """Blur each image of x (B, C, H, W) with its own sigma (B,) (0 = untouched): a separable kernel of
    2 * ceil(3 * max sigma) + 1 taps (capped by the image size) with reflect padding, as torchvision.
    sigma lives on the CPU: the kernel's size is read from it without waiting for the GPU."""
    B, C, H, W = x.shape
    radius = min(math.ceil(3 * float(sigma.max())), H - 1, W - 1)  # a CPU tensor: no host sync
    if radius < 1:
        return x
    sigma = common.to_device(sigma, x.device)
    t = torch.arange(-radius, radius + 1, device=x.device, dtype=x.dtype)
    kernel = torch.exp(-0.5 * (t / sigma.clamp_min(1e-6).view(-1, 1)) ** 2)  # (B, K)
    kernel = kernel / kernel.sum(dim=1, keepdim=True)
    kernel = kernel.repeat_interleave(C, dim=0)  # (B*C, K): one kernel per image and channel
    y = F.pad(x.reshape(1, B * C, H, W), (radius, radius, radius, radius), mode="reflect")
    y = F.conv2d(y, kernel.view(B * C, 1, -1, 1), groups=B * C)
    y = F.conv2d(y, kernel.view(B * C, 1, 1, -1), groups=B * C)
    return y.view(B, C, H, W)


def adjust_hue(x, shift):
    """Rotate the hue of RGB images x (B, 3, H, W) in [0, 1] by shift (B,) turns, through HSV."""
    r, g, b = x.unbind(1)
    maxc, minc = x.amax(1), x.amin(1)
    chroma = maxc - minc
    gray = chroma == 0
    sat = chroma / torch.where(gray, torch.ones_like(maxc), maxc)
    c = torch.where(gray, torch.ones_like(chroma), chroma)
    rc = (maxc - r) / c
    gc = (maxc - g) / c
    bc = (maxc - b) / c
    hue = torch.where(maxc == r, bc - gc, torch.where(maxc == g, 2.0 + rc - bc, 4.0 + gc - rc))
    hue = torch.where(gray, torch.zeros_like(hue), hue)
    hue = (hue / 6.0 + 1.0 + shift.view(-1, 1, 1)) % 1.0
    # back to RGB: channel n takes v - v*s*clamp(min(k, 4 - k), 0, 1) with k = (n + 6h) mod 6, n = 5, 3, 1
    n = torch.arange(5.0, 0.0, -2.0, device=x.device)  # made on the device: torch.tensor([5.0, 3.0, 1.0]) is a copy
    k = (n.view(1, 3, 1, 1) + 6 * hue.unsqueeze(1)) % 6
    return maxc.unsqueeze(1) * (1 - sat.unsqueeze(1) * torch.minimum(k, 4 - k).clamp(0, 1))


def resized_crop(x, x0, y0, w, h, size, flip=None):
    """Crop box (x0, y0, w, h) (pixels, (B,) each, may be fractional) of every image, resized bicubically (as DINO's
    RandomResizedCrop) to size x size, mirrored where flip (B,) is True and clamped to [0, 1] (bicubic overshoots):
    one affine grid_sample for the whole batch. It equals torchvision's crop-then-resize (antialias=False) except
    within 2 pixels of a box edge inside the image: there its taps read the image's own pixels beyond the box, where
    torchvision repeats the box's edge pixel; one call for the batch is worth that. (DINO's PIL resize antialiases.)"""
    B, C, H, W = x.shape
    mirror = 1.0 if flip is None else torch.where(flip, -1.0, 1.0)
    theta = torch.zeros(B, 2, 3, device=x.device)  # output [-1, 1]^2 -> the box in input coordinates
    theta[:, 0, 0], theta[:, 0, 2] = mirror * w / W, (2 * x0 + w) / W - 1
    theta[:, 1, 1], theta[:, 1, 2] = h / H, (2 * y0 + h) / H - 1
    grid = F.affine_grid(theta, [B, C, size, size], align_corners=False)
    return F.grid_sample(x, grid, mode="bicubic", padding_mode="border", align_corners=False).clamp_(0, 1)


def color_jitter(x, strengths, p, rand):
    """torchvision's ColorJitter per image on floats in [0, 1]: with probability p, brightness, contrast,
    saturation and hue (strengths, in this order of the list) each with its own factor, applied in a random
    order per image. Factors are uniform in [max(0, 1 - s), 1 + s], hue shifts in [-s, s]; one channel has
    no saturation or hue."""
    B = x.shape[0]
    strength = dict(zip(("brightness", "contrast", "saturation", "hue"), strengths))
    if x.shape[1] == 1:
        strength["saturation"] = strength["hue"] = 0
    ops = [(name, s) for name, s in strength.items() if s > 0]
    if not ops or not p:
        return x
    apply = rand(B) < p
    factors = [s * (2 * rand(B) - 1) if name == "hue" else (1 + s * (2 * rand(B) - 1)).clamp(min=0)
               for name, s in ops]
    order = rand(B, len(ops)).argsort(dim=1)  # a random permutation of the ops for every image
    for position in range(len(ops)):
        for j, ((name, _), f) in enumerate(zip(ops, factors)):
            # every op on every image, kept where chosen: asking whether any image chose it would wait for the GPU
            chosen = apply & (order[:, position] == j)
            x = torch.where(chosen.view(B, 1, 1, 1), adjust(x, name, f), x)
    return x


def adjust(x, name, f):
    """One colour-jitter op with a factor per image f (B,)."""
    f4 = f.view(-1, 1, 1, 1)
    if name == "brightness":
        return (x * f4).clamp(0, 1)
    if name == "contrast":  # blend with the mean grey level of the image
        return (f4 * x + (1 - f4) * grayscale(x).mean(dim=(1, 2, 3), keepdim=True)).clamp(0, 1)
    if name == "saturation":  # blend with the grey image
        return (f4 * x + (1 - f4) * grayscale(x)).clamp(0, 1)
    return adjust_hue(x, f)

# -----------------------------------------------------------------------------
# the supervised ViT's augmentation (DeiT-III), on the global RNG


def to_unit(x, img_size):
    """uint8 images (B, C, H, W) -> floats in [0, 1] at img_size x img_size (resized only if needed).
    Bicubic with antialiasing, as DeiT and timm resize; clamped to [0, 1] like their uint8 (PIL) results."""
    x = x.float().div_(255)
    if x.shape[-1] != img_size:
        x = F.interpolate(x, size=(img_size, img_size), mode="bicubic", antialias=True).clamp_(0, 1)
    return x


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


def rand_augment_groups(x, num_ops, magnitude, group=8):
    """torchvision's RandAugment on uint8 images. It draws one op sequence per call, so it is called on groups
    of `group` images: ops differ between groups and are shared inside one (1 would be per image, but slow)."""
    from torchvision.transforms import v2
    ra = v2.RandAugment(num_ops, magnitude)
    return torch.cat([ra(chunk) for chunk in x.split(group)])


def three_augment(x, jitter):
    """DeiT-III's 3-Augment (photometric part) on floats in [0, 1]: per image one of grayscale, solarisation
    (invert pixels >= 128/255) or Gaussian blur (sigma in [0.1, 2]), chosen uniformly; then torchvision's
    colour jitter: brightness, contrast and saturation of strength `jitter`, in a random order per image."""
    B = x.shape[0]
    choice = torch.randint(0, 3, (B, 1, 1, 1), device=x.device)
    x = torch.where(choice == 0, grayscale(x).expand_as(x), x)
    x = torch.where((choice == 1) & (x >= 128 / 255), 1 - x, x)
    x = torch.where(choice == 2, gaussian_blur(x, torch.empty(B).uniform_(0.1, 2.0)), x)  # sigma drawn on the CPU
    return color_jitter(x, [jitter, jitter, jitter, 0.0], 1.0, lambda *shape: torch.rand(*shape, device=x.device))


def make_mixer(mixup, cutmix, num_classes):
    """torchvision.transforms.v2 MixUp / CutMix (one of them per batch, like timm) or None.
    Returns images mixed with a rolled copy of the batch and soft targets (B, num_classes) summing to 1."""
    if not (mixup or cutmix):
        return None
    from torchvision.transforms import v2
    mixers = ([v2.MixUp(alpha=mixup, num_classes=num_classes)] if mixup else []) + (
        [v2.CutMix(alpha=cutmix, num_classes=num_classes)] if cutmix else [])
    return mixers[0] if len(mixers) == 1 else v2.RandomChoice(mixers)


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

# -----------------------------------------------------------------------------
# DINO's multi-crop augmentation, from a seeded torch.Generator


class MultiCrop:
    """DINO's augmentation for a batch of uint8 images -> [global crops (2B, C, G, G), local crops (nB, C, L, L)],
    normalised. Global crop 1: blur always; global crop 2: blur p=0.1, solarise p=solarize_p; local crops:
    blur p=0.5 (facebookresearch/dino). Crops of one image are B apart: global crop 2 of image i is row B + i."""

    def __init__(self, config, channels, mean, std, device="cpu"):
        self.c, self.rgb = config, channels == 3
        self.mean = torch.tensor(mean, device=device).view(1, -1, 1, 1)  # on the images' device once, not every step
        self.std = torch.tensor(std, device=device).view(1, -1, 1, 1)

    def __call__(self, images, generator):
        x = images.float() / 255  # (B, C, H, W)
        c = self.c
        views = [self.view(x, c["global_size"], c["global_scale"], 1.0, 0.0, generator),
                 self.view(x, c["global_size"], c["global_scale"], 0.1, c["solarize_p"], generator)]
        crops = [torch.cat(views)]
        if c["local_crops"]:
            xl = x.repeat(c["local_crops"], 1, 1, 1)  # (nB, C, H, W): local crop j of image i is row j*B + i
            crops.append(self.view(xl, c["local_size"], c["local_scale"], 0.5, 0.0, generator))
        return [(v - self.mean) / self.std for v in crops]

    def view(self, x, size, scale, blur_p, solarize_p, g):
        """One random view of every image: crop + resize + flip, colour jitter, grayscale, blur, solarise."""
        B, C, H, W = x.shape
        def rand(*shape, device=x.device):  # uniform numbers from the generator (on the CPU), on the images' device
            return common.to_device(torch.rand(*shape, generator=g), device)

        # RandomResizedCrop: area fraction in `scale`, aspect ratio log-uniform in [3/4, 4/3], then
        # a bicubic resize (and the horizontal flip) in one grid_sample
        area = H * W * (scale[0] + (scale[1] - scale[0]) * rand(B))
        ratio = torch.exp(math.log(3 / 4) + math.log(16 / 9) * rand(B))
        w = torch.sqrt(area * ratio).clamp(max=W)
        h = torch.sqrt(area / ratio).clamp(max=H)
        x0, y0 = (W - w) * rand(B), (H - h) * rand(B)
        x = resized_crop(x, x0, y0, w, h, size, flip=rand(B) < 0.5)
        x = color_jitter(x, self.c["jitter"], self.c["jitter_p"], rand)
        if self.rgb and self.c["grayscale_p"]:
            x = torch.where((rand(B) < self.c["grayscale_p"]).view(B, 1, 1, 1), grayscale(x).expand_as(x), x)
        lo, hi = self.c["blur_sigma"]
        cpu = torch.device("cpu")
        sigma = torch.where(rand(B, device=cpu) < blur_p, lo + (hi - lo) * rand(B, device=cpu), torch.zeros(B))
        x = gaussian_blur(x, sigma)
        if solarize_p:
            x = torch.where((rand(B) < solarize_p).view(B, 1, 1, 1) & (x >= 0.5), 1 - x, x)
        return x
