"""
Supervised ViTs with Laplacian heads, the DeiT-III recipe: the paper's first experiment, from a laptop CPU
(Fashion-MNIST) to ImageNet on many GPUs. The model lives in nanolap.py, the data and its augmentation in data/.

    python train_vit.py                                   # CPU: Fashion-MNIST, every head Laplacian
    python train_vit.py --n_lap=0                         # the same ViT with attention heads only
    python train_vit.py --n_lap=[0,2,4,4]                 # a per-layer schedule
    python train_vit.py config/vit_cifar10.py             # one GPU: CIFAR-10, vit-small, DeiT-III ingredients
    torchrun --nproc_per_node=8 train_vit.py config/vit_deit3_b.py --data_dir=/data/imagenet   # the paper
    python train_vit.py --resume                          # continue out_dir/ckpt.pt exactly where it stopped

To reproduce a run on more processes keep the global batch (divide batch_size or grad_accum) and lr; for a larger one
scale lr with it (DeiT: 5e-4 * global_batch / 512) and keep warmup in epochs. The data order and every random draw
depend on (seed, epoch, step, chunk), never on how the global batch is split: 1 or N processes see the same images.
"""

import os
import time
from contextlib import nullcontext
from dataclasses import asdict

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import common
import configurator
import nanolap
from common import UsageError, print0
from data import augment, folders, images
from optim import load_optimizer_states, optimizer_step

# ----------------------------------------------------------------------------- defaults
# I/O
out_dir = "out-vit"  # ckpt.pt, log.jsonl and result.txt go here; a fresh run moves an earlier run's files aside
eval_interval = 250  # steps between evaluations and checkpoints (also at step 0 and the last); the default: an epoch
log_interval = 100  # optimizer steps between progress lines
resume = False  # continue from out_dir/ckpt.pt exactly where it stopped (options on the command line go on top)
stop_at_step = 0  # stop with a checkpoint after this step, as if interrupted (the schedule still spans the whole run); 0 = never
# data
dataset = "fashion_mnist"  # fashion_mnist | cifar10 | cifar100 | synthetic (generated, for tests) | imagefolder
data_dir = "data"  # small datasets: data/<dataset>; imagefolder: the folder holding train/ and val/
train_subset = 0  # train on N training images only (0 = all): smoke tests and quick recipe checks
val_subset = 0  # evaluate on N validation images only (0 = all): faster evals, noisier numbers
holdout = 0.0  # for choosing hyperparameters: train without the last this fraction of the train images, evaluate on it; 0 = off
img_size = 0  # model resolution; 0 = the dataset's own (imagefolder: 224); small datasets are resized on the device
num_workers = min(8, os.cpu_count() or 1)  # imagefolder: DataLoader processes per training process; raise it while data_wait is high
# model (None = the preset's value)
preset = "vit-cpu"  # vit-cpu (vit-tiny at d 64, patch 7: fast on a CPU) | vit-tiny | vit-small | vit-b (DeiT-III)
n_lap = 4  # Laplacian heads per layer: 0..n_head, or a per-layer list like [0,2,4,4]; 0 = a plain ViT to compare
n_layer = None  # transformer blocks
n_head = None  # heads per layer (Laplacian and attention together)
n_embd = None  # token width; must be a multiple of n_head
patch_size = None  # pixels per patch side; smaller patches mean more tokens: slower, often more accurate
mlp_ratio = None  # MLP hidden width / n_embd (4.0 in every preset)
pooling = "mean"  # 'cls' token or 'mean' of the patch tokens; mean pooling suits short CPU runs
drop_path = 0.1  # stochastic depth, rising linearly to the last block; curbs overfitting (DeiT-III: 0.1-0.4)
layerscale = None  # LayerScale init (DeiT-III: 1e-6, it steadies deep models); 0.0 = off
qk_norm = None  # normalise queries and keys per head (the paper's ViTs: True); keeps attention logits bounded
graph = "attention"  # P: attention (softmax) | uniform (every head: the sequence mean) | lap_uniform (the Laplacian heads alone)
# augmentation (on the device, per image, batched)
crop_padding = 0  # random crop after zero-padding by this many pixels (CIFAR: 4); imagefolder: random resized crop
simple_random_crop = False  # imagefolder: DeiT-III's ImageNet-21k crop (resize, crop with 4 px padding), not RRC
hflip = False  # random horizontal flip: on for natural images; off for Fashion-MNIST, whose items share one orientation
three_augment = False  # DeiT-III 3-Augment: per image one of grayscale / solarize / blur, then colour jitter
color_jitter = 0.3  # 3-Augment's brightness/contrast/saturation strength
rand_augment = 0  # RandAugment: ops per image (0 = off; timm's rand-m9-n2 is 2); DeiT-III replaced it by 3-Augment
rand_magnitude = 9  # RandAugment magnitude (0-30)
random_erasing = 0.25  # probability per image of erasing a random rectangle with noise (DeiT: 0.25; DeiT-III: 0)
mixup = 0.0  # mixup alpha (DeiT-III: 0.8); 0 = off. Pays off on long runs, slows short ones
cutmix = 0.0  # cutmix alpha (DeiT-III: 1.0); with both on, each batch uses one of the two
label_smoothing = 0.1  # soften the targets: a confident ViT generalises worse
bce_loss = False  # DeiT-III: binary cross-entropy per class, on the same (mixed, smoothed) targets
# optimization
epochs = 18  # the cosine schedule spans them all; fixed on --resume (use --stop_at_step to stop early)
batch_size = 128  # images per process and micro-step; the global batch, batch_size * grad_accum * processes, is printed
grad_accum = 1  # micro-steps per optimizer step: a large global batch on few devices
lr = 3e-3  # peak learning rate at the global batch, as given (nanoGPT's rule): scale it yourself with the global batch
min_lr = 1e-5  # the cosine schedule ends here
warmup_epochs = 0.5  # linear warmup from 0, in epochs so that it survives changes of batch size
weight_decay = 0.05  # on weight matrices only (not biases, norms, position embedding, CLS token)
beta1 = 0.9  # Adam's momentum
beta2 = 0.999  # Adam's second-moment decay; lower (0.99, 0.95) is steadier with large learning rates
grad_clip = 1.0  # clip the global gradient norm, a guard against loss spikes; 0 = off
# system
device = "auto"  # auto (cuda > mps > cpu; torchrun: one GPU per process) | cpu | cuda | cuda:N | mps
dtype = "auto"  # auto: bfloat16 on GPUs from Ampere on, float16 (grad scaler) on older ones, float32 on CPU/MPS
compile_model = False  # torch.compile the model: faster on a GPU after a warm-up of a minute or so
cpu_procs = 2  # CPU: data-parallel single-threaded processes, started by torchrun; 1 = this one
cpu_threads = 1  # torch threads per process on a CPU; 0 = torch's default (one per core)
seed = 0  # initial weights, data order, augmentation and drop-path all follow from it

# ----------------------------------------------------------------------------- helpers

def augment_batch(x, y, img_size, mean, std, mixer=None, geometric=True, crop_padding=0, hflip=False, rand_augment=0,
                  rand_magnitude=9, three_augment=False, color_jitter=0.3, random_erasing=0.0):
    """uint8 images (B, C, H, W) on the device -> normalised float images at img_size and targets: class
    indices (B,), or soft targets (B, K) when mixing. Randomness comes from the global RNG, which the training
    loop seeds per micro-batch. geometric=False (imagefolder): DataLoader workers did the crop and flip."""
    if geometric and crop_padding:
        x = augment.random_crop(x, crop_padding)
    if geometric and hflip:
        x = augment.random_hflip(x)
    if geometric and rand_augment:
        x = augment.rand_augment_groups(x, rand_augment, rand_magnitude)
    x = augment.to_unit(x, img_size)
    if three_augment:
        x = augment.three_augment(x, color_jitter)
    if mixer is not None:
        x, y = mixer(x, y)
    x = (x - mean) / std
    if random_erasing:
        x = augment.random_erasing(x, random_erasing)
    return x, y

def compute_loss(logits, y, label_smoothing=0.0, bce=False):
    """Cross-entropy (or DeiT-III's binary cross-entropy) with label smoothing. y: class indices (B,)
    or soft targets (B, K) from mixup/cutmix. The smoothed mix is timm's mixup_target, which the first author's
    BCE runs use: lam * smooth(y1) + (1 - lam) * smooth(y2), smooth = 1 - s + s/K on the class, s/K elsewhere.
    (Official DeiT-III instead makes every mixed class a hard 1 and does not smooth.)"""
    logits = logits.float()
    K = logits.size(-1)
    if y.ndim == 1 and not bce:
        return F.cross_entropy(logits, y, label_smoothing=label_smoothing)
    t = F.one_hot(y, K).float() if y.ndim == 1 else y
    t = t * (1 - label_smoothing) + label_smoothing / K  # (B, K); smoothing is linear, so mixing commutes with it
    if bce:
        return F.binary_cross_entropy_with_logits(logits, t)
    return -(t * F.log_softmax(logits, dim=-1)).sum(-1).mean()

def build_optimizers(model, lr, weight_decay, betas, device):
    """[AdamW] with weight decay on weight matrices only, as in DeiT (not on biases, norms, the position embedding or
    the CLS token); the fused kernel: one pass over all parameters instead of a loop over them."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 and name not in ("pos_embed", "cls_token") else no_decay).append(p)
    groups = [dict(params=decay, weight_decay=weight_decay), dict(params=no_decay, weight_decay=0.0)]
    return [torch.optim.AdamW(groups, lr=lr, betas=betas, fused=torch.device(device).type in ("cuda", "cpu"))]

def get_lr(step):
    """The learning rate of optimizer step `step`, nanoGPT's get_lr: a linear warm-up whose step s trains at
    (s + 1) / warmup_iters of lr, then a half cosine from lr down to min_lr at max_iters. Like nanoGPT's it reads
    module globals: the options and the run's warmup_iters and max_iters."""
    if step < warmup_iters:
        return lr * (step + 1) / warmup_iters
    return common.cosine_schedule(step - warmup_iters, max_iters - warmup_iters, lr, min_lr)

def train_batches(data, epoch, first_step, steps_per_epoch, batch_size, grad_accum, rank, world, seed, device,
                  num_workers=0):
    """This process's micro-batches (uint8 images, labels) on the device from step first_step of the epoch on.
    data: (images, labels) on the device, or a folder dataset (decoded by num_workers DataLoader workers).
    The epoch's order is one permutation seeded by (seed, epoch); global batch s is cut into grad_accum * world
    chunks of batch_size, and chunk micro * world + rank belongs to this process's micro-step `micro`."""
    in_memory = isinstance(data, tuple)
    n = len(data[1]) if in_memory else len(data)
    global_batch = batch_size * grad_accum * world
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(common.step_seed(seed, epoch)))
    chunks = [perm[s * global_batch + (m * world + rank) * batch_size:][:batch_size]
              for s in range(first_step, steps_per_epoch) for m in range(grad_accum)]
    if in_memory:
        for idx in chunks:
            idx = common.to_device(idx, device)
            yield data[0][idx], data[1][idx]
        return
    worker_seed = torch.Generator().manual_seed(common.step_seed(seed, epoch, first_step, rank))
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size, sampler=torch.cat(chunks).tolist(),
                                         generator=worker_seed, num_workers=num_workers,
                                         pin_memory=str(device).startswith("cuda"))
    for x, y in loader:
        yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)

def val_batches(data, batch_size, rank, world, device, num_workers=0):
    """This process's contiguous shard of the validation set, unaugmented (data as in train_batches)."""
    in_memory = isinstance(data, tuple)
    n = len(data[1]) if in_memory else len(data)
    lo = rank * n // world
    hi = (rank + 1) * n // world
    if in_memory:
        for i in range(lo, hi, batch_size):
            yield data[0][i:min(i + batch_size, hi)], data[1][i:min(i + batch_size, hi)]
        return
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size, sampler=list(range(lo, hi)),
                                         num_workers=num_workers, pin_memory=str(device).startswith("cuda"))
    for x, y in loader:
        yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)

@torch.no_grad()
def evaluate(model, batches, img_size, mean, std, ctx=nullcontext(), world=1):
    """(accuracy, mean cross-entropy) of the model on the validation batches of every process."""
    model.eval()
    device = mean.device
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    size = None  # the first batch's: a shorter last batch is padded to it, or a compiled model compiles a second graph
    for x, y in batches:
        size = size or len(y)
        x = torch.cat([x, x.new_zeros(size - len(x), *x.shape[1:])])  # black images ...
        y = F.pad(y, (0, size - len(y)), value=-100)  # ... whose label the loss ignores and no prediction matches
        with ctx:
            logits = model((augment.to_unit(x, img_size) - mean) / std).float()
        sums += torch.stack([F.cross_entropy(logits, y, reduction="sum"), (logits.argmax(-1) == y).sum(),
                             (y >= 0).sum()]).double()
    model.train()
    sums = common.all_reduce_mean(sums, device) * world
    return (sums[1] / sums[2]).item(), (sums[0] / sums[2]).item()

# ----------------------------------------------------------------------------- run

if __name__ == "__main__":
    config, ckpt = configurator.configure(globals(), schedule=("epochs", "warmup_epochs"))
    configurator.check_options(config, at_least={
        1: ("epochs", "batch_size", "grad_accum", "eval_interval", "log_interval", "cpu_procs"),
        0: ("train_subset", "val_subset", "img_size", "crop_padding", "rand_augment", "stop_at_step",
            "num_workers", "cpu_threads")},
        fractions=("random_erasing", "holdout"),
        choices=dict(dataset=images.DATASETS + ("imagefolder",)))
    if holdout and dataset == "imagefolder":
        raise UsageError("--holdout splits an in-memory dataset; for an image folder, keep a selection folder apart")
    common.check_compile(compile_model, common.resolve_device(device))
    ctx, amp_dtype = common.autocast(common.resolve_device(device), dtype)  # checks --device and --dtype
    common.launch_processes(cpu_procs, device)

    # ---- data, read before out_dir is touched (a missing dataset fails without moving an earlier run aside): small
    # datasets as uint8 tensors, moved to the device below; image folders are decoded by DataLoader workers, which
    # also crop and flip
    if dataset == "imagefolder":
        resolution = img_size or 224  # the model's image side
        train_set, val_set = folders.imagefolder_datasets(data_dir, resolution, hflip=hflip, rand_augment=rand_augment,
                                                         rand_magnitude=rand_magnitude, simple_random_crop=simple_random_crop)
        # --train_subset/--val_subset: a fixed random subset (the folders are sorted by class)
        train_data = torch.utils.data.Subset(train_set, images.fixed_subset(len(train_set), train_subset).tolist())
        val_data = torch.utils.data.Subset(val_set, images.fixed_subset(len(val_set), val_subset).tolist())
        n_train = len(train_data)
        n_val = len(val_data)
        classes = train_set.classes
        in_chans = 3
        mean = folders.IMAGENET_MEAN
        std = folders.IMAGENET_STD
    else:
        data = images.hold_out(images.load_images(dataset, data_dir), holdout)
        (train_x, train_y), (val_x, val_y) = data["train"], data["val"]
        train_data = (train_x[:train_subset or None], train_y[:train_subset or None])
        val_data = (val_x[:val_subset or None], val_y[:val_subset or None])
        n_train = len(train_data[1])
        n_val = len(val_data[1])
        resolution = img_size or train_x.shape[-1]  # the model's image side
        classes = data["classes"]
        in_chans = train_x.shape[1]
        mean = data["mean"]
        std = data["std"]
    model_config = configurator.config_from_options(config, "vit", img_size=resolution, in_chans=in_chans,
                                                    num_classes=len(classes))
    if ckpt is not None and ckpt["step"] >= epochs * ckpt["steps_per_epoch"]:  # leave a finished run as it is
        configurator.finished_run(out_dir, ckpt["step"], epochs * ckpt["steps_per_epoch"], "epochs")
    rank, local_rank, world, run_device = common.start_processes(
        out_dir, resume, device, oom_advice=f"in the run {out_dir} at {batch_size} images per process and "
        f"micro-step: lower --batch_size and raise --grad_accum as much to keep the global batch")
    master = rank == 0
    device_type = run_device.split(":")[0]
    if device_type == "cpu" and cpu_threads:
        torch.set_num_threads(cpu_threads)
    if dataset != "imagefolder":
        train_data = tuple(t.to(run_device) for t in train_data)
        val_data = tuple(t.to(run_device) for t in val_data)
    mean = torch.tensor(mean, device=run_device).view(1, -1, 1, 1)
    std = torch.tensor(std, device=run_device).view(1, -1, 1, 1)
    global_batch = batch_size * grad_accum * world
    steps_per_epoch = n_train // global_batch
    if steps_per_epoch == 0:
        raise UsageError(f"the global batch ({global_batch} = batch_size * grad_accum * processes) is larger than "
                         f"the {n_train} training images; lower --batch_size")
    max_iters = epochs * steps_per_epoch
    warmup_iters = round(warmup_epochs * steps_per_epoch)

    # ---- model and optimizer (a resumed run restores both and its clock)
    torch.manual_seed(seed)  # the same initial weights in every process
    raw_model = nanolap.build_model(model_config).to(run_device)
    optimizers = build_optimizers(raw_model, lr=lr, weight_decay=weight_decay, betas=(beta1, beta2), device=run_device)
    scaler = torch.amp.GradScaler(device_type, enabled=amp_dtype == torch.float16)
    step = 0
    best_acc = 0.0
    val_acc = float("nan")
    val_loss = float("nan")
    if ckpt is not None:
        configurator.check_resume(ckpt, "vit", model_config)
        if ckpt["steps_per_epoch"] != steps_per_epoch:
            raise UsageError(f"--resume: the checkpoint has {ckpt['steps_per_epoch']} steps per epoch, this run "
                             f"{steps_per_epoch}; keep the global batch and the dataset the same")
        raw_model.load_state_dict(ckpt["model"])
        load_optimizer_states(optimizers, ckpt["optimizer"])
        if ckpt.get("scaler"):  # a float16 run's loss scale; a bfloat16 or float32 checkpoint holds none
            scaler.load_state_dict(ckpt["scaler"])
        step = ckpt["step"]
        best_acc = ckpt["best_val_acc"]
        val_acc = ckpt["val_acc"]
        val_loss = ckpt["val_loss"]
    # raw_model: the module (its weights, checkpoints); model: compiled or not, what trains and evaluates;
    # ddp_model: model with DDP's gradient averaging around it (several processes), what the training step calls
    model = torch.compile(raw_model) if compile_model else raw_model
    ddp_model = DDP(model, device_ids=[local_rank] if device_type == "cuda" else None) if world > 1 else model
    mixer = augment.make_mixer(mixup, cutmix, len(classes))
    tokens = model_config.img_size ** 2 // model_config.patch_size ** 2 + 1
    flops_per_img = raw_model.flops_per_token(tokens) * tokens
    peak = common.peak_flops(run_device, dtype=amp_dtype)
    machine = common.machine_name(run_device)  # kept in the log and the RESULT line: floats differ by machine
    log_path = os.path.join(out_dir, common.LOG)

    print0("config: " + " ".join(f"{k}={v!r}" for k, v in config.items()))
    print0(f"data: {dataset} {n_train} train / {n_val} {'held-out' if holdout else 'val'} images, "
           f"{in_chans}x{resolution}x{resolution}, "
           f"{len(classes)} classes, on {run_device} in {common.DTYPE_WORDS[amp_dtype]}, "
           f"{world} process{'es' if world > 1 else ''}")
    print0(f"model: {preset} {model_config.n_layer} layers, d {model_config.n_embd}, {model_config.n_head} heads, "
           f"patch {model_config.patch_size} ({tokens} tokens), Laplacian heads per layer "
           f"{model_config.n_lap_per_layer()}, {raw_model.num_params():,} params")
    print0(f"schedule: global batch {global_batch} = {batch_size} x {grad_accum} accum x {world} process(es), "
           f"{steps_per_epoch} steps/epoch, {epochs} epochs = {max_iters} steps, warmup {warmup_iters}, "
           f"adamw lr {lr:g}" + (f"; resuming at step {step}" if ckpt else ""))
    if master and ckpt is not None:
        common.keep_log_until(log_path, step)

    # ---- the loop: evaluate (and checkpoint) every eval_interval steps and at the last, else one optimizer step
    t_start = time.time() - (ckpt["seconds"] if ckpt else 0)  # a resumed run's seconds count its earlier pieces too
    window = common.LogWindow(run_device, ckpt)  # the steps since the last progress line, and since the last record
    start_step = step
    batches = None
    data_time = 0.0  # of the steps since the last progress line
    speeds = []  # img/s of each log window
    waits = []  # fraction of each log window spent on data (a GPU: waiting for it)
    while True:
        last = step == max_iters
        stopped = step == stop_at_step and start_step < step < max_iters
        # a resumed run's first step was evaluated before it stopped
        evaluating = (step % eval_interval == 0 or last) and (step > start_step or ckpt is None)
        if evaluating or stopped:  # a checkpoint may follow: no weight it saves may come from a non-finite step
            window.read(step)
            common.check_finite_weights(raw_model.parameters(), step - 1)  # float16: the norm is the scaler's 0
            data_time = 0.0
        if evaluating:
            shard = val_batches(val_data, 4 * batch_size, rank=rank, world=world, device=run_device, num_workers=num_workers)
            val_acc, val_loss = evaluate(model, shard, img_size=resolution, mean=mean, std=std, ctx=ctx, world=world)
            best_acc = max(best_acc, val_acc)
            common.log_record(log_path, dict(
                step=step, lr=get_lr(step), train_loss=window.train_loss(), seconds=round(time.time() - t_start, 1),
                epoch=round(step / steps_per_epoch, 4), val_acc=val_acc, val_loss=val_loss, machine=machine),
                keys=("train_loss", "val_acc", "val_loss"))
        if master and step > start_step and (evaluating or stopped):
            common.save_checkpoint(dict(
                kind="vit", model_config=asdict(model_config), model=raw_model.state_dict(), config=config,
                optimizer=[optimizer.state_dict() for optimizer in optimizers], scaler=scaler.state_dict(), step=step,
                seconds=time.time() - t_start, record_loss=window.record_loss, record_steps=window.record_steps,
                epoch=step / steps_per_epoch, steps_per_epoch=steps_per_epoch, best_val_acc=best_acc, val_acc=val_acc,
                val_loss=val_loss, classes=list(classes), mean=mean.flatten().tolist(), std=std.flatten().tolist()),
                os.path.join(out_dir, common.CHECKPOINT))
        if last or stopped:
            break
        if evaluating:
            window.start = time.time()  # evaluation and checkpoint time is not training time

        # one optimizer step: the learning rate from get_lr, grad_accum micro-batches
        epoch, step_in_epoch = divmod(step, steps_per_epoch)
        if batches is None:
            batches = train_batches(train_data, epoch, step_in_epoch, steps_per_epoch, batch_size=batch_size,
                                    grad_accum=grad_accum, rank=rank, world=world, seed=seed, device=run_device,
                                    num_workers=num_workers)
        lr_now = get_lr(step)
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr_now
        loss_accum = torch.zeros((), device=run_device)
        for micro in range(grad_accum):
            torch.manual_seed(common.step_seed(seed, epoch, step, micro * world + rank))  # augmentation and drop-path
            t0 = time.time()
            x, y = next(batches)
            x, y = augment_batch(x, y, img_size=resolution, mean=mean, std=std, mixer=mixer, geometric=dataset != "imagefolder",
                                 crop_padding=crop_padding, hflip=hflip, rand_augment=rand_augment,
                                 rand_magnitude=rand_magnitude, three_augment=three_augment, color_jitter=color_jitter,
                                 random_erasing=random_erasing)
            data_time += time.time() - t0  # on a GPU: the wait for the batch, the augmentation runs asynchronously
            # DDP all-reduces the gradients in backward(); only the last micro-step of a step needs it to
            ddp_model.require_backward_grad_sync = micro == grad_accum - 1
            with ctx:
                logits = ddp_model(x)  # (B, num_classes)
            loss = compute_loss(logits, y, label_smoothing, bce_loss) / grad_accum
            scaler.scale(loss).backward()
            loss_accum += loss.detach()
        grad_norm = optimizer_step(optimizers, scaler, raw_model.parameters(), grad_clip=grad_clip)
        raw_model.zero_grad(set_to_none=True)
        step += 1
        window.add(loss_accum, grad_norm)
        if step % steps_per_epoch == 0:
            batches = None  # the next epoch's order

        if step % log_interval == 0 or step == max_iters:
            steps = window.steps
            loss_now, per_step = window.read(step)  # waits for the GPU
            speeds.append(global_batch / per_step)
            waits.append(data_time / (per_step * steps))
            data_time = 0.0
            fields = [f"ep {step / steps_per_epoch:.2f}", f"data {waits[-1]:.1%}"]
            if peak:
                fields.append(f"mfu {flops_per_img * speeds[-1] / (peak * world):.1%}")
            print0(common.progress_line(step, max_iters, loss_now, lr_now, speeds[-1], "img/s", per_step, *fields))

    # ---- end
    if master and stopped:
        print(f"stopped at step {step} (--stop_at_step); continue with --resume --out_dir={out_dir}")
    timed = speeds[1:] or speeds or [0]  # the first log window holds the compilation and the warm-up
    if master and not stopped:
        common.write_result(out_dir, n_lap=n_lap, params=raw_model.num_params(), seed=seed, dataset=dataset,
                            steps=step, seconds=round(time.time() - t_start), val_acc=val_acc, val_loss=val_loss,
                            epochs=epochs, img_per_s=round(sum(timed) / len(timed)),
                            data_wait=sum(waits) / max(len(waits), 1), machine=machine,
                            **({"holdout": holdout} if holdout else {}))
    common.teardown_distributed()
