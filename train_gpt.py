"""
Causal language models with Laplacian heads, nanochat style: Shakespeare on a laptop CPU, FineWeb-Edu
on a GPU node (Zhang & Papyan, arXiv 2602.09297, the language-model experiment).

    python data/shakespeare_char/prepare.py && python train_gpt.py     # CPU default, under 10 minutes
    python train_gpt.py --n_lap=0                                      # the all-attention baseline
    python train_gpt.py --n_lap=[0,1,2,3]                              # one count per layer
    python train_gpt.py --stop_at_step=500 && python train_gpt.py --resume   # stop early, continue exactly
    python train_gpt.py --sample_from=out-gpt/ckpt.pt --prompt="ROMEO:"   # only sample a checkpoint
    torchrun --standalone --nproc_per_node=8 train_gpt.py config/gpt_d20.py   # the paper's d20

The model follows nanochat's GPT (nanolap.py: RMSNorm, RoPE, QK-norm, ReLU^2, untied embeddings, logit soft-cap),
its optimizers (Muon for the block matrices, AdamW for the embedding and lm_head; or --optimizer_name=adamw) and
its schedule (constant, then a linear warm-down). A step's batch is a function of (seed, step) alone, however
processes and micro-steps split it, so --resume continues exactly. Data: data/text.py.
"""

import inspect
import math
import os
import time
from contextlib import nullcontext
from dataclasses import asdict, replace

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import common
import configurator
import nanolap
from common import UsageError, print0
from data import text
from optim import Muon, load_optimizer_states, optimizer_step

# ---------------------------------------------------------------- defaults
# I/O
out_dir = "out-gpt"  # ckpt.pt, log.jsonl and result.txt go here
eval_interval = 250  # steps between evaluations and checkpoints (also at step 0 and the last); each costs eval_iters batches
eval_iters = 40  # eval_iters * batch_size validation windows per evaluation, shared by the processes (fixed windows)
log_interval = 25  # steps between progress lines
resume = False  # continue out_dir/ckpt.pt exactly: its options are the base, the command line goes on top
stop_at_step = 0  # stop with a checkpoint after this step, as if interrupted (the schedule still spans the whole run); 0 = never
# data
dataset = "shakespeare_char"  # data/<dataset>/{train,val}.bin and meta.json, made by data/<dataset>/prepare.py
data_dir = "data"  # the folder that holds the dataset folders
holdout = 0.0  # for choosing hyperparameters: train without the last this fraction of the train split, evaluate on it; 0 = off
block_size = 128  # context length in tokens, also the model's (its rotary embeddings end there)
batch_size = 8  # sequences per process and micro-step (the global batch, in tokens, is printed); lower it when memory runs out
total_batch_size = 0  # tokens per optimizer step over all processes (gradient accumulation); 0 = one batch each
# model: a nanolap preset; None keeps the preset's value
preset = "gpt-tiny"  # gpt-tiny (the CPU model), gpt-small, gpt-d20 (the paper's 561M model)
n_layer = None  # None = the preset's depth
n_head = None  # None = the preset's head count
n_kv_head = None  # key/value heads, a divisor of n_head shared by its query heads (grouped-query attention); None = n_head
n_embd = None  # None = the preset's width (a multiple of n_head)
n_lap = 2  # Laplacian heads per layer (the trailing ones), or a list with one count per layer
dropout = 0.0  # attention and residual dropout; short runs do not overfit, so 0
graph = "attention"  # P: attention (softmax) | uniform (every head: the running mean) | lap_uniform (the Laplacian heads alone)
# optimization (nanochat's values; AdamW learning rates are scaled by (n_embd / 768) ** -0.5)
optimizer_name = "muon"  # 'muon': Muon for block matrices + AdamW for embedding/lm_head; 'adamw': AdamW for all
matrix_lr = 0.02  # Muon, the block matrices
embedding_lr = 0.2  # AdamW, token embedding
unembedding_lr = 0.004  # AdamW, lm_head
lr = 1e-3  # --optimizer_name=adamw: the learning rate of every parameter (not scaled)
weight_decay = 0.0  # decoupled weight decay of the block matrices (adamw: of every matrix)
beta1 = 0.8  # AdamW's first-moment decay (nanochat's; nanoGPT uses 0.9)
beta2 = 0.95  # AdamW's second-moment decay
grad_clip = 1.0  # clip the global gradient norm; 0 = off
max_iters = 2000  # optimizer steps: the length of the learning-rate schedule
warmup_iters = 0  # linear warm-up steps (nanochat uses none)
warmdown_frac = 0.2  # the last fraction of the schedule decays linearly ...
final_lr_frac = 0.0  # ... to this fraction of the peak learning rate
# system
device = "auto"  # auto = cuda (torchrun: one GPU per process), else mps, else cpu; or cpu, cuda, cuda:N, mps
dtype = "auto"  # auto: bfloat16 on GPUs from Ampere on, float16 (gradient scaler) on older ones, float32 on CPU/MPS
compile_model = False  # torch.compile the model for training: faster on GPUs after a minute of compiling
cpu_procs = 2  # CPU without torchrun: data-parallel single-threaded processes (the batch grows with them); 1 = this one
seed = 1337  # the initial weights, the batches, dropout and the samples are functions of it
# sampling: at the end of training, or only from a checkpoint with --sample_from
sample_from = ""  # path of a ckpt.pt: sample from it and exit (no training, no data needed)
prompt = "\n"  # the text the samples continue
num_samples = 1  # samples to print
max_new_tokens = 500  # tokens per sample; 0 = no sample
temperature = 0.8  # 0 = greedy
top_k = 200  # sample among the k most likely tokens; 0 = no top-k filter

# ---------------------------------------------------------------- helpers

@torch.no_grad()
def evaluate(model, tokens, token_bytes, block_size, n_windows, batch_size, device, ctx=nullcontext(), rank=0, world=1):
    """(loss, bits per byte) on n_windows windows spread evenly over `tokens`: the same windows at every evaluation
    and in every run. loss = mean nats per predicted token; bits per byte = sum of nats / (ln 2 * sum of UTF-8 bytes)
    over the predicted tokens that stand for text (token_bytes > 0). token_bytes: (vocab,) int64 tensor on device.
    With several processes each takes every world-th window and the sums are added up."""
    starts = np.linspace(0, len(tokens) - block_size - 1, n_windows).astype(np.int64)[rank::world]
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # nats, tokens, nats of text tokens, bytes
    for i in range(0, len(starts), batch_size):
        x, y = text.windows(tokens, starts[i:i + batch_size], block_size, device)
        with ctx:
            logits = model(x)  # (B, T, vocab)
        nats = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none")  # (B*T,)
        nbytes = token_bytes[y.flatten()]
        sums += torch.stack([nats.sum(), torch.tensor(nats.numel(), device=device),
                             (nats * (nbytes > 0)).sum(), nbytes.sum()]).double()
    if world > 1:
        dist.all_reduce(sums)
    nats, count, text_nats, nbytes = sums.tolist()
    return nats / count, text_nats / (math.log(2) * nbytes) if nbytes else float("nan")

def train_batch(tokens, seed, step, chunk, batch_size, block_size, device):
    """Chunk `chunk` (batch_size sequences) of step `step`'s global batch, cut from the step's one stream of random
    windows (text.get_batch's index 0): 1 process x 16 sequences, 2 x 8 and 2 micro-steps x 8 train on the same."""
    x, y = text.get_batch(tokens, seed=seed, step=step, index=0, batch_size=(chunk + 1) * batch_size,
                          block_size=block_size, device="cpu")  # ((chunk + 1) * B, T)
    x, y = x[chunk * batch_size:], y[chunk * batch_size:]  # (B, T)
    return common.to_device(x, device), common.to_device(y, device)

def build_optimizers(model, kind, lr, matrix_lr, embedding_lr, unembedding_lr, weight_decay, betas, compile=False,
                     dtype=torch.float32):
    """nanochat (kind 'muon'): Muon for the 2-D matrices inside the blocks, AdamW for the embedding and
    the lm_head (learning rates scaled by 1/sqrt(n_embd / 768), tuned at width 768). Or (kind 'adamw')
    one AdamW for everything. Every group remembers its peak learning rate as initial_lr. Muon orthogonalises in
    the run's dtype (bfloat16 or float16 under autocast, else float32); compile=True compiles its iteration."""
    # fused AdamW: one kernel for the step, which under float16 reads optimizer_step's skip decision on the device
    fused = next(model.parameters()).device.type in ("cuda", "cpu")
    if kind == "adamw":
        groups = [dict(params=list(model.parameters()), lr=lr, weight_decay=weight_decay)]
        optimizers = [torch.optim.AdamW(groups, betas=betas, fused=fused)]
    else:
        # q, k and v as three matrices, as nanochat's c_q, c_k, c_v (the uniform graph: v alone); qkv_rows: their heights,
        # which differ between layers of different n_lap on the lap_uniform graph: a group per list of heights
        qkv = {}
        for block in model.blocks:
            qkv.setdefault(tuple(block.attn.qkv_rows), []).append(block.attn.qkv.weight)
        matrices = [p for n, p in model.blocks.named_parameters() if p.ndim == 2 and not n.endswith("qkv.weight")]
        embedding = [model.wte.weight]
        head = [model.lm_head.weight]
        assert len(matrices) + len(model.blocks) + 2 == len(list(model.parameters())), "every parameter needs an optimizer"
        scale = (model.config.n_embd / 768) ** -0.5
        groups = [dict(params=head, lr=unembedding_lr * scale), dict(params=embedding, lr=embedding_lr * scale)]
        optimizers = [torch.optim.AdamW(groups, betas=betas, eps=1e-10, weight_decay=0.0, fused=fused),
                      Muon([dict(params=matrices)] + [dict(params=ps, blocks=list(rows)) for rows, ps in qkv.items()],
                           lr=matrix_lr, weight_decay=weight_decay,
                           ns_dtype=dtype, compile=compile)]
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["initial_lr"] = group["lr"]
    return optimizers

def get_lr_multiplier(step):
    """Step `step`'s learning rate as a fraction of each group's peak (nanochat's get_lr_multiplier): a linear warm-up
    whose step s trains at (s + 1) / warmup_iters, constant, then a linear warm-down over the last warmdown_frac of
    max_iters to final_lr_frac. Like nanoGPT's get_lr it reads module globals: the options."""
    warmdown = round(warmdown_frac * max_iters)
    if step < warmup_iters:
        return (step + 1) / warmup_iters
    if warmdown == 0 or step <= max_iters - warmdown:
        return 1.0
    progress = max(max_iters - step, 0) / warmdown  # 1 -> 0 across the warm-down
    return progress + (1 - progress) * final_lr_frac

def get_muon_momentum(step):
    """Muon's momentum rises from 0.85 to 0.95 over the first 300 steps (nanochat)."""
    return 0.85 + 0.10 * min(step / 300, 1.0)

@torch.no_grad()
def sample(model, tokenizer, prompt, num_samples, max_new_tokens, temperature, top_k, seed, device):
    """Print num_samples continuations of prompt (temperature 0 = greedy; top_k 0 = no filter)."""
    ids = tokenizer.encode(prompt)
    if not ids:
        raise UsageError("--prompt is empty; give at least one character, e.g. --prompt='\\n'")
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    texts = []
    for _ in range(num_samples):
        out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k or None, generator=generator)
        texts.append(tokenizer.decode(out[0].tolist()))
        print(texts[-1] + "\n" + "-" * 80)
    return texts

def sample_checkpoint(path, device, prompt, num_samples, max_new_tokens, temperature, top_k, seed):
    """--sample_from=path: load a GPT checkpoint and print samples; no data directory is needed."""
    ckpt = common.load_checkpoint(path, "--sample_from: ", map_location=device)
    if ckpt.get("kind") != "gpt":
        raise UsageError(f"{path} is a {ckpt.get('kind')!r} checkpoint; --sample_from needs one written by "
                         f"train_gpt.py (kind 'gpt')")
    model = common.load_model(ckpt).to(device).eval()
    print(f"sampling from {path} (step {ckpt['step']}, {ckpt['config']['dataset']}, n_lap={model.config.n_lap})")
    print("-" * 80)
    return sample(model, text.get_tokenizer(ckpt["meta"]), prompt, num_samples=num_samples, max_new_tokens=max_new_tokens,
                  temperature=temperature, top_k=top_k, seed=seed, device=device)

# ---------------------------------------------------------------- run

if __name__ == "__main__":
    config, ckpt = configurator.configure(globals(), schedule=("max_iters", "warmup_iters", "warmdown_frac"))
    # ---- validation: every mistake in the options fails here, in one line, before any work
    configurator.check_options(config, at_least={
        1: ("max_iters", "eval_interval", "eval_iters", "log_interval", "block_size", "batch_size", "num_samples",
            "cpu_procs"),
        0: ("stop_at_step", "warmup_iters", "total_batch_size", "seed", "max_new_tokens", "top_k", "temperature",
            "grad_clip", "weight_decay")},
        fractions=("warmdown_frac", "final_lr_frac", "holdout"),
        choices=dict(optimizer_name=("muon", "adamw")))
    if sample_from:  # only sample a checkpoint: no data, no training
        sample_checkpoint(sample_from, common.resolve_device(device), prompt, num_samples=num_samples,
                          max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed)
        raise SystemExit(0)
    if ckpt is not None and block_size > ckpt["model_config"]["block_size"]:
        raise UsageError(f"--block_size={block_size} is larger than the model's block_size="
                         f"{ckpt['model_config']['block_size']} (its rotary embeddings end there)")
    common.check_compile(compile_model, common.resolve_device(device))
    ctx, amp_dtype = common.autocast(common.resolve_device(device), dtype)  # checks --device and --dtype
    model_config = configurator.config_from_options(config, "gpt")  # the model options; the vocabulary: the data's
    common.launch_processes(cpu_procs, device)
    meta = text.load_meta(data_dir, dataset)  # a missing dataset fails before out_dir is touched
    model_config = replace(model_config, vocab_size=text.model_vocab_size(meta["vocab_size"]))
    if ckpt is not None and ckpt["step"] >= max_iters:  # leave a finished run as it is
        configurator.finished_run(out_dir, ckpt["step"], max_iters, "max_iters")
    rank, local_rank, world, run_device = common.start_processes(
        out_dir, resume, device, oom_advice=f"in the run {out_dir} at {batch_size} sequences of {block_size} "
        f"tokens per process and micro-step: lower --batch_size (--total_batch_size keeps the global batch)")
    master = rank == 0
    torch.manual_seed(seed)

    # ---- data: flat uint16 token files (data/text.py); bytes per token for bits per byte
    train_tokens = text.load_tokens(data_dir, dataset, "train")
    val_tokens = text.load_tokens(data_dir, dataset, "val")
    if holdout:
        train_tokens, val_tokens = text.hold_out(train_tokens, holdout)
    for split, tokens in (("train", train_tokens), ("val", val_tokens)):
        if len(tokens) <= block_size + 1:
            raise UsageError(f"the {split} split of {dataset} has {len(tokens)} tokens, too few for "
                             f"--block_size={block_size} (needs more than block_size + 1): lower --block_size")
    tokenizer = text.get_tokenizer(meta)
    padding = [0] * (model_config.vocab_size - meta["vocab_size"])  # the padded vocabulary's rows stand for no text
    token_bytes = torch.tensor(tokenizer.token_bytes + padding, device=run_device)
    tokens_per_batch = batch_size * block_size * world
    total = total_batch_size or tokens_per_batch
    if total % tokens_per_batch:
        raise UsageError(f"--total_batch_size={total} is not a multiple of batch_size x block_size x processes = "
                         f"{batch_size} x {block_size} x {world} = {tokens_per_batch}")
    grad_accum = total // tokens_per_batch

    # ---- model and optimizers (a resumed run restores both and its clock)
    raw_model = nanolap.build_model(model_config).to(run_device)
    optimizers = build_optimizers(raw_model, kind=optimizer_name, lr=lr, matrix_lr=matrix_lr, embedding_lr=embedding_lr,
                                  unembedding_lr=unembedding_lr, weight_decay=weight_decay, betas=(beta1, beta2),
                                  compile=compile_model and run_device.startswith("cuda"),  # a GPU gains, a CPU waits
                                  dtype=amp_dtype)
    scaler = torch.amp.GradScaler(run_device.split(":")[0], enabled=amp_dtype == torch.float16)  # float16 only
    step = 0
    best_val_loss = float("inf")
    if ckpt is not None:
        configurator.check_resume(ckpt, "gpt", model_config)
        raw_model.load_state_dict(common.clean_state_dict(ckpt["model"]))
        load_optimizer_states(optimizers, ckpt["optimizer"])
        if ckpt.get("scaler"):  # a float16 run's loss scale; a bfloat16 or float32 checkpoint holds none
            scaler.load_state_dict(ckpt["scaler"])
        step = ckpt["step"]
        best_val_loss = ckpt["best_val_loss"]
    # raw_model: the module (its weights, checkpoints, sampling); model: compiled or not, what trains and evaluates;
    # ddp_model: model with DDP's gradient averaging around it (several processes), what the training step calls
    model = torch.compile(raw_model) if compile_model else raw_model
    ddp_model = model
    if world > 1:
        # no buffer broadcast (a wait) before every forward: RoPE's cos/sin never change. The option's name depends
        # on the torch version: forward_sync_buffers, else broadcast_buffers (which newer versions warn on)
        no_broadcast = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters else "broadcast_buffers"
        ddp_model = DDP(model, device_ids=[local_rank] if run_device.startswith("cuda") else None, **{no_broadcast: False})
    peak = common.peak_flops(run_device, dtype=amp_dtype)
    machine = common.machine_name(run_device)  # kept in the log and the RESULT line: floats differ by machine
    corpus = meta.get("corpus", "unknown")  # kept there too: losses on two corpora do not compare (prepare.py names it)
    flops_per_step = raw_model.flops_per_token(block_size) * total
    peak_lr = matrix_lr if optimizer_name == "muon" else lr  # the rate that log.jsonl and the progress line show

    # ---- output: the resolved options first; a resumed log.jsonl keeps only the evaluations up to the checkpoint
    ckpt_path = os.path.join(out_dir, common.CHECKPOINT)
    log_path = os.path.join(out_dir, common.LOG)
    print0("config: " + " ".join(f"{k}={v!r}" for k, v in config.items()))
    print0(f"data: {dataset} (corpus {corpus}, {meta['tokenizer']} tokenizer, vocab {meta['vocab_size']}), "
           f"train {len(train_tokens):,} tokens, val {len(val_tokens):,}" + " (held out of train)" * (holdout > 0))
    print0(f"model: {preset}, {model_config.n_layer} layers, {model_config.n_head} heads, d={model_config.n_embd}, "
           f"Laplacian heads per layer {model_config.n_lap_per_layer()}, {raw_model.num_params() / 1e6:.2f}M parameters "
           f"({raw_model.num_params(exclude_embedding=True) / 1e6:.2f}M without the embedding)")
    print0(f"batch: global batch {total:,} tokens = {batch_size} x {block_size} tokens x {world} process(es) x "
           f"{grad_accum} micro-step(s); {optimizer_name} optimizer; {run_device}, "
           f"{common.DTYPE_WORDS[amp_dtype]}{', compiled' if compile_model else ''}")
    if master and ckpt is not None:
        print(f"resumed from {ckpt_path} at step {step}")
        common.keep_log_until(log_path, step)

    # ---- the loop: evaluate (and checkpoint) every eval_interval steps and at the last, else one optimizer step
    t_start = time.time() - (ckpt["seconds"] if ckpt else 0)  # a resumed run's seconds count its earlier pieces too
    window = common.LogWindow(run_device, ckpt)  # the steps since the last progress line, and since the last record
    start_step = step
    metrics = {}  # the last evaluation's
    while True:
        last = step == max_iters
        stopped = step == stop_at_step and start_step < step < max_iters
        # a resumed run's first step was evaluated before it stopped
        evaluating = (step % eval_interval == 0 or last) and (step > start_step or ckpt is None)
        if evaluating or stopped:  # a checkpoint may follow: no weight it saves may come from a non-finite step
            window.read(step)
            common.check_finite_weights(raw_model.parameters(), step - 1)  # float16: the norm is the scaler's 0
        if evaluating:
            model.eval()
            metrics["val_loss"], metrics["val_bpb"] = evaluate(
                model, val_tokens, token_bytes, block_size=block_size, n_windows=eval_iters * batch_size,
                batch_size=batch_size, device=run_device, ctx=ctx, rank=rank, world=world)
            model.train()
            best_val_loss = min(best_val_loss, metrics["val_loss"])
            common.log_record(log_path, dict(
                step=step, lr=peak_lr * get_lr_multiplier(step), train_loss=window.train_loss(),
                seconds=round(time.time() - t_start, 1), **metrics, tokens=step * total, machine=machine,
                corpus=corpus), keys=("train_loss", "val_loss", "val_bpb"))
        if master and step > start_step and (evaluating or stopped):
            common.save_checkpoint(dict(
                kind="gpt", model_config=asdict(model_config), model=common.clean_state_dict(raw_model.state_dict()),
                config=config, optimizer=[optimizer.state_dict() for optimizer in optimizers],
                scaler=scaler.state_dict(), step=step, seconds=time.time() - t_start, record_loss=window.record_loss,
                record_steps=window.record_steps, meta={k: v for k, v in meta.items() if k != "token_bytes"},
                best_val_loss=best_val_loss), ckpt_path)
        if last or stopped:
            break
        if evaluating:
            window.start = time.time()  # evaluation and checkpoint time is not training time

        # one optimizer step: learning rates and Muon momentum from the schedules, grad_accum micro-batches
        torch.manual_seed(common.step_seed(seed, step, rank))  # this step's dropout masks
        lr_mult = get_lr_multiplier(step)
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["lr"] = group["initial_lr"] * lr_mult
                if isinstance(optimizer, Muon):
                    group["momentum"] = get_muon_momentum(step)
        loss_step = torch.zeros((), device=run_device)
        for micro in range(grad_accum):
            x, y = train_batch(train_tokens, seed=seed, step=step, chunk=micro * world + rank, batch_size=batch_size,
                               block_size=block_size, device=run_device)
            # DDP all-reduces the gradients in backward(); only the last micro-step of a step needs it to
            ddp_model.require_backward_grad_sync = micro == grad_accum - 1
            with ctx:
                _, loss = ddp_model(x, y)  # logits (B, T, vocab), mean cross-entropy
            scaler.scale(loss / grad_accum).backward()
            loss_step += loss.detach() / grad_accum
        grad_norm = optimizer_step(optimizers, scaler, raw_model.parameters(), grad_clip=grad_clip)
        raw_model.zero_grad(set_to_none=True)
        step += 1
        window.add(loss_step, grad_norm)

        if step % log_interval == 0 or step == max_iters:
            loss_now, per_step = window.read(step)  # waits for the GPU; the first window holds the compilation
            fields = [f"mfu {flops_per_step / per_step / (peak * world):.1%}"] if peak else []
            print0(common.progress_line(step, max_iters, loss_now, peak_lr * lr_mult, total / per_step, "tok/s",
                                        per_step, *fields))

    # ---- the end: the processes part first (no one waits while the first one samples), then a sample and RESULT
    common.teardown_distributed()
    if master and stopped:
        print(f"stopped at step {step} (--stop_at_step); continue with --resume --out_dir={out_dir}")
    elif master:
        seconds = round(time.time() - t_start)
        if num_samples and max_new_tokens:
            print("-" * 80)
            try:
                sample(raw_model.eval(), tokenizer, prompt, num_samples=num_samples, max_new_tokens=max_new_tokens,
                       temperature=temperature, top_k=top_k, seed=seed, device=run_device)
            except UsageError as e:
                print(f"no sample: {e}")
        common.write_result(out_dir, n_lap=model_config.n_lap, params=raw_model.num_params(), seed=seed,
                            dataset=dataset, corpus=corpus, steps=step, seconds=seconds, val_loss=metrics["val_loss"],
                            val_bpb=metrics["val_bpb"], machine=machine, **({"holdout": holdout} if holdout else {}))
