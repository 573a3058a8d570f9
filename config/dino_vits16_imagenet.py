# DINO ViT-S/16 on ImageNet-1k with the paper's 50 epochs and n_lap in {1, 3, 5, 6} (of 6 heads).
#   torchrun --standalone --nproc_per_node=8 train_dino.py config/dino_vits16_imagenet.py --data_dir=/path/to/imagenet --n_lap=3
# data_dir holds train/ and val/ with one folder per class. One recipe, facebookresearch/dino's "Boosting DINO
# performance" command for ViT-S/16 (its README: main_dino.py's defaults plus --teacher_temp 0.07
# --warmup_teacher_temp_epochs 30 --norm_last_layer false, 300 epochs on 2 nodes x 8 GPUs x 64 images; 73.3% k-NN,
# 76.0% linear there). Its released 74.5% / 77.0% model ran 800 epochs with other crops; those flags are not in the repo.
# Each value names its source: "dino" (that command and main_dino.py's argparse defaults it keeps), "paper" or "ours".
# Warm-ups stay in DINO's epochs, so they take a larger share of 50 epochs than of 300. Unverified on GPU in this repo.
dataset = "imagefolder"  # ours: ImageNet-1k as folders train/<class>/*.jpg and val/<class>/*.jpg
data_dir = "/path/to/imagenet"  # ours
out_dir = "out-dino-vits16"  # ours
num_workers = 10  # dino (decoding workers per GPU)
imagefolder_base = 256  # ours: images are resized to 256 x 256 first (DINO crops the decoded image)
preset = "vit-s"  # paper: ViT-S/16 (12 layers, d 384, 6 heads)
n_embd = None  # paper: the preset's 384
patch_size = None  # paper: the preset's 16
n_lap = 3  # paper: one of {1, 3, 5, 6}; pass --n_lap on the command line
drop_path = 0.1  # dino (drop_path_rate)
out_dim = 65536  # dino
head_hidden = 2048  # dino (DINOHead hidden_dim)
head_bottleneck = 256  # dino (DINOHead bottleneck_dim)
norm_last_layer = False  # dino: --norm_last_layer false (README: "only safe with --arch vit_small")
student_temp = 0.1  # dino
warmup_teacher_temp = 0.04  # dino
teacher_temp = 0.07  # dino: --teacher_temp 0.07
warmup_teacher_temp_epochs = 30  # dino: --warmup_teacher_temp_epochs 30
center_momentum = 0.9  # dino
momentum_teacher = 0.996  # dino
global_size = 224  # dino
global_scale = [0.4, 1.0]  # dino
local_crops = 8  # dino
local_size = 96  # dino
local_scale = [0.05, 0.4]  # dino
jitter = [0.4, 0.4, 0.2, 0.1]  # dino
jitter_p = 0.8  # dino
grayscale_p = 0.2  # dino
blur_sigma = [0.1, 2.0]  # dino (GaussianBlur radius_min, radius_max)
solarize_p = 0.2  # dino
epochs = 50  # paper (the command runs 300)
batch_size = 128  # ours: images per GPU, DINO's global batch of 1024 on 8 GPUs (DINO: 64 per GPU on 2 nodes x 8)
lr = 0.002  # dino: 0.0005 per 256 images, scaled linearly to the global batch of 1024 (with fewer GPUs scale it down)
min_lr = 1e-6  # dino
warmup_epochs = 10  # dino
weight_decay = 0.04  # dino
weight_decay_end = 0.4  # dino
clip_grad = 3.0  # dino
freeze_last_layer = 1  # dino
dtype = "auto"  # ours: bfloat16 from compute capability 8.0, which needs no loss scaler; float16 with one below
#                 (DINO trains in float16 with a loss scaler, use_fp16)
eval_interval = 5000  # ours
log_interval = 50  # ours
eval_train = 20000  # ours: k-NN bank and linear probe on a subset (DINO: all 1.28M images)
eval_val = 10000  # ours
knn_k = 20  # dino (eval_knn.py)
knn_temp = 0.07  # dino (eval_knn.py)
linear_blocks = 4  # dino (eval_linear.py: n_last_blocks 4 for ViT-Small)
seg_dataset = "pets"  # ours: the paper probes ADE20K; train_dino.py has Oxford-IIIT Pet (and generated scenes)
seg_size = 224  # ours
seg_train = 2000  # ours
seg_val = 1000  # ours
