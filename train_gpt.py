"""
Causal language models with Laplacian heads, nanochat style: Shakespeare on a laptop CPU, FineWeb-Edu
on a GPU node (Zhang & Papyan, arXiv 2602.09297, the language-model experiment).

    python data/shakespeare_char/prepare.py && python train_gpt.py     # CPU default, under 10 minutes
    python train_gpt.py --n_lap=0                                      # the all-attention baseline
    python train_gpt.py --n_lap=[0,1,2,3]                              # one count per layer
    python train_gpt.py --resume --max_iters=6000                      # continue out_dir/ckpt.pt
    python train_gpt.py --sample_from=out-gpt/ckpt.pt --prompt="ROMEO:"   # only sample a checkpoint
    torchrun --standalone --nproc_per_node=8 train_gpt.py config/gpt_d20.py   # the paper's d20

Model: nanolap's GPT (nanochat's architecture: RMSNorm, RoPE, QK-norm, ReLU^2, no biases, untied
embeddings, logit soft-cap, zero-initialised output projections); the trailing n_lap heads of every
layer are Laplacian. Optimiser (nanochat): Muon for the 2-D matrices of the blocks, AdamW for the token
embedding and the lm_head; or --optimizer=adamw for everything.

Evaluation every eval_interval steps on fixed windows of the validation split: the loss (nats per
token) and the bits per byte, sum of nats / (ln 2 * sum of the UTF-8 bytes of the predicted tokens),
which compares models across tokenizers. One JSON line per evaluation in out_dir/log.jsonl; the
checkpoint out_dir/ckpt.pt is written atomically after each evaluation.

Exact resume: the batch of a step and its dropout masks are pure functions of (seed, step, process),
and the checkpoint holds the model, both optimisers and the step, so `--resume` continues exactly as
the uninterrupted run would have (on CPU the losses are equal to the last bit).
"""

import json
import math
import os
import sys
import textwrap
import time
from contextlib import nullcontext
from dataclasses import asdict

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from nanolap import (PRESETS, UsageError, all_reduce_mean, append_jsonl, check_finite, clean_state_dict,
                     format_time, load_checkpoint, load_model, make_config, build_model, Config, parse_args,
                     peak_flops, rng_state, run_main, save_checkpoint, set_rng_state, setup_distributed,
                     teardown_distributed)

# -----------------------------------------------------------------------------
# default config: override with --key=value or a config file of `key = value` lines (config/gpt_*.py)

DEFAULTS = dict(
    # I/O
    out_dir="out-gpt",  # ckpt.pt and log.jsonl go here
    eval_interval=250,  # steps between evaluations (and checkpoints)
    eval_iters=20,  # batches per evaluation, of the validation and of the training split
    log_interval=25,  # steps between progress lines
    resume=False,  # continue from out_dir/ckpt.pt (its config, updated by the options given now)
    # data
    dataset="shakespeare_char",  # data/<dataset>/{train,val}.bin, made by data/<dataset>/prepare.py
    data_dir="data",
    block_size=128,  # context length in tokens (also the model's)
    batch_size=16,  # sequences per forward/backward, per process
    total_batch_size=0,  # tokens per optimiser step over all processes (gradient accumulation); 0 = one batch each
    # model: a nanolap preset; None keeps the preset's value
    model="gpt-tiny",  # gpt-tiny, gpt-small, gpt-d20 (the paper's 561M model)
    n_layer=None,
    n_head=None,
    n_embd=None,
    n_lap=2,  # Laplacian heads per layer (the trailing ones), or a list with one count per layer
    dropout=0.0,
    # optimiser (nanochat's values; AdamW learning rates are scaled by (n_embd / 768) ** -0.5)
    optimizer="muon",  # 'muon': Muon for block matrices + AdamW for embedding/lm_head; 'adamw': AdamW for all
    matrix_lr=0.02,  # Muon
    embedding_lr=0.2,  # AdamW, token embedding
    unembedding_lr=0.004,  # AdamW, lm_head
    lr=1e-3,  # --optimizer=adamw: the learning rate of every parameter (not scaled)
    weight_decay=0.0,  # decoupled weight decay of the block matrices (adamw: of every matrix)
    beta1=0.8,
    beta2=0.95,
    grad_clip=1.0,  # clip the global gradient norm; 0 = off
    max_iters=2000,  # optimiser steps
    schedule_iters=0,  # length of the learning-rate schedule; 0 = max_iters
    warmup_iters=0,  # linear warm-up steps
    warmdown_frac=0.2,  # the last fraction of the schedule decays linearly ...
    final_lr_frac=0.0,  # ... to this fraction of the peak learning rate
    # system
    device="",  # '' = cuda if available (torchrun: one GPU per process), else mps, else cpu
    dtype="auto",  # 'auto' (bfloat16 autocast on CUDA, float32 elsewhere), 'bfloat16' or 'float32'
    compile=False,  # torch.compile the model for training
    seed=1337,
    # sampling: at the end of training, or only from a checkpoint with --sample_from
    sample_from="",  # path of a ckpt.pt: sample from it and exit (no training, no data needed)
    prompt="\n",
    num_samples=1,
    max_new_tokens=500,
    temperature=0.8,  # 0 = greedy
    top_k=200,  # 0 = no top-k filter
)
MODEL_KEYS = ("dataset", "model", "n_layer", "n_head", "n_embd", "n_lap", "dropout")  # fixed once trained
DATASETS = ("shakespeare_char", "shakespeare", "fineweb_edu")  # the ones with a data/<name>/prepare.py

# -----------------------------------------------------------------------------
# data: nanoGPT's flat uint16 token files, JSON metadata, tokenizers


def _prepared(data_dir, dataset, filename):
    path = os.path.join(data_dir, dataset, filename)
    if not os.path.isfile(path):
        script = os.path.join("data", dataset, "prepare.py")
        fix = (f"prepare it first: python {script}" if dataset in DATASETS else
               f"known datasets: {', '.join(DATASETS)} (each made by python data/<name>/prepare.py)")
        raise UsageError(f"{path} not found: dataset {dataset!r} is not prepared in {data_dir}; {fix}")
    return path


def load_meta(data_dir, dataset):
    """The dataset's meta.json: vocab_size, tokenizer ('char' or 'gpt2'), chars or encoding, token_bytes."""
    with open(_prepared(data_dir, dataset, "meta.json"), encoding="utf-8") as f:
        return json.load(f)


def load_tokens(data_dir, dataset, split):
    """The token ids of a split ('train' or 'val') as a read-only uint16 memmap."""
    return np.memmap(_prepared(data_dir, dataset, f"{split}.bin"), dtype=np.uint16, mode="r")


def tiktoken_encoding(name="gpt2"):
    """A tiktoken Encoding by name; tiktoken downloads its vocabulary on first use, then caches it."""
    import tiktoken
    try:
        return tiktoken.get_encoding(name)
    except Exception as e:
        reason = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise UsageError(f"tiktoken could not load the {name!r} vocabulary ({reason}). tiktoken downloads it from "
                         f"openaipublic.blob.core.windows.net on first use and caches it (TIKTOKEN_CACHE_DIR): "
                         f"connect to the internet once, or use the character-level data/shakespeare_char") from None


def token_byte_lengths(enc):
    """UTF-8 bytes of every token id of a tiktoken Encoding; 0 for special tokens and unused ids."""
    special = {enc.encode_single_token(t) for t in enc.special_tokens_set}
    out = []
    for i in range(enc.n_vocab):
        try:
            out.append(0 if i in special else len(enc.decode_single_token_bytes(i)))
        except KeyError:  # an id between the ordinary and the special tokens
            out.append(0)
    return out


class Tokenizer:
    """encode(text) -> ids, decode(ids) -> text, and token_bytes[i] = UTF-8 length of token i (0 for
    special tokens such as <|endoftext|>), the weights of bits per byte. GPT-2 BPE loads tiktoken's
    vocabulary only when text is encoded or decoded: training needs just meta["token_bytes"]."""

    def __init__(self, meta, encoding=None):
        self.kind, self.vocab_size = meta["tokenizer"], meta["vocab_size"]
        if self.kind == "char":
            self.chars = meta["chars"]
            self.stoi = {c: i for i, c in enumerate(self.chars)}
            computed = [len(c.encode("utf-8")) for c in self.chars]
        elif self.kind == "gpt2":
            self.encoding_name, self._enc = meta.get("encoding", "gpt2"), encoding
            computed = None
        else:
            raise UsageError(f"meta.json: unknown tokenizer {self.kind!r}; expected 'char' or 'gpt2'")
        self.token_bytes = list(meta["token_bytes"]) if "token_bytes" in meta else computed
        if self.token_bytes is None:
            self.token_bytes = token_byte_lengths(self.enc)

    @property
    def enc(self):
        if self._enc is None:
            self._enc = tiktoken_encoding(self.encoding_name)
        return self._enc

    def encode(self, text):
        if self.kind == "char":
            unknown = sorted(set(text) - set(self.stoi))
            if unknown:
                raise UsageError(f"the text has characters outside the vocabulary: {''.join(unknown)!r}")
            return [self.stoi[c] for c in text]
        return self.enc.encode(text, allowed_special="all")

    def decode(self, ids):
        ids = [i for i in ids if i < self.vocab_size]  # never emitted by a trained model: padded vocabulary rows
        return "".join(self.chars[i] for i in ids) if self.kind == "char" else self.enc.decode(ids)


def get_tokenizer(meta, encoding=None):
    """The tokenizer of a dataset's meta dict; `encoding` supplies a tiktoken Encoding directly."""
    return Tokenizer(meta, encoding)


def model_vocab_size(vocab_size):
    """BPE vocabularies are padded to a multiple of 64 for fast matmuls (50257 -> 50304); small
    character vocabularies stay exact."""
    return vocab_size if vocab_size <= 1024 else 64 * math.ceil(vocab_size / 64)


def windows(tokens, starts, block_size, device):
    """Inputs x and next-token targets y (B, block_size) from windows of block_size + 1 tokens."""
    w = torch.from_numpy(np.stack([tokens[s:s + block_size + 1] for s in starts]).astype(np.int64))
    x, y = w[:, :-1], w[:, 1:]
    if str(device).startswith("cuda"):
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def get_batch(tokens, seed, step, index, batch_size, block_size, device):
    """Micro-batch `index` of optimiser step `step`: random windows, a pure function of (seed, step,
    index); so a resumed run draws exactly the batches the uninterrupted one would have."""
    starts = np.random.default_rng([seed, step, index]).integers(0, len(tokens) - block_size, size=batch_size)
    return windows(tokens, starts, block_size, device)


@torch.no_grad()
def evaluate(model, tokens, token_bytes, block_size, n_windows, batch_size, device, autocast=nullcontext(),
             rank=0, world_size=1):
    """(loss, bits per byte) on n_windows windows spread evenly over `tokens`: the same windows at every
    evaluation and in every run. loss = mean nats per predicted token; bits per byte = sum of nats /
    (ln 2 * sum of bytes) over the predicted tokens that stand for text (token_bytes > 0).
    token_bytes: (vocab,) int64 tensor on device. With several processes each takes every world_size-th
    window and the sums are added up."""
    starts = np.linspace(0, len(tokens) - block_size - 1, n_windows).astype(np.int64)[rank::world_size]
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # nats, tokens, nats of text tokens, bytes
    for i in range(0, len(starts), batch_size):
        x, y = windows(tokens, starts[i:i + batch_size], block_size, device)
        with autocast:
            logits = model(x)
        nats = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none")  # (B*T,)
        nbytes = token_bytes[y.flatten()]
        sums += torch.stack([nats.sum(), torch.tensor(nats.numel(), device=device),
                             (nats * (nbytes > 0)).sum(), nbytes.sum()]).double()
    if world_size > 1:
        torch.distributed.all_reduce(sums)
    nats, count, text_nats, nbytes = sums.tolist()
    return nats / count, text_nats / (math.log(2) * nbytes) if nbytes else float("nan")

# -----------------------------------------------------------------------------
# optimisers and schedules


def orthogonalize(G, steps=5, eps=1e-7):
    """Newton-Schulz iteration towards the nearest semi-orthogonal matrix U V^T of G = U S V^T, with
    the quintic coefficients of Keller Jordan's Muon (also torch.optim.Muon's): fast, and it leaves
    the singular values spread around 1 rather than exactly 1, which does not hurt training."""
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G.bfloat16() if G.is_cuda else G.float()  # bf16 on GPU; CPUs without bf16 units are 20x slower in it
    if X.size(0) > X.size(1):
        X = X.T
    X = X / X.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return (X.T if G.size(0) > G.size(1) else X).to(G.dtype)


class Muon(torch.optim.Optimizer):
    """MomentUm Orthogonalized by Newton-Schulz (Jordan et al. 2024), for 2-D weight matrices: SGD with
    Nesterov momentum whose update is orthogonalised, scaled by sqrt(max(1, rows / cols)). The same
    update as torch.optim.Muon, which however always orthogonalises in bfloat16."""

    def __init__(self, params, lr=0.02, momentum=0.95, weight_decay=0.0, ns_steps=5):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, ns_steps=ns_steps))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = orthogonalize(p.grad.lerp(buf, group["momentum"]), group["ns_steps"])  # Nesterov
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"] * max(1.0, p.size(0) / p.size(1)) ** 0.5)


def build_optimizers(model, config):
    """nanochat: Muon for the 2-D matrices inside the blocks, AdamW for the embedding and the lm_head
    (learning rates scaled by 1/sqrt(n_embd / 768), tuned at width 768). Or one AdamW for everything."""
    on_cuda = next(model.parameters()).is_cuda
    betas = (config["beta1"], config["beta2"])
    if config["optimizer"] == "adamw":
        groups = [dict(params=list(model.parameters()), lr=config["lr"], weight_decay=config["weight_decay"])]
        optimizers = [torch.optim.AdamW(groups, betas=betas, fused=on_cuda)]
    else:
        matrices = [p for p in model.blocks.parameters() if p.ndim == 2]
        embedding, head = [model.wte.weight], [model.lm_head.weight]
        assert len(matrices) + 2 == len(list(model.parameters())), "every parameter needs an optimiser"
        scale = (model.config.n_embd / 768) ** -0.5
        groups = [dict(params=head, lr=config["unembedding_lr"] * scale),
                  dict(params=embedding, lr=config["embedding_lr"] * scale)]
        optimizers = [torch.optim.AdamW(groups, betas=betas, eps=1e-10, weight_decay=0.0, fused=on_cuda),
                      Muon(matrices, lr=config["matrix_lr"], momentum=0.95, weight_decay=config["weight_decay"])]
    for opt in optimizers:
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    return optimizers


def get_lr_multiplier(step, config):
    """Linear warm-up, constant, then a linear warm-down over the last warmdown_frac of the schedule
    to final_lr_frac (nanochat's schedule)."""
    n = config["schedule_iters"] or config["max_iters"]
    warmup, warmdown = config["warmup_iters"], round(config["warmdown_frac"] * n)
    if step < warmup:
        return (step + 1) / warmup
    if warmdown == 0 or step <= n - warmdown:
        return 1.0
    progress = max(n - step, 0) / warmdown  # 1 -> 0 across the warm-down
    return progress + (1 - progress) * config["final_lr_frac"]


def get_muon_momentum(step):
    """Muon's momentum rises from 0.85 to 0.95 over the first 300 steps (nanochat)."""
    frac = min(step / 300, 1.0)
    return (1 - frac) * 0.85 + frac * 0.95


def step_seed(seed, step, rank):
    """The torch seed of one optimiser step on one process (dropout masks)."""
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1, np.uint64)[0] >> 1)

# -----------------------------------------------------------------------------
# sampling


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
        print(texts[-1])
        print("-" * 80)
    return texts


def sample_checkpoint(config, device):
    """--sample_from=path: load a GPT checkpoint and print samples; no data directory is needed."""
    ckpt = load_checkpoint(config["sample_from"], map_location=device)
    if ckpt.get("kind") != "gpt":
        raise UsageError(f"{config['sample_from']} is a {ckpt.get('kind')!r} checkpoint; --sample_from needs one "
                         f"written by train_gpt.py (kind 'gpt')")
    model = load_model(ckpt).to(device).eval()
    print(f"sampling from {config['sample_from']} (step {ckpt['step']}, {ckpt['config']['dataset']}, "
          f"n_lap={model.config.n_lap})")
    print("-" * 80)
    return sample(model, get_tokenizer(ckpt["meta"]), config["prompt"], config["num_samples"],
                  config["max_new_tokens"], config["temperature"], config["top_k"], config["seed"], device)

# -----------------------------------------------------------------------------
# configuration checks


def check_config(config):
    allowed = dict(optimizer=("muon", "adamw"), dtype=("auto", "float32", "bfloat16"),
                   device=("", "cpu", "cuda", "mps"))
    for key, values in allowed.items():
        if config[key] not in values and not (key == "device" and str(config[key]).startswith("cuda:")):
            raise UsageError(f"--{key}={config[key]!r}: choose one of {values}")
    for key in ("eval_interval", "eval_iters", "log_interval", "block_size", "batch_size", "num_samples"):
        if config[key] < 1:
            raise UsageError(f"--{key}={config[key]}: must be at least 1")
    for key in ("max_iters", "schedule_iters", "warmup_iters", "total_batch_size", "seed", "max_new_tokens",
                "top_k", "temperature", "grad_clip", "weight_decay"):
        if config[key] < 0:
            raise UsageError(f"--{key}={config[key]}: must not be negative")
    if not 0 <= config["warmdown_frac"] <= 1 or not 0 <= config["final_lr_frac"] <= 1:
        raise UsageError("--warmdown_frac and --final_lr_frac must lie in [0, 1]")
    if PRESETS.get(config["model"], {}).get("model", "gpt") != "gpt":
        gpts = sorted(k for k, v in PRESETS.items() if v["model"] == "gpt")
        raise UsageError(f"--model={config['model']!r} is not a GPT preset; choose one of {gpts}")
    if not config["resume"] and not config["sample_from"]:
        model_config(config)  # a bad model (n_lap > n_head, ...) is reported before any data is read


def model_config(config, **overrides):
    return make_config(config["model"], n_layer=config["n_layer"], n_head=config["n_head"], n_embd=config["n_embd"],
                       n_lap=config["n_lap"], dropout=config["dropout"], block_size=config["block_size"], **overrides)


def resume_config(config, argv):
    """--resume: the checkpoint's config updated by the options given now; the model cannot change."""
    path = os.path.join(config["out_dir"], "ckpt.pt")
    if not os.path.isfile(path):
        raise UsageError(f"--resume: no checkpoint at {path}; train first (without --resume) or set --out_dir")
    ckpt = load_checkpoint(path)
    new = parse_args({**DEFAULTS, **ckpt["config"]}, argv)
    for key in MODEL_KEYS:
        if new[key] != ckpt["config"][key]:
            raise UsageError(f"--{key}={new[key]!r} differs from the checkpoint's {ckpt['config'][key]!r}: the "
                             f"model and its data cannot change on --resume (start a new run in another --out_dir)")
    model_block = ckpt["model_config"]["block_size"]
    if new["block_size"] > model_block:
        raise UsageError(f"--block_size={new['block_size']} is larger than the model's block_size={model_block} "
                         f"(its rotary embeddings end there): use --block_size<={model_block}")
    return new, ckpt

# -----------------------------------------------------------------------------
# training


def main(argv=None):
    config = parse_args(DEFAULTS, argv)
    check_config(config)
    ckpt = None
    if config["resume"] and not config["sample_from"]:
        config, ckpt = resume_config(config, argv)
        check_config(config)
    rank, local_rank, world_size, device = setup_distributed()
    if config["device"] and world_size == 1:
        device = config["device"]
    master = rank == 0
    print0 = print if master else (lambda *a, **k: None)
    torch.manual_seed(config["seed"])
    if config["sample_from"]:
        return sample_checkpoint(config, device)

    # ---- data
    meta = load_meta(config["data_dir"], config["dataset"])
    train_tokens = load_tokens(config["data_dir"], config["dataset"], "train")
    val_tokens = load_tokens(config["data_dir"], config["dataset"], "val")
    T, B = config["block_size"], config["batch_size"]
    for split, tokens in (("train", train_tokens), ("val", val_tokens)):
        if len(tokens) <= T + 1:
            raise UsageError(f"the {split} split of {config['dataset']} has {len(tokens)} tokens, too few for "
                             f"--block_size={T} (needs more than block_size + 1): lower --block_size")
    tokenizer = get_tokenizer(meta)
    token_bytes = torch.tensor(tokenizer.token_bytes + [0] * (model_vocab_size(meta["vocab_size"]) - meta["vocab_size"]),
                               dtype=torch.int64, device=device)
    tokens_per_batch = B * T * world_size
    total = config["total_batch_size"] or tokens_per_batch
    if total % tokens_per_batch:
        raise UsageError(f"--total_batch_size={total} is not a multiple of batch_size x block_size x processes = "
                         f"{B} x {T} x {world_size} = {tokens_per_batch}")
    grad_accum = total // tokens_per_batch

    # ---- model and optimisers
    if ckpt is not None:
        model_cfg = Config(**ckpt["model_config"])
    else:
        model_cfg = model_config(config, vocab_size=model_vocab_size(meta["vocab_size"]))
    raw_model = build_model(model_cfg).to(device)
    optimizers = build_optimizers(raw_model, config)
    step, best_val_loss, time_before = 0, float("inf"), 0.0  # time_before: training time of earlier runs
    if ckpt is not None:
        raw_model.load_state_dict(clean_state_dict(ckpt["model"]))
        for opt, state in zip(optimizers, ckpt["optimizer"]):
            hyper = [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]
            opt.load_state_dict(state)  # moments and step counts from the checkpoint ...
            for group, h in zip(opt.param_groups, hyper):
                group.update(h)  # ... hyperparameters from the config (identical unless overridden now)
        set_rng_state(ckpt["rng"])
        step, best_val_loss, time_before = ckpt["step"], ckpt["best_val_loss"], ckpt["time_s"]
    model = torch.compile(raw_model) if config["compile"] else raw_model
    if world_size > 1:
        model = DDP(model, device_ids=[local_rank] if str(device).startswith("cuda") else None)
    device_type = str(device).split(":")[0]
    use_bf16 = config["dtype"] == "bfloat16" or (config["dtype"] == "auto" and device_type == "cuda")
    autocast = torch.autocast(device_type, dtype=torch.bfloat16) if use_bf16 else nullcontext()
    peak = peak_flops(device)
    flops_per_step = raw_model.flops_per_token(T) * total
    peak_lr = config["matrix_lr"] if config["optimizer"] == "muon" else config["lr"]

    # ---- output: the resolved config first; log.jsonl keeps only evaluations up to the checkpoint
    ckpt_path, log_path = os.path.join(config["out_dir"], "ckpt.pt"), os.path.join(config["out_dir"], "log.jsonl")
    print0("config:\n" + textwrap.fill(" ".join(f"{k}={v!r}" for k, v in config.items()), 110,
                                       initial_indent="  ", subsequent_indent="  "))
    print0(f"data: {config['dataset']} ({meta['tokenizer']} tokenizer, vocab {meta['vocab_size']}), "
           f"train {len(train_tokens):,} tokens, val {len(val_tokens):,}")
    print0(f"model: {config['model']}, {model_cfg.n_layer} layers, {model_cfg.n_head} heads, d={model_cfg.n_embd}, "
           f"Laplacian heads per layer {model_cfg.lap_schedule()}, {raw_model.num_params() / 1e6:.2f}M parameters "
           f"({raw_model.num_params(exclude_embedding=True) / 1e6:.2f}M without the embedding)")
    print0(f"batch: {total:,} tokens per step = {B} x {T} tokens x {world_size} process(es) x {grad_accum} "
           f"micro-step(s); {config['optimizer']} optimiser; {device}, "
           f"{'bfloat16 autocast' if use_bf16 else 'float32'}{', compiled' if config['compile'] else ''}")
    if master:
        os.makedirs(config["out_dir"], exist_ok=True)
        if ckpt is not None:
            print(f"resumed from {ckpt_path} at step {step}")
        elif os.path.isfile(ckpt_path):
            print(f"note: starting afresh: {ckpt_path} will be overwritten (--resume continues it)")
        kept = []
        if ckpt is not None and os.path.isfile(log_path):
            with open(log_path) as f:
                kept = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
        with open(log_path, "w") as f:
            f.writelines(kept)

    def run_eval():
        raw_model.eval()
        out = {}
        for split, tokens in (("val", val_tokens), ("train", train_tokens)):
            out[f"{split}_loss"], out[f"{split}_bpb"] = evaluate(raw_model, tokens, token_bytes, T,
                                                                 config["eval_iters"] * B, B, device, autocast,
                                                                 rank, world_size)
        raw_model.train()
        return out

    def checkpoint():
        save_checkpoint(dict(kind="gpt", model_config=asdict(model_cfg), model=clean_state_dict(raw_model.state_dict()),
                             config=config, meta={k: v for k, v in meta.items() if k != "token_bytes"},
                             optimizer=[opt.state_dict() for opt in optimizers], step=step, rng=rng_state(),
                             best_val_loss=best_val_loss, time_s=time_before + time.time() - t0), ckpt_path)

    # ---- the loop
    max_iters, start_step = config["max_iters"], step
    t0 = time.time()
    metrics, train_time, timed_steps, logged_loss, logged_steps = {}, 0.0, 0, 0.0, 0
    while True:
        last = step >= max_iters
        # evaluate every eval_interval steps and at the end (a resumed run's first step was evaluated before)
        if (step % config["eval_interval"] == 0 or last) and (step > start_step or ckpt is None or last):
            metrics = run_eval()
            best_val_loss = min(best_val_loss, metrics["val_loss"])
            print0(f"eval step {step}: val loss {metrics['val_loss']:.4f}, val bpb {metrics['val_bpb']:.4f}, "
                   f"train loss {metrics['train_loss']:.4f}")
            if master:
                append_jsonl(log_path, dict(step=step, **metrics, lr=peak_lr * get_lr_multiplier(step, config),
                                            tokens=step * total, time_s=round(time_before + time.time() - t0, 2)))
                if step > start_step:
                    checkpoint()
        if last:
            break

        # one optimiser step: learning rates and Muon momentum from the schedules, grad_accum micro-batches
        t_step = time.time()
        torch.manual_seed(step_seed(config["seed"], step, rank))
        lr_mult = get_lr_multiplier(step, config)
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = group["initial_lr"] * lr_mult
                if isinstance(opt, Muon):
                    group["momentum"] = get_muon_momentum(step)
        loss_step = torch.zeros((), device=device)
        for micro in range(grad_accum):
            x, y = get_batch(train_tokens, config["seed"], step, micro * world_size + rank, B, T, device)
            sync = micro == grad_accum - 1 or world_size == 1  # DDP all-reduces the gradients once per step
            with nullcontext() if sync else model.no_sync():
                with autocast:
                    _, loss = model(x, y)
                (loss / grad_accum).backward()
            loss_step += loss.detach() / grad_accum
        loss_step = loss_step.item()  # one synchronisation per step, for the non-finite guard
        grad_norm = float(torch.nn.utils.clip_grad_norm_(raw_model.parameters(), config["grad_clip"] or math.inf))
        check_finite(loss_step, step)
        if not math.isfinite(grad_norm):  # the norm is global: every process stops at the same step
            raise FloatingPointError(f"non-finite gradient norm at step {step}: stopping before the optimiser "
                                     f"step; the last checkpoint is intact. Try a lower learning rate.")
        for opt in optimizers:
            opt.step()
        raw_model.zero_grad(set_to_none=True)
        step += 1
        dt = time.time() - t_step
        if step > start_step + 1:  # the first step (allocation, compilation) is left out of the speed ...
            train_time, timed_steps = train_time + dt, timed_steps + 1
        per_step = train_time / timed_steps if timed_steps else dt  # ... unless it is all there is
        logged_loss, logged_steps = logged_loss + loss_step, logged_steps + 1

        if step % config["log_interval"] == 0 or step == max_iters:
            loss_avg = all_reduce_mean(logged_loss / logged_steps, device)
            logged_loss, logged_steps = 0.0, 0
            line = f"step {step}/{max_iters} | loss {loss_avg:.4f} | lr {peak_lr * lr_mult:.2e} | {total / per_step:,.0f} tok/s"
            if peak:
                line += f" | mfu {100 * flops_per_step / per_step / (peak * world_size):.1f}%"
            elapsed = time.time() - t0
            eta = elapsed / (step - start_step) * (max_iters - step)  # wall clock, evaluations included
            print0(f"{line} | {format_time(elapsed)} elapsed, eta {format_time(eta)}")

    # ---- the end: a sample and the RESULT line
    result = dict(val_loss=metrics["val_loss"], val_bpb=metrics["val_bpb"], train_loss=metrics["train_loss"],
                  best_val_loss=best_val_loss, step=step, params=raw_model.num_params(),
                  time_s=time_before + time.time() - t0)
    if master and config["num_samples"] and config["max_new_tokens"]:
        print0("-" * 80)
        try:
            sample(raw_model.eval(), tokenizer, config["prompt"], config["num_samples"], config["max_new_tokens"],
                   config["temperature"], config["top_k"], config["seed"], device)
        except UsageError as e:
            print0(f"no sample: {e}")
    n_lap = str(model_cfg.n_lap).replace(" ", "")
    print0(f"RESULT val_loss={result['val_loss']:.4f} val_bpb={result['val_bpb']:.4f} "
           f"train_loss={result['train_loss']:.4f} step={step} n_lap={n_lap} params={result['params']} "
           f"time_s={result['time_s']:.1f}")
    teardown_distributed()
    return result


if __name__ == "__main__":
    run_main(main)
