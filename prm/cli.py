"""Config's command line (its fields as flags, also under underscore and TRL's / HF's names;
one-line errors) and its --config files (YAML or JSON)."""
import argparse
import difflib
import json
import os
import re
import sys
from dataclasses import fields

import yaml

from prm.config import Config, boolean, checked_value, flag, kind, preview, unique_keys
from prm.errors import UsageError, check


# every TRL/HF name of a field: {name: (field, its Conv or None)}; a name shared with TRL needs
# no entry
ALIASES = {getattr(t, "name", t): (f.name, None if isinstance(t, str) else t)
           for f in fields(Config) for t in f.metadata["trl"]}
# TRL / HF flags left out on purpose, with what to do instead
UNSUPPORTED = {name: why for names, why in [
    ("push_to_hub hub_model_id hub_token", "upload <output-dir>/final yourself (hf upload)"),
    ("deepspeed fsdp_config",
     "launch with torchrun: DDP, or --fsdp to shard weights, gradients and AdamW state (FSDP2)"),
    ("do_train do_eval do_predict", "train.py always trains and evaluates (--eval-every for more "
     "often); eval.py scores a saved model"),
    ("optim lr_scheduler_kwargs", "the optimizer is AdamW (--adam-beta1, --adam-beta2, "
     "--adam-epsilon, --weight-decay); the schedule is --lr-scheduler-type"),
    ("load_in_4bit load_in_8bit", "no quantized base: --lora-base-dtype bf16 halves its memory"),
    ("use_rslora use_dora lora_modules_to_save", "LoRA here is plain LoRA; the head trains fully"),
    ("max_prompt_length", "prompts are kept whole: --max-length caps the example, "
     "--max-completion-length its steps"),
    ("attn_implementation", "attention is chosen per device (SDPA; varlen flash with --packing)"),
] for name in names.split()}


class Setter(argparse.Action):
    """Sets its field to convert(value). nargs "?": a switch as HF's (`--x`, `--x false`,
    `--no-x`); 0: one taking no value. A false switch leaves a value in keep alone (see Conv)."""

    def __init__(self, option_strings, dest, *, convert, keep=(), **kw):
        if kw.get("nargs") in ("?", 0):
            option_strings = option_strings + ["--no-" + s[2:] for s in option_strings]
        if kw.get("nargs") == "?":
            kw.update(const="true", metavar="BOOL")
        super().__init__(option_strings, dest, **kw)
        self.convert, self.keep = convert, keep

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            if self.nargs in ("?", 0):  # a switch
                on = boolean("true" if self.nargs == 0 else values)
                values = on != option_string.startswith("--no-")
                current = getattr(namespace, self.dest, None)
                if not values and current in self.keep:
                    return
                if values and current in self.keep:  # `--bf16 --fp16`, as HF
                    raise ValueError("at most one of fp16 and bf16 can be true "
                                     f"({self.dest} is {current} already)")
            setattr(namespace, self.dest, self.convert(values))
        except ValueError as e:
            raise argparse.ArgumentError(self, str(e)) from None


def nearest(name: str, names: list):
    """The name a typo meant: difflib's closest whose words each near one of name's, or None."""
    def words(text: str) -> list:
        return [w for w in re.split(r"[-_]+", text.lower()) if w]

    def near(typed: str, word: str) -> bool:  # 'eps' for 'epsilon', 'lenght' for 'length'
        return word.startswith(typed) or difflib.SequenceMatcher(None, typed, word).ratio() >= 0.75
    return next((c for c in difflib.get_close_matches(name, names, n=5)
                 if all(any(near(t, w) for w in words(c)) for t in words(name))), None)


class Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an empty or escaped string default as its repr ('\\n'), not as a line break, a tuple
    as a comma list, a required flag as required."""

    def _get_help_string(self, action):
        text, default = super()._get_help_string(action), action.default
        if action.required:
            return (action.help or "") + " (required)"
        if isinstance(default, str) and not (default and default.isprintable()):
            return text.replace(" (default: %(default)s)", " (default: %(default)r)")
        if isinstance(default, tuple):  # a comma list, as typed
            return text.replace("%(default)s", ",".join(map(str, default)))
        return text


class Parser(argparse.ArgumentParser):
    """A bad flag raises a one-line UsageError: an unsupported TRL/HF flag says what to do
    instead, an unknown one names the nearest flag, a bad value its field's flag; a field set
    under two names is refused. No abbreviations: with the aliases, a prefix often fits several."""

    def __init__(self, usage: str = "%(prog)s [options]", **kw):
        kw.setdefault("formatter_class", Formatter)
        super().__init__(usage=usage, allow_abbrev=False, **kw)

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        parsed = super().parse_known_args(args, namespace)
        # {a field's flag: the first of its names given}; one name given twice: the last wins
        used = {}
        for arg in (a.split("=")[0] for a in args if a.startswith("--")):
            target = getattr(self._option_string_actions.get(arg), "flag", None)
            name = arg.replace("--no-", "--", 1)  # a switch's --no- form is its own name
            if target and used.setdefault(target, name) != name:
                raise UsageError(f"{used[target]} and {name} both set {target}: give one")
        return parsed

    def error(self, message: str):
        # "argument --batch_size/--per_device_train_batch_size: ...": named as --help lists it
        bad = re.fullmatch(r"argument ([^/:]+)[^:]*: (.*)", message, re.S)
        action = self._option_string_actions.get(bad[1]) if bad else None
        if hasattr(action, "flag"):
            raise UsageError(f"argument {action.flag}: {bad[2]}")
        unknown = [a for a in message.split()[2:] if a.startswith("-")]
        given = unknown[0].split("=")[0] if unknown and "unrecognized" in message else ""
        why = UNSUPPORTED.get(given.lstrip("-").replace("-", "_"))
        if why:
            raise UsageError(f"{given} is not supported: {why}")
        near = nearest(given, list(self._option_string_actions))
        if near:
            action = self._option_string_actions[near]
            shown = next((a for a in self._actions
                          if a.dest == action.dest and a.help != argparse.SUPPRESS), action)
            message += f" (did you mean {' / '.join(shown.option_strings)}?)"
        raise UsageError(message)


def add_field(container, f, *, suppress: bool = False, switch_value: bool = True,
              help: str = None):
    """Field f (prm.config.opt) as --its-name on container (a parser or group); a Config field
    also under its underscore spelling and `trl` names (--help lists the dashed ones). suppress:
    an absent flag sets nothing. switch_value False: a switch takes no true/false, so a positional
    may follow it. help: another text (argparse.SUPPRESS: hidden)."""
    meta = {k: v for k, v in f.metadata.items() if k in ("help", "choices", "type", "required")}
    meta.update({} if help is None else {"help": help})
    # None is auto: a flag that takes the word auto shows it
    default = "auto" if f.default is None and "auto" in meta.get("choices", ()) else f.default
    default = argparse.SUPPRESS if suppress or default is None else default
    if kind(f) is bool:
        meta.update(action=Setter, convert=bool, nargs="?" if switch_value else 0)
    else:
        meta.setdefault("type", kind(f))
    trl = f.metadata.get("trl")
    plain = [f.name] + [t for t in trl or () if isinstance(t, str)]
    dashed = list(dict.fromkeys(map(flag, plain)))
    # flag: how errors name the field, whichever of its names was given
    container.add_argument(*dashed, **meta, dest=f.name, default=default).flag = dashed[0]
    hidden = dict(dest=f.name, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    underscored = [s for s in ("--" + n for n in plain) if s not in dashed and trl is not None]
    if underscored:
        container.add_argument(*underscored, **{**meta, **hidden}).flag = dashed[0]
    for conv in (t for t in trl or () if not isinstance(t, str)):
        spellings = dict.fromkeys(["--" + conv.name, flag(conv.name)])
        container.add_argument(*spellings, action=Setter, convert=conv.convert, nargs=conv.nargs,
                               keep=conv.keep, **hidden)


def add_fields(parser, cls, **kw) -> argparse.ArgumentParser:
    """Each field of the dataclass cls as a flag (add_field with kw); a `section` starts a group."""
    group = parser
    for f in fields(cls):
        if "section" in f.metadata:
            group = parser.add_argument_group(f.metadata["section"])
        add_field(group, f, **kw)
    return parser


def parsed(cls, args):
    """The dataclass cls of a command line parsed with add_fields(parser, cls)."""
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def writable(path: str) -> bool:
    """Whether path's nearest existing part is a writable folder (or path itself)."""
    target = part = os.path.abspath(path)
    while not os.path.exists(part):
        part = os.path.dirname(part)
    return (part == target or os.path.isdir(part)) and os.access(part, os.W_OK)


class BoundedLoader(yaml.SafeLoader):
    """SafeLoader refusing a key given twice and over 20 aliases (a 'billion laughs' bomb)."""
    aliases = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > 20:
                raise yaml.MarkedYAMLError(problem="more than 20 aliases (*name)",
                                           problem_mark=self.peek_event().start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen = set()
        # a merge (<<: *base) may repeat a key: the mapping's own one wins
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key = self.construct_object(key_node)
                if key in seen:
                    raise yaml.MarkedYAMLError(problem=f"key {preview(key)} given twice",
                                               problem_mark=key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep)


def yaml_problem(e: yaml.YAMLError) -> str:
    """A PyYAML error on one line: where (line, column) and what."""
    at = lambda mark: f"line {mark.line + 1}, column {mark.column + 1}"
    if getattr(e, "problem_mark", None) is None or not e.problem:
        return " ".join(str(e).split())
    context = f" ({e.context} at {at(e.context_mark)})" if e.context and e.context_mark else ""
    return f"{at(e.problem_mark)}: {e.problem}{context}"


def read_config_file(path: str) -> dict:
    """{field: value} from a YAML or JSON file keyed by any of the flags' spellings."""
    def fail(what: str):
        raise UsageError(f"--config {path}: {what}")
    if os.path.exists(path) and not os.path.isfile(path):  # a FIFO would block open() for ever
        fail("not a regular file")
    try:
        with open(path, encoding="utf-8") as f:
            if path.endswith(".json"):
                data = json.load(f, object_pairs_hook=unique_keys)
            else:
                data = yaml.load(f, BoundedLoader)
    except yaml.YAMLError as e:
        fail(yaml_problem(e))
    except (OSError, ValueError, RecursionError) as e:  # json's decode error: a ValueError
        fail(str(e))
    if not isinstance(data, dict):
        return {} if data is None else fail(
            f"expected a mapping of settings, got {type(data).__name__}")
    by_name, out, settled_later = Config.__dataclass_fields__, {}, []
    for key, value in data.items():
        plain = str(key).replace("-", "_")
        name, conv = ALIASES.get(plain, (plain, None))
        if name in UNSUPPORTED and value in (None, False):  # `push_to_hub: false` asks nothing
            continue
        if name in UNSUPPORTED:
            fail(f"'{key}' is not supported: {UNSUPPORTED[name]}")
        if name not in by_name:
            near = nearest(name, list(by_name) + list(ALIASES))
            meant = f" (did you mean '{ALIASES.get(near, (near,))[0]}'?)" if near else ""
            fail(f"unknown key {preview(key)}{meant}")
        try:
            on = boolean(value) if conv and conv.nargs == "?" else None
            value = conv.convert(value if on is None else on) if conv else value
            value = checked_value(by_name[name], value)
        except ValueError as e:
            fail(f"'{key}': {e}" if conv else str(e))
        if on is False and conv.keep:  # `bf16: true` and `fp16: false`, in either order, mean bf16
            settled_later.append((key, name, value, conv.keep))
            continue
        if name in out:  # lr and learning_rate both given
            fail(f"'{key}' sets '{name}' a second time")
        out[name] = value
    for key, name, value, keep in settled_later:  # "not fp16" agrees with fp32 and bf16
        if out.setdefault(name, value) not in keep + (value,):
            fail(f"'{key}' sets '{name}' a second time")
    return out


def parse_config(argv=None) -> Config:
    """train.py's command line, resolved: flags given win over --config FILE, then defaults."""
    p = add_fields(Parser(description="Train a process reward model. Every flag also takes its "
                          "underscore spelling (--max_length) and, where it has one, TRL's name "
                          "(--learning_rate)."), Config)
    p.add_argument("--config", default="", metavar="FILE", help="YAML or JSON file of settings, "
                   "keys as in config.train.json; flags given here override it")
    unset = object()  # left alone by argparse when its flag is absent
    ns = argparse.Namespace(**{a.dest: unset for a in p._actions if a.dest != "help"})
    ns = p.parse_args(argv, ns)
    # the flags written, not the defaults
    given = {k: v for k, v in vars(ns).items() if v is not unset}
    path = given.pop("config", "")
    from_file = read_config_file(path) if path else {}
    for key in ("overwrite", "trust_remote_code", "resume"):  # command line only
        if from_file.pop(key, False):
            print(f"note: --config {path}: {key} ignored: only {flag(key)} on the command line "
                  "sets it", file=sys.stderr)
    cfg = Config(**{**from_file, **given}).resolve()
    out_ok = cfg.output_dir and writable(cfg.output_dir) and not os.path.isfile(cfg.output_dir)
    check([] if out_ok else [f"--output-dir {cfg.output_dir}: not a writable folder"])
    return cfg
