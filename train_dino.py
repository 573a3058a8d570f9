"""
DINO: self-supervised ViTs with Laplacian heads, from a laptop CPU to many GPUs.

    python train_dino.py                                   # CPU default: Fashion-MNIST, 0.2M-parameter ViT
    python train_dino.py --n_lap=0                         # the attention-only baseline
    python train_dino.py --stop_at_step=500 && python train_dino.py --resume   # stop early, continue exactly
    python train_dino.py --eval_only=out-dino/ckpt.pt      # k-NN, linear and segmentation probes of a checkpoint
    torchrun --standalone --nproc_per_node=8 train_dino.py config/dino_vits16_imagenet.py --data_dir=/imagenet

DINO (Caron et al. 2021, facebookresearch/dino): a student ViT sees 2 global and several local crops of each image; a
teacher, an exponential moving average of the student, sees the global crops; the student learns to predict the
teacher's softmax over out_dim prototypes. Centring and sharpening the teacher's outputs keep both from collapsing.
Probes of the frozen teacher backbone (probes.py), against the raw pixels: k-NN at every evaluation; at the end a
linear probe and a linear segmentation probe (mIoU) on generated scenes or Oxford-IIIT Pets.

The progress line adds wd, mom (teacher EMA momentum), t_temp (teacher temperature), t_std (the teacher's output std
across images; near 0: collapse, warned) and t_ent (its softmax entropy / ln(out_dim)). The loss rises early while
t_temp warms up, which is no divergence: judge progress by knn_acc. Unlike facebookresearch/dino, the crops are cut
batched on the device and schedules are functions of the step (fractional epochs: short CPU runs get real warm-ups).
The CPU default departs from DINO's ViT-S where short runs on 28 px images do better (see the comments);
config/dino_vits16_imagenet.py keeps DINO's values.
"""

import math
import os
import sys
import time
from dataclasses import asdict, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import common
import configurator
import nanolap
import probes
from common import UsageError, print0
from data import augment, folders, images
from optim import load_optimizer_states, optimizer_step

# ---------------------------------------------------------------- defaults: the CPU default (Fashion-MNIST, 2 cores)
# I/O
out_dir = "out-dino"  # ckpt.pt, log.jsonl (one line per evaluation) and result.txt go here
eval_interval = 500  # steps between k-NN evaluations and checkpoints (also at step 0 and the last)
log_interval = 50  # steps between progress lines
eval_only = ""  # a checkpoint (any nanolap ViT): run the probes on its backbone, print RESULT, exit
resume = False  # continue out_dir/ckpt.pt exactly where it stopped (with the same processes and batch_size)
stop_at_step = 0  # stop with a checkpoint after this step, as if interrupted (the schedule still spans the whole run); 0 = never
# data
dataset = "fashion_mnist"  # fashion_mnist | cifar10 | cifar100 | scenes | synthetic | imagefolder (data_dir/train, /val)
data_dir = "data"  # where the datasets live (downloads go here)
train_subset = 0  # train on a fixed random subset of this many train images, for quick experiments; 0 = all
holdout = 0.0  # for choosing hyperparameters: train without the last this fraction of the train images, probe on it; 0 = off
num_workers = min(8, os.cpu_count() or 1)  # imagefolder: decoding processes; about the CPU cores per GPU
imagefolder_base = 256  # imagefolder: images are resized to this square first, the canvas the crops are cut from
# model: the preset, then these overrides (None = the preset's value)
preset = "vit-cpu"  # a ViT preset: vit-cpu (4 layers, d 64, patch 7, 1 channel) trains on a laptop; vit-s is DINO's
n_layer = None  # blocks
n_head = None  # heads per block
n_embd = None  # width
patch_size = None  # patch side; global_size, local_size and seg_size must be multiples of it
n_lap = 2  # Laplacian heads per layer (int or per-layer list); 0 = standard attention, the baseline
graph = "attention"  # P: attention (softmax) | uniform (every head: the sequence mean) | lap_uniform (the Laplacian heads alone)
drop_path = 0.0  # stochastic depth of the student (DINO ViT-S: 0.1); it only slows a 0.2M-parameter model down
# DINO head and loss
out_dim = 4096  # prototypes (DINO: 65536 on ImageNet): many more than classes, far fewer than images
head_hidden = 256  # hidden width of the head's MLP (DINO: 2048); small backbones need less
head_bottleneck = 64  # L2-normalised bottleneck before the prototypes (DINO: 256)
norm_last_layer = True  # fix each prototype's norm at 1 (DINO's default): steadier, at a small cost in accuracy
student_temp = 0.1  # student softmax temperature (DINO)
warmup_teacher_temp = 0.01  # teacher temperature at step 0 (DINO: 0.04); lower it if the loss does not decrease
teacher_temp = 0.025  # after the warm-up (DINO ViT-S: 0.07); a sharper teacher suits short runs on small images
warmup_teacher_temp_epochs = 0.3  # linear warm-up of the teacher temperature
center_momentum = 0.9  # EMA of the centre; 1 leaves it at 0, and without centring DINO collapses
momentum_teacher = 0.99  # teacher EMA momentum at step 0, cosine to 1 (DINO: 0.996, made for long runs of batch 1024)
# multi-crop augmentation (for 1-channel images, saturation, hue and grayscale are skipped)
global_size = 28  # side of the 2 global crops: the backbone's img_size
global_scale = [0.25, 1.0]  # global crop area as a fraction of the image (DINO: [0.4, 1.0]; wider without local crops)
local_crops = 0  # local crops per image (DINO: 8 of 96 px); at 28 px a 14 px crop is 4 patches, not worth its time
local_size = 14  # side of the local crops
local_scale = [0.1, 0.4]  # local crop area (DINO: [0.05, 0.4]; at 28 px a 5% crop is a 6 x 6 blob)
jitter = [0.4, 0.4, 0.2, 0.1]  # colour jitter strengths: brightness, contrast, saturation, hue (DINO)
jitter_p = 0.8  # probability of colour jitter per crop
grayscale_p = 0.2  # probability of a grey crop (RGB only)
blur_sigma = [0.1, 0.5]  # Gaussian blur sigma range in pixels (DINO: 0.1-2 at 224 px; scale it with the image)
solarize_p = 0.2  # solarisation probability of the second global crop
# optimization (lengths in epochs, fractions allowed)
epochs = 6.0  # the schedules span them; a quarter of an hour on 2 cores
batch_size = 64  # images per process (DINO's batch_size_per_gpu); the global batch, batch_size * processes, is printed
lr = 0.0005  # peak learning rate at the global batch, as given: scale it yourself (DINO: 0.0005 x global batch / 256)
min_lr = 1e-6  # learning rate at the end of the cosine
warmup_epochs = 0.05  # linear learning-rate warm-up (DINO: 10 of 100 epochs)
weight_decay = 0.04  # weight decay at step 0, cosine to weight_decay_end (DINO)
weight_decay_end = 0.4  # weight decay at the end (DINO)
clip_grad = 3.0  # clip each parameter's gradient norm to this (DINO's rule and name); 0 = off
freeze_last_layer = 0.0  # epochs in which the head's last layer is not updated (DINO: 1); short runs lose more than gain
# system
device = "auto"  # auto (cuda, else mps, else cpu), cpu, cuda, cuda:N or mps
dtype = "auto"  # auto: bfloat16 on GPUs from Ampere on, float16 (GradScaler) on older ones, float32 on CPU/MPS
compile_model = False  # torch.compile the backbones: faster steps on a GPU after a slow first one
cpu_procs = 2  # on a CPU without torchrun: this many single-threaded data-parallel processes (beat threads); 1 = one
seed = 0  # initial weights, data order, crops and drop path all follow from it
# evaluation
eval_train = 10000  # labelled train images for the k-NN bank and the linear probe; 0 = all
eval_val = 5000  # val images for k-NN and linear accuracy; 0 = all
knn_k = 20  # neighbours that vote (DINO's eval_knn.py)
knn_temp = 0.07  # votes weigh exp(cosine similarity / knn_temp) (DINO)
linear_blocks = 4  # the linear probe reads the CLS tokens of the last this many blocks (DINO ViT-S: 4)
probe_steps = 2000  # AdamW steps of the linear and segmentation probes (on cached, standardised features)
seg_dataset = "scenes"  # scenes (generated, offline) | pets (Oxford-IIIT Pet, downloads) | none
seg_size = 56  # segmentation images are resized to this side, a multiple of the patch size
seg_train = 1000  # segmentation probe train images
seg_val = 500  # segmentation probe val images
collapse_std = 0.01  # warn when the teacher's output std across the batch falls below this

# ---------------------------------------------------------------- helpers: DINO

class DINO(nn.Module):
    """Backbone + DINO head; each crop size goes through the backbone as one batch (DINO's MultiCropWrapper)."""
    def __init__(self, backbone, head):
        super().__init__()
        self.backbone = backbone
        self.head = head
    def forward(self, crops):  # list of (n_i * B, C, S_i, S_i) -> (sum n_i * B, out_dim)
        return self.head(torch.cat([self.backbone(x) for x in crops]))

def dino_loss(student_out, teacher_out, center, student_temp, teacher_temp, n_global=2):
    """Mean over pairs (teacher view t, student view s != t) of the cross-entropy
    H(softmax((teacher_t - center) / teacher_temp), softmax(student_s / student_temp)), averaged over images.
    student_out (n_crops * B, K) with the global crops first; teacher_out (n_global * B, K)."""
    n_crops = student_out.shape[0] // (teacher_out.shape[0] // n_global)
    log_p = F.log_softmax(student_out / student_temp, dim=-1).chunk(n_crops)
    q = F.softmax((teacher_out - center) / teacher_temp, dim=-1).detach().chunk(n_global)
    pairs = [(t, s) for t in range(n_global) for s in range(n_crops) if s != t]  # never a view with itself
    return sum(torch.sum(-q[t] * log_p[s], dim=-1).mean() for t, s in pairs) / len(pairs)

@torch.no_grad()
def update_center(center, teacher_out, momentum, device="cpu"):
    """EMA of the teacher's mean output over the whole (all-process) batch."""
    batch_mean = common.all_reduce_mean(teacher_out.float().mean(dim=0, keepdim=True), device).to(center)
    return center * momentum + batch_mean * (1 - momentum)

@torch.no_grad()
def ema_update(teacher, student, momentum):
    """teacher <- momentum * teacher + (1 - momentum) * student, parameter by parameter."""
    t_params = list(teacher.parameters())
    s_params = list(student.parameters())
    torch._foreach_mul_(t_params, momentum)
    torch._foreach_add_(t_params, s_params, alpha=1 - momentum)

def build_optimizers(model, device_type):
    """[AdamW] as DINO builds it: weight decay on weights, none on biases and 1-d parameters (norms, LayerScale); the
    learning rate and the weight decay are set at every step from the schedules."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if name.endswith(".bias") or p.ndim == 1 else decay).append(p)
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [torch.optim.AdamW(groups, lr=0.0, fused=device_type in ("cuda", "cpu"))]

def get_lr(step):
    """The learning rate of optimizer step `step`: a linear warm-up, then a half cosine from lr down to min_lr at
    max_iters. DINO's warm-up starts from 0 at step 0 (its cosine_scheduler), one step behind the ViT's and the GPT's
    (nanoGPT's); kept, as the committed runs trained with it. Like nanoGPT's get_lr it reads module globals: the
    options and the run's warmup_iters and max_iters."""
    if step < warmup_iters:
        return lr * step / warmup_iters
    return common.cosine_schedule(step - warmup_iters, max_iters - warmup_iters, lr, min_lr)

def get_teacher_temp(step):
    """DINO's teacher temperature: linear from warmup_teacher_temp at step 0 to teacher_temp, then constant."""
    if step < temp_warmup_iters:
        return warmup_teacher_temp + (teacher_temp - warmup_teacher_temp) * step / temp_warmup_iters
    return teacher_temp

def cancel_last_layer_grads(head, epoch, freeze_epochs):
    """In the first freeze_epochs epochs the head's last layer gets no update (its gradient is dropped)."""
    if epoch < freeze_epochs:
        for p in (head.weight_v, head.weight_g):  # the last layer
            p.grad = None

@torch.no_grad()
def teacher_stats(teacher_out, center, temp):
    """(t_std, t_ent) on the device, unread: t_std, the std across the batch of the centred teacher outputs, mean over
    dims; t_ent, the softmax entropy / ln(K)."""
    t = teacher_out.float() - center
    p = F.softmax(t / temp, dim=-1)
    entropy = -(p * torch.log(p + 1e-12)).sum(-1).mean() / math.log(p.shape[-1])
    return torch.stack([t.std(dim=0).mean(), entropy])

# ---------------------------------------------------------------- helpers: data

def batch_indices(n, global_batch, step, seed, rank=0, world=1):
    """This process's image indices at `step`: epoch e visits a permutation seeded by (seed, e), so resume is exact."""
    epoch, i = divmod(step, n // global_batch)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(common.step_seed(seed, epoch)))
    per_rank = global_batch // world
    start = i * global_batch + rank * per_rank
    return perm[start:start + per_rank]

def epoch_batches(x_train, subset, n, global_batch, step, seed, rank, world, num_workers=0, pin_memory=False):
    """This process's uint8 image batches from `step` to the end of its epoch: indexed from a tensor, or
    decoded by DataLoader workers from an ImageFolder. subset: the train_subset images (None = all)."""
    last = (step // (n // global_batch) + 1) * (n // global_batch)
    idx = (batch_indices(n, global_batch, s, seed=seed, rank=rank, world=world) for s in range(step, last))
    idx = (i if subset is None else subset[i] for i in idx)
    if isinstance(x_train, torch.Tensor):  # pinned on CUDA: a copy from pageable memory would wait for the GPU
        return (x_train[i].pin_memory() if pin_memory else x_train[i] for i in idx)
    loader = torch.utils.data.DataLoader(x_train, batch_sampler=[i.tolist() for i in idx], num_workers=num_workers,
                                         pin_memory=pin_memory)
    return (x.as_subclass(torch.Tensor) for x, _ in loader)

# ---------------------------------------------------------------- run

if __name__ == "__main__":
    config, ckpt = configurator.configure(globals(), schedule=("epochs", "warmup_epochs", "warmup_teacher_temp_epochs"))

    # ---- validation: every bad input fails here, in one line, before data is read or processes start
    for key, top in (("global_scale", 1), ("local_scale", 1), ("blur_sigma", math.inf)):
        lo_hi = config[key]
        if not (len(lo_hi) == 2 and 0 <= lo_hi[0] <= lo_hi[1] <= top and (top > 1 or lo_hi[1] > 0)):
            raise UsageError(f"--{key}={lo_hi}: expected [low, high] with 0 <= low <= high" + " <= 1" * (top == 1))
    if len(jitter) != 4 or min(jitter) < 0 or jitter[3] > 0.5:
        raise UsageError(f"--jitter={jitter}: expected [brightness, contrast, saturation, hue] >= 0, hue <= 0.5")
    configurator.check_options(config, at_least={
        1: ("batch_size", "out_dim", "head_hidden", "head_bottleneck", "global_size", "local_size", "eval_interval",
            "log_interval", "knn_k", "probe_steps", "linear_blocks", "cpu_procs"),
        0: ("local_crops", "train_subset", "eval_train", "eval_val", "seg_train", "seg_val", "warmup_epochs",
            "freeze_last_layer", "weight_decay", "weight_decay_end", "clip_grad", "min_lr", "stop_at_step")},
        above_zero=("epochs", "lr", "student_temp", "teacher_temp", "warmup_teacher_temp", "knn_temp"),
        fractions=("momentum_teacher", "center_momentum", "jitter_p", "grayscale_p", "solarize_p", "holdout"),
        choices=dict(dataset=images.DATASETS + ("imagefolder",), seg_dataset=("scenes", "pets", "none")))
    if resume and eval_only:
        raise UsageError("--resume and --eval_only exclude each other")
    if holdout and dataset == "imagefolder":
        raise UsageError("--holdout splits an in-memory dataset; for an image folder, keep a selection folder apart")
    ctx, amp_dtype = common.autocast(common.resolve_device(device), dtype)  # checks --device and --dtype too
    common.check_compile(compile_model, common.resolve_device(device))

    # ---- eval_only: probe a checkpoint's backbone (DINO teacher or supervised ViT) on the data it was trained on
    if eval_only:
        run_device = common.resolve_device(device)
        ckpt = common.load_checkpoint(eval_only, "--eval_only: ")
        if ckpt["model_config"]["model"] != "vit":
            raise UsageError(f"{eval_only} holds a {ckpt['model_config']['model']} model; the probes need a ViT")
        backbone = common.load_model(ckpt).to(run_device).eval()
        trained = {**config, **ckpt.get("config", {})}  # the data it was trained on
        data = (folders.imagefolder_squares(trained["data_dir"], trained["imagefolder_base"])
                if trained["dataset"] == "imagefolder" else
                images.hold_out(images.load_images(trained["dataset"], trained["data_dir"]), trained.get("holdout", 0.0)))
        eval_sets = [images.load_eval_images(data, s, n, size=backbone.config.img_size, num_workers=num_workers)
                     for s, n in (("train", eval_train), ("val", eval_val))]
        seg_sets = None if seg_dataset == "none" else [
            images.load_segmentation(seg_dataset, trained["data_dir"], s, n, size=seg_size, in_chans=backbone.config.in_chans)
            for s, n in (("train", seg_train), ("val", seg_val))]
        probe = dict(mean=data["mean"], std=data["std"], num_classes=data["num_classes"], device=run_device)
        res = dict(knn_acc=probes.knn_eval(backbone, eval_sets, k=knn_k, temp=knn_temp, ctx=ctx, **probe),
                   knn_acc_init=ckpt.get("knn_acc_init"),  # None: not a DINO checkpoint
                   knn_acc_pixels=probes.knn_eval(None, eval_sets, k=knn_k, temp=knn_temp, **probe))
        res.update(probes.evaluate_final(backbone, eval_sets, seg_sets, linear_blocks=linear_blocks,
                                         probe_steps=probe_steps, seed=seed, ctx=ctx, **probe))
        os.makedirs(out_dir, exist_ok=True)
        common.write_result(out_dir, **res, pixel_side=min(backbone.config.img_size, probes.PIXEL_SIDE))
        sys.exit(0)

    # ---- data and model, before out_dir is touched (a missing dataset or a bad size moves no earlier run aside):
    # uint8 tensors in memory or ImageFolders read lazily; the crops are cut on the device
    common.launch_processes(cpu_procs, device)
    data = (folders.imagefolder_squares(data_dir, imagefolder_base) if dataset == "imagefolder"
            else images.hold_out(images.load_images(dataset, data_dir), holdout))
    x_train = data["train"] if dataset == "imagefolder" else data["train"][0]
    n_train = min(len(x_train), train_subset) if train_subset else len(x_train)
    subset = images.fixed_subset(len(x_train), train_subset) if train_subset else None
    in_chans = 3 if dataset == "imagefolder" else x_train.shape[1]
    model_config = configurator.config_from_options(config, "vit", img_size=global_size, in_chans=in_chans,
                                                    num_classes=0)
    teacher_config = replace(model_config, drop_path=0.0)  # the teacher has no drop path
    for key in ["local_size"] * (local_crops > 0) + ["seg_size"] * (seg_dataset != "none"):  # only sizes in use
        if config[key] % model_config.patch_size:
            raise UsageError(f"--{key}={config[key]} is not a multiple of the patch size {model_config.patch_size}")
    procs = int(os.environ.get("WORLD_SIZE", cpu_procs if common.resolve_device(device) == "cpu" else 1))
    global_batch = batch_size * procs
    if global_batch > n_train:
        raise UsageError(f"the global batch ({global_batch} = batch_size x {procs} processes) is larger than the "
                         f"{n_train} training images; lower --batch_size")
    steps_per_epoch = n_train // global_batch
    if ckpt is not None and ckpt.get("steps_per_epoch", steps_per_epoch) != steps_per_epoch:
        raise UsageError(f"--resume: the checkpoint has {ckpt['steps_per_epoch']} steps per epoch, this run "
                         f"{steps_per_epoch}; keep batch_size and the processes (--cpu_procs, torchrun's) the same")
    max_iters = max(1, round(epochs * steps_per_epoch))
    if ckpt is not None and ckpt["step"] >= max_iters:  # leave a finished run as it is
        configurator.finished_run(out_dir, ckpt["step"], max_iters, "epochs")
    rank, local_rank, world, run_device = common.start_processes(
        out_dir, resume, device, oom_advice=f"in the run {out_dir} at {batch_size} images per process, "
        f"{2 + local_crops} crops each: lower --batch_size or --local_crops (no gradient accumulation here)")
    master = rank == 0
    device_type = run_device.split(":")[0]
    print0("config: " + " ".join(f"{k}={v!r}" for k, v in config.items()))
    torch.manual_seed(seed)  # the same initial weights in every process
    # the first process alone evaluates: it alone reads the evaluation images (seg_sets now: they fail before training)
    eval_sets = [images.load_eval_images(data, s, n, size=global_size, num_workers=num_workers)
                 for s, n in (("train", eval_train), ("val", eval_val))] if master else None
    seg_sets = [images.load_segmentation(seg_dataset, data_dir, s, n, size=seg_size, in_chans=in_chans)
                for s, n in (("train", seg_train), ("val", seg_val))] if master and seg_dataset != "none" else None
    multicrop = augment.MultiCrop(config, in_chans, data["mean"], data["std"], device=run_device)
    probe = dict(mean=data["mean"], std=data["std"], num_classes=data["num_classes"], device=run_device)

    # ---- student and teacher: the same ViT + DINO head; the teacher has no drop path and learns only by EMA
    student = DINO(nanolap.ViT(model_config), nanolap.DINOHead(model_config.n_embd, out_dim, head_hidden,
                                                               head_bottleneck, norm_last_layer=norm_last_layer))
    teacher = DINO(nanolap.ViT(teacher_config), nanolap.DINOHead(model_config.n_embd, out_dim, head_hidden,
                                                                 head_bottleneck, norm_last_layer=norm_last_layer))
    student.to(run_device)
    teacher.to(run_device)
    teacher.load_state_dict(student.state_dict())  # the same start
    teacher.requires_grad_(False).eval()
    center = torch.zeros(1, out_dim, device=run_device)
    print0(f"backbone: {model_config.n_layer} layers, {model_config.n_head} heads, {model_config.n_lap_per_layer()} "
           f"Laplacian, d={model_config.n_embd}, patch {model_config.patch_size}, {student.backbone.num_params():,} params; "
           f"DINO head with {out_dim} prototypes; {n_train} images, {max_iters} steps of a global batch {global_batch} "
           f"= {batch_size} x {world} process(es); "
           + (f"{local_crops} local crops" if local_crops else "no local crops")
           + f"; {run_device}, {common.DTYPE_WORDS[amp_dtype]}")

    # ---- optimizer (and the state of a resumed run)
    optimizers = build_optimizers(student, device_type)
    scaler = torch.amp.GradScaler(device_type, enabled=amp_dtype == torch.float16)
    ckpt_path = os.path.join(out_dir, common.CHECKPOINT)
    log_path = os.path.join(out_dir, common.LOG)
    machine = common.machine_name(run_device)  # kept in the log and the RESULT line: floats differ by machine
    step = 0
    knn_init = None
    if ckpt is not None:
        configurator.check_resume(ckpt, "dino", teacher_config)
        student.load_state_dict(common.clean_state_dict(ckpt["student"]))
        teacher.load_state_dict(common.clean_state_dict(ckpt["teacher"]))
        center = ckpt["center"].to(run_device)
        load_optimizer_states(optimizers, ckpt["optimizer"])
        if ckpt.get("scaler"):  # a float16 run's loss scale; a bfloat16 or float32 checkpoint holds none
            scaler.load_state_dict(ckpt["scaler"])
        step = ckpt["step"]
        knn_init = ckpt.get("knn_acc_init")
        print0(f"resumed from {ckpt_path} at step {step}")
        if master:
            common.keep_log_until(log_path, step)
    teacher_backbone = teacher.backbone  # the probes read it uncompiled: each of their sizes would compile a graph
    if compile_model:  # a static graph per crop size (student: global, local; teacher: global), never recompiled
        student.backbone = torch.compile(student.backbone, dynamic=False)
        teacher.backbone = torch.compile(teacher.backbone, dynamic=False)
    ddp_student = DDP(student, device_ids=[local_rank] if device_type == "cuda" else None) if world > 1 else student
    warmup_iters = round(warmup_epochs * steps_per_epoch)
    temp_warmup_iters = round(warmup_teacher_temp_epochs * steps_per_epoch)

    # ---- the loop: evaluate (and checkpoint) every eval_interval steps and at the last, else one optimizer step
    pixels_knn = probes.knn_eval(None, eval_sets, k=knn_k, temp=knn_temp, **probe) if master else None
    t_start = time.time() - (ckpt["seconds"] if ckpt else 0)  # a resumed run's seconds count its earlier pieces too
    window = common.LogWindow(run_device, ckpt)  # the steps since the last progress line, and since the last record
    start_step = step
    batches = None
    knn_acc = None
    t_std = float("nan")  # the teacher's output statistics, measured at each progress line
    t_ent = float("nan")
    while True:
        last = step == max_iters
        stopped = step == stop_at_step and start_step < step < max_iters
        # a resumed run's first step was evaluated before it stopped
        evaluating = (step % eval_interval == 0 or last) and (step > start_step or ckpt is None)
        if evaluating or stopped:  # a checkpoint may follow: no weight it saves may come from a non-finite step
            window.read(step)
            # every process checks the same numbers (the losses averaged over the processes, weights alike in all):
            # one that stopped alone would leave the others waiting in their next collective
            common.check_finite_weights([*student.parameters(), *teacher.parameters(), center], step - 1)
        if evaluating:
            train_loss = window.train_loss()
        if evaluating and master:  # k-NN of the teacher backbone, on the first process alone
            knn_acc = probes.knn_eval(teacher_backbone, eval_sets, k=knn_k, temp=knn_temp, ctx=ctx, **probe)
            knn_init = knn_acc if step == 0 else knn_init
            common.log_record(log_path, dict(
                step=step, lr=get_lr(step), train_loss=train_loss, seconds=round(time.time() - t_start, 1),
                epoch=round(step / steps_per_epoch, 4), knn_acc=knn_acc, knn_acc_pixels=pixels_knn, teacher_std=t_std,
                teacher_entropy=t_ent, machine=machine), keys=("train_loss", "knn_acc", "knn_acc_pixels"))
        if master and step > start_step and (evaluating or stopped):
            common.save_checkpoint(dict(  # the contract analyze.py reads: kind, model_config, model, config
                kind="dino", model_config=asdict(teacher_config), model=teacher_backbone.state_dict(), config=config,
                optimizer=[optimizer.state_dict() for optimizer in optimizers], scaler=scaler.state_dict(), step=step,
                seconds=time.time() - t_start, record_loss=window.record_loss, record_steps=window.record_steps,
                epoch=step / steps_per_epoch, steps_per_epoch=steps_per_epoch,
                student=common.clean_state_dict(student.state_dict()),
                teacher=common.clean_state_dict(teacher.state_dict()), center=center.cpu(), knn_acc_init=knn_init),
                ckpt_path)
        if last or stopped:
            break
        if evaluating:
            window.start = time.time()  # evaluation and checkpoint time is not training time

        # one optimizer step: the schedules are functions of the step
        epoch = step // steps_per_epoch
        if batches is None or step % steps_per_epoch == 0:
            batches = epoch_batches(x_train, subset, n_train, global_batch=global_batch, step=step, seed=seed, rank=rank,
                                    world=world, num_workers=num_workers, pin_memory=device_type == "cuda")
        batch = next(batches).to(run_device, non_blocking=True)
        torch.manual_seed(common.step_seed(seed, step, rank))  # crops and drop path: resume is exact
        crops = multicrop(batch, torch.default_generator)  # [global (2B, C, G, G), local (nB, C, L, L)]
        lr_now = get_lr(step)
        wd_now = common.cosine_schedule(step, max_iters, weight_decay, weight_decay_end)
        momentum = common.cosine_schedule(step, max_iters, momentum_teacher, 1.0)
        t_temp = get_teacher_temp(step)
        for optimizer in optimizers:
            optimizer.param_groups[0].update(lr=lr_now, weight_decay=wd_now)  # weights
            optimizer.param_groups[1].update(lr=lr_now)  # biases and norms: no weight decay
        with ctx:
            with torch.no_grad():
                teacher_out = teacher(crops[:1]).float()  # only the global crops go through the teacher
            student_out = ddp_student(crops).float()  # ((2 + n) * B, out_dim)
        loss = dino_loss(student_out, teacher_out, center, student_temp=student_temp, teacher_temp=t_temp)
        scaler.scale(loss).backward()
        cancel_last_layer_grads(student.head, epoch, freeze_last_layer)
        grad_norm = optimizer_step(optimizers, scaler, student.parameters(), clip_grad=clip_grad)
        student.zero_grad(set_to_none=True)
        ema_update(teacher, student, momentum)
        if (step + 1) % log_interval == 0 or step + 1 == max_iters:
            stats = teacher_stats(teacher_out, center, t_temp)  # read at the progress line
        center = update_center(center, teacher_out, center_momentum, run_device)
        step += 1
        window.add(loss.detach(), grad_norm)

        if step % log_interval == 0 or step == max_iters:
            loss_now, per_step = window.read(step)  # waits for the GPU
            t_std, t_ent = stats.tolist()
            fields = [f"ep {step / steps_per_epoch:.2f}", f"wd {wd_now:.3f}", f"mom {momentum:.5f}",
                      f"t_temp {t_temp:.4f}", f"t_std {t_std:.4f}", f"t_ent {t_ent:.3f}"]
            print0(common.progress_line(step, max_iters, loss_now, lr_now, global_batch / per_step, "img/s", per_step,
                                        *fields))
            if t_std < collapse_std and step > warmup_iters:
                print0(f"warning: the teacher's outputs barely differ across images (std {t_std:.2e} < "
                       f"{collapse_std}): DINO may be collapsing. t_ent near 0: one prototype for every image (centre more: "
                       f"center_momentum < 1, higher teacher_temp); near 1: a uniform teacher (lower teacher_temp). "
                       f"A lower lr or a higher momentum_teacher also help.")

    # ---- the end: the processes part, then the first one alone runs the final probes (no process waits for it)
    common.teardown_distributed()
    if master and stopped:
        print(f"stopped at step {step} (--stop_at_step); continue with --resume --out_dir={out_dir}")
    elif master:
        res = dict(knn_acc=knn_acc, knn_acc_init=knn_init, knn_acc_pixels=pixels_knn)
        res.update(probes.evaluate_final(teacher_backbone, eval_sets, seg_sets, linear_blocks=linear_blocks,
                                         probe_steps=probe_steps, seed=seed, ctx=ctx, **probe))
        common.append_jsonl(log_path, dict(step=step, lr=get_lr(step), train_loss=None,
                                           seconds=round(time.time() - t_start, 1), **res, machine=machine))
        common.write_result(out_dir, n_lap=n_lap, params=student.backbone.num_params(), seed=seed, dataset=dataset,
                            steps=step, seconds=round(time.time() - t_start), **res,
                            pixel_side=min(global_size, probes.PIXEL_SIDE), machine=machine,
                            **({"holdout": holdout} if holdout else {}))
