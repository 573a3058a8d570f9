# One GPU: CIFAR-10 with the vit-small preset (6 layers, d 192, 6 heads, patch 4: 64 patches + CLS), all heads
# Laplacian, the DeiT-III ingredients at CIFAR scale. Not yet run on a GPU by us: treat accuracy as unverified.
#   python train_vit.py config/vit_cifar10.py            (compare: --n_lap=0)
out_dir = "out-vit-cifar10"
dataset = "cifar10"
preset = "vit-small"
patch_size = 4
pooling = "cls"
n_lap = 6
qk_norm = True
drop_path = 0.1
crop_padding = 4
hflip = True
three_augment = True
random_erasing = 0.0  # DeiT-III dropped DeiT's random erasing
mixup = 0.8
cutmix = 1.0
label_smoothing = 0.1
epochs = 200
batch_size = 512
lr = 2e-3
min_lr = 1e-5
warmup_epochs = 10.0
weight_decay = 0.05
grad_clip = 1.0
compile_model = True
log_interval = 20
eval_interval = 97  # an epoch of 50,000 images at the global batch 512
