# The paper's supervised ImageNet-1k run: DeiT-III ViT-B/16, all 12 heads Laplacian.
#   torchrun --nproc_per_node=8 train_vit.py config/vit_deit3_b.py --data_dir=/data/imagenet
# Each value names its source: "paper" (what the paper states), "author" (the first author's sweep script for
# ViT-B on ImageNet-1k in their timm fork, used where the paper is silent) or "ours". Where the two disagree we
# take the paper's value and give the script's. The paper compares n_lap in {0, 3, 6, 9, 11, 12} and drop_path in
# {0.1, 0.3, 0.4}, 3 seeds each; its learning-rate grid is {4e-5, 3e-4, 5e-4, 3e-3, 4e-3}.
out_dir = "out-vit-deit3-b"  # ours
dataset = "imagefolder"  # ours: ImageNet-1k as folders train/<class>/*.jpg and val/<class>/*.jpg
img_size = 192  # author (deit3_base_*_patch16_192, trained and evaluated at 192, no 224 fine-tuning stage)
num_workers = 10  # ours
preset = "vit-b"  # paper: DeiT-III ViT-B (12 layers, d 768, 12 heads)
patch_size = 16  # paper: ViT-B/16
pooling = "cls"  # author: DeiT-III's class token (position embedding on the patches only, as ours)
n_lap = 12  # paper: the all-Laplacian end of k in {0, 3, 6, 9, 11, 12}
qk_norm = True  # author
layerscale = 1e-6  # author (DeiT-III's init_values)
drop_path = 0.1  # paper: the grid {0.1, 0.3, 0.4}; the author's script uses 0.2
simple_random_crop = False  # author: timm's random resized crop, scale 0.08-1 (SRC is DeiT-III's ImageNet-21k crop)
hflip = True  # author (timm's default flip, p 0.5)
three_augment = True  # author (timm --aa 3a)
color_jitter = 0.3  # author
random_erasing = 0.0  # author (timm's default reprob 0, as DeiT-III)
mixup = 0.8  # author
cutmix = 1.0  # author
label_smoothing = 0.1  # author (applied inside the mix, timm's mixup_target)
bce_loss = True  # author
epochs = 300  # paper; the author's script runs 400
batch_size = 256  # author: global batch 2048 (there 256 x 4 GPUs x 2 accumulation steps; here 256 x 8 GPUs)
grad_accum = 1  # ours: with fewer GPUs raise grad_accum to keep the global batch 2048 (and keep lr)
lr = 2e-3  # author (1e-3 per 1024 images, scaled linearly to 2048); not in the paper's stated grid
min_lr = 1e-6  # author
warmup_epochs = 5.0  # author
weight_decay = 0.05  # author
grad_clip = 1.0  # author
seed = 0  # paper: 3 seeds; the author's script uses 0, 1, 2
compile_model = True  # author (--torchcompile)
log_interval = 100  # ours
eval_interval = 625  # ours: one evaluation per epoch of ImageNet-1k at the global batch 2048
