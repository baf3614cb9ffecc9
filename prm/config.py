"""One dataclass holds every training/eval setting; argparse is generated from it; a YAML/JSON file can set it too.
Depends on: stdlib, PyYAML (installed with transformers)."""
import argparse
import dataclasses
import difflib
import json
import math
import os
import sys
from dataclasses import dataclass, field, fields

import yaml


FILE = "config.train.json"
# settings a resumed run may change (they define neither the model nor the data nor its order); every other one must
# equal the checkpoint's. The batch split may change too, as long as the global batch stays the same.
MAY_CHANGE = {"max_steps", "epochs", "eval_every", "save_every", "log_every", "keep_last", "resume", "output_dir",
              "num_proc", "eval_batch_size", "threshold", "compile", "gradient_checkpointing", "trust_remote_code",
              "max_grad_norm", "batch_size", "grad_accum", "report_to", "run_name", "overwrite",
              "packing", "pack_to"}


def unescape(text: str) -> str:
    """`--step-separator '\\n'` on a shell means a newline, as it does in TRL's Python config."""
    return text.encode("utf-8").decode("unicode_escape").encode("latin-1").decode("utf-8")


FORMAT_CHOICES = ["auto", "pretokenized", "stepwise", "math_shepherd", "prm800k", "processbench", "candidates",
                  "prmbench", "mrben"]


def _opt(default, help, **kw):
    """A field with its --help text; section="title" on a field starts a --help section (argument group) there."""
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class Config:
    model: str = _opt("tiny", "hub id, local dir, or 'tiny' (a small random decoder built from a config, offline)",
                      section="model and data")
    tokenizer: str = _opt("", "tokenizer path/id; default: the model's own (the built-in char tokenizer for 'tiny')")
    dataset: str = _opt("synthetic", "'synthetic', a hub dataset name, a .jsonl/.json/.parquet file, or a directory")
    eval_dataset: str = _opt("", "held-out data; default: the dataset's eval split or an --eval-fraction share")
    dataset_config: str = _opt("", "hub dataset config name")
    train_split: str = _opt("train", "split used for training")
    eval_split: str = _opt("test", "split used for evaluation when the dataset has it")
    eval_fraction: float = _opt(0.05, "share held out (split by prompt) when there is no eval split")
    format: str = _opt("auto", "input format; 'auto' detects it from the columns", choices=FORMAT_CHOICES)
    eval_format: str = _opt("auto", "input format of --eval-dataset, on its own (--format is --dataset's)",
                            choices=FORMAT_CHOICES)
    neutral_label: str = _opt("negative", "PRM800K rating 0 means: positive, negative (as TRL), or drop "
                              "(step kept as context, unlabeled)", choices=["positive", "negative", "drop"])
    skip_invalid: bool = _opt(False, "drop invalid rows (and report how many) instead of stopping with exit status 2")
    num_proc: int = _opt(0, "processes for dataset tokenization; 0 = one per CPU core (up to 8) for 20,000 rows "
                         "or more, else 1 (a process costs seconds to start)")
    synthetic_size: int = _opt(32000, "rows generated for the synthetic default (10%% of them held out)")
    output_dir: str = _opt("out", "where metrics.jsonl, checkpoints and final/ go")
    overwrite: bool = _opt(False, "replace the run already in --output-dir (its metrics.jsonl, checkpoints, final/); "
                           "without this or --resume such a directory is refused. Command line only: a --config "
                           "file's value is ignored, so rerunning a saved config never deletes a run")
    max_length: int = _opt(1024, "tokens per example; truncation keeps whole steps only", section="tokenization")
    max_completion_length: int = _opt(0, "tokens of the steps (separators included), whole steps only, applied "
                                      "before --max-length; 0: no separate cap")
    step_separator: str = _opt("\n", "text appended to every step (escapes like \\n understood); its last token "
                               "carries the step's label", type=unescape)
    train_on_last_step_only: bool = _opt(False, "in training, keep only the last step's label")
    cut_after_first_error: bool = _opt(False, "in training, end each solution at its first wrong step (label false "
                                       "or 0.0): what follows an error is not judged, as in ProcessBench")
    max_steps: int = _opt(-1, "optimizer steps; -1 means --epochs full passes", section="optimization")
    epochs: float = _opt(1.0, "passes over the training data when --max-steps is -1")
    batch_size: int = _opt(0, "examples per device per micro-batch; 0 = 32 for the 'tiny' preset, else 8")
    grad_accum: int = _opt(1, "micro-batches per optimizer step (global batch = batch x accum x world size)")
    lr: float = _opt(0.0, "peak AdamW learning rate; 0 = 1e-3 for the random 'tiny' preset, else 1e-4 "
                       "with LoRA, 1e-5 without")
    weight_decay: float = _opt(0.0, "AdamW weight decay")
    warmup_steps: int = _opt(0, "linear warmup steps, then cosine decay to 10%% of --lr")
    max_grad_norm: float = _opt(1.0, "gradient clipping norm; 0 disables")
    dtype: str = _opt("auto", "autocast dtype; auto = bf16 where the device has it natively (CUDA; CPUs with AMX or "
                      "AVX512-BF16), else fp32; master weights stay fp32",
                      choices=["auto", "fp32", "bf16", "fp16"])
    gradient_checkpointing: bool = _opt(False, "recompute backbone activations in backward to save memory")
    fsdp: bool = _opt(False, "under torchrun, shard weights, gradients and AdamW state over the ranks (FSDP2) "
                      "instead of copying them to every rank (DDP): for models whose training state fills a device")
    group_by_length: bool = _opt(True, "batch similar lengths together (less padding); deterministic from the seed")
    compile: bool = _opt(False, "torch.compile the model")
    packing: bool = _opt(True, "padding-free micro-batches: the examples back to back in one row, each attending to "
                         "itself only (varlen flash attention on CUDA in bf16/fp16, exact per-example SDPA otherwise); "
                         "decoders only, other backbones are padded")
    pack_to: int = _opt(0, "with --packing, pad each micro-batch's row up to a multiple of N tokens so shapes repeat "
                        "(N >= batch x --max-length: one shape, --compile compiles once); 0: no padding")
    seed: int = _opt(0, "seed for init, data order and dropout")
    lora_r: int = _opt(0, "LoRA rank; 0 trains every weight (full fine-tuning)",
                       section="LoRA: low-rank adapters on the backbone's linear layers; the head trains fully")
    lora_alpha: float = _opt(0.0, "LoRA scale numerator (update = alpha / r x B A); 0 = 2 x --lora-r")
    lora_dropout: float = _opt(0.0, "dropout on the LoRA branch's input")
    lora_targets: str = _opt("q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                             "comma-separated glob patterns, matched against a linear layer's full name or its last "
                             "part (the default covers Llama/Qwen2/Mistral attention and MLP projections)")
    lora_base_dtype: str = _opt("fp32", "dtype of the frozen base under LoRA; bf16 halves its memory (it needs no fp32 "
                                "master copy: it never updates) and needs autocast (--dtype bf16 or auto)",
                                choices=["fp32", "bf16"])
    eval_every: int = _opt(0, "evaluate every N optimizer steps (0: only at the end)",
                           section="evaluation, logging, checkpoints")
    eval_batch_size: int = _opt(0, "examples per device at evaluation (0: 2 x --batch-size)")
    threshold: float = _opt(0.5, "a step is predicted correct when P(correct) >= threshold")
    log_every: int = _opt(10, "log line and metrics.jsonl record every N optimizer steps")
    report_to: str = _opt("none", "also send the metrics.jsonl records and the config to TensorBoard "
                          "(<output-dir>/tensorboard) or Weights & Biases; the package must be installed",
                          choices=["none", "tensorboard", "wandb"])
    run_name: str = _opt("", "the run's name in TensorBoard / W&B; default: the output directory's name")
    save_every: int = _opt(0, "write <output-dir>/checkpoint-<step>/ every N steps (0: never)")
    keep_last: int = _opt(2, "checkpoints kept (older ones are deleted); 0 keeps all")
    resume: str = _opt("", "checkpoint directory to continue from, or 'auto' for the newest complete one")
    trust_remote_code: bool = _opt(False, "allow hub models that run their own code (off: safer). Command line "
                                   "only: never taken from a file (--config, a model's config.train.json)")

    def resolve(self) -> "Config":
        """Fill the 0 = auto fields, so the saved config says what was actually used."""
        tiny = self.model == "tiny"
        self.batch_size = self.batch_size or (32 if tiny else 8)
        self.lr = self.lr or (1e-3 if tiny else 1e-4 if self.lora_r else 1e-5)
        self.lora_alpha = self.lora_alpha or 2.0 * self.lora_r
        self.eval_batch_size = self.eval_batch_size or 2 * self.batch_size
        return self

    def problems(self) -> list:
        """Every setting that cannot work, one line each: checked before any data or weight loads."""
        out = []

        def need(ok: bool, name: str, what: str):
            if not ok:
                out.append(f"--{name.replace('_', '-')} {getattr(self, name)!r}: {what}")

        for name in ("batch_size", "eval_batch_size", "max_completion_length", "warmup_steps", "eval_every",
                     "save_every", "keep_last", "lora_r", "pack_to", "num_proc"):
            need(getattr(self, name) >= 0, name, "must be >= 0")
        for name in ("grad_accum", "max_length", "log_every", "synthetic_size"):
            need(getattr(self, name) >= 1, name, "must be >= 1")
        for name in ("lr", "weight_decay", "max_grad_norm", "lora_alpha"):  # NaN fails every comparison
            need(math.isfinite(getattr(self, name)) and getattr(self, name) >= 0, name, "must be finite and >= 0")
        need(self.max_steps == -1 or self.max_steps >= 1, "max_steps", "must be -1 (train --epochs) or >= 1")
        need(math.isfinite(self.epochs) and self.epochs > 0, "epochs", "must be finite and > 0")
        need(0 <= self.lora_dropout < 1, "lora_dropout", "must be in [0, 1)")
        need(0 <= self.threshold <= 1, "threshold", "must be in [0, 1]")
        need(0 < self.eval_fraction < 1, "eval_fraction", "must be in (0, 1)")
        need(self.step_separator != "", "step_separator", "must not be empty: its last token carries the label")
        need(not (self.fsdp and self.dtype == "fp16"), "dtype", "fp16 loss scaling is not supported with --fsdp: "
             "use bf16")
        need(self.lora_base_dtype == "fp32" or (self.lora_r > 0 and self.dtype in ("bf16", "auto")),
             "lora_base_dtype", "bf16 needs --lora-r > 0 and bf16 autocast (--dtype bf16 or auto)")
        return out

    def resume_conflicts(self, saved: "Config", saved_world: int, world: int) -> tuple:
        """(settings that must equal the checkpoint's but differ, harmless changes), as '--flag new (was old)'."""
        fmt = lambda name: f"--{name.replace('_', '-')} {getattr(self, name)!r} (was {getattr(saved, name)!r})"
        differ = [f.name for f in fields(self) if getattr(self, f.name) != getattr(saved, f.name)]
        bad = [fmt(n) for n in differ if n not in MAY_CHANGE]
        if self.batch_size * self.grad_accum * world != saved.batch_size * saved.grad_accum * saved_world:
            bad.append(f"global batch {self.batch_size} x {self.grad_accum} x {world} ranks (was "
                       f"{saved.batch_size} x {saved.grad_accum} x {saved_world})")
        return bad, [fmt(n) for n in differ if n in MAY_CHANGE and n not in ("resume", "output_dir")]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    def save(self, directory: str):
        """<directory>/config.train.json: saved with every run, checkpoint and final model."""
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, FILE), "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, directory: str) -> "Config":
        """A saved run's settings (eval.py, PRMReward, --resume); exit 2 naming the file and the field for a file
        that is not JSON or a value of the wrong type, which would otherwise fail far away in a traceback."""
        path = os.path.join(directory, FILE)
        try:
            with open(path) as f:
                saved = json.load(f)
        except (OSError, ValueError) as e:  # json's decode error (and a non-UTF-8 file) is a ValueError
            exit_on_problems([f"{path}: cannot read it: {e}"])
        if not isinstance(saved, dict):
            exit_on_problems([f"{path}: expected a JSON object of settings, got {type(saved).__name__}"])
        problems, by_name = [], {f.name: f for f in fields(cls)}
        for key, value in saved.items():
            try:
                saved[key] = checked_value(by_name[key], value) if key in by_name else value
            except ValueError as e:
                problems.append(f"{path}: {e}")
        exit_on_problems(problems)
        return cls.from_dict(saved)

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default holding a newline or tab (or nothing) as an escaped string, '\\n', not as a blank; lists a
    field's dashed names only (its `shown`), not the underscore spellings it also answers to."""

    def _get_help_string(self, action):
        text = super()._get_help_string(action)
        if isinstance(action.default, str) and (not action.default.isprintable() or not action.default):
            text = text.replace("%(default)s", "%(default)r")
        return text

    def _format_action_invocation(self, action):
        shown = getattr(action, "shown", None)
        if shown is None:
            return super()._format_action_invocation(action)
        metavar = "" if action.nargs == 0 else " " + self._format_args(action, action.dest.upper())
        return ", ".join(shown) + metavar


class Parser(argparse.ArgumentParser):
    """Bad flags end with one line and exit status 2 (not a usage dump of every flag), an unknown one naming the
    nearest valid flag. No prefix abbreviations: with the aliases, a prefix often fits several spellings."""

    def __init__(self, usage: str = "%(prog)s [options]", **kw):
        super().__init__(usage=usage, formatter_class=HelpFormatter, allow_abbrev=False, **kw)

    def error(self, message: str):
        unknown = [a for a in message.split()[2:] if a.startswith("-")] if message.startswith("unrecognized") else []
        if unknown:
            near = difflib.get_close_matches(unknown[0].split("=")[0], list(self._option_string_actions), n=1)
            action = self._option_string_actions[near[0]] if near else None
            names = getattr(action, "shown", None) or (action.option_strings if action else [])
            message += f" (did you mean {' / '.join(names)}?)" if names else ""
        exit_on_problems([message])


def add_field(container, f, suppress: bool = False):
    """Field f as --its-name on container (a parser or an argument group), also answering to its underscore
    spelling and to TRL's / HF's name for it (TRL_NAMES); --help shows the dashed names. suppress: an absent flag
    leaves no attribute (eval.py takes it from the run instead)."""
    names = [f.name] + [trl for trl, ours in TRL_NAMES.items() if ours == f.name]
    dashed = ["--" + n.replace("_", "-") for n in names]
    spellings = list(dict.fromkeys(dashed + ["--" + n for n in names]))  # --lr has one spelling only
    default = argparse.SUPPRESS if suppress else f.default
    meta = {k: v for k, v in f.metadata.items() if k != "section"}
    if f.type in (bool, "bool"):
        action = container.add_argument(*spellings, dest=f.name, action=argparse.BooleanOptionalAction,
                                        default=default, help=meta["help"])
        action.shown = [dashed[0], "--no-" + dashed[0][2:]] + dashed[1:]  # every --no- spelling still works
    else:
        meta.setdefault("type", {"int": int, "float": float, "str": str}.get(f.type, f.type))
        action = container.add_argument(*spellings, dest=f.name, default=default, **meta)
        action.shown = dashed


def sections(cls=Config) -> list:
    """[(title, [fields])] in declaration order: a field whose metadata has a section starts one."""
    out = []
    for f in fields(cls):
        if "section" in f.metadata:
            out.append((f.metadata["section"], []))
        out[-1][1].append(f)
    return out


def build_parser(cls=Config, description: str = "") -> argparse.ArgumentParser:
    """Every field of cls as a flag, in an argument group per section."""
    p = Parser(description=description)
    for title, group in sections(cls):
        target = p.add_argument_group(title)
        for f in group:
            add_field(target, f)
    return p


def writable(path: str) -> bool:
    """Whether a file or folder can be written at path: it, or the nearest part of it that exists, is writable,
    and no file sits where a folder has to be."""
    target = part = os.path.abspath(path)
    while not os.path.exists(part):
        part = os.path.dirname(part)
    if part != target and not os.path.isdir(part):
        return False
    return os.access(part, os.W_OK)


class UsageError(SystemExit):
    """Exit status 2, with the message kept on the exception for callers that catch it (tests, notebooks)."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self):
        return self.message


def exit_on_problems(problems: list):
    """Bad settings or inputs end the program with exit status 2 and a one-line message, not a traceback."""
    if problems:
        print("error: " + "; ".join(problems), file=sys.stderr, flush=True)
        raise UsageError("; ".join(problems))


# names TRL's PRMConfig / ScriptArguments and HF's TrainingArguments give our fields (same meaning, same values);
# each one also sets its field on the command line (--learning_rate, --learning-rate) and in a --config file.
# Names the two share (max_length, gradient_checkpointing, output_dir, ...) need no entry.
TRL_NAMES = {"learning_rate": "lr", "per_device_train_batch_size": "batch_size", "num_train_epochs": "epochs",
             "gradient_accumulation_steps": "grad_accum", "logging_steps": "log_every", "save_steps": "save_every",
             "save_total_limit": "keep_last", "eval_steps": "eval_every", "model_name_or_path": "model",
             "dataset_name": "dataset", "per_device_eval_batch_size": "eval_batch_size", "dataset_num_proc": "num_proc",
             "dataset_train_split": "train_split", "dataset_test_split": "eval_split", "torch_compile": "compile",
             "resume_from_checkpoint": "resume"}


def canonical(key: str) -> str:
    """Our field name for a key in any accepted spelling: max-length, max_length, TRL's learning_rate."""
    key = key.replace("-", "_")
    return TRL_NAMES.get(key, key)


def nearest_field(key: str, cls=Config) -> str:
    """The field a mistyped key most likely meant, TRL's names included ('' if none is close)."""
    names = [f.name for f in fields(cls)] + list(TRL_NAMES)
    close = difflib.get_close_matches(key.replace("-", "_"), names, n=1, cutoff=0.6)
    return canonical(close[0]) if close else ""


def checked_value(f, value):
    """value for field f as read from a file; ValueError saying why when it does not fit."""
    kind = {"int": int, "float": float, "str": str, "bool": bool}.get(f.type, f.type)
    if kind is float and isinstance(value, str):  # YAML 1.1 reads 1e-5 (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if kind is float and type(value) is int:  # `lr: 1` means 1.0
        value = float(value)
    if type(value) is not kind:  # type(), not isinstance: a bool is an int to isinstance
        raise ValueError(f"'{f.name}' must be {kind.__name__}, got {type(value).__name__} {value!r}")
    if f.metadata.get("choices") and value not in f.metadata["choices"]:
        raise ValueError(f"'{f.name}' must be one of {f.metadata['choices']}, got {value!r}")
    return value


def read_config_file(path: str, parser: argparse.ArgumentParser) -> dict:
    """{field: value} from a YAML or JSON file whose keys are Config's fields (as in config.train.json), or any
    spelling the command line takes (TRL's names too).

    Values are taken as written (no shell escapes: write a newline separator as "\\n" in YAML/JSON). Any problem
    (missing file, bad syntax, unknown key, wrong type) stops with parser.error: a message and exit status 2."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f) if path.endswith(".json") else yaml.safe_load(f)
    except (OSError, ValueError, yaml.YAMLError) as e:  # json's decode error is a ValueError
        parser.error(f"--config {path}: {e}")
    if data is None:  # an empty YAML file
        return {}
    if not isinstance(data, dict):
        parser.error(f"--config {path}: expected a mapping of settings, got {type(data).__name__}")
    by_name, out = {f.name: f for f in fields(Config)}, {}
    for key, value in data.items():
        name = canonical(str(key))
        if name not in by_name:
            near = nearest_field(str(key))
            parser.error(f"--config {path}: unknown key '{key}'" + (f" (did you mean '{near}'?)" if near else ""))
        if name in out:  # lr and learning_rate both given: neither may silently win
            parser.error(f"--config {path}: '{key}' sets '{name}' a second time")
        try:
            out[name] = checked_value(by_name[name], value)
        except ValueError as e:
            parser.error(f"--config {path}: {e}")
    return out


def given_args(parser: argparse.ArgumentParser, argv=None) -> dict:
    """Parses argv; returns only the options written on the command line (not the defaults)."""
    unset = object()  # argparse leaves an attribute already in the namespace alone when its flag is absent
    ns = argparse.Namespace(**{a.dest: unset for a in parser._actions if a.dest != "help"})
    parser.parse_args(argv, namespace=ns)
    return {k: v for k, v in vars(ns).items() if v is not unset}


def parse_config(argv=None) -> Config:
    """train.py's command line: flags given win over --config FILE, which wins over the defaults."""
    p = build_parser(description="Train a process reward model. Every flag also takes its underscore spelling "
                     "(--max_length) and, where it has one, TRL's name (--learning_rate).")
    p.add_argument("--config", default="", metavar="FILE",
                   help="YAML or JSON file of settings, keys as in config.train.json; flags given here override it")
    given = given_args(p, argv)
    path = given.pop("config", "")
    from_file = read_config_file(path, p) if path else {}
    for key in ("overwrite", "trust_remote_code"):  # deletes a run / runs a model's code: command line only
        if from_file.pop(key, False):  # a saved run (config.train.json, a downloaded model's too) may hold true
            print(f"note: --config {path}: {key} ignored: only --{key.replace('_', '-')} on the command line "
                  "sets it", file=sys.stderr)
    cfg = Config(**{**from_file, **given})
    out_ok = writable(cfg.output_dir) and not os.path.isfile(cfg.output_dir)
    exit_on_problems(cfg.problems() + ([] if out_ok else [f"--output-dir {cfg.output_dir}: not a writable folder"]))
    return cfg
