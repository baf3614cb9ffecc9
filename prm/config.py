"""Every training/eval setting as an opt() field; prm.cli makes them flags."""
import contextlib
import dataclasses
import json
import math
import os
import reprlib
from dataclasses import dataclass, field, fields
from typing import Callable, NamedTuple, Optional, get_args

import yaml

from prm.errors import UsageError, check
from prm.files import write_lines

FILE = "config.train.json"
FORMATS = ["auto", "pretokenized", "stepwise", "math_shepherd", "prm800k", "processbench",
           "candidates", "prmbench", "mrben"]
SCHEDULES = ["linear", "cosine", "cosine_with_min_lr", "constant", "constant_with_warmup"]
# change: a resume may change it; rows: it shapes the rows read; scoring: eval.py takes it
RULES = {"change", "rows", "scoring"}
AUTO = (0, "auto")  # still auto (None)
BOOLEAN = ("true", "false", "yes", "no", "1", "0")
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 3, 200, 200


def unescape(text: str) -> str:
    """`--step-separator '\\n'` is a newline."""
    return text.encode("utf-8").decode("unicode_escape").encode("latin-1").decode("utf-8")


def boolean(value) -> bool:
    text = str(value).lower()
    if text not in BOOLEAN:
        raise ValueError(f"expected true or false, got {preview(value)}")
    return text in ("true", "yes", "1")


def preview(value) -> str:
    text = _SHORT.repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


class Converted(NamedTuple):
    """A TRL name set through convert(); nargs "?": switch, "+": list; keep: see translate."""
    name: str
    convert: Callable
    nargs: Optional[str] = None
    keep: tuple = ()


def torch_dtype(name: str) -> str:
    names = {"auto": "auto", "bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
    if name not in names:
        raise ValueError(f"expected one of {', '.join(names)}, got {preview(name)}")
    return names[name]


def target_list(value) -> str:
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"expected module names, got {preview(value)}")
    return "*" if names == ["all-linear"] else ",".join(names)


def opt(default=None, help: str = "", *, rules: str = "", trl=(), check=(), like=None, **kw):
    """A field and its flag. kw: argparse's, section, flag, positional. like: a field to copy."""
    assert set(rules.split()) <= RULES, rules
    meta = dict(help=help, rules=frozenset(rules.split()), trl=trl, check=check, **kw)
    if like is not None:
        default, meta = like.default, {**like.metadata, **{k: v for k, v in meta.items() if v}}
    return field(default=default, metadata=meta)


def bound(test: Callable, why: str) -> tuple:
    return ((test, why),)


def at_least(n) -> tuple:
    return bound(lambda v: v >= n, f"must be >= {n}")


def within(lo, hi, ends: str = "[]") -> tuple:
    def test(v) -> bool:
        return (lo <= v if ends[0] == "[" else lo < v) and (v <= hi if ends[1] == "]" else v < hi)
    return bound(test, f"must be in {ends[0]}{lo}, {hi}{ends[1]}")


def not_empty(why: str) -> tuple:
    return bound(lambda v: v != "", "must not be empty: " + why)


FINITE = bound(lambda v: math.isfinite(v) and v >= 0, "must be finite and >= 0")
WHOLE = bound(lambda v: v % 1 == 0, "must be a whole number (or a ratio below 1)")  # inf % 1: nan
LARGEST = 2 ** 24  # beyond: index lists overflow
COUNT = at_least(0)


def field_problems(options) -> list:
    out = []
    for f in fields(options):
        value = getattr(options, f.name)
        for test, why in f.metadata.get("check", ()):
            for v in value if isinstance(value, (tuple, list)) else [value]:
                if v is not None and not test(v):  # None: auto
                    out.append(f"{flag(f.name)} {preview(v)}: {why}")
    return out


class Checked:
    def __post_init__(self):
        check(field_problems(self))


def _switch(name: str, other: str) -> Converted:
    """TRL's --bf16 / --fp16 [BOOL]: false is fp32 (or the other)."""
    return Converted(name, lambda on: name if on else "fp32", "?", keep=(other,))


@dataclass
class Config:
    model: str = opt(
        "tiny", "hub id, folder or 'tiny'", trl=("model_name_or_path",), section="model and data")
    tokenizer: str = opt("", "default: the model's", rules="scoring")
    dataset: str = opt(
        "synthetic", "hub id, .jsonl/.json/.parquet or folder", rules="rows", trl=("dataset_name",))
    eval_dataset: str = opt("", "held out; default: --eval-split/--eval-fraction", rules="rows")
    dataset_config: str = opt("", "hub dataset config", rules="scoring")
    train_split: str = opt("train", "training split", rules="rows", trl=("dataset_train_split",))
    eval_split: str = opt(
        "test", "eval split, if present", rules="rows scoring", trl=("dataset_test_split",))
    eval_fraction: float = opt(
        0.05, "held out by prompt if no eval split", rules="rows", check=within(0, 1, "()"))
    format: Optional[str] = opt(None, "auto: by the columns", rules="rows scoring", choices=FORMATS)
    eval_format: Optional[str] = opt(None, "--eval-dataset's format", rules="rows", choices=FORMATS)
    neutral_label: str = opt(
        "negative", "PRM800K's rating 0 (drop: unlabeled context)", rules="rows scoring",
        choices=["positive", "negative", "drop"])
    skip_invalid: bool = opt(False, "drop invalid rows (counted), not exit 2", rules="rows scoring")
    num_proc: Optional[int] = opt(
        None, "tokenizing processes; default/0: up to 8 from 20k rows, else 1",
        rules="change scoring", trl=("dataset_num_proc",), check=COUNT)
    synthetic_size: int = opt(32000, "synthetic dataset rows", check=at_least(1))
    output_dir: str = opt("out", "for metrics.jsonl, checkpoints and final/", rules="change")
    overwrite: bool = opt(False, "replace --output-dir's run (command line only)", rules="change")
    max_length: int = opt(
        1024, "tokens per example (whole steps kept)", rules="scoring",
        section="tokenization", check=at_least(1))
    max_completion_length: int = opt(0, "cap on step tokens; 0: none", rules="scoring", check=COUNT)
    step_separator: str = opt(
        "\n", "ends each step (\\n read); its last token carries the label", rules="scoring",
        type=unescape, check=not_empty("it carries the label"))
    train_on_last_step_only: bool = opt(False, "the last step's label only")
    cut_after_first_error: bool = opt(False, "drop steps after the first wrong one", rules="rows")
    max_steps: int = opt(
        -1, "optimizer steps; -1: --epochs passes", rules="change", section="optimization",
        check=bound(lambda v: v == -1 or v >= 1, "must be -1 or >= 1"))
    epochs: float = opt(  # below 2^31: no overflow
        1.0, "passes if --max-steps is -1 (the last batch filled with repeats)", rules="change",
        trl=("num_train_epochs",), check=within(0, 2 ** 31, "()"))
    batch_size: Optional[int] = opt(
        None, "per device and micro-batch; default/0: 32 for 'tiny', else 8", rules="change",
        trl=("per_device_train_batch_size",), check=within(0, LARGEST))
    grad_accum: int = opt(
        1, "micro-batches per optimizer step", rules="change", trl=("gradient_accumulation_steps",),
        check=within(1, LARGEST))
    lr: Optional[float] = opt(
        None, "peak AdamW lr; default/0: 1e-3 for 'tiny', 1e-4 with LoRA, else 1e-5",
        trl=("learning_rate",), check=FINITE)
    lr_scheduler_type: str = opt(
        "cosine_with_min_lr", "HF's decay; cosine_with_min_lr: to 10%%", choices=SCHEDULES)
    warmup_steps: float = opt(0, "linear warmup steps; below 1: a ratio", check=COUNT + WHOLE)
    warmup_ratio: float = opt(0.0, "warmup share if --warmup-steps is 0", check=within(0, 1))
    weight_decay: float = opt(0.0, "AdamW weight decay", check=FINITE)
    adam_beta1: float = opt(0.9, "AdamW beta1", check=within(0, 1, "[)"))
    adam_beta2: float = opt(0.95, "AdamW beta2 (HF's: 0.999)", check=within(0, 1, "[)"))
    adam_epsilon: float = opt(1e-8, "AdamW epsilon", check=FINITE)
    max_grad_norm: float = opt(1.0, "gradient clipping norm; 0: none", rules="change", check=FINITE)
    dtype: Optional[str] = opt(
        None, "autocast; auto: bf16 where native (or TRL's --bf16/--fp16/--torch_dtype)",
        rules="scoring", choices=["auto", "fp32", "bf16", "fp16"],
        trl=(_switch("bf16", "fp16"), _switch("fp16", "bf16"),
             Converted("torch_dtype", torch_dtype)))
    gradient_checkpointing: bool = opt(False, "recompute activations: less memory", rules="change")
    fsdp: bool = opt(False, "under torchrun: FSDP2 sharding, not DDP")
    group_by_length: bool = opt(True, "batch similar lengths (seeded)")
    compile: bool = opt(False, "torch.compile the model", rules="change", trl=("torch_compile",))
    packing: bool = opt(
        True, "padding-free (decoders): examples back to back", rules="change scoring")
    pack_to: int = opt(0, "pad packed rows to a multiple of N tokens", rules="change", check=COUNT)
    seed: int = opt(0, "for init, data order and dropout", rules="rows scoring")
    disable_dropout: bool = opt(True, "no backbone dropout, as TRL")
    lora_r: int = opt(
        0, "rank; 0: train every weight", check=COUNT, section="LoRA (the head trains fully)")
    use_peft: Optional[bool] = opt(
        None, "TRL's: LoRA (rank 16 if --lora-r 0) or not; unset: by --lora-r", rules="change")
    lora_alpha: Optional[float] = opt(None, "scale alpha/r; default/0: 2 x --lora-r", check=FINITE)
    lora_dropout: float = opt(0.0, "dropout on the LoRA input", check=within(0, 1, "[)"))
    lora_targets: str = opt(
        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        "linear layer globs (or TRL's --lora_target_modules)",
        trl=(Converted("lora_target_modules", target_list, "+"),))
    lora_base_dtype: str = opt(
        "fp32", "frozen base's dtype; bf16 needs bf16 autocast", choices=["fp32", "bf16"])
    eval_every: int = opt(
        0, "eval every N steps; 0: at the end", rules="change", trl=("eval_steps",),
        section="evaluation, logging, checkpoints", check=COUNT)
    eval_strategy: Optional[str] = opt(
        None, "steps: every --eval-every or --log-every; default: steps if --eval-every",
        rules="change", choices=["steps", "epoch", "no"])
    eval_batch_size: Optional[int] = opt(
        None, "per device; default/0: 2 x --batch-size", rules="change scoring",
        trl=("per_device_eval_batch_size",), check=COUNT)
    threshold: float = opt(
        0.5, "a step is correct at P(correct) >= this", rules="change scoring", check=within(0, 1))
    log_every: int = opt(
        10, "log every N steps", rules="change", trl=("logging_steps",), check=at_least(1))
    disable_tqdm: bool = opt(False, "no progress bars", rules="change scoring")
    report_to: str = opt(
        "none", "also to TensorBoard/W&B", rules="change", choices=["none", "tensorboard", "wandb"])
    run_name: str = opt("", "TensorBoard/W&B name; default: --output-dir's", rules="change")
    save_every: int = opt(
        0, "checkpoint every N steps; 0: never", rules="change", trl=("save_steps",), check=COUNT)
    save_strategy: Optional[str] = opt(
        None, "steps: every --save-every or 500; default: steps if --save-every",
        rules="change", choices=["steps", "epoch", "no"])
    keep_last: int = opt(
        2, "checkpoints kept; 0: all", rules="change", trl=("save_total_limit",), check=COUNT)
    resume: str = opt(
        "", "checkpoint folder or 'auto': the newest (command line only)", rules="change",
        trl=("resume_from_checkpoint",), check=bound(
            lambda v: v.lower() not in BOOLEAN or os.path.isdir(v), "takes a folder or 'auto'"))
    trust_remote_code: bool = opt(
        False, "run hub models' own code (command line only)", rules="change scoring")

    def __post_init__(self):
        for f in fields(self):  # use_peft False is no 0
            if f.default is None and kind(f) is not bool and getattr(self, f.name) in AUTO:
                setattr(self, f.name, None)
        if 0 < self.warmup_steps < 1:  # a ratio, as transformers 5
            self.warmup_ratio, self.warmup_steps = self.warmup_steps, 0

    @classmethod
    def names_with(cls, rule: str) -> tuple:
        return tuple(f.name for f in fields(cls) if rule in f.metadata["rules"])

    def resolve(self) -> "Config":
        """A checked copy; auto (None) fields filled but dtype, num_proc, format."""
        check(self.problems())
        tiny, lora_r = self.model == "tiny", self.lora_rank()
        batch = self.batch_size or (32 if tiny else 8)
        # as HF: strategy steps, no interval: eval every --log-every, save every 500
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
        """As TRL: use_peft false: 0; true without a rank: 16."""
        return 0 if self.use_peft is False else self.lora_r or 16 * bool(self.use_peft)

    def every(self, kind: str, steps_per_epoch: int) -> int:
        """Steps between evals or saves (kind "eval"/"save"); 0: none."""
        steps = {"steps": getattr(self, kind + "_every"), "epoch": steps_per_epoch, "no": 0}
        return steps[getattr(self, kind + "_strategy")]

    def problems(self) -> list:
        out = field_problems(self)
        if self.fsdp and self.dtype == "fp16":
            out.append("--dtype 'fp16': not with --fsdp: use bf16")
        bf16 = self.dtype in ("bf16", None)  # autocast
        if self.lora_base_dtype == "bf16" and not (self.lora_rank() and bf16):
            out.append("--lora-base-dtype 'bf16': needs LoRA and bf16 autocast")
        if self.lr_scheduler_type == "constant" and (self.warmup_steps or self.warmup_ratio):
            out.append("--lr-scheduler-type 'constant': takes no warmup: use constant_with_warmup")
        return out

    def resume_conflicts(self, saved: "Config", saved_world: int, world: int) -> tuple:
        """(refused changes, harmless ones), each '--x new (was old)'."""
        def fmt(name):
            new, old = (preview(getattr(c, name)) for c in (self, saved))
            return f"{flag(name)} {new} (was {old})"
        differ = [f.name for f in fields(self) if getattr(self, f.name) != getattr(saved, f.name)]
        bad = [fmt(n) for n in differ if n not in MAY_CHANGE]
        batch, was = (c.batch_size * c.grad_accum for c in (self, saved))
        if batch * world != was * saved_world:
            bad.append(f"global batch {self.batch_size} x {self.grad_accum} x {world} ranks (was "
                       f"{saved.batch_size} x {saved.grad_accum} x {saved_world})")
        fine = [fmt(n) for n in differ if n in MAY_CHANGE and n not in ("resume", "output_dir")]
        return bad, fine

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    def save(self, directory: str):
        os.makedirs(directory, exist_ok=True)
        write_lines(os.path.join(directory, FILE), [self.to_json()])

    @classmethod
    def load(cls, directory: str) -> "Config":
        path = os.path.join(directory, FILE)
        saved, problems = read_mapping(path, path + ": "), []
        for f in (f for f in fields(cls) if f.name in saved):  # the rest: their defaults
            try:
                saved[f.name] = checked_value(f, saved[f.name])
            except ValueError as e:
                problems.append(f"{path}: {e}")
        check(problems)
        return cls.from_dict(saved)

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


MAY_CHANGE = Config.names_with("change")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def kind(f) -> type:  # float for Optional[float]
    return ([t for t in get_args(f.type) if t is not type(None)] or [f.type])[0]


def unique_keys(pairs: list) -> dict:  # json's object_pairs_hook
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {preview(key)} given twice")
        out[key] = value
    return out


def checked_value(f, value):
    want = kind(f)
    if value is None and f.default is None:  # auto
        return value
    if want is float and type(value) in (int, str):  # `lr: 1`; YAML 1.1 reads 1e-5 as a string
        with contextlib.suppress(ValueError, OverflowError):
            value = float(value)
    if type(value) is not want:  # type(), not isinstance: a bool is an int to isinstance
        raise ValueError(f"'{f.name}' must be {want.__name__}, got {preview(value)}")
    if f.metadata.get("choices") and value not in f.metadata["choices"]:
        raise ValueError(f"'{f.name}' must be one of {f.metadata['choices']}, got {preview(value)}")
    return value


class BoundedLoader(yaml.SafeLoader):
    """Refuses a repeated key and over 20 aliases ('billion laughs')."""
    aliases = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > 20:
                raise ValueError(f"{at(self.peek_event().start_mark)}: over 20 aliases (*name)")
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key, _ in node.value:  # a merge (<<: *base) may repeat a key
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                if key.value in seen:
                    raise ValueError(f"{at(key.start_mark)}: key {preview(key.value)} given twice")
                seen.add(key.value)
        return super().construct_mapping(node, deep)


def at(mark: yaml.Mark) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"


def yaml_problem(e: yaml.YAMLError) -> str:
    if getattr(e, "problem_mark", None) is None or not e.problem:
        return " ".join(str(e).split())
    context = f" ({e.context} at {at(e.context_mark)})" if e.context and e.context_mark else ""
    return f"{at(e.problem_mark)}: {e.problem}{context}"


def read_mapping(path: str, where: str) -> dict:
    """A .json or YAML file's mapping, else UsageError(where + why)."""
    if os.path.exists(path) and not os.path.isfile(path):  # a FIFO: open() blocks
        raise UsageError(where + "not a regular file")
    try:
        with open(path, encoding="utf-8") as f:
            data = (json.load(f, object_pairs_hook=unique_keys) if path.endswith(".json")
                    else yaml.load(f, BoundedLoader))
    except yaml.YAMLError as e:
        raise UsageError(where + yaml_problem(e)) from None
    except (OSError, ValueError, RecursionError) as e:
        raise UsageError(where + str(e)) from None
    if data is None and not path.endswith(".json"):  # an empty YAML file
        return {}
    if not isinstance(data, dict):
        raise UsageError(where + f"expected a mapping, got {type(data).__name__}")
    return data
