"""Config: every training/eval setting, each field's rules in its metadata (see _opt); resolve()
checks them and fills in the auto ones. Flags and --config files: prm.cli."""
import collections
import contextlib
import dataclasses
import json
import math
import os
import reprlib
from dataclasses import dataclass, field, fields
from typing import Callable, NamedTuple, Optional, get_args

from prm.errors import UsageError, check
from prm.files import write_lines

FILE = "config.train.json"
FORMATS = ["auto", "pretokenized", "stepwise", "math_shepherd", "prm800k", "processbench",
           "candidates", "prmbench", "mrben"]
SCHEDULES = ["linear", "cosine", "cosine_with_min_lr", "constant", "constant_with_warmup"]
# a field's `rules`. change: a resumed run may change it (the global batch aside). rows: it shapes
# the rows read from data files, so it keys their cache. scoring: eval.py takes it
RULES = {"change", "rows", "scoring"}
# auto is None; 0 for a number and the word for a choice still read as None
AUTO = (0, "auto")
BOOLEAN = ("true", "false", "yes", "no", "1", "0")
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 3, 200, 200


def unescape(text: str) -> str:
    """Backslash escapes decoded: `--step-separator '\\n'` is a newline."""
    return text.encode("utf-8").decode("unicode_escape").encode("latin-1").decode("utf-8")


def boolean(value) -> bool:
    """A switch's value as HF's parser takes it (true/false, yes/no, 1/0, any case)."""
    text = str(value).lower()
    if text not in BOOLEAN:
        raise ValueError(f"expected true or false, got {preview(value)}")
    return text in ("true", "yes", "1")


def preview(value) -> str:
    """repr(value) in at most about 200 characters, without expanding a deeply nested value."""
    text = _SHORT.repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


class Conv(NamedTuple):
    """A TRL/HF name setting a field through convert. nargs "?": a switch (convert gets a bool);
    "+": a list. keep: values a false switch leaves alone (`--bf16 --fp16 false`), a true one
    refuses."""
    name: str
    convert: Callable
    nargs: Optional[str] = None
    keep: tuple = ()


def torch_dtype(name: str) -> str:
    """TRL's --torch_dtype as our dtype."""
    names = {"auto": "auto", "bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
    if name not in names:
        raise ValueError(f"expected one of {', '.join(names)}, got {preview(name)}")
    return names[name]


def target_list(value) -> str:
    """TRL's lora_target_modules (a list, or PEFT's 'all-linear') as comma-separated patterns."""
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"expected a list of module names, got {preview(value)}")
    return "*" if names == ["all-linear"] else ",".join(names)


def opt(default, help, **kw):
    """A field of an options dataclass and its flag (prm.cli.add_fields): help; add_argument's
    choices, type, required; section: starts a --help group."""
    return field(default=default, metadata={"help": help, **kw})


def _opt(default, help, *, rules: str = "", trl=(), **kw):
    """An opt with its rules (words of RULES); trl: its TRL / HF names (a Conv converts)."""
    assert set(rules.split()) <= RULES, rules
    return opt(default, help, rules=frozenset(rules.split()), trl=trl, **kw)


def _switch(name: str, other: str) -> Conv:
    """TRL's --bf16 / --fp16 [BOOL]: true is that dtype, false fp32 (or the other's)."""
    return Conv(name, lambda on: name if on else "fp32", "?", keep=(other,))


@dataclass
class Config:
    model: str = _opt(
        "tiny", "hub id, local dir, or 'tiny' (a small random decoder, offline)",
        trl=("model_name_or_path",), section="model and data")
    tokenizer: str = _opt("", "tokenizer path/id; default: the model's own", rules="scoring")
    dataset: str = _opt(
        "synthetic", "'synthetic', a hub dataset name, a .jsonl/.json/.parquet file, or a "
        "directory", rules="rows", trl=("dataset_name",))
    eval_dataset: str = _opt(
        "", "held-out data; default: --eval-split or an --eval-fraction share", rules="rows")
    dataset_config: str = _opt("", "hub dataset config name", rules="scoring")
    train_split: str = _opt(
        "train", "split used for training", rules="rows", trl=("dataset_train_split",))
    eval_split: str = _opt(
        "test", "split used for evaluation when the dataset has it", rules="rows scoring",
        trl=("dataset_test_split",))
    eval_fraction: float = _opt(
        0.05, "share held out (split by prompt) without an eval split", rules="rows")
    format: Optional[str] = _opt(
        None, "'auto' detects it from the columns", rules="rows scoring", choices=FORMATS)
    eval_format: Optional[str] = _opt(
        None, "input format of --eval-dataset", rules="rows", choices=FORMATS)
    neutral_label: str = _opt(
        "negative", "PRM800K rating 0 means: positive, negative (as TRL), or drop (unlabeled "
        "context)", rules="rows scoring", choices=["positive", "negative", "drop"])
    skip_invalid: bool = _opt(
        False, "drop invalid rows (and report how many), not exit 2", rules="rows scoring")
    num_proc: Optional[int] = _opt(
        None, "tokenization processes (default, or 0: one per CPU core up to 8 from 20,000 "
        "rows, else 1)", rules="change scoring", trl=("dataset_num_proc",))
    synthetic_size: int = _opt(32000, "rows of the synthetic default")
    output_dir: str = _opt("out", "where metrics.jsonl, checkpoints and final/ go", rules="change")
    overwrite: bool = _opt(
        False, "replace the run in --output-dir (command line only)", rules="change")
    max_length: int = _opt(
        1024, "tokens per example; truncation keeps whole steps only", rules="scoring",
        section="tokenization")
    max_completion_length: int = _opt(
        0, "tokens of the steps (whole steps), applied before --max-length; 0: no separate cap",
        rules="scoring")
    step_separator: str = _opt(
        "\n", "text appended to every step (escapes like \\n understood); its last token "
        "carries the step's label", rules="scoring", type=unescape)
    train_on_last_step_only: bool = _opt(False, "in training, keep only the last step's label")
    cut_after_first_error: bool = _opt(
        False, "in training, end each solution at its first wrong step", rules="rows")
    max_steps: int = _opt(
        -1, "optimizer steps; -1 means --epochs full passes", rules="change",
        section="optimization")
    epochs: float = _opt(
        1.0, "data passes if --max-steps is -1; a pass's last global batch is filled up to a "
        "full batch: some examples train twice a pass", rules="change",
        trl=("num_train_epochs",))
    batch_size: Optional[int] = _opt(
        None, "examples per device per micro-batch (default, or 0: 32 for 'tiny', else 8)",
        rules="change", trl=("per_device_train_batch_size",))
    grad_accum: int = _opt(
        1, "micro-batches per optimizer step", rules="change",
        trl=("gradient_accumulation_steps",))
    lr: Optional[float] = _opt(
        None, "peak AdamW learning rate (default, or 0: 1e-3 for the random 'tiny' preset, "
        "else 1e-4 with LoRA, 1e-5 without)", trl=("learning_rate",))
    lr_scheduler_type: str = _opt(
        "cosine_with_min_lr", "decay after warmup, as HF's schedules (cosine_with_min_lr: to "
        "10%% of --lr)", choices=SCHEDULES)
    warmup_steps: float = _opt(0, "linear warmup steps; below 1: --warmup-ratio")
    warmup_ratio: float = _opt(0.0, "warmup share of all steps if --warmup-steps is 0")
    weight_decay: float = _opt(0.0, "AdamW weight decay")
    adam_beta1: float = _opt(0.9, "AdamW beta1")
    adam_beta2: float = _opt(0.95, "AdamW beta2 (HF's default: 0.999)")
    adam_epsilon: float = _opt(1e-8, "AdamW epsilon")
    max_grad_norm: float = _opt(1.0, "gradient clipping norm; 0 disables", rules="change")
    dtype: Optional[str] = _opt(
        None, "autocast dtype; auto: bf16 where the device has it natively, else fp32. TRL's "
        "--bf16 / --fp16 [BOOL] and --torch_dtype set it too", rules="scoring",
        choices=["auto", "fp32", "bf16", "fp16"],
        trl=(_switch("bf16", "fp16"), _switch("fp16", "bf16"), Conv("torch_dtype", torch_dtype)))
    gradient_checkpointing: bool = _opt(
        False, "save memory by recomputing activations", rules="change")
    fsdp: bool = _opt(
        False, "under torchrun, shard weights, gradients and AdamW state over the ranks (FSDP2), "
        "not copy them (DDP)")
    group_by_length: bool = _opt(True, "batch similar lengths (less padding), reproducible by seed")
    compile: bool = _opt(False, "torch.compile the model", rules="change", trl=("torch_compile",))
    packing: bool = _opt(
        True, "padding-free micro-batches: examples back to back in one row, each attending to "
        "itself; decoders only", rules="change scoring")
    pack_to: int = _opt(
        0, "with --packing, pad rows to a multiple of N tokens (shapes repeat); 0: none",
        rules="change")
    seed: int = _opt(0, "seed for init, data order and dropout", rules="rows scoring")
    disable_dropout: bool = _opt(True, "set the backbone's dropout to 0 for training, as TRL does")
    lora_r: int = _opt(
        0, "LoRA rank; 0 trains every weight",
        section="LoRA: low-rank adapters on the backbone's linear layers; the head trains fully")
    use_peft: Optional[bool] = _opt(
        None, "TRL's switch: true: LoRA (rank 16 if --lora-r is 0); false: full fine-tuning; "
        "unset: --lora-r decides", rules="change")
    lora_alpha: Optional[float] = _opt(None, "update: alpha/r x B A (default, or 0: 2 x --lora-r)")
    lora_dropout: float = _opt(0.0, "dropout on the LoRA branch's input")
    lora_targets: str = _opt(
        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "comma-separated glob "
        "patterns of linear layers' full or last names; TRL's --lora_target_modules takes a "
        "list, all-linear for every one", trl=(Conv("lora_target_modules", target_list, "+"),))
    lora_base_dtype: str = _opt(
        "fp32", "dtype of the frozen base under LoRA; bf16 halves its memory and needs bf16 "
        "autocast", choices=["fp32", "bf16"])
    eval_every: int = _opt(
        0, "evaluate every N optimizer steps (0: only at the end)", rules="change",
        trl=("eval_steps",), section="evaluation, logging, checkpoints")
    eval_strategy: Optional[str] = _opt(
        None, "steps (every --eval-every, else --log-every), epoch or no; default: steps with "
        "--eval-every, else no", rules="change", choices=["steps", "epoch", "no"])
    eval_batch_size: Optional[int] = _opt(
        None, "examples per device (default, or 0: 2 x --batch-size)", rules="change scoring",
        trl=("per_device_eval_batch_size",))
    threshold: float = _opt(
        0.5, "predict a step correct when P(correct) >= this", rules="change scoring")
    log_every: int = _opt(
        10, "log (and metrics.jsonl) every N steps", rules="change", trl=("logging_steps",))
    disable_tqdm: bool = _opt(False, "no progress bars", rules="change scoring")
    report_to: str = _opt(
        "none", "also send the metrics and the config to TensorBoard (<output-dir>/tensorboard) "
        "or Weights & Biases", rules="change", choices=["none", "tensorboard", "wandb"])
    run_name: str = _opt(
        "", "name in TensorBoard / W&B; default: the output directory's", rules="change")
    save_every: int = _opt(
        0, "write a checkpoint every N steps (0: never)", rules="change", trl=("save_steps",))
    save_strategy: Optional[str] = _opt(
        None, "steps (every --save-every, else 500), epoch or no; default: steps with "
        "--save-every, else no", rules="change", choices=["steps", "epoch", "no"])
    keep_last: int = _opt(
        2, "newest checkpoints kept; 0: all", rules="change", trl=("save_total_limit",))
    resume: str = _opt(
        "", "checkpoint directory to continue from, or 'auto' for the newest complete one; "
        "command line only", rules="change", trl=("resume_from_checkpoint",))
    trust_remote_code: bool = _opt(
        False, "allow hub models' own code (command line only)", rules="change scoring")

    def __post_init__(self):
        for f in fields(self):  # use_peft is a bool: its False is no 0
            if f.default is None and kind(f) is not bool and getattr(self, f.name) in AUTO:
                setattr(self, f.name, None)
        if 0 < self.warmup_steps < 1:  # a ratio, as transformers 5
            self.warmup_ratio, self.warmup_steps = self.warmup_steps, 0

    @classmethod
    def names_with(cls, rule: str) -> tuple:
        """The fields with the rule (see RULES), in order."""
        return tuple(f.name for f in fields(cls) if rule in f.metadata["rules"])

    def resolve(self) -> "Config":
        """Checked (UsageError naming every problem), a copy with the auto (None) fields filled
        in; dtype, num_proc and format, decided by the device or the data, stay None."""
        check(self.problems())
        tiny, lora_r = self.model == "tiny", self.lora_rank()
        batch = self.batch_size or (32 if tiny else 8)
        # as HF's: strategy steps without an interval: eval every --log-every steps, save every 500
        eval_every = self.eval_every or self.log_every * (self.eval_strategy == "steps")
        save_every = self.save_every or 500 * (self.save_strategy == "steps")
        return dataclasses.replace(
            self, batch_size=batch, lr=self.lr or (1e-3 if tiny else 1e-4 if lora_r else 1e-5),
            lora_r=lora_r, lora_alpha=self.lora_alpha or 2.0 * lora_r,
            eval_batch_size=self.eval_batch_size or 2 * batch, eval_every=eval_every,
            eval_strategy=self.eval_strategy or ("steps" if eval_every else "no"),
            save_every=save_every,
            save_strategy=self.save_strategy or ("steps" if save_every else "no"))

    def lora_rank(self) -> int:
        """--lora-r as TRL reads it: use_peft false is 0, use_peft true without a rank is 16."""
        return 0 if self.use_peft is False else self.lora_r or 16 * bool(self.use_peft)

    def every(self, kind: str, steps_per_epoch: int) -> int:
        """Steps between evaluations (kind "eval") or checkpoints ("save"); 0: none."""
        steps = {"steps": getattr(self, kind + "_every"), "epoch": steps_per_epoch, "no": 0}
        return steps[getattr(self, kind + "_strategy")]

    def problems(self) -> list:
        """Every setting that cannot work, one line each."""
        out = []

        def need(test, what: str, *names):
            for name in names:
                value = getattr(self, name)
                if value is not None and not test(value):  # None: auto
                    out.append(f"{flag(name)} {preview(value)}: {what}")

        need(lambda v: v >= 0, "must be >= 0", "batch_size", "eval_batch_size", "warmup_steps",
             "max_completion_length", "eval_every", "save_every", "keep_last", "lora_r",
             "pack_to", "num_proc")
        need(lambda v: v % 1 == 0, "must be a whole number (or a ratio below 1)",  # inf % 1: nan
             "warmup_steps")
        need(lambda v: v >= 1, "must be >= 1", "grad_accum", "max_length", "log_every",
             "synthetic_size")
        need(lambda v: math.isfinite(v) and v >= 0, "must be finite and >= 0", "lr",
             "weight_decay", "max_grad_norm", "lora_alpha", "adam_epsilon")  # NaN fails every test
        need(lambda v: v == -1 or v >= 1, "must be -1 (train --epochs) or >= 1", "max_steps")
        # beyond: an overflow in the step count or the batches' index lists
        need(lambda v: 0 < v < 2 ** 31, "must be > 0 and below 2^31", "epochs")
        need(lambda v: v <= 2 ** 24, "must be at most 2^24", "batch_size", "grad_accum")
        need(lambda v: 0 <= v < 1, "must be in [0, 1)", "lora_dropout", "adam_beta1", "adam_beta2")
        need(lambda v: 0 <= v <= 1, "must be in [0, 1]", "threshold", "warmup_ratio")
        need(lambda v: 0 < v < 1, "must be in (0, 1)", "eval_fraction")
        need(lambda v: v != "", "must not be empty: its last token carries the label",
             "step_separator")
        need(lambda v: not (self.fsdp and v == "fp16"),
             "fp16 loss scaling is not supported with --fsdp: use bf16", "dtype")
        need(lambda v: v == "fp32" or self.lora_rank() > 0 and self.dtype in ("bf16", None),
             "bf16 needs --lora-r > 0 and bf16 autocast (--dtype bf16 or auto)", "lora_base_dtype")
        need(lambda v: v != "constant" or not (self.warmup_steps or self.warmup_ratio),
             "takes no warmup: use constant_with_warmup", "lr_scheduler_type")
        need(lambda v: v.lower() not in BOOLEAN or os.path.isdir(v), "takes a checkpoint "
             "directory or 'auto' (the newest complete one in --output-dir: HF's true)", "resume")
        return out

    def resume_conflicts(self, saved: "Config", saved_world: int, world: int) -> tuple:
        """(refused changes from the checkpoint's settings, harmless ones): '--x new (was old)'."""
        def fmt(name):
            new, old = (preview(getattr(c, name)) for c in (self, saved))
            return f"{flag(name)} {new} (was {old})"
        differ = [f.name for f in fields(self) if getattr(self, f.name) != getattr(saved, f.name)]
        bad = [fmt(n) for n in differ if n not in MAY_CHANGE]
        batch, was = (c.batch_size * c.grad_accum for c in (self, saved))
        if batch * world != was * saved_world:
            bad.append(f"global batch {self.batch_size} x {self.grad_accum} x {world} ranks (was "
                       f"{saved.batch_size} x {saved.grad_accum} x {saved_world})")
        fine = [n for n in differ if n in MAY_CHANGE and n not in ("resume", "output_dir")]
        return bad, [fmt(n) for n in fine]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    def save(self, directory: str):
        """<directory>/config.train.json: saved with every run, checkpoint and final model."""
        os.makedirs(directory, exist_ok=True)
        write_lines(os.path.join(directory, FILE), [self.to_json()])

    @classmethod
    def load(cls, directory: str) -> "Config":
        """A saved run's settings; UsageError naming the file (and field) when unreadable."""
        path = os.path.join(directory, FILE)
        try:
            with open(path) as f:
                saved = json.load(f, object_pairs_hook=unique_keys)
        except (OSError, ValueError) as e:
            raise UsageError(f"{path}: cannot read it: {e}") from None
        if not isinstance(saved, dict):
            raise UsageError(f"{path}: expected a JSON object of settings, got "
                             f"{type(saved).__name__}")
        problems, by_name = [], cls.__dataclass_fields__
        for key, value in saved.items():
            try:
                saved[key] = checked_value(by_name[key], value) if key in by_name else value
            except ValueError as e:
                problems.append(f"{path}: {e}")
        check(problems)
        return cls.from_dict(saved)

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


MAY_CHANGE = Config.names_with("change")


def flag(name: str) -> str:
    """A field's flag: --its-name."""
    return "--" + name.replace("_", "-")


def kind(f) -> type:
    """A field's value type: float for `Optional[float]`."""
    return ([t for t in get_args(f.type) if t is not type(None)] or [f.type])[0]


def unique_keys(pairs: list) -> dict:
    """json's object_pairs_hook refusing a key given twice."""
    twice = [k for k, n in collections.Counter(k for k, _ in pairs).items() if n > 1]
    if twice:
        raise ValueError(f"key {preview(twice[0])} given twice")
    return dict(pairs)


def checked_value(f, value):
    """value for field f as read from a file; ValueError saying why when it does not fit."""
    want = kind(f)
    if value is None and f.default is None:  # auto
        return value
    if want is float and type(value) in (int, str):  # `lr: 1`; YAML 1.1 reads 1e-5 as a string
        with contextlib.suppress(ValueError, OverflowError):
            value = float(value)
    if type(value) is not want:  # type(), not isinstance: a bool is an int to isinstance
        raise ValueError(f"'{f.name}' must be {want.__name__}, got {type(value).__name__} "
                         f"{preview(value)}")
    if f.metadata.get("choices") and value not in f.metadata["choices"]:
        raise ValueError(f"'{f.name}' must be one of {f.metadata['choices']}, got {preview(value)}")
    return value
