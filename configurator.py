"""Options, as nanoGPT and nanochat keep them in configurator.py, but parsed, never executed: a script's options are
its top-level `name = value  # comment` globals; `--key=value` and config files of `key = value` lines override them
in command-line order; --help lists them with their comments; --resume starts from the options a checkpoint saved and
refuses to change its model, data or schedule. Bad input ends in one line (common.UsageError)."""

import ast
import difflib
import os
import re
import sys
from contextlib import suppress
from dataclasses import asdict, fields

from common import CHECKPOINT, UsageError, load_checkpoint, print0, report_error
from nanolap import PRESETS, Config, make_config

MODEL_TYPES = {f.name: f.default for f in fields(Config) if f.default is not None} | {"n_kv_head": 1}

def _typed(key, value, default):
    """value (text of --key=value, or a config file's literal) as an option of the default's type; a model option
    whose default is None (the preset's value) has its Config field's type (MODEL_TYPES; n_kv_head: an int or None)."""
    kind = MODEL_TYPES.get(key) if default is None else default
    if isinstance(value, str) and not isinstance(kind, str):
        with suppress(ValueError, SyntaxError):  # a bare word stays a string: --dataset=cifar10
            value = ast.literal_eval(value)
    if kind is None or value is None:
        return value
    value = float(value) if isinstance(kind, float) and type(value) is int else value  # --lr=1 is 1.0
    if type(value) is not type(kind) and not (key == "n_lap" and isinstance(value, (list, tuple))):  # n_lap: per layer
        like = f" like the default {default!r}" if default is not None else ""
        raise UsageError(f"--{key}={value!r} has type {type(value).__name__}, expected {type(kind).__name__}{like}")
    return list(value) if isinstance(value, tuple) else value

def parse_args(defaults, argv):
    """defaults, then config files and --key=value options in command-line order -> a new dict."""
    return {**defaults, **given_options(defaults, argv)}

def given_options(defaults, argv):
    """{key: value} of the options that config files and --key=value options set (the last one wins), checked against
    the names and typed like the values of defaults."""
    given = {}
    for arg in argv:
        key, has_value, text = arg[2:].partition("=")
        if arg.startswith("--") and key not in defaults:
            raise UsageError(f"unknown option --{key};{_closest(key, defaults, '--')} --help lists every option")
        if arg.startswith("--") and not has_value and not isinstance(defaults[key], bool):
            raise UsageError(f"--{key} needs a value: --{key}=...")
        if arg.startswith("--"):
            given[key] = _typed(key, text if has_value else "True", defaults[key])  # --flag is --flag=True
            continue
        if not os.path.isfile(arg):
            raise UsageError(f"{arg!r} is neither a --key=value option nor a config file")
        try:
            tree = ast.parse(open(arg).read(), arg)
        except SyntaxError as e:
            raise UsageError(f"config file {arg}: line {e.lineno}: {e.msg}")
        for node in tree.body:
            where = f"config file {arg}: line {node.lineno}"
            if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
                raise UsageError(f"{where}: only `key = value` lines are allowed")
            key = node.targets[0].id
            if key not in defaults:
                raise UsageError(f"{where}: unknown key {key!r};{_closest(key, defaults)} --help lists every option")
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                raise UsageError(f"{where}: {key} must be a literal value")
            given[key] = _typed(key, value, defaults[key])
    return given

def _closest(name, names, prefix=""):
    """' did you mean --a or --b?' for the nearest valid names (difflib), '' when none is near."""
    close = difflib.get_close_matches(name, list(names), n=3, cutoff=0.6)
    return f" did you mean {' or '.join(prefix + c for c in close)}?" if close else ""

def configure(namespace, argv=None, schedule=()):
    """Resolve a script's options (declared_options) into it; --help lists them with their comments. --resume: the
    options saved in out_dir/ckpt.pt are the base and the command line goes on top, but neither the model, the data
    (Config fields, preset, dataset, seed) nor the `schedule` length may change. Returns (config, checkpoint or None)."""
    sys.excepthook = report_error  # a bad option ends in one line
    argv = sys.argv[1:] if argv is None else argv
    comments = declared_options(namespace)
    options = {k: namespace[k] for k in comments}
    if {"-h", "--help"} & set(argv):
        print(namespace["__doc__"].strip() + "\n\noptions (--key=value, or key = value lines in a config file):")
        print("\n".join(f"  --{k}={v!r}  # {comments[k]}" for k, v in options.items()))
        sys.exit(0)
    given = given_options(options, argv)
    config, ckpt = {**options, **given}, None
    if config.get("resume"):  # the checkpoint's options, then the command line's, read once
        ckpt = load_checkpoint(os.path.join(config["out_dir"], CHECKPOINT), "--resume: ")
        saved = {k: v for k, v in ckpt.get("config", {}).items() if k in options}
        config = {**options, **saved, **given, "resume": True, "out_dir": config["out_dir"]}
        fixed = [f.name for f in fields(Config)] + ["preset", "dataset", "seed", *schedule]
        changed = [f"--{k}={config[k]!r} (checkpoint: {saved[k]!r})" for k in fixed if k in saved and config[k] != saved[k]]
        if changed:  # a longer schedule would raise a cooled-down learning rate again
            raise UsageError(f"--resume continues a run exactly: it cannot change the model, data or schedule ({', '.join(changed)}). "
                             f"To train longer, run the longer schedule in a new --out_dir (--stop_at_step stops early)")
    namespace.update(config)
    return config, ckpt

def declared_options(namespace):
    """{option: its comment}: the script's top-level `name = value  # comment` lines with a lower-case name and a literal
    value, in order. Any other global (a constant, an import, a line without a comment) never becomes an option."""
    lines = re.findall(r"^([a-z]\w*) = .*?  # (.*)$", open(namespace["__file__"]).read(), re.M)
    literal = (type(None), bool, int, float, str, list)
    return {k: why for k, why in lines if k.islower() and isinstance(namespace.get(k, ()), literal)}

def check_options(config, at_least=None, above_zero=(), fractions=(), choices=None):
    """A script's rules for its options, declared once and worded alike: at_least {minimum: [keys]},
    above_zero [keys] (> 0), fractions [keys] (in [0, 1]), choices {key: allowed values}. Raises UsageError."""
    def require(key, ok, why):
        if not ok:
            raise UsageError(f"--{key}={config[key]!r}: {why}")
    for minimum, keys in (at_least or {}).items():
        for key in keys:
            require(key, config[key] >= minimum, f"must be at least {minimum}")
    for key in above_zero:
        require(key, config[key] > 0, "must be greater than 0")
    for key in fractions:
        require(key, 0 <= config[key] <= 1, "must lie in [0, 1]")
    for key, allowed in (choices or {}).items():
        require(key, config[key] in allowed, f"choose one of {', '.join(map(str, allowed))}")

def config_from_options(options, kind, **fixed):
    """Model Config of a script's options: preset, then options named like Config fields (None = keep), then `fixed`."""
    names = [name for name, p in PRESETS.items() if p["model"] == kind]
    if options["preset"] not in names:
        raise UsageError(f"--preset={options['preset']!r}: choose one of {names}")
    overrides = {f.name: options[f.name] for f in fields(Config) if f.name in options}
    try:
        return make_config(options["preset"], **{**overrides, **fixed})
    except ValueError as e:  # the model's rules, as a usage error
        raise UsageError(str(e)) from None

def check_resume(ckpt, kind, model_config):
    """--resume continues one run: the checkpoint must hold a `kind` run of the same model. Raises UsageError."""
    if ckpt.get("kind") != kind:
        raise UsageError(f"--resume: the checkpoint holds a {ckpt.get('kind')} run, not a {kind} one; use a new --out_dir")
    if asdict(Config(**ckpt["model_config"])) != asdict(model_config):
        raise UsageError("--resume: the checkpoint holds a different model; do not change model options on resume, "
                         "or use a new --out_dir")

def finished_run(out_dir, step, total, option):
    """--resume of a run at the end of its schedule: nothing to train, its files stay as they are; exits."""
    print0(f"{out_dir} holds a finished run (step {step} of {total}): --resume has nothing to train. To train longer, "
           f"start a new --out_dir with a longer --{option} (continuing would raise a cooled-down learning rate again)")
    sys.exit(0)
