# nanoGPT's CPU recipe for shakespeare_char (its README: val loss ~1.88 on tinyshakespeare after
# ~3 minutes on a laptop), as hyperparameters for nanolap's GPT: the reference that the CPU default
# has to beat in the same wall time. Differences that remain: nanolap's architecture (nanochat's, not
# GPT-2's) and a linear instead of a cosine decay to lr/10.
#   python train_gpt.py config/gpt_nanogpt_cpu.py
n_layer = 4
n_head = 4
n_embd = 128
n_lap = 0
block_size = 64
batch_size = 12
max_iters = 2000
dropout = 0.0
optimizer_name = "adamw"
lr = 1e-3
beta1 = 0.9
beta2 = 0.99
weight_decay = 0.1
grad_clip = 1.0
warmup_iters = 100
warmdown_frac = 0.95
final_lr_frac = 0.1
eval_interval = 250
eval_iters = 20
log_interval = 100
out_dir = "out-gpt-nanogpt-recipe"
