# DINO ViT-S/16 on ImageNet-1k: facebookresearch/dino's ViT-S recipe with the paper's 50 epochs.
# Values the paper does not state are DINO's published ViT-S defaults. Unverified on GPU in this repo.
#   torchrun --standalone --nproc_per_node=8 train_dino.py config/dino_vits16_imagenet.py --data_dir=/path/to/imagenet --n_lap=3
# data_dir holds train/ and val/ with one folder per class. The paper tries n_lap in {1, 3, 5, 6} (of 6 heads).
dataset = "imagefolder"
data_dir = "/path/to/imagenet"
out_dir = "out-dino-vits16"
num_workers = 10
imagefolder_base = 256
preset = "vit-s"
n_embd = None  # the preset's 384
patch_size = None  # the preset's 16
n_lap = 3
drop_path = 0.1
out_dim = 65536
head_hidden = 2048
head_bottleneck = 256
norm_last_layer = True
global_size = 224
global_scale = [0.4, 1.0]
local_crops = 8
local_size = 96
local_scale = [0.05, 0.4]
blur_sigma = [0.1, 2.0]
epochs = 50
batch_size = 1024
lr = 0.0005
min_lr = 1e-5
warmup_epochs = 10
weight_decay = 0.04
weight_decay_end = 0.4
clip_grad = 3.0
freeze_last_layer = 1
momentum_teacher = 0.996
warmup_teacher_temp = 0.04
teacher_temp = 0.07
warmup_teacher_temp_epochs = 30
dtype = "bfloat16"
eval_interval = 5000
log_interval = 50
eval_train = 20000
eval_val = 10000
linear_blocks = 4
seg_dataset = "pets"
seg_size = 224
seg_train = 2000
seg_val = 1000
