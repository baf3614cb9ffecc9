"""opt() fields as flags, and train.py's --config files; TRL's names for both."""
import argparse
import copy
import difflib
import os
import re
import sys
from dataclasses import fields

from prm.config import Config, boolean, checked_value, flag, kind, preview, read_mapping
from prm.errors import UsageError


# {TRL name: (field, its Converted or None)}
ALIASES = {getattr(t, "name", t): (f.name, None if isinstance(t, str) else t)
           for f in fields(Config) for t in f.metadata["trl"]}
# TRL / HF flags refused: the alternative
UNSUPPORTED = {name: why for names, why in [
    ("push_to_hub hub_model_id hub_token", "upload final/ yourself"),
    ("deepspeed fsdp_config", "use torchrun (DDP) or --fsdp"),
    ("do_train do_eval do_predict", "train.py always does both"),
    ("optim lr_scheduler_kwargs", "AdamW only; see --lr-scheduler-type"),
    ("load_in_4bit load_in_8bit", "try --lora-base-dtype bf16"),
    ("use_rslora use_dora lora_modules_to_save", "plain LoRA only"),
    ("max_prompt_length", "see --max-completion-length"),
    ("attn_implementation", "chosen per device"),
] for name in names.split()}


class Given(argparse.Action):
    """Appends (name given, field, value) to `given`; a switch's value is a bool."""

    def __call__(self, parser, namespace, values, option_string=None):
        name = option_string or self.dest
        if self.type is boolean:  # a switch; values: a bool, or [] for nargs 0
            on = values is not False
            values, name = on != name.startswith("--no-"), name.replace("--no-", "--", 1)
        namespace.given.append((name, self.dest, values))


def hint(name: str, names: list) -> str:
    """' (did you mean X?)', X the closest name with words near name's, or ''."""
    def words(text: str) -> list:
        return re.findall(r"[^-_]+", text.lower())

    def near(typed: str, word: str) -> bool:  # 'eps' for 'epsilon', 'lenght' for 'length'
        return word.startswith(typed) or difflib.SequenceMatcher(None, typed, word).ratio() >= 0.75
    best = next((c for c in difflib.get_close_matches(name, names, n=5)
                 if all(any(near(t, w) for w in words(c)) for t in words(name))), None)
    return f" (did you mean {best}?)" if best else ""


class Formatter(argparse.HelpFormatter):
    """Underscore spellings hidden; defaults as typed ('auto', 1,4,16, '\\n')."""

    def _format_action_invocation(self, action):
        shown = copy.copy(action)
        shown.option_strings = [s for s in action.option_strings if "_" not in s]
        return super()._format_action_invocation(shown)

    def _get_help_string(self, action):
        default = action.default
        if default is None and "auto" in (action.choices or ()):
            default = "auto"
        if default in (None, argparse.SUPPRESS, ()) or action.required:  # required: a positional
            return action.help
        if isinstance(default, tuple):
            default = ",".join(map(str, default))
        elif default == "" or not str(default).isprintable():
            default = repr(default)
        return f"{action.help} (default: {str(default).replace('%', '%%')})"


class Parser(argparse.ArgumentParser):
    """opt() fields as flags; no abbreviations: aliases share prefixes."""

    def __init__(self, *classes, usage: str = None, **kw):
        own = [f for cls in classes for f in fields(cls)]
        needed = [flag_of(f) + " " + f.name.upper() for f in own if f.metadata.get("required")]
        self.bare = [f.name for f in own if f.metadata.get("positional")]
        super().__init__(usage=usage or " ".join(["%(prog)s", *needed, *self.bare, "[options]"]),
                         allow_abbrev=False, formatter_class=Formatter, **kw)
        self.fields = {}
        for cls in classes:
            self.add_fields(cls)

    def add_fields(self, cls, names=None, group=None):
        section = group or self
        for f in fields(cls):
            if "help" in f.metadata and (names is None or f.name in names):
                if "section" in f.metadata and group is None:
                    section = self.add_argument_group(f.metadata["section"])
                self.add_field(section, f, shown=group is None)
                self.fields[f.name] = f

    def add_field(self, group, f, shown: bool):
        """One action for a flag's spellings; one, hidden, per converting TRL name."""
        m = f.metadata
        kw = {k: m[k] for k in ("help", "choices", "type", "nargs", "metavar") if k in m}
        required = m.get("required")  # checked after unknown flags
        kw["help"] += " (required)" if required else ""
        kw.update(action=Given, default=f.default if shown and not required else argparse.SUPPRESS)
        if kind(f) is bool:  # positionals: `--skip-invalid INPUT` takes no value
            kw.update(nargs=0 if self.bare else "?", const=True, metavar="BOOL", type=boolean)
        elif kind(f) is tuple:  # 1,4,16, or with nargs a word an item
            kw.setdefault("type", str if "nargs" in kw else comma_list(type(f.default[0])))
        else:
            kw.setdefault("type", kind(f))
        dest = m.get("dest", f.name)
        if m.get("positional"):
            group.add_argument(dest, **kw)
            return
        kw["dest"] = dest
        names = [m.get("flag", "--" + f.name)[2:]] + [t for t in m["trl"] if isinstance(t, str)]
        spelled = [([*map(flag, names), *("--" + n for n in names)], kw)]
        for c in m["trl"]:
            if not isinstance(c, str):
                more = dict(kw, default=argparse.SUPPRESS, help=argparse.SUPPRESS, nargs=c.nargs,
                            type=boolean if c.nargs == "?" else str, const=True, choices=None)
                spelled.append(([flag(c.name), "--" + c.name], more))
        for spellings, more in spelled:
            spellings = list(dict.fromkeys(spellings))
            if more["type"] is boolean:
                spellings += ["--no-" + s[2:] for s in spellings]
            group.add_argument(*spellings, **more)

    def parse_args(self, args=None, namespace=None):
        ns = super().parse_args(args, argparse.Namespace(given=[]))
        ns.given = translate(ns.given, self.fields)
        vars(ns).update(ns.given)
        missing = [flag_of(f) for f in self.fields.values()
                   if f.metadata.get("required") and f.name not in ns.given]
        if missing:
            raise UsageError(f"{', '.join(missing)} {'are' if missing[1:] else 'is'} required")
        return ns

    def error(self, message: str):
        message = re.sub(r"^(argument [^/:]+)[^:]*", r"\1", message)  # its first spelling only
        unknown = re.search(r"unrecognized arguments:.*? (-[^\s=]*)", message)
        given = unknown[1] if unknown else ""
        why = UNSUPPORTED.get(given.lstrip("-").replace("-", "_"))
        if why:
            raise UsageError(f"{given} is not supported: {why}")
        raise UsageError(message + hint(given, self._option_string_actions))


def flag_of(f) -> str:
    return f.metadata.get("flag", flag(f.name))


def comma_list(kind):
    def comma_list(text: str) -> tuple:  # argparse's error names it
        return tuple(kind(x.strip()) for x in text.split(","))
    return comma_list


def translate(pairs: list, known: dict, where: str = "") -> dict:
    """{field: value} of (name given, field, value); where: '--config FILE: ', checks values."""
    def fail(what: str):
        raise UsageError(where + what)
    out, named = {}, {}
    for name, dest, value in pairs:
        plain = name.strip("'-").replace("-", "_")
        if plain in UNSUPPORTED:
            if value in (None, False):  # `push_to_hub: false` in a file
                continue
            fail(f"{name} is not supported: {UNSUPPORTED[plain]}")
        dest, conv = ALIASES.get(plain, (dest, None))
        if dest not in known:
            fail(f"unknown key {name}" + hint(plain, [*known, *ALIASES]))
        try:
            if conv:
                value = conv.convert(boolean(value) if conv.nargs == "?" else value)
            value = checked_value(known[dest], value) if where else value
        except ValueError as e:
            fail(f"{name}: {e}" if conv else str(e))
        keep = conv.keep if conv else ()
        if out.get(dest) in keep:  # `--bf16 --fp16 false`: bf16
            if value != "fp32":
                fail(f"{name} and {out[dest]} both true: give one")
            continue
        if not keep and named.setdefault(dest, name) != name:
            fail(f"{named[dest]} and {name} both set {flag(dest)}: give one")
        out[dest] = value
    return out


def parsed(cls, args):
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


def writable(path: str) -> bool:
    target = part = os.path.abspath(path)
    while not os.path.exists(part):
        part = os.path.dirname(part)
    return (part == target or os.path.isdir(part)) and os.access(part, os.W_OK)


def parse_config(argv=None) -> Config:
    """train.py's command line, resolved."""
    p = Parser(Config, description="Train a process reward model. Flags also take underscores "
               "(--max_length) and TRL's names (--learning_rate).")
    p.add_argument("--config", default="", metavar="FILE",
                   help="YAML/JSON settings as in config.train.json; flags override them")
    args = p.parse_args(argv)
    where = f"--config {args.config}: "
    data = read_mapping(args.config, where) if args.config else {}
    pairs = [(preview(k), str(k).replace("-", "_"), v) for k, v in data.items()]
    from_file = translate(pairs, Config.__dataclass_fields__, where)
    for key in ("overwrite", "trust_remote_code", "resume"):
        if from_file.pop(key, False):
            print(f"note: {where}{key} ignored: command line only", file=sys.stderr)
    cfg = Config(**{**from_file, **args.given}).resolve()
    if not (cfg.output_dir and writable(cfg.output_dir)) or os.path.isfile(cfg.output_dir):
        raise UsageError(f"--output-dir {cfg.output_dir}: not a writable folder")
    return cfg
