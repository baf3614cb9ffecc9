"""Checked, cached train/held-out rows of a hub dataset or local files."""
import contextlib
import inspect
import json
import os
import random
import re
import shutil
import sys

import datasets
from datasets import Dataset, DatasetInfo, Features, List, Value, load_dataset
from datasets.data_files import NON_WORDS_CHARS, SPLIT_KEYWORDS
from datasets.exceptions import DatasetGenerationError
from datasets.fingerprint import Hasher

from prm.config import Config
from prm.core.data import IGNORE
from prm.errors import UsageError, WriteFailed
from prm.files import digest, write_lines
from prm.readers.formats import (FORMATS, META, decode, detect_format, field_problem, format_help,
                                 read_json, to_rows)
from prm.readers.synthetic import train_eval_rows

LOCAL_EXT = (".jsonl", ".json", ".parquet")
SHOWN = 15  # problems listed in full
SHAPING = Config.names_with("rows")  # in the rows cache's key


class DataError(UsageError):
    """A "<source> <line|row> N: field 'x': ..." line per problem."""

    def __init__(self, problems: list, total_rows: int = 0):
        self.problems, self.total_rows = problems, total_rows
        head = "invalid input data:"
        if total_rows:
            head = (f"{total_rows} invalid rows (lines 1-based, rows 0-based; --skip-invalid "
                    "drops them):")
        more = [f"  ... and {len(problems) - SHOWN} more"] if len(problems) > SHOWN else []
        super().__init__("\n".join([head] + [f"  {p}" for p in problems[:SHOWN]] + more))

    def __reduce__(self):  # rank 0's error is pickled to the others
        return type(self), (self.problems, self.total_rows)


class MissingSplit(DataError):
    """No such split."""


def say(msg: str):
    if int(os.environ.get("RANK", "0")) == 0:
        print(msg, file=sys.stderr, flush=True)


def is_local(spec: str) -> bool:
    return os.path.isdir(spec) or spec.lower().endswith(LOCAL_EXT)


def read_records(path: str):
    """(where, record, problem) per row of a local file."""
    if path.lower().endswith(".parquet"):
        try:
            ds = Dataset.from_parquet(path)
        except Exception as e:
            raise DataError([f"{path}: unreadable parquet: {e}"]) from None
        return [(f"row {i}", r, None) for i, r in enumerate(ds)]
    with open(path, "rb") as f:
        text, problem, line = decode(f.read())
    if problem:
        raise DataError([f"{path} line {line}: {problem}"])
    if path.lower().endswith(".json"):
        data, problem, line = read_json(text)
        if data is None and problem and (text.lstrip().startswith("[") or line is None):
            raise DataError([f"{path}{f' line {line}' if line else ''}: {problem}"])
        pairs = [(f"row {i}", r) for i, r in enumerate(data)] if isinstance(data, list) else None
        if isinstance(data, dict) and any(data.values()) and all(
                isinstance(v, list) and all(isinstance(r, dict) for r in v) for v in data.values()):
            pairs = [(f"{k}[{i}]", r) for k, v in data.items() for i, r in enumerate(v)]
        if pairs is not None:
            return [(where, r, problem and field_problem(r)) for where, r in pairs]
        if isinstance(data, dict) and "\n" in text.strip():
            raise DataError([f"{path}: one object, not an array of records or JSON Lines"])
    # not splitlines(): U+2028 may sit raw inside a JSON string
    lines = enumerate(text.split("\n"), 1)
    return [(f"line {n}", *read_json(line)[:2]) for n, line in lines if line.strip()]


def data_files(folder: str) -> list:
    names = (f for f in os.listdir(folder) if f.lower().endswith(LOCAL_EXT))
    return sorted(os.path.join(folder, f) for f in names)


def split_files(folder: str, split: str, cfg) -> list:
    """The folder's files named for split (as datasets reads names); None if none names one."""
    paths = {os.path.basename(f): f for f in data_files(folder)}
    keywords = {str(s): set(k) for s, k in SPLIT_KEYWORDS.items()}
    ours = {cfg.train_split, cfg.eval_split, split}
    keywords.update((s, {s}) for s in ours - set().union(*keywords.values()))
    words = lambda f: set(re.split(f"[{NON_WORDS_CHARS}]+", f.lower()))
    named = {f: [s for s, k in keywords.items() if k & words(f)] for f in paths}
    unnamed = [f for f, splits in named.items() if not splits]
    if len(unnamed) == len(named):
        return None
    if unnamed:
        raise DataError([f"{folder}: {', '.join(unnamed)} named for no split, unlike the others"])
    twice = [f"{f} ({' and '.join(s)})" for f, s in named.items() if len(s) > 1]
    if twice:
        raise DataError([f"{folder}: {', '.join(twice)} named for more than one split"])
    own = next(s for s, k in keywords.items() if split in k)  # "dev" is validation's
    return [paths[f] for f, splits in named.items() if own in splits]


def sources(spec: str, split: str = "train", cfg=None, by_split: bool = False) -> list:
    """(name, [(where, record, problem)]) per file of a local spec, or of a hub split."""
    cfg = cfg or Config()
    if not is_local(spec):
        try:
            ds = load_dataset(spec, cfg.dataset_config or None, split=split)
        except Exception as e:  # offline, unknown, or a mistyped local path
            if isinstance(e, ValueError) and "split" in str(e).lower():
                raise MissingSplit([f"{spec}: {e}"]) from None
            raise DataError([f"{spec}: no local data file nor loaded from the hub "
                             f"({type(e).__name__}: {e})"]) from None
        return [(f"{spec}[{split}]", ((f"row {i}", r, None) for i, r in enumerate(ds)))]
    files = [spec]
    if os.path.isdir(spec):
        files = data_files(spec)
        if not files:
            raise DataError([f"{spec}: no {'/'.join(LOCAL_EXT)} files"])
        named = split_files(spec, split, cfg) if by_split else None
        if named == []:
            among = ", ".join(os.path.basename(f) for f in files)
            raise MissingSplit([f"{spec}: no file named for split {split!r} among {among}"])
        files = named or files
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise DataError([f"{f}: " + ("a folder" if os.path.isdir(f) else "no such file")
                         for f in missing])
    return [(f, read_records(f)) for f in files]


def read_rows(spec: str, split: str, cfg, format_key: str = "format", *, notes: list = None,
              by_split: bool = False) -> list:
    """A source's checked rows; notes gets what was read."""
    rows, problems, bad, n_records, empty, ids, repeated = [], [], 0, 0, 0, set(), 0
    forced = getattr(cfg, format_key)
    formats = {forced: f"forced by --{format_key.replace('_', '-')}"} if forced else {}
    for name, records in sources(spec, split, cfg, by_split):
        fmt = forced
        for where, record, problem in records:
            n_records += 1
            if fmt is None and isinstance(record, dict) and not problem:  # a file's first object
                fmt = detect_format(record)
                if fmt is None:
                    raise DataError([f"{name} {where}: {format_help(record)}"])
                formats.setdefault(fmt, "detected from columns " + ", ".join(FORMATS[fmt]))
            found, issues = ([], [problem]) if problem else to_rows(record, fmt, cfg.neutral_label)
            if found and rows and _shape(found[0]) != _shape(rows[0]):
                issues = [f"{_shape(found[0])} rows mixed with {_shape(rows[0])} rows"]
            if issues:
                bad += 1
                problems += [f"{name} {where}: {p}" for p in issues]
                continue
            if fmt == "pretokenized":  # so tokenization's errors name the line
                for row in found:
                    row["where"] = f"{name} {where}"
            empty += not found
            if fmt == "prmbench" and record.get("idx") is not None:  # as PRMBench: an id's first
                repeated += sum(row["id"] in ids for row in found)
                found = [row for row in found if row["id"] not in ids]
                ids.update(row["id"] for row in found)
            rows += found
    if bad and not cfg.skip_invalid:
        raise DataError(problems, total_rows=bad)
    note = f"; {empty} records gave no labeled example" if empty else ""
    if repeated:
        note += f"; dropped {repeated} rows of a PRMBench id read before, as its harness does"
    if bad:
        note += f"; skipped {bad} invalid records (--skip-invalid), the first: {problems[0]}"
    said = (f"{spec}: format {', '.join(f'{k} ({v})' for k, v in formats.items())}; "
            f"{n_records} records -> {len(rows)} examples{note}")
    say(said)
    if notes is not None:
        notes.append(said)
    if not rows:
        raise DataError([f"{spec}: no usable rows"])
    return rows


def _shape(row: dict) -> str:
    if "input_ids" in row:
        return "pre-tokenized"
    return "chat-prompt" if isinstance(row["prompt"], list) else "plain-prompt"


def to_dataset(rows: list, *, cache_dir=None, fingerprint=None, notes=None) -> Dataset:
    """An arrow-backed Dataset in cache_dir, notes in its info."""
    if "input_ids" in rows[0]:
        features = {"input_ids": List(Value("int64")), "labels": List(Value("float64")),
                    "where": Value("string")}
    else:
        soft = any(isinstance(y, float) for r in rows for y in r["labels"])
        chat = isinstance(rows[0]["prompt"], list)
        features = {"prompt": List({"role": Value("string"), "content": Value("string")})
                    if chat else Value("string"), "completions": List(Value("string")),
                    "labels": List(Value("float64" if soft else "bool"))}
    features.update({col: Value(kind) for col, kind in META.items() if any(col in r for r in rows)})

    def generate():
        for r in rows:
            yield {k: r.get(k) for k in features}
    try:
        return Dataset.from_generator(generate, features=Features(features), cache_dir=cache_dir,
                                      fingerprint=fingerprint or Hasher.hash([features, rows]),
                                      info=DatasetInfo(description=json.dumps(notes)))
    except (OSError, DatasetGenerationError) as e:  # a full disk; datasets wraps the OSError
        cause = e if isinstance(e, OSError) else e.__cause__ or e.__context__
        if not isinstance(cause, OSError):
            raise
        where = datasets.config.HF_DATASETS_CACHE
        why = cause.strerror or cause
        raise WriteFailed(f"cannot write rows to the datasets cache {where}: {why}") from None


def cut_after_first_error(row: dict) -> dict:
    """The row up to its first wrong label."""
    labels = row["labels"]
    end = next((i for i, y in enumerate(labels) if y not in (None, IGNORE) and float(y) == 0), None)
    if end is None:
        return row
    key = "completions" if "completions" in row else "input_ids"
    return {**row, key: row[key][:end + 1], "labels": labels[:end + 1]}


def read_splits(cfg, cache_dir: str = None) -> tuple:
    cut = lambda r: cut_after_first_error(r) if cfg.cut_after_first_error else r
    if cfg.dataset == "synthetic":
        train, held = train_eval_rows(cfg.synthetic_size, cfg.seed)
        return Dataset.from_list([cut(r) for r in train]), Dataset.from_list(held)
    notes, held = [], None
    read = lambda src, split, fmt="format": read_rows(src, split, cfg, fmt, notes=notes,
                                                       by_split=True)
    train = read(cfg.dataset, cfg.train_split)
    if cfg.eval_dataset:
        held = read(cfg.eval_dataset, cfg.eval_split, "eval_format")
    elif not is_local(cfg.dataset) or os.path.isdir(cfg.dataset) and split_files(
            cfg.dataset, cfg.eval_split, cfg) is not None:
        with contextlib.suppress(MissingSplit):
            held = read(cfg.dataset, cfg.eval_split)
    if held is None:  # by prompt (pre-tokenized: by row): no problem on both sides
        keys = [json.dumps(r["prompt"] if "prompt" in r else r["input_ids"]) for r in train]
        prompts = sorted(set(keys))
        n = len(prompts)
        if n < 2:
            raise DataError([f"only {n} distinct prompt: pass --eval-dataset"])
        random.Random(cfg.seed).shuffle(prompts)
        chosen = set(prompts[:min(n - 1, max(1, round(n * cfg.eval_fraction)))])
        train, held = ([r for r, k in zip(train, keys) if k not in chosen],
                       [r for r, k in zip(train, keys) if k in chosen])
        notes.append(f"held out {len(held)} of {len(train) + len(held)} examples by prompt "
                     f"(--eval-fraction {cfg.eval_fraction}, --seed {cfg.seed})")
        say(notes[-1])
    return (to_dataset([cut(r) for r in train], **_entry(cache_dir, "train")),
            to_dataset(held, **_entry(cache_dir, "held"), notes=notes))


def _entry(path: str, split: str) -> dict:
    return dict(cache_dir=path, fingerprint=path and f"{os.path.basename(path)}-{split}")


def data_digest(spec: str) -> str:
    """sha256 of a local file or a folder's data files; '' for hub."""
    if not (is_local(spec) and os.path.exists(spec)):
        return ""
    folder = os.path.isdir(spec)
    return digest(data_files(spec) if folder else [spec], named=folder)


def rows_cache(cfg, digests: dict = None):
    """The cache folder of local splits (digests: {spec: digest} if known); None if not cached."""
    specs = [s for s in (cfg.dataset, cfg.eval_dataset) if s]
    sums = datasets.is_caching_enabled() and [  # caching off: the data not hashed
        (digests or {}).get(s) or data_digest(s) for s in specs]
    if not (sums and all(sums)):
        return None
    # Hasher does not follow a function's callees: hash the code
    code = [inspect.getsource(sys.modules[m]) for m in (__name__, to_rows.__module__)]
    key = [[getattr(cfg, k) for k in SHAPING], code, *sums]
    return os.path.join(datasets.config.HF_DATASETS_CACHE, "prm_rows", Hasher.hash(key))


def load_splits(cfg, digests: dict = None) -> tuple:
    """read_splits, or its datasets read back from rows_cache."""
    path = rows_cache(cfg, digests)
    found = os.path.isdir(path or "") and _read_back(path)
    if found:
        return found
    train, held = read_splits(cfg, cache_dir=path)
    if path:
        write_lines(os.path.join(path, "rows.sha256"), [_checksum(train, held)])
    return train, held


def _checksum(*splits) -> str:
    return digest(sorted({f["filename"] for split in splits for f in split.cache_files}))


def _not_cached():
    raise LookupError("no such split in the rows cache")


def _read_back(path: str):
    """(train, held) of a cache entry, notes said; None if partial (rows.sha256 comes last) or
    damaged (removed)."""
    sums = os.path.join(path, "rows.sha256")
    try:
        train, held = (Dataset.from_generator(_not_cached, **_entry(path, split))
                       for split in ("train", "held"))
        notes = json.loads(held.info.description)
        if not (isinstance(notes, list) and all(isinstance(n, str) for n in notes)):
            raise ValueError("bad notes")
        if not os.path.isfile(sums):
            return None
        with open(sums, encoding="utf-8") as f:
            if f.read().strip() != _checksum(train, held):
                raise ValueError("its files changed")
    except DatasetGenerationError:  # _not_cached: a split not there yet
        return None
    except Exception as e:
        say(f"{path}: a damaged rows cache entry ({type(e).__name__}: {str(e)[:120]})")
        shutil.rmtree(path, ignore_errors=True)
        return None
    for msg in notes + [f"(rows read back from {path})"]:
        say(msg)
    return train, held


def load_eval(cfg, whole: str = ""):
    """All of source whole, else the held-out set a run used."""
    if whole and whole != "synthetic":
        return to_dataset(read_rows(whole, cfg.eval_split, cfg))
    return load_splits(cfg)[1]
