"""The machines students train on, tested on the CPU with the GPU faked: --dtype=auto per device (a T4 gets float16
with a gradient scaler, an A100 or newer bfloat16, a CPU or a Mac float32; --dtype=bfloat16 on a T4 falls back to
float16 in one line; every config/ recipe leaves dtype auto) and MFU against that dtype's peak;
train_gpt.py's float16 step (AdamW and Muon: unscale each, clip, one skip decision for both, one scaler update, no
host read); out of memory, a missing Triton and processes that cannot start, each in one line, while an error in the
code (out of memory too) keeps its traceback; the Windows environment of gloo."""

import ast
import glob
import importlib.util
import os
import runpy
import subprocess
import sys

import pytest
import torch
import torch.utils._triton  # noqa: F401 (monkeypatched below)

import common
from conftest import ENV, ROOT, randomise, run
from nanolap import build_model, make_config


def load_train_gpt():
    """train_gpt.py as a module (its functions, not its run)."""
    spec = importlib.util.spec_from_file_location("train_gpt_module", os.path.join(ROOT, "train_gpt.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


train_gpt = load_train_gpt()


def fake_gpu(monkeypatch, name, capability):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


# ---- the dtype and the peak it is measured against
@pytest.mark.parametrize("name, capability, dtype, peak", [
    ("Tesla T4", (7, 5), torch.float16, 65e12),  # no bfloat16 tensor cores: float16, and its float16 peak
    ("Tesla V100-SXM2-16GB", (7, 0), torch.float16, 125e12),
    ("NVIDIA A100-SXM4-80GB", (8, 0), torch.bfloat16, 312e12),
    ("NVIDIA GeForce RTX 3090", (8, 6), torch.bfloat16, 71e12),
    ("NVIDIA H100 80GB HBM3", (9, 0), torch.bfloat16, 989e12),
])
def test_auto_dtype_follows_the_capability_and_mfu_its_peak(monkeypatch, name, capability, dtype, peak):
    fake_gpu(monkeypatch, name, capability)
    assert common.amp_dtype("cuda") == dtype and common.amp_dtype("cuda:1", "auto") == dtype
    assert common.peak_flops("cuda", dtype=dtype) == peak
    assert common.peak_flops("cuda", dtype=torch.float32) is None  # TF32 peaks are not in the table
    words = common.DTYPE_WORDS[dtype]
    assert words == ("float16 autocast with a gradient scaler" if dtype == torch.float16 else "bfloat16 autocast")
    assert common.amp_dtype("cuda", "float32") == torch.float32  # an explicit choice stands
    assert common.amp_dtype("cpu") == common.amp_dtype("mps") == torch.float32


def test_bfloat16_on_a_gpu_without_bfloat16_tensor_cores_has_no_peak(monkeypatch):
    fake_gpu(monkeypatch, "Tesla T4", (7, 5))
    assert common.peak_flops("cuda", dtype=torch.bfloat16) is None  # emulated: no MFU rather than a wrong one
    assert common.peak_flops("cuda", name="NVIDIA L4", dtype=torch.bfloat16) == 121e12


def fake_cuda(monkeypatch, capability):
    """A CUDA GPU of this capability as common and torch.autocast see it (autocast checks bfloat16 support itself)."""
    fake_gpu(monkeypatch, "a faked GPU", capability)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)


def test_bfloat16_below_compute_capability_8_falls_back_to_float16_in_one_line(monkeypatch, capsys):
    fake_cuda(monkeypatch, (7, 5))  # a T4
    context, dtype = common.autocast("cuda", "bfloat16")
    assert dtype == torch.float16 and context.fast_dtype == torch.float16  # so the scripts' GradScaler is enabled
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["--dtype=bfloat16: this GPU (compute capability 7.5) has no bfloat16 tensor cores and would "
                     "emulate it slowly; training in float16 with a gradient scaler instead"]
    assert common.autocast("cuda:0", "auto")[1] == torch.float16 and capsys.readouterr().out == ""  # auto: no line
    assert common.amp_dtype("cuda", "float32") == torch.float32 and common.amp_dtype("cuda", "float16") == torch.float16
    monkeypatch.setenv("RANK", "1")  # under torchrun only the first process says it
    assert common.amp_dtype("cuda", "bfloat16") == torch.float16 and capsys.readouterr().out == ""


@pytest.mark.parametrize("capability", [(8, 0), (9, 0)])
def test_bfloat16_stays_from_compute_capability_8(monkeypatch, capsys, capability):
    fake_cuda(monkeypatch, capability)
    context, dtype = common.autocast("cuda", "bfloat16")
    assert dtype == torch.bfloat16 and context.fast_dtype == torch.bfloat16 and capsys.readouterr().out == ""
    assert common.autocast("cuda", "auto")[1] == torch.bfloat16
    assert common.amp_dtype("cpu", "bfloat16") == torch.bfloat16  # CPU autocast keeps what it is asked for


def test_every_config_leaves_dtype_auto():
    """A recipe that hard-set bfloat16 would have emulated it on a T4; 'auto' (or no dtype) picks the card's own."""
    configs = sorted(glob.glob(os.path.join(ROOT, "config", "*.py")))
    assert len(configs) >= 6
    for path in configs:
        tree = ast.parse(open(path).read())  # `key = value` lines of literals, parsed as configurator.py parses them
        values = {node.targets[0].id: ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)}
        assert "n_lap" in values and values.get("dtype", "auto") == "auto", path


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_muon_orthogonalises_in_the_runs_dtype(dtype):
    """A T4's float16 run orthogonalises in float16 (its tensor cores'), an A100's in bfloat16, a float32 run in float32."""
    model = build_model(make_config("gpt-tiny", vocab_size=16, block_size=8))
    adamw, muon = train_gpt.build_optimizers(model, "muon", 1e-3, 0.02, 0.2, 0.004, 0.0, (0.8, 0.95), dtype=dtype)
    assert muon.ns_dtype == dtype


# ---- train_gpt.py in float16: AdamW and Muon behind one gradient scaler
def tiny_gpt_with_gradients(scaler=torch.amp.GradScaler("cpu", enabled=False)):
    torch.manual_seed(0)
    model = randomise(build_model(make_config("gpt-tiny", vocab_size=16, block_size=8)), std=0.1)
    optimizers = train_gpt.build_optimizers(model, "muon", 1e-3, 0.02, 0.2, 0.004, 0.1, (0.8, 0.95))
    x = torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(1))
    _, loss = model(x, x.roll(1, 1))
    scaler.scale(loss).backward()
    return model, optimizers


def test_gpt_step_unscales_each_optimiser_clips_steps_each_on_one_skip_decision_and_updates_once(monkeypatch):
    calls = []

    class RecordingScaler:
        def unscale_(self, optimizer):
            calls.append(("unscale", type(optimizer).__name__))

        def update(self):
            calls.append(("update",))

        def is_enabled(self):
            return True

    def clip(params, max_norm):
        calls.append(("clip", max_norm))
        return torch.tensor(1.0)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    model, optimizers = tiny_gpt_with_gradients()
    for optimizer in optimizers:
        def step(optimizer=optimizer):
            calls.append(("step", type(optimizer).__name__, optimizer.found_inf))
        optimizer.step = step
    train_gpt.optimizer_step(optimizers, RecordingScaler(), model.parameters(), 0.5)
    no = torch.tensor(0.0)
    assert calls == [("unscale", "AdamW"), ("unscale", "Muon"), ("clip", 0.5), ("step", "AdamW", no),
                     ("step", "Muon", no), ("update",)]
    assert calls[3][2] is calls[4][2]  # one decision, the same tensor for both


def optimiser_state(optimizers):
    """Every tensor of the optimisers' states, cloned: AdamW's moments and step count, Muon's momentum buffers."""
    return [t.clone() for optimizer in optimizers for state in optimizer.state.values() for t in state.values()]


@pytest.mark.parametrize("grad_clip", [1.0, 0.0])
@pytest.mark.parametrize("overflowed", ["AdamW", "Muon"])
def test_an_overflow_in_either_optimisers_gradients_skips_both(overflowed, grad_clip):
    """float16 through a real GradScaler: float16 overflowed in one optimiser's gradients only. The step must change no
    weight and no optimiser state of either: decided per optimiser, the other stepped on the clip's inf norm (with
    clip 1 its gradients were zeroed, so it moved on its momentum alone; with clip 0 they were NaN)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    model, optimizers = tiny_gpt_with_gradients(scaler)
    train_gpt.optimizer_step(optimizers, scaler, model.parameters(), grad_clip)  # a first step fills the states
    model.zero_grad(set_to_none=True)
    x = torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(2))
    _, loss = model(x, x.roll(1, 1))
    scaler.scale(loss).backward()
    before = [p.detach().clone() for p in model.parameters()]
    state = optimiser_state(optimizers)
    optimizer = next(o for o in optimizers if type(o).__name__ == overflowed)
    optimizer.param_groups[0]["params"][0].grad.view(-1)[0] = float("inf")
    train_gpt.optimizer_step(optimizers, scaler, model.parameters(), grad_clip)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # equal, so finite too
    assert all(torch.equal(a, b) for a, b in zip(state, optimiser_state(optimizers)))
    assert scaler.get_scale() == 2.0 ** 11
    model.zero_grad(set_to_none=True)
    x = torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(3))
    _, loss = model(x, x.roll(1, 1))
    scaler.scale(loss).backward()
    train_gpt.optimizer_step(optimizers, scaler, model.parameters(), grad_clip)  # the next step moves them again
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_float16_step_reads_nothing_back(monkeypatch):
    """GradScaler.step reads each optimiser's overflow on the host (a wait for the GPU) unless the optimiser reads it on
    the device, as fused AdamW does; so must Muon, and so must the one decision for both."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    model, optimizers = tiny_gpt_with_gradients(scaler)
    reads = []
    for name in ("item", "tolist", "__float__", "__int__", "__bool__", "__index__"):
        def read(self, *args, original=getattr(torch.Tensor, name), name=name, **kwargs):
            reads.append(name)
            return original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, read)
    train_gpt.optimizer_step(optimizers, scaler, model.parameters(), 1.0)
    monkeypatch.undo()
    assert reads == [] and scaler.get_scale() == 2.0 ** 12


def test_gpt_float16_step_equals_the_unscaled_step_and_skips_an_overflow():
    """A loss scaled by 2^12 (exact in float32) and unscaled before the clip moves the weights exactly as the plain
    step does; a step whose gradients overflowed changes no weight and halves the scale."""
    plain, plain_optimizers = tiny_gpt_with_gradients()
    train_gpt.optimizer_step(plain_optimizers, torch.amp.GradScaler("cpu", enabled=False), plain.parameters(), 0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    scaled, scaled_optimizers = tiny_gpt_with_gradients(scaler)
    train_gpt.optimizer_step(scaled_optimizers, scaler, scaled.parameters(), 0.05)  # 0.05: the clip acts
    for a, b in zip(plain.parameters(), scaled.parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0)

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    model, optimizers = tiny_gpt_with_gradients(scaler)
    before = [p.detach().clone() for p in model.parameters()]
    for optimizer in optimizers:  # float16 overflowed somewhere in each optimiser's gradients
        optimizer.param_groups[0]["params"][0].grad.view(-1)[0] = float("inf")
    norm = train_gpt.optimizer_step(optimizers, scaler, model.parameters(), 1.0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and scaler.get_scale() == 2.0 ** 11
    assert norm == 0  # the scaler handled the overflow: nothing for the loop's check to stop on
    norm = train_gpt.optimizer_step(optimizers, torch.amp.GradScaler("cpu", enabled=False), model.parameters(), 1.0)
    with pytest.raises(FloatingPointError, match="non-finite gradient norm (inf|nan) in steps 3-5"):  # float32: no scaler
        common.check_finite(norm, 5, first_step=3, what="gradient norm")  # the loop's check, at its next progress line


@pytest.mark.slow
def test_train_gpt_trains_in_float16_on_the_cpu(data_dir, tmp_path, capsys):
    argv = sys.argv
    sys.argv = ["train_gpt.py", "--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=4",
                "--eval_iters=2", "--log_interval=1", "--max_new_tokens=0", "--device=cpu", "--cpu_procs=1",
                "--dtype=float16", "--max_iters=3", f"--data_dir={data_dir}", "--dataset=tiny", f"--out_dir={tmp_path}"]
    try:
        found = runpy.run_path(os.path.join(ROOT, "train_gpt.py"), run_name="__main__")
    finally:
        sys.argv = argv
    assert "cpu, float16 autocast with a gradient scaler" in capsys.readouterr().out
    assert found["optimizers"][1].ns_dtype == torch.float16  # Muon orthogonalised in the run's dtype
    assert float(common.read_result(str(tmp_path))["val_loss"]) < 10
    assert common.load_checkpoint(str(tmp_path / "ckpt.pt"))["scaler"]["scale"] > 0  # a scaler that was enabled


# ---- failures in one line
def run_script_with(prelude, script, *args):
    """`python script args` with prelude run first in the same interpreter (a fake GPU failure)."""
    code = f"import runpy, sys, torch, nanolap, common\n{prelude}\nsys.argv = {[script, *args]!r}\n" \
           f"runpy.run_path({script!r}, run_name='__main__')"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


OUT_OF_MEMORY = {  # what a model call raises: CUDA's error class, and MPS's RuntimeError
    "cuda": "torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')",
    "mps": "RuntimeError('MPS backend out of memory (MPS allocated: 17.00 GB, other allocations: 1.00 GB)')",
}


def test_the_error_handler_keeps_the_traceback_and_adds_the_advice_after_it(monkeypatch, capfd):
    errors = [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nmore"),
              RuntimeError("MPS backend out of memory (MPS allocated: 17.00 GB).\nmore")]
    for error in errors:
        common.report_error(type(error), error, None, out_dir="out-x", oom_advice="in the run out-x: lower --batch_size")
        err = capfd.readouterr().err
        assert err.splitlines()[-1] == "out of memory in the run out-x: lower --batch_size"
        assert str(error).split("\n")[0] in err  # the error itself, before the advice
    shape_bug = RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x64 and 32x64)")
    common.report_error(RuntimeError, shape_bug, None, out_dir="out-x", oom_advice="lower --batch_size")
    assert "lower --batch_size" not in capfd.readouterr().err  # not memory: no advice


@pytest.mark.slow
@pytest.mark.parametrize("script, model, device, args, line", [
    ("train_gpt.py", "GPT", "cuda", ["--batch_size=4", "--block_size=32", "--n_layer=2", "--n_head=2", "--n_embd=32",
                                     "--eval_iters=1"],
     "at 4 sequences of 32 tokens per process and micro-step: lower --batch_size (--total_batch_size keeps the global "
     "batch)"),
    ("train_vit.py", "ViT", "mps", ["--dataset=synthetic", "--batch_size=64", "--grad_accum=2"],
     "at 64 images per process and micro-step: lower --batch_size and raise --grad_accum as much to keep the global "
     "batch"),
    ("train_dino.py", "ViT", "cuda", ["--dataset=synthetic", "--batch_size=32", "--local_crops=2", "--seg_dataset=none",
                                      "--eval_train=64", "--eval_val=64"],
     "at 32 images per process, 4 crops each: lower --batch_size or --local_crops (no gradient accumulation here)"),
])
def test_out_of_memory_keeps_its_traceback_and_ends_with_what_to_lower(data_dir, tmp_path, script, model, device,
                                                                       args, line):
    raise_it = f"def out_of_memory(*args, **kwargs):\n    raise {OUT_OF_MEMORY[device]}\n" \
               f"nanolap.{model}.forward = out_of_memory"
    data = [f"--data_dir={data_dir}", "--dataset=tiny"] if script == "train_gpt.py" else []
    done = run_script_with(raise_it, script, "--cpu_procs=1", *args, *data, f"--out_dir={tmp_path / 'run'}")
    assert done.returncode == 1 and "Traceback" in done.stderr and ", in out_of_memory" in done.stderr  # the line
    assert done.stderr.splitlines()[-1] == f"out of memory in the run {tmp_path / 'run'} {line}"


@pytest.mark.slow
@pytest.mark.parametrize("script, args", [
    ("train_vit.py", ["--dataset=synthetic", "--train_subset=256", "--batch_size=32", "--epochs=1"]),
    ("train_gpt.py", ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=4", "--eval_iters=2",
                      "--max_iters=4", "--eval_interval=2", "--max_new_tokens=0", "--dataset=tiny"]),
    ("train_dino.py", ["--dataset=synthetic", "--n_layer=2", "--n_embd=32", "--n_head=2", "--out_dim=64",
                       "--head_hidden=32", "--head_bottleneck=16", "--train_subset=128", "--batch_size=32", "--epochs=1.0",
                       "--eval_train=64", "--eval_val=64", "--probe_steps=5", "--seg_dataset=none", "--eval_interval=100"]),
])
def test_a_bfloat16_checkpoint_resumes_in_float16(data_dir, tmp_path, script, args):
    """A run checkpointed in bfloat16 (no loss scale) continues where float16 trains with a gradient scaler (a T4)."""
    data = [f"--data_dir={data_dir}"] if script == "train_gpt.py" else []
    first = run(script, *args, *data, "--dtype=bfloat16", "--stop_at_step=2", f"--out_dir={tmp_path}")
    assert first.returncode == 0, first.stderr[-2000:]
    rest = run(script, *args, *data, "--dtype=float16", "--resume", f"--out_dir={tmp_path}")
    assert rest.returncode == 0 and "RESULT " in rest.stdout, rest.stderr[-2000:]
    assert common.load_checkpoint(str(tmp_path / "ckpt.pt"))["scaler"]["scale"] > 0  # float16's scaler took over


@pytest.mark.slow
def test_a_shape_bug_in_a_models_forward_shows_its_traceback(tmp_path):
    bug = "def forward(self, img, explicit=False):\n    return self.head(img.flatten(1))  # a student's shape bug\n" \
          "nanolap.ViT.forward = forward"
    done = run_script_with(bug, "train_vit.py", "--cpu_procs=1", "--dataset=synthetic", f"--out_dir={tmp_path / 'run'}")
    assert done.returncode == 1 and "Traceback" in done.stderr and ", in forward" in done.stderr  # the changed line
    assert done.stderr.splitlines()[-1].startswith("RuntimeError: mat1 and mat2 shapes cannot be multiplied")


@pytest.mark.parametrize("script", ["train_vit.py", "train_gpt.py", "train_dino.py"])
def test_compile_without_triton_is_one_line_before_training(monkeypatch, tmp_path, script):
    fake_gpu(monkeypatch, "Tesla T4", (7, 5))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.utils._triton, "has_triton", lambda: False)
    monkeypatch.setattr(sys, "argv", [script, "--compile_model", "--device=cuda", f"--out_dir={tmp_path / 'run'}"])
    with pytest.raises(common.UsageError, match=r"^--compile_model: torch.compile needs Triton on a CUDA GPU.*; run "
                                                r"without --compile_model, or install Triton"):
        runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
    assert not (tmp_path / "run").exists()  # nothing started
    common.check_compile(True, "cpu")  # inductor on a CPU needs no Triton
    monkeypatch.setattr(torch.utils._triton, "has_triton", lambda: True)
    common.check_compile(True, "cuda")


# ---- Windows and the CPU processes' group
def test_gloo_turns_libuv_off_on_windows(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(common.dist, "init_process_group", lambda backend: seen.update(os.environ))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # put back after the test
    monkeypatch.delenv("USE_LIBUV", raising=False)
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1").items():
        monkeypatch.setenv(key, value)
    assert common.gloo_environment() == {}  # this machine
    real = os.name
    os.name = "nt"  # only for this call: pytest's own reporting needs the real one
    try:
        windows = common.gloo_environment()
        started = common.start_processes(str(tmp_path / "run"), False, "cpu")
    finally:
        os.name = real
    assert windows == {"USE_LIBUV": "0"} and started == (0, 0, 1, "cpu") and seen["USE_LIBUV"] == "0"


@pytest.mark.slow
def test_processes_that_cannot_start_end_in_one_line_saying_what_to_do(tmp_path):
    """torchrun's rendezvous fails (here: a store that cannot bind; on Windows a PyTorch without libuv): one line that
    names --cpu_procs=1, no traceback."""
    script = tmp_path / "group.py"
    script.write_text(
        "import common, configurator, torch.distributed.run as torchrun\n"
        "def no_rendezvous(args):\n"
        "    raise RuntimeError('The server socket has failed to listen on any local network address.\\nmore')\n"
        "torchrun.run = no_rendezvous\n"
        "configurator.configure({'__file__': __file__, '__doc__': ''}, [])\n"
        "common.launch_processes(2, 'cpu')\n")
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == ("error: the 2 CPU processes cannot start here (The server socket has failed to listen on any "
                           "local network address.); train in one process with --cpu_procs=1 (raise batch_size 2 "
                           "times to keep the global batch)\n")
