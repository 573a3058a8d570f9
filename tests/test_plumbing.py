"""The run plumbing every script shares (common.py and configurator.py), in the order a run meets it:
options (parse_args, configure, --help, config_from_options, --resume, check_options, check_resume), devices and dtypes,
the non-finite guard, checkpoints and atomic writes and the RESULT line (the schedules and the log records:
test_dialect.py; damaged checkpoints and the output folder of an earlier run: test_faults.py)."""

import ast
import glob
import math
import os
import pickle
import re
import runpy
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch

import common
import configurator
import nanolap
from conftest import ROOT, run_here
from nanolap import Config


def test_parse_args_overrides_config_files_and_errors(tmp_path):
    defaults = dict(lr=1e-3, batch_size=64, dataset="fashion_mnist", compile=False, n_lap=0, preset=None)
    cfg = configurator.parse_args(defaults, ["--lr=3e-4", "--batch_size=32", "--dataset=cifar10", "--compile",
                                              "--n_lap=[0,1,2]", "--preset='vit-b'"])
    assert cfg == dict(lr=3e-4, batch_size=32, dataset="cifar10", compile=True, n_lap=[0, 1, 2], preset="vit-b")
    assert configurator.parse_args(defaults, ["--lr=1"])["lr"] == 1.0  # an int where a float is expected is fine
    f = tmp_path / "cfg.py"
    f.write_text("# a comment\nlr = 0.01\nn_lap = 3\n")
    assert configurator.parse_args(defaults, [str(f), "--lr=0.5"])["lr"] == 0.5
    for argv, message in [(["--learning_rate=1"], "unknown option --learning_rate"),
                          (["--batch_size=3.5"], "expected int"),
                          (["--batch_size=big"], "expected int"),
                          (["--compile=1"], "expected bool"),
                          (["--lr"], "needs a value"),
                          (["nonexistent.py"], "neither"),
                          (["--n_lap=1.5"], "expected int")]:
        with pytest.raises(common.UsageError, match=message):
            configurator.parse_args(defaults, argv)
    f.write_text("import os\n")
    with pytest.raises(common.UsageError, match="only `key = value`"):
        configurator.parse_args(defaults, [str(f)])
    f.write_text("lr = __import__('os').getcwd()\n")
    with pytest.raises(common.UsageError, match="literal"):
        configurator.parse_args(defaults, [str(f)])


def fake_script(tmp_path, text):
    """A script's namespace as configure() sees it: its globals, its file and its docstring."""
    path = tmp_path / "script.py"
    path.write_text(text)
    namespace = {"__file__": str(path), "__doc__": "A test script.", "torch": torch}
    exec(compile(text, str(path), "exec"), namespace)
    return namespace


SCRIPT = '''
out_dir = "out"  # where ckpt.pt goes
resume = False  # continue out_dir/ckpt.pt
lr = 0.001  # the peak learning rate
n_lap = 2  # Laplacian heads per layer
preset = "vit-cpu"  # a ViT preset
n_embd = None  # None = the preset's width
MAX = 3
_private = 1
'''


def test_configure_reads_the_options_from_the_globals_and_writes_them_back(tmp_path):
    ns = fake_script(tmp_path, SCRIPT)
    config, ckpt = configurator.configure(ns, ["--lr=0.01", "--n_lap=[0,1,2,4]"])
    assert ckpt is None and sorted(config) == ["lr", "n_embd", "n_lap", "out_dir", "preset", "resume"]
    assert ns["lr"] == 0.01 and ns["n_lap"] == [0, 1, 2, 4] and ns["MAX"] == 3


@pytest.mark.parametrize("script", ["train_vit.py", "train_gpt.py", "train_dino.py", "analyze.py"])
def test_help_lists_every_option_with_its_comment(script, capsys):
    """--help: the script's docstring, then each option it declares with its value and comment, and nothing else."""
    namespace = runpy.run_path(os.path.join(ROOT, script))  # its definitions, not its run
    with pytest.raises(SystemExit) as stop:
        run_here(script, "--help")
    out = capsys.readouterr().out
    assert stop.value.code == 0 and out.startswith(namespace["__doc__"].strip().splitlines()[0])
    assert dict(re.findall(r"^  --(\w+)=.*?  # (.+)$", out, re.M)) == configurator.declared_options(namespace)


def test_only_commented_top_level_literals_are_options(tmp_path):
    """A script's options are its `name = literal  # comment` lines: a global without a comment, one set in a
    block, or one whose value is not a literal stays the script's own, and --it=... is refused as unknown."""
    ns = fake_script(tmp_path, SCRIPT + 'it = 1\nfor step in range(2):\n    pass\nzeros = torch.zeros(1)  # a tensor\n')
    config, _ = configurator.configure(ns, [])
    assert sorted(config) == ["lr", "n_embd", "n_lap", "out_dir", "preset", "resume"]
    for argv in (["--it=2"], ["--step=1"], ["--zeros=0"]):
        with pytest.raises(common.UsageError, match=f"unknown option {argv[0].split('=')[0]};"):
            configurator.configure(fake_script(tmp_path, SCRIPT + 'it = 1\nfor step in range(2):\n    pass\n'
                                                'zeros = torch.zeros(1)  # a tensor\n'), argv)


def test_config_from_options_derives_the_model_config_from_its_fields(tmp_path):
    ns = fake_script(tmp_path, SCRIPT)
    config, _ = configurator.configure(ns, ["--n_embd=32"])
    cfg = configurator.config_from_options(config, "vit", num_classes=3)
    assert (cfg.n_embd, cfg.n_lap, cfg.patch_size, cfg.num_classes) == (32, 2, 7, 3)  # option, option, preset, data
    with pytest.raises(common.UsageError, match="--preset='gpt-tiny': choose one of"):
        configurator.config_from_options(dict(config, preset="gpt-tiny"), "vit")


def test_resume_takes_the_checkpoint_options_and_refuses_model_changes(tmp_path, monkeypatch):
    out = tmp_path / "run"
    cfg = dict(out_dir=str(out), resume=False, lr=0.5, n_lap=3, preset="vit-cpu", n_embd=None)
    common.save_checkpoint({"config": cfg, "model_config": {}}, str(out / "ckpt.pt"))
    config, ckpt = configurator.configure(fake_script(tmp_path, SCRIPT), ["--resume", f"--out_dir={out}"])
    assert ckpt is not None and config["lr"] == 0.5 and config["n_lap"] == 3 and config["resume"]
    typed, read = [], configurator._typed
    monkeypatch.setattr(configurator, "_typed", lambda key, *args: typed.append(key) or read(key, *args))
    config, _ = configurator.configure(fake_script(tmp_path, SCRIPT), ["--resume", f"--out_dir={out}", "--lr=0.1"])
    assert config["lr"] == 0.1  # a training option may change ...
    assert typed == ["resume", "out_dir", "lr"]  # (the command line is read once)
    # ... the model not
    with pytest.raises(common.UsageError, match=r"cannot change the model, data or schedule \(--n_lap=4 \(checkpoint: 3\)"):
        configurator.configure(fake_script(tmp_path, SCRIPT), ["--resume", f"--out_dir={out}", "--n_lap=4"])
    with pytest.raises(common.UsageError, match=r"or schedule \(--lr=0.1 \(checkpoint: 0.5\)\)\. To train longer"):
        configurator.configure(fake_script(tmp_path, SCRIPT), ["--resume", f"--out_dir={out}", "--lr=0.1"],
                               schedule=("lr",))
    with pytest.raises(FileNotFoundError, match="--resume: no checkpoint at"):
        configurator.configure(fake_script(tmp_path, SCRIPT), ["--resume", f"--out_dir={tmp_path / 'none'}"])



def test_check_options_states_each_rule_once_in_one_wording():
    config = dict(epochs=3, subset=0, lr=0.1, p=0.5, optimizer_name="adamw")
    rules = dict(at_least={1: ("epochs",), 0: ("subset",)}, above_zero=("lr",), fractions=("p",),
                 choices=dict(optimizer_name=("adamw", "lamb")))
    configurator.check_options(config, **rules)  # all good: nothing raised
    for change, message in [(dict(epochs=0), "--epochs=0: must be at least 1"),
                            (dict(subset=-1), "--subset=-1: must be at least 0"),
                            (dict(lr=0.0), "--lr=0.0: must be greater than 0"),
                            (dict(p=1.5), "--p=1.5: must lie in [0, 1]"),
                            (dict(p=-0.1), "--p=-0.1: must lie in [0, 1]"),
                            (dict(optimizer_name="sgd"), "--optimizer_name='sgd': choose one of adamw, lamb")]:
        with pytest.raises(common.UsageError) as err:
            configurator.check_options({**config, **change}, **rules)
        assert str(err.value) == message


def test_check_resume_refuses_another_kind_or_another_model():
    model_config = nanolap.make_config("vit-cpu", n_lap=2)
    ckpt = dict(kind="vit", model_config=asdict(model_config))
    configurator.check_resume(ckpt, "vit", model_config)  # the same run: nothing raised
    with pytest.raises(common.UsageError, match="holds a vit run, not a dino one"):
        configurator.check_resume(ckpt, "dino", model_config)
    with pytest.raises(common.UsageError, match="holds a different model"):
        configurator.check_resume(ckpt, "vit", nanolap.make_config("vit-cpu", n_lap=2, img_size=14))


def test_devices_and_dtypes_are_checked():
    assert common.resolve_device("cpu") == "cpu"
    with pytest.raises(common.UsageError, match="choose auto, cpu"):
        common.resolve_device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(common.UsageError, match="--device=cuda: this machine has no CUDA device"):
            common.resolve_device("cuda")
    context, dtype = common.autocast("cpu", "auto")
    assert dtype == torch.float32
    with pytest.raises(common.UsageError, match="--dtype='fp8'"):
        common.autocast("cpu", "fp8")


def test_to_device_copies_to_a_gpu_from_pinned_memory_without_blocking(monkeypatch):
    """From pageable memory a copy to a GPU waits for the GPU's queued work; from pinned memory it need not. Shown with
    the copy faked: to a GPU the tensor is pinned first and copied without blocking; to the CPU (no pinning there
    without a GPU) it is copied plainly."""
    calls = []

    def pin_memory(t):
        calls.append("pin")
        return t

    def to(t, *args, **kwargs):
        calls.append(("to", args, kwargs))
        return t

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    common.to_device(torch.zeros(3), "cuda:1")
    assert calls == ["pin", ("to", ("cuda:1",), dict(non_blocking=True))]
    calls.clear()
    common.to_device(torch.zeros(3), torch.device("cpu"))
    assert calls == [("to", (torch.device("cpu"),), {})]


def test_check_finite_stops_on_nan():
    common.check_finite(torch.tensor(1.0), 3)
    with pytest.raises(FloatingPointError, match="non-finite loss nan at step 7"):
        common.check_finite(torch.tensor(float("nan")), 7)
    common.check_finite(torch.tensor(2.0), 9, first_step=5)
    with pytest.raises(FloatingPointError, match="non-finite loss inf in steps 5-9: stopped before a checkpoint holds"):
        common.check_finite(torch.tensor(float("inf")), 9, first_step=5)  # a sum of losses, read now and then
    with pytest.raises(FloatingPointError, match="non-finite loss nan at step 9: stopped before a checkpoint holds"):
        common.check_finite(float("nan"), 9, first_step=9)


def test_checkpoint_is_atomic_and_never_executes_code(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt.pt")
    common.save_checkpoint({"step": 1}, path)

    def crash(*args, **kwargs):
        raise RuntimeError("disk full")
    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(RuntimeError):
        common.save_checkpoint({"step": 2}, path)
    monkeypatch.undo()
    assert common.load_checkpoint(path)["step"] == 1  # the old checkpoint survived
    torch.save({"evil": Config()}, str(tmp_path / "evil.pt"))  # a pickled object, not plain data
    with pytest.raises(common.UsageError, match="holds Python objects.*not loaded"):
        common.load_checkpoint(str(tmp_path / "evil.pt"))

    def refuse(*args, **kwargs):  # the refusal in other words: torch's texts change between versions
        raise pickle.UnpicklingError("Weights only load failed: GLOBAL nanolap.Config is not allowed")
    monkeypatch.setattr(torch, "load", refuse)
    with pytest.raises(common.UsageError, match="holds Python objects.*not loaded"):
        common.load_checkpoint(str(tmp_path / "evil.pt"))
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        common.load_checkpoint(str(tmp_path / "missing.pt"))


def test_checkpoints_round_trip_plain_data(tmp_path, capsys):
    """Also a checkpoint saved without the checksums that load_checkpoint verifies (torch.save can leave them out)."""
    path = str(tmp_path / "ckpt.pt")
    saved = {"step": 4, "model": {"w": torch.arange(6.0).view(2, 3)}, "rng": (3, [1, 2], None)}
    common.save_checkpoint(saved, path)
    ckpt = common.load_checkpoint(path)
    assert sorted(ckpt) == ["model", "rng", "step"] and torch.equal(ckpt["model"]["w"], saved["model"]["w"])
    assert capsys.readouterr().out == ""
    crc = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        common.save_checkpoint(saved, path)
    finally:
        torch.serialization.set_crc32_options(crc)
    assert torch.equal(common.load_checkpoint(path)["model"]["w"], saved["model"]["w"])


def test_save_checkpoint_removes_temp_files_of_killed_saves(tmp_path):
    (tmp_path / "ckpt.pt.tmp12345").write_bytes(b"")  # what a save killed mid-write leaves
    common.save_checkpoint({"step": 3}, str(tmp_path / "ckpt.pt"))
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]



def test_atomic_write_writes_everything_or_nothing(tmp_path):
    path = tmp_path / "sub" / "data.bin"
    with common.atomic_write(str(path)) as f:  # makes the folder
        f.write(b"first")
    assert path.read_bytes() == b"first"
    with pytest.raises(ValueError):
        with common.atomic_write(str(path)) as f:
            f.write(b"half of the second")
            raise ValueError("the writer fails half-way")
    assert path.read_bytes() == b"first" and os.listdir(path.parent) == ["data.bin"]  # old file, no temporary left


def test_atomic_writes_of_two_processes_to_one_path_both_complete(tmp_path):
    """Two runs that generate the same data at once: the second writer leaves the first one's temporary file alone."""
    path = tmp_path / "data.bin"
    with common.atomic_write(str(path)) as f:
        f.write(b"first, still writing")
        other = (f"import sys; sys.path.insert(0, {ROOT!r}); import common\n"
                 f"with common.atomic_write({str(path)!r}) as f:\n    f.write(b'second')")
        subprocess.run([sys.executable, "-c", other], check=True, timeout=60)
        assert path.read_bytes() == b"second"
    assert path.read_bytes() == b"first, still writing" and os.listdir(tmp_path) == ["data.bin"]


def test_clean_state_dict_strips_compile_and_ddp_prefixes():
    sd = {"module._orig_mod.blocks.0.x": 1, "_orig_mod.wte.weight": 2, "head.weight": 3}
    assert common.clean_state_dict(sd) == {"blocks.0.x": 1, "wte.weight": 2, "head.weight": 3}




def test_result_line_and_step_seed(tmp_path, capsys):
    common.write_result(str(tmp_path), val_acc=0.81234, n_lap=[0, 4], params=12, seconds="3.5")
    line = "RESULT val_acc=0.8123 n_lap=[0,4] params=12 seconds=3.5"
    assert capsys.readouterr().out.strip() == line and (tmp_path / "result.txt").read_text().strip() == line
    assert common.step_seed(0, 1, 2) == common.step_seed(0, 1, 2) != common.step_seed(0, 2, 1)



def local_imports(path, local):
    """The repository modules that the file at path imports (first name of each import)."""
    tree = ast.parse(open(path).read())
    names = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    names |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    return names & local if local else names


def test_the_arrows_point_one_way():
    """nanolap.py <- common.py <- configurator.py, optim.py, probes.py, geometry.py (<- figures.py) and data/ <- the
    scripts (train_*.py, analyze.py, exercises/) <- results/verdict.py <- results/report.py: each file imports only
    what lies below it, the model file nothing but math, dataclasses and torch, and the report's statistics
    (results/stats.py) nothing of the repository's; no script imports another, but for the instructor's tools
    (exercises/instructor.py), which run the reference solutions through the checks' own helpers (exercises/check.py),
    and for the checks, which import what the experiments train and read (exercises/experiments.py)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    local = {os.path.splitext(f)[0] for f in os.listdir(root) if f.endswith(".py")}
    local |= {"data", "report", "stats", "verdict", "check", "experiments"}
    assert local_imports(os.path.join(root, "nanolap.py"), None) <= {"math", "dataclasses", "torch"}
    below = {"common.py": {"nanolap"}, "configurator.py": {"nanolap", "common"}, "optim.py": set(),
             "probes.py": {"common"}, "geometry.py": {"nanolap", "common"}, "figures.py": {"common", "geometry"},
             "results/stats.py": set(),
             "results/verdict.py": {"nanolap", "common", "data", "geometry", "figures", "stats"},
             "results/report.py": {"nanolap", "common", "configurator", "data", "geometry", "figures", "stats", "verdict"}}
    scripts = glob.glob(os.path.join(root, "train_*.py")) + [os.path.join(root, "analyze.py")]
    scripts += glob.glob(os.path.join(root, "exercises", "**", "*.py"), recursive=True)
    data = glob.glob(os.path.join(root, "data", "**", "*.py"), recursive=True)
    below.update({os.path.relpath(p, root): {"nanolap", "common", "configurator", "data"} for p in data})
    below.update({os.path.relpath(p, root): {"nanolap", "common", "configurator", "data", "optim", "probes", "geometry",
                                             "figures"} for p in scripts})
    below["exercises/instructor.py"] |= {"check"}
    below["exercises/check.py"] |= {"experiments"}
    assert len(below) > 20
    for path, allowed in below.items():
        found = local_imports(os.path.join(root, path), local)
        assert found <= allowed, (path, found - allowed)


def test_machine_name_is_one_word_naming_the_gpu_or_the_cpu_and_its_kernels(monkeypatch):
    """A run records what trained it (floats differ between machines): the GPU's name, or the CPU's model name and the
    vector instructions torch's kernels use, as one word for the RESULT line, without trademark signs."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert common.machine_name("cuda:0") == "NVIDIA_H200"
    cpu = common.machine_name("cpu")
    assert cpu.endswith("_" + torch.backends.cpu.get_cpu_capability()) and " " not in cpu and len(cpu) > 8
    monkeypatch.setattr(common, "cpu_model_name", lambda: "Apple  M2 Pro")
    assert common.machine_name("mps") == f"Apple_M2_Pro_{torch.backends.cpu.get_cpu_capability()}"
    monkeypatch.setattr(common, "cpu_model_name", lambda: "Intel(R) Core(TM) i7-8700 CPU @ 3.20GHz")
    assert common.machine_name("cpu") == f"Intel_Core_i7-8700_CPU_@_3.20GHz_{torch.backends.cpu.get_cpu_capability()}"


def test_a_cuda_run_allows_tf32(monkeypatch, tmp_path):
    """float32 matmuls on CUDA may use TF32 (bfloat16 autocast covers most of them anyway); tests that compare in
    float32 after a run in the same process turn it off (conftest.float32_matmuls)."""
    from conftest import float32_matmuls
    monkeypatch.setattr(common, "resolve_device", lambda device: device)  # the flags need no GPU
    monkeypatch.delenv("RANK", raising=False)  # one process: no process group
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # put back after the test
    with float32_matmuls():
        common.start_processes(str(tmp_path / "run"), False, "cuda")
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
