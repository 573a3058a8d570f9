# The paper's supervised recipe (its section 2): DeiT-III ViT-B/16 on ImageNet-1k, as in the first
# author's code (QK-norm, LayerScale 1e-6, AdamW 2e-3 at batch 2048, wd 0.05, 5 warmup epochs, 3-Augment,
# mixup 0.8, cutmix 1.0, label smoothing 0.1, BCE loss, grad clip 1.0), all 12 heads Laplacian.
#   torchrun --nproc_per_node=8 train_vit.py config/vit_deit3_b.py --data_dir=/data/imagenet
# Global batch 2048 = 256 x 1 x 8 GPUs; with fewer GPUs raise grad_accum to keep it (and keep lr).
# The paper compares n_lap in {0, 3, 6, 9, 11, 12} and drop_path in {0.1, 0.3, 0.4}, 3 seeds each.
out_dir = "out-vit-deit3-b"
dataset = "imagefolder"
img_size = 224
num_workers = 10
preset = "vit-b"
patch_size = 16
pooling = "cls"
n_lap = 12
qk_norm = True
layerscale = 1e-6
drop_path = 0.1
hflip = True
three_augment = True
color_jitter = 0.3
random_erasing = 0.0  # DeiT-III dropped DeiT's random erasing
mixup = 0.8
cutmix = 1.0
label_smoothing = 0.1
bce_loss = True
optimizer = "adamw"
epochs = 300
batch_size = 256
grad_accum = 1
lr = 2e-3
min_lr = 1e-5
warmup_epochs = 5.0
weight_decay = 0.05
grad_clip = 1.0
compile_model = True
log_interval = 100
