"""Read train/held-out data from a hub name, a .jsonl/.json/.parquet file or a directory; convert and validate
every row. Depends on: datasets, prm.data, prm.formats, prm.synthetic."""
import contextlib
import hashlib
import inspect
import json
import os
import random
import shutil
import sys

import datasets
from datasets import Dataset, Features, List, Value, load_dataset

from prm.config import Config
from prm.data import IGNORE
from prm.errors import UsageError
from prm.formats import FORMATS, detect_format, format_help, to_stepwise
from prm.synthetic import train_eval_rows

LOCAL_EXT = (".jsonl", ".json", ".parquet")
SHOWN = 15  # problems listed before "... and N more": the message must fit one screen
WHERE = "line = 1-based line of a .jsonl file; row = 0-based index in a .json array, a parquet file or a hub split"


class DataError(UsageError):
    """Problems with the input data, one "<source> <line|row> N: field 'x': ..." line each."""

    def __init__(self, problems: list, total_rows: int = 0):
        self.problems = problems
        head = f"{total_rows} invalid rows ({WHERE}):" if total_rows else "invalid input data:"
        more = [f"  ... and {len(problems) - SHOWN} more"] if len(problems) > SHOWN else []
        tail = ["Fix these rows, or pass --skip-invalid to drop them."] if total_rows else []
        super().__init__("\n".join([head] + [f"  {p}" for p in problems[:SHOWN]] + more + tail))


class MissingSplit(DataError):
    """The hub dataset has no such split; for the eval split, load_splits holds out --eval-fraction instead."""


@contextlib.contextmanager
def exit_on_data_error():
    """Bad data ends the program with exit status 2 and the problem list, not a traceback."""
    try:
        yield
    except DataError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2)


SAID = []  # every data message of this process: load_splits keeps a read's messages with its cached rows


def _say(msg: str):
    SAID.append(msg)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun every rank loads the data: say it once
        print(msg, file=sys.stderr, flush=True)


def is_local(spec: str) -> bool:
    return os.path.isdir(spec) or spec.endswith(LOCAL_EXT)


def read_records(path: str):
    """(where, record, problem) for every row of one local file; JSONL is read here so a bad line names its number."""
    if path.endswith(".parquet"):
        try:
            ds = Dataset.from_parquet(path)
        except Exception as e:  # pyarrow's own error says what is wrong with the file
            raise DataError([f"{path}: cannot read this parquet file: {e}"]) from None
        return [(f"row {i}", r, None) for i, r in enumerate(ds)]
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8-sig")  # -sig: a byte-order mark some editors write first is dropped, not refused
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise DataError([f"{path} line {line}: not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start}); "
                         "convert the file to UTF-8"]) from None
    if path.endswith(".json"):
        before = _REPEATS[0]
        data, problem, line = _loads(text)
        if problem and (text.lstrip().startswith("[") or line is None):  # a broken array: nothing in it is trusted
            raise DataError([f"{path}" + (f" line {line}" if line else "") + f": {problem}"]) from None
        pairs = [(f"row {i}", r) for i, r in enumerate(data)] if isinstance(data, list) else None
        if isinstance(data, dict) and data and all(isinstance(v, list) for v in data.values()):
            # records grouped under keys, as Mr-Ben groups the solutions of a question under its id
            pairs = [(f"{k}[{i}]", r) for k, v in data.items() for i, r in enumerate(v)]
        if pairs is not None:
            look = _REPEATS[0] > before or _SURROGATE in text.lower()  # the deep look only where it can find one
            return [(where, r, _field_problem(r) if look else None) for where, r in pairs]
        if isinstance(data, dict) and "\n" in text.strip():
            raise DataError([f"{path}: one JSON object; expected an array of records, an object of such arrays, or JSON Lines"])
    out = []
    for n, line in enumerate(text.split("\n"), 1):  # not splitlines(): U+2028 may sit raw inside a JSON string
        if line.strip():
            before = _REPEATS[0]
            record, problem, _ = _loads(line)
            if problem is None and (_REPEATS[0] > before or _SURROGATE in line.lower()):
                problem = _field_problem(record)
            out.append((f"line {n}", record, problem))
    return out


_SURROGATE = "\\ud"  # how a UTF-16 surrogate is escaped in JSON (\ud800-\udfff); lowercased text is searched
_REPEATS = [0]  # objects with a repeated key that json.loads has built (_object counts them): rows to look into


class _Repeated(dict):
    """A JSON object that gave one key twice (json keeps the last value without a word); `key` names it."""
    key = None


def _object(pairs: list) -> dict:
    """json's object_pairs_hook: a dict, or a _Repeated one when a key repeats."""
    d = dict(pairs)
    if len(d) == len(pairs):
        return d
    seen, _REPEATS[0] = set(), _REPEATS[0] + 1
    d = _Repeated(d)
    d.key = next(k for k, _ in pairs if k in seen or seen.add(k))
    return d


def _loads(text: str):
    """(value, problem, line) of one JSON text: a failure is a problem, not a traceback (line None: none known)."""
    try:
        return json.loads(text, object_pairs_hook=_object), None, None
    except json.JSONDecodeError as e:
        return None, f"malformed JSON: {e.msg} (column {e.colno})", e.lineno
    except RecursionError:  # [[[[... : json recurses once per level
        return None, "malformed JSON: nested too deeply", None
    except ValueError as e:  # a number of over 4300 digits (Python's int conversion limit)
        return None, f"unreadable JSON: {str(e).split(';')[0]}", None


def _field_problem(value, field: str = ""):
    """"field 'x': ..." for the first key given twice or string holding a lone surrogate (\ud800 without its
    pair: no character, and no UTF-8 encoding) inside value, else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return f"field '{field}': a lone UTF-16 surrogate {value[e.start]!r} (position {e.start}) is not text"
        return None
    if isinstance(value, _Repeated):
        return f"field '{field + '.' if field else ''}{value.key}': given twice in one object (which value is meant?)"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        found = _field_problem(v, f"{field}[{k}]" if isinstance(k, int) else f"{field}.{k}" if field else str(k))
        if found:
            return found
    return None


def _sources(spec: str, split: str, cfg):
    """(name, records) per file of a local spec, or the one split of a hub dataset."""
    if os.path.isdir(spec):
        files = sorted(os.path.join(spec, f) for f in os.listdir(spec) if f.endswith(LOCAL_EXT))
        if not files:
            raise DataError([f"{spec}: no .jsonl/.json/.parquet files in this directory"])
        folders = [f for f in files if not os.path.isfile(f)]
        if folders:  # data is read from the files of one folder, never from the folders inside it
            raise DataError([f"{f}: a folder named like a data file; move it out of {spec}" for f in folders])
        return [(f, read_records(f)) for f in files]
    if is_local(spec):
        if not os.path.isfile(spec):
            raise DataError([f"{spec}: no such file"])
        return [(spec, read_records(spec))]
    try:
        ds = load_dataset(spec, cfg.dataset_config or None, split=split)
    except Exception as e:  # offline, no such dataset, a typo in a local path: one line, not a traceback
        if isinstance(e, ValueError) and "split" in str(e).lower():  # datasets: 'Unknown split' or 'Bad split'
            raise MissingSplit([f"{spec}: {e}"]) from None
        raise DataError([f"{spec}: not a local .jsonl/.json/.parquet file or directory, and the hub could not load "
                         f"it ({type(e).__name__}: {e})"]) from None
    return [(f"{spec}[{split}]", ((f"row {i}", r, None) for i, r in enumerate(ds)))]


def read_rows(spec: str, split: str, cfg, format_key: str = "format") -> list:
    """Every record of a source as validated stepwise rows, in the format cfg.<format_key> names (--format, or
    --eval-format for --eval-dataset). Raises DataError listing each bad row, or with cfg.skip_invalid drops those
    records and says how many."""
    rows, problems, bad, n_records, empty = [], [], 0, 0, 0
    forced = getattr(cfg, format_key)
    formats = {forced: f"forced by --{format_key.replace('_', '-')}"} if forced != "auto" else {}
    for name, records in _sources(spec, split, cfg):
        fmt = forced if forced != "auto" else None
        for where, record, problem in records:
            n_records += 1
            if fmt is None and problem is None:  # each file's format comes from its first readable record
                fmt = detect_format(record) if isinstance(record, dict) else None
                if fmt is None:
                    why = format_help(record) if isinstance(record, dict) else "expected a JSON object"
                    raise DataError([f"{name} {where}: {why}"])
                formats.setdefault(fmt, "detected from columns " + ", ".join(FORMATS[fmt]))
            found, issues = ([], [problem]) if problem else to_stepwise(record, fmt, cfg.neutral_label)
            if found and rows and ("input_ids" in found[0]) != ("input_ids" in rows[0]):
                issues = ["pre-tokenized and text rows are mixed in one dataset"]
            elif found and rows and "prompt" in rows[0] and \
                    isinstance(found[0]["prompt"], list) != isinstance(rows[0]["prompt"], list):
                issues = ["field 'prompt': plain-text and conversational prompts are mixed in one dataset"]
            if issues:
                bad += 1
                problems += [f"{name} {where}: {p}" for p in issues]
            else:
                if fmt == "pretokenized":  # errors found at tokenization (ids past the vocabulary) name the line
                    for row in found:
                        row["where"] = f"{name} {where}"
                rows += found
                empty += not found
    if bad and not cfg.skip_invalid:
        raise DataError(problems, total_rows=bad)
    note = f"; {empty} records gave no labeled example" if empty else ""
    skipped = f"; skipped {bad} invalid records (--skip-invalid), the first: {problems[0]}" if bad else ""
    _say(f"{spec}: format {', '.join(f'{k} ({v})' for k, v in formats.items())}; "
         f"{n_records} records -> {len(rows)} examples{note}{skipped}")
    if not rows:
        raise DataError([f"{spec}: no usable rows"])
    return rows


def to_dataset(rows: list) -> Dataset:
    """An arrow-file-backed Dataset (so tokenization by datasets.map is cached), keyed by a hash of the rows."""
    if "input_ids" in rows[0]:  # pre-tokenized: one float column holds -100, hard and soft labels
        features = {"input_ids": List(Value("int64")), "labels": List(Value("float64")), "where": Value("string")}
    else:
        soft = any(isinstance(y, float) for r in rows for y in r["labels"])
        features = {"prompt": List({"role": Value("string"), "content": Value("string")})
                    if isinstance(rows[0]["prompt"], list) else Value("string"),
                    "completions": List(Value("string")), "labels": List(Value("float64" if soft else "bool"))}
    for col, kind in (("id", "string"), ("first_error", "int64"), ("final_answer_correct", "bool"), ("group", "string"),
                      ("response_answer", "string"), ("category", "string")):
        if any(col in r for r in rows):
            features[col] = Value(kind)
    digest = hashlib.sha256(json.dumps(list(features)).encode())
    for r in rows:
        digest.update(json.dumps(r, sort_keys=True).encode())

    def generate():
        for r in rows:
            yield {k: r.get(k) for k in features}

    return Dataset.from_generator(generate, features=Features(features), fingerprint=digest.hexdigest()[:32])


def cut_after_first_error(row: dict) -> dict:
    """The row up to and including its first wrong label (False, 0 or 0.0); a row without one is returned as is.
    Stepwise rows lose the steps after it, pre-tokenized rows the tokens after it (labels align with both)."""
    end = next((i + 1 for i, y in enumerate(row["labels"]) if y is not None and y != IGNORE and float(y) == 0.0), None)
    if end is None:
        return row
    key = "completions" if "completions" in row else "input_ids"
    return {**row, key: row[key][:end], "labels": row["labels"][:end]}


def split_by_prompt(rows: list, fraction: float, seed: int):
    """Seeded held-out share, split by prompt so one problem never sits on both sides.

    Pre-tokenized rows carry no prompt: each is held out on its own (pass --eval-dataset to split by problem)."""
    key = lambda r: json.dumps(r["prompt"] if "prompt" in r else r["input_ids"])
    prompts = sorted({key(r) for r in rows})
    if len(prompts) < 2:
        raise DataError([f"only {len(prompts)} distinct prompt: nothing to hold out; pass --eval-dataset"])
    random.Random(seed).shuffle(prompts)
    held = set(prompts[:min(len(prompts) - 1, max(1, round(len(prompts) * fraction)))])
    return [r for r in rows if key(r) not in held], [r for r in rows if key(r) in held]


def read_splits(cfg):
    """(train, held-out) datasets with columns prompt, completions, labels and, when the data has them, id,
    first_error and final_answer_correct (ProcessBench), group and response_answer (best-of-N), category
    (PRMBench)."""
    # training rows only: the held-out set is judged on whole solutions
    cut = cut_after_first_error if cfg.cut_after_first_error else lambda r: r
    if cfg.dataset == "synthetic":
        train, held = train_eval_rows(cfg.synthetic_size, cfg.seed)
        return Dataset.from_list([cut(r) for r in train]), Dataset.from_list(held)
    train = read_rows(cfg.dataset, cfg.train_split, cfg)
    held = None
    if cfg.eval_dataset:
        held = read_rows(cfg.eval_dataset, cfg.eval_split, cfg, "eval_format")  # its own format, not --dataset's
    elif not is_local(cfg.dataset):
        try:
            held = read_rows(cfg.dataset, cfg.eval_split, cfg)
        except MissingSplit:  # hold out a share below
            pass
    if held is None:
        train, held = split_by_prompt(train, cfg.eval_fraction, cfg.seed)
        _say(f"held out {len(held)} of {len(train) + len(held)} examples, split by prompt (--eval-fraction "
             f"{cfg.eval_fraction}, --seed {cfg.seed})")
    return to_dataset([cut(r) for r in train]), to_dataset(held)


SHAPING = Config.names_with("rows")  # the settings read_splits reads


def data_digest(spec: str) -> str:
    """sha256 of a local data file's or folder's contents (its files' names too); '' for hub or synthetic data."""
    if not (is_local(spec) and os.path.exists(spec)):
        return ""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(spec)) if os.path.isdir(spec) else [""]:
        path = os.path.join(spec, name) if name else spec
        digest.update(path.encode() + b"\0")
        if os.path.isfile(path):  # folders named like data files are refused when read, never hashed
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()


def rows_cache(cfg):
    """Where load_splits keeps the validated splits of local files, keyed by the files' contents, the settings that
    shape the rows and this reading code: a rerun on unchanged files skips parsing and checking every row again
    (about 30 s for 400k rows; hashing them takes about 1 s). None for hub or synthetic data, or caching off."""
    specs = [s for s in (cfg.dataset, cfg.eval_dataset) if s]
    if not datasets.is_caching_enabled() or not all(is_local(s) and os.path.exists(s) for s in specs):
        return None
    digest = hashlib.sha256(json.dumps([[getattr(cfg, k) for k in SHAPING], [inspect.getsource(m) for m in (
        sys.modules[__name__], sys.modules[to_stepwise.__module__])]]).encode())
    for spec in specs:
        digest.update(data_digest(spec).encode())
    return os.path.join(datasets.config.HF_DATASETS_CACHE, "prm_rows", digest.hexdigest()[:32])


def load_splits(cfg):
    """read_splits, or its result read back from rows_cache when the files and settings are unchanged."""
    path = rows_cache(cfg)
    if path and os.path.isfile(os.path.join(path, SAID_FILE)):  # written last: a complete cache
        with open(os.path.join(path, SAID_FILE)) as f:
            for msg in json.load(f):  # what the read said (formats, skipped rows, the held-out share), said again
                _say(msg)
        _say(f"(rows read back from {path}: files and settings unchanged)")
        return _read_back(path)
    start = len(SAID)
    train, held = read_splits(cfg)
    if not path:
        return train, held
    try:
        shutil.rmtree(path, ignore_errors=True)
        datasets.DatasetDict(train=train, held=held).save_to_disk(path)
        with open(os.path.join(path, SAID_FILE), "w") as f:
            json.dump(SAID[start:], f)
    except OSError:  # a cache that cannot be written (a full disk) costs only the next read
        return train, held
    return _read_back(path)  # this run too: the fingerprints its tokenization is cached under are the reruns'


def _read_back(path: str) -> tuple:
    splits = datasets.load_from_disk(path)  # memory-mapped, with the same fingerprints every time it is read
    return splits["train"], splits["held"]


SAID_FILE = "said.json"


def load_eval(cfg, whole: str = ""):
    """`whole`: evaluate all of that source; otherwise the held-out set a run used, rebuilt from its config."""
    if whole and whole != "synthetic":
        return to_dataset(read_rows(whole, cfg.eval_split, cfg))
    return load_splits(cfg)[1]
