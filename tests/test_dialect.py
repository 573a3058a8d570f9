"""The one dialect of the three training scripts: each writes log.jsonl records and checkpoints that begin with the same
keys, in strict JSON; and each script's get_lr gives, to the bit, the learning rates the committed runs trained with
(before get_lr, through one cosine_schedule with a `warmup_from` for the two warm-up conventions)."""

import json
import math

import pytest

import common
import train_dino
import train_gpt
import train_vit
from common import load_checkpoint
from conftest import run_here

LOG_CORE = ["step", "lr", "train_loss", "seconds"]  # every record's first keys, in this order
CHECKPOINT_CORE = {"kind", "model_config", "model", "config", "optimizer", "scaler", "step", "seconds", "record_loss",
                   "record_steps"}

TINY_RUNS = {  # 6 steps each, evaluations at 0, 4 and 6, a progress line every 2 steps
    "train_vit.py": ["--dataset=synthetic", "--train_subset=96", "--val_subset=32", "--batch_size=16", "--epochs=1",
                     "--n_layer=1", "--n_embd=32", "--n_head=2", "--n_lap=1"],
    "train_gpt.py": ["--n_layer=1", "--n_embd=32", "--n_head=2", "--block_size=32", "--batch_size=4", "--max_iters=6",
                     "--eval_iters=1", "--max_new_tokens=0"],
    "train_dino.py": ["--dataset=synthetic", "--train_subset=96", "--batch_size=16", "--epochs=1", "--n_layer=1",
                      "--n_embd=32", "--n_head=2", "--n_lap=1", "--out_dim=32", "--head_hidden=32",
                      "--head_bottleneck=16", "--eval_train=64", "--eval_val=32", "--probe_steps=2",
                      "--seg_dataset=none"],
}


def strict_json(line):
    """json.loads that refuses NaN and infinities, as strict parsers do."""
    def refuse(word):
        raise ValueError(f"{word} is not JSON")
    return json.loads(line, parse_constant=refuse)


@pytest.mark.parametrize("script", TINY_RUNS)
def test_every_script_logs_and_checkpoints_the_same_core_in_strict_json(script, request, tmp_path):
    data = [f"--data_dir={request.getfixturevalue('data_dir')}", "--dataset=tiny"] if script == "train_gpt.py" else []
    run_here(script, *TINY_RUNS[script], *data, "--device=cpu", "--cpu_procs=1", "--eval_interval=4",
             "--log_interval=2", f"--out_dir={tmp_path}")
    records = [strict_json(line) for line in open(tmp_path / common.LOG)]
    assert [r["step"] for r in records][:3] == [0, 4, 6], records
    assert all(list(r)[:4] == LOG_CORE for r in records), [list(r) for r in records]
    assert records[0]["train_loss"] is None and all(math.isfinite(r["train_loss"]) for r in records[1:3])
    assert all(r["seconds"] >= 0 and r["lr"] >= 0 for r in records)
    ckpt = load_checkpoint(str(tmp_path / common.CHECKPOINT))
    assert CHECKPOINT_CORE <= set(ckpt) and "rng" not in ckpt and ckpt["step"] == 6
    assert isinstance(ckpt["optimizer"], list) and all("state" in state for state in ckpt["optimizer"])


def test_the_log_writes_null_for_what_json_has_no_number_for(tmp_path):
    path = tmp_path / "log.jsonl"
    common.append_jsonl(path, dict(step=0, train_loss=float("nan"), t_std=float("inf"), ok=0.5))
    assert strict_json(path.read_text()) == dict(step=0, train_loss=None, t_std=None, ok=0.5)
    with pytest.raises(ValueError):  # deeper down a NaN stops the run rather than spoil the log
        common.append_jsonl(path, dict(step=1, losses=[1.0, float("nan")]))
    assert path.read_text().count("\n") == 1


def cosine_schedule_before(step, total, start, end, warmup=0, warmup_start=0.0, warmup_from=0):
    """common.cosine_schedule as the committed runs called it: warm-up step s at (s + warmup_from) / warmup."""
    if step < warmup:
        return warmup_start + (start - warmup_start) * (step + warmup_from) / warmup
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    return end + 0.5 * (start - end) * (1 + math.cos(math.pi * progress))


@pytest.mark.parametrize("module, warmup_from", [(train_vit, 1), (train_dino, 0)])
def test_get_lr_gives_the_rates_the_committed_runs_trained_with(monkeypatch, module, warmup_from):
    """The ViT warmed up as nanoGPT does (warmup_from=1), DINO from 0 at step 0 (warmup_from=0); each get_lr keeps
    its script's convention, so every rate is the one before, to the bit (the default recipes' lengths)."""
    for name, value in dict(lr=3e-3, min_lr=1e-5, warmup_iters=117, max_iters=4212).items():
        monkeypatch.setattr(module, name, value, raising=False)
    before = [cosine_schedule_before(s, 4212, 3e-3, 1e-5, warmup=117, warmup_from=warmup_from) for s in range(4300)]
    assert [module.get_lr(s) for s in range(4300)] == before


def test_dinos_rate_at_the_global_batch_is_the_rate_it_scaled_before(monkeypatch):
    """DINO took lr per 256 images and trained at lr x batch / 256 (batch: the global one); lr is now that product,
    and each committed recipe's new number is the product to the bit: the default (0.002 at 64 images), the ImageNet
    config (0.0005 at 1024) and the README's GPU line (0.0005 at 64). Its teacher temperature is as before too."""
    assert 0.002 * 64 / 256 == train_dino.lr == 0.0005
    assert 0.0005 * 1024 / 256 == 0.002 and 0.0005 * 64 / 256 == 0.000125
    for name, value in dict(warmup_teacher_temp=0.04, teacher_temp=0.07, temp_warmup_iters=281).items():
        monkeypatch.setattr(train_dino, name, value, raising=False)
    before = [cosine_schedule_before(s, 5622, 0.07, 0.07, warmup=281, warmup_start=0.04) for s in range(5700)]
    assert [train_dino.get_teacher_temp(s) for s in range(5700)] == before


def test_the_gpt_schedule_warms_up_as_the_vit_does(monkeypatch):
    """nanochat's warm-up, as nanoGPT's: step s of warmup_iters at (s + 1) / warmup_iters, never at 0."""
    for name, value in dict(max_iters=100, warmup_iters=4, warmdown_frac=0.2, final_lr_frac=0.0).items():
        monkeypatch.setattr(train_gpt, name, value)
    assert [train_gpt.get_lr_multiplier(s) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]


def test_cosine_schedule_runs_from_start_to_end():
    cosine = common.cosine_schedule
    assert cosine(0, 100, 1.0, 0.1) == 1.0 and cosine(100, 100, 1.0, 0.1) == 0.1 and cosine(150, 100, 1.0, 0.1) == 0.1
    assert cosine(50, 100, 1.0, 0.0) == pytest.approx(0.5)


def test_a_resumed_log_keeps_the_records_up_to_the_checkpoint(tmp_path):
    """Every script on --resume: records after the checkpoint's step, and a line cut short, go (they are re-made)."""
    path = tmp_path / "log.jsonl"
    path.write_text('{"step": 0}\n{"step": 4}\n{"step": 8}\n{"step": 9, "val_lo')
    common.keep_log_until(path, 4)
    assert path.read_text() == '{"step": 0}\n{"step": 4}\n'
    common.keep_log_until(tmp_path / "new.jsonl", 4)  # a run that has not logged yet
    assert (tmp_path / "new.jsonl").read_text() == ""
