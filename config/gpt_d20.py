# The paper's language model: nanochat's d20 (20 layers, width 1280, 10 heads of 128, ~522M parameters
# with the GPT-2 vocabulary; 561M with nanochat's 65536-token one) on FineWeb-Edu, 11.2B tokens
# (20 per parameter, Chinchilla). On one node of 8 GPUs with 80 GB each:
#   python data/fineweb_edu/prepare.py --shards=99
#   torchrun --standalone --nproc_per_node=8 train_gpt.py config/gpt_d20.py --n_lap=5
# With fewer GPUs gradient accumulation keeps the 524288-token batch; on smaller GPUs lower batch_size.
dataset = "fineweb_edu"
preset = "gpt-d20"
block_size = 2048
batch_size = 32  # sequences per GPU and micro-step
total_batch_size = 524288  # tokens per optimizer step, as nanochat
# 21400 steps x 524288 = 11.2B tokens, as the paper: random windows drawn with replacement from the 9.9B
# tokens of FineWeb-Edu sample-10BT (--shards=99), about 1.13 passes. One pass over more data is not
# offered: the prepared shards (llm.c's GPT-2 tokenisation of sample-10BT) hold 9.9B tokens.
max_iters = 21400
eval_interval = 250
eval_iters = 10  # 10 x 32 windows x 2048 tokens = 0.66M tokens per split and evaluation, over all GPUs
log_interval = 10
n_lap = 5
compile_model = True
out_dir = "out-d20"
prompt = "The capital of France is"
max_new_tokens = 100
