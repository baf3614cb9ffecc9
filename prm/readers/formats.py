"""JSON reading, format detection, and records made into checked rows."""
import difflib
import itertools
import json
import re

from prm.core.data import IGNORE, label_problem

FORMATS = {  # each format's columns, in detection order
    "pretokenized": ("input_ids", "labels"),
    "stepwise": ("prompt", "completions", "labels"),
    "processbench": ("problem", "steps", "label"),
    "prm800k": ("question", "label"),
    "math_shepherd": ("input", "label"),
    "candidates": ("question", "outputs"),
    "prmbench": ("original_process", "modified_process", "error_steps", "classification"),
    "mrben": ("Question", "Model_Solution_Steps", "Model_Solution_First_Error_Step"),
}
# source columns for eval's reports
META = {"id": "string", "first_error": "int64", "final_answer_correct": "bool", "group": "string",
        "response_answer": "string", "category": "string"}
WHAT = {str: "text", bool: "true/false", list: "a list", dict: "an object"}
STEP_TAG = "ки"  # Math-Shepherd's end-of-step marker
NEUTRAL = {"positive": True, "negative": False, "drop": None}  # a PRM800K rating of 0
ZERO_WIDTH = dict.fromkeys(map(ord, "\u200b\u200c\u200d\u2060\ufeff"))


def decode(data: bytes) -> tuple:
    """(text, problem, line)."""
    try:
        return data.decode("utf-8-sig"), None, None
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        return None, f"not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start})", line


def read_json(text: str) -> tuple:
    """(value, problem, line)."""
    repeated = []

    def pairs_hook(pairs: list) -> dict:
        d = dict(pairs)
        if len(d) < len(pairs):
            seen, d = set(), _Repeated(d)
            d.key = next(k for k, _ in pairs if k in seen or seen.add(k))
            repeated.append(d)
        return d
    try:
        value = json.loads(text, object_pairs_hook=pairs_hook)
    except json.JSONDecodeError as e:
        return None, f"malformed JSON: {e.msg} (column {e.colno})", e.lineno
    except RecursionError:
        return None, "malformed JSON: nested too deeply", None
    except ValueError as e:  # a number past Python's 4300-digit limit
        return None, f"unreadable JSON: {str(e).split(';')[0]}", None
    look = repeated or "\\ud" in text.lower()  # a lone surrogate can only come escaped
    return value, field_problem(value) if look else None, None


class _Repeated(dict):
    key = None


def field_problem(value):
    """The first key given twice or lone surrogate, or None."""
    todo = [("", value)]  # a loop, not recursion: any depth json reads
    while todo:
        field, value = todo.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                return f"field '{field}': a lone UTF-16 surrogate {value[e.start]!r} at {e.start}"
        if isinstance(value, _Repeated):
            where = f"{field}.{value.key}" if field else value.key
            return f"field '{where}': given twice"
        if isinstance(value, dict):
            todo += reversed([(f"{field}.{k}" if field else k, v) for k, v in value.items()])
        elif isinstance(value, list):
            todo += reversed([(f"{field}[{k}]", v) for k, v in enumerate(value)])
    return None


class BadField(ValueError):
    def __init__(self, field: str, problem: str):
        super().__init__(f"field '{field}': {problem}")


def is_blank(text: str) -> bool:
    return not text.translate(ZERO_WIDTH).strip()


def step_spans(text: str, separator: str) -> list:
    pieces = text.split(separator)
    starts = itertools.accumulate((len(p) + len(separator) for p in pieces), initial=0)
    blank = {p for p in set(pieces) if is_blank(p)}  # each distinct piece checked once
    return [(a, a + len(p)) for a, p in zip(starts, pieces) if p not in blank]


def split_steps(text: str, separator: str) -> list:
    """The non-blank steps, whitespace kept."""
    return [text[a:b] for a, b in step_spans(text, separator)]


def detect_format(record: dict):
    return next((name for name, cols in FORMATS.items() if all(c in record for c in cols)
                 and (name != "prm800k" or isinstance(record["label"], dict))), None)


def format_help(record: dict) -> str:
    known = sorted({c for cols in FORMATS.values() for c in cols})
    near = [f"'{k}' -> '{m[0]}'" for k in record if k not in known
            for m in [difflib.get_close_matches(str(k), known, 1, 0.75)] if m]
    expected = "; ".join(f"{n} ({', '.join(c)})" for n, c in FORMATS.items())
    return (f"columns {sorted(map(str, record))} match no format ({expected})."
            + (f" Misnamed? {', '.join(near)}." if near else "") + " Or pass --format.")


def _need(record: dict, key: str, kind=None, where: str = "", optional: bool = False):
    """record[key] of type kind (optional: None if absent or null); where: a prefix."""
    if not isinstance(record, dict):
        raise BadField(where.rstrip("."), f"expected an object, got {_kind(record)}")
    if optional and record.get(key) is None:
        return None
    if key not in record:
        near = difflib.get_close_matches(key, [str(k) for k in record], 1, 0.6)
        near = f" (misnamed '{near[0]}'?)" if near else ""
        raise BadField(where + key, "missing" + near)
    value = record[key]
    if kind is not None and not isinstance(value, kind):
        raise BadField(where + key, f"expected {WHAT[kind]}, got {_kind(value)}")
    return value


def _kind(value) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r}"[:80]


def from_stepwise(r: dict, neutral: str) -> list:
    row = {k: _need(r, k) for k in FORMATS["stepwise"]}
    if r.get("first_error") is not None:
        n = len(row["completions"]) if isinstance(row["completions"], list) else 0
        row.update(_benchmark_columns(r, "first_error", n))
    for col, kind in META.items():
        if col not in row and col != "id" and r.get(col) is not None:
            row[col] = _need(r, col, bool if kind == "bool" else str)
    return [row]


def _benchmark_columns(r: dict, key: str, n_steps: int) -> dict:
    first = _need(r, key)
    if type(first) is not int or not -1 <= first < n_steps:
        raise BadField(key, f"first error {_kind(first)} is out of range for {n_steps} steps")
    return {"first_error": first,
            "final_answer_correct": _need(r, "final_answer_correct", bool, optional=True)}


def from_math_shepherd(r: dict, neutral: str) -> list:
    """`input`: question + "Step 1: ... ки\\nStep 2: ... ки"; `label`: +/- per tag, or a list."""
    text, label = _need(r, "input", str), _need(r, "label")
    steps = _tagged_steps(text, "input")
    if isinstance(label, str):
        labels, pos = [], 0
        for k, part in enumerate(text.split(STEP_TAG)[:-1]):
            end = pos + len(part)
            if not label.startswith(part, pos) or label[end:end + 1] not in ("+", "-"):
                raise BadField("label", f"not 'input' with +/- per '{STEP_TAG}' at step {k + 1}")
            labels.append(label[end] == "+")
            pos = end + 1
    elif isinstance(label, list):
        labels = label
    else:
        raise BadField("label", f"expected +/- marked text or a list, got {_kind(label)}")
    question, marker, first = steps[0].rpartition("Step 1:")
    if not marker:
        raise BadField("input", "no 'Step 1:' after the question")
    steps[0] = (marker + first).strip()
    return [{"prompt": question.strip(), "completions": steps, "labels": labels}]


def from_prm800k(r: dict, neutral: str) -> list:
    """A row per rated alternative not chosen, then the trajectory unless the last row is it."""
    problem = _need(_need(r, "question", dict), "problem", str, "question.")
    label = _need(r, "label", dict)
    steps = _need(label, "steps", list, "label.")
    if label.get("finish_reason") == "bad_problem":
        return []
    rate = {1: True, -1: False, 0: NEUTRAL[neutral], None: None}
    rows, texts, labels = [], [], []
    for k, step in enumerate(steps):
        where = f"label.steps[{k}]"
        options = _need(step, "completions", list, where + ".", optional=True) or []
        chosen = step.get("chosen_completion")
        for i, c in enumerate(options):
            rating = c.get("rating") if isinstance(c, dict) else "not an object"
            if type(rating) not in (int, type(None)) or rating not in rate:  # True is no rating
                raise BadField(f"{where}.completions[{i}].rating",
                               f"not -1, 0, 1 or null: {_kind(c)}")
            if i != chosen and rate[rating] is not None:
                rows.append({"prompt": problem, "completions": texts + [c.get("text")],
                             "labels": labels + [rate[rating]]})
        if chosen is not None:
            if type(chosen) is not int or not 0 <= chosen < len(options):  # True is no index
                raise BadField(f"{where}.chosen_completion", f"{chosen!r} is not an index")
            texts.append(options[chosen].get("text"))
            labels.append(rate[options[chosen].get("rating")])
        elif isinstance(step.get("human_completion"), dict):
            texts.append(step["human_completion"].get("text"))
            labels.append(True)
        else:
            break
    if any(y is not None for y in labels) and not (rows and rows[-1]["completions"][:-1] == texts):
        rows.append({"prompt": problem, "completions": texts, "labels": labels})
    return rows


def from_processbench(r: dict, neutral: str) -> list:
    """Right before the first error, wrong at it, None after."""
    steps = _need(r, "steps", list)
    extra = _benchmark_columns(r, "label", len(steps))
    n, first = len(steps), extra["first_error"]
    labels = [True] * n if first < 0 else [True] * first + [False] + [None] * (n - first - 1)
    return [{"prompt": _need(r, "problem"), "completions": steps, "labels": labels, **extra}]


def from_mrben(r: dict, neutral: str) -> list:
    """As ProcessBench; steps lose "Step k: "; first error 1-based."""
    steps = [re.sub(r"^Step \d+:\s*", "", s).strip() if isinstance(s, str) else s
             for s in _need(r, "Model_Solution_Steps", list)]
    first = _need(r, "Model_Solution_First_Error_Step")
    number = type(first) in (str, int) and str(first).isdigit() and 1 <= int(first) <= len(steps)
    if first != "N/A" and not number:
        raise BadField("Model_Solution_First_Error_Step",
                       f"{_kind(first)} is not 1-{len(steps)} or N/A")
    options = _need(r, "Options", str).strip() if r.get("Options") else ""
    prompt = _need(r, "Question", str) + ("\n" + options if options else "")
    label = -1 if first == "N/A" else int(first) - 1
    correct = r.get("Model_Solution_Correctness") == "correct"
    record = {"problem": prompt, "steps": steps, "label": label, "final_answer_correct": correct}
    return [{**row, "id": f"mrben-{r.get('Question_UUID')}-{r.get('Sampled_Model')}"}
            for row in from_processbench(record, neutral)]


def _tagged_steps(text: str, field: str) -> list:
    parts = text.split(STEP_TAG)
    if len(parts) < 2:
        raise BadField(field, f"no '{STEP_TAG}' step tag")
    if parts[-1].strip():
        raise BadField(field, f"text after the last '{STEP_TAG}': {parts[-1].strip()[:40]!r}")
    return [s.strip() for s in parts[:-1]]


def from_candidates(r: dict, neutral: str) -> list:
    """A row per solution (tagged `response`, or `steps`), one `group`."""
    question = _need(r, "question", str)
    outputs = _need(r, "outputs", list)
    group = str(r["idx"] if r.get("idx") is not None else r.get("id", question))
    rows = []
    for j, o in enumerate(outputs):
        where = f"outputs[{j}]."
        if isinstance(o, dict) and "steps" in o:
            steps = _need(o, "steps", list, where)
        else:
            steps = _tagged_steps(_need(o, "response", str, where), where + "response")
        correct = _need(o, "label", bool, where)  # is the final answer correct?
        answer = _need(o, "response_answer", str, where, True)
        labels = o["step_labels"] if o.get("step_labels") is not None else [None] * len(steps)
        rows.append({"prompt": question, "completions": steps, "labels": labels,
                     "final_answer_correct": correct, "response_answer": answer, "group": group,
                     "id": f"{group}/{j}"})
    return rows


def from_prmbench(r: dict, neutral: str) -> list:
    """The modified solution, 1-based error_steps wrong (past the end: ignored, as PRMBench does);
    redundancy also gives the original."""
    steps = _unnumbered(_need(r, "modified_process", list))
    errors = _need(r, "error_steps", list)
    for e in errors:
        if type(e) is not int or e < 1:
            raise BadField("error_steps", f"{_kind(e)} is not a 1-based step index")
    within = [e for e in errors if e <= len(steps)]
    if errors and not within:
        raise BadField("error_steps", f"every error step {errors} is past the {len(steps)} steps")
    category = _need(r, "classification", str)
    key = r.get("idx", "")
    rows = [{"prompt": _need(r, "modified_question", str), "completions": steps,
             "labels": [k + 1 not in within for k in range(len(steps))], "category": category,
             "first_error": min(within) - 1 if within else -1, "id": f"{category}_{key}"}]
    if category == "redundency":  # PRMBench's own spelling
        original = _unnumbered(_need(r, "original_process", list))
        rows.append({"prompt": _need(r, "original_question", str), "completions": original,
                     "labels": [True] * len(original), "category": "correct", "first_error": -1,
                     "id": f"correct_{key}"})
    return rows


def _unnumbered(steps: list) -> list:
    """PRMBench's remove_step_prefix, but a bare prefix stays."""
    prefix = re.compile(r"^(Step\s*\d+\.\s*|\d+\.\s*)", re.IGNORECASE)
    bare = [prefix.sub("", s.strip()) if isinstance(s, str) else s for s in steps]
    return [s.strip() if isinstance(b, str) and is_blank(b) else b for s, b in zip(steps, bare)]


def from_pretokenized(r: dict, neutral: str) -> list:
    row = {k: _need(r, k) for k in FORMATS["pretokenized"]}
    return [{**row, "attention_mask": r.get("attention_mask")}]


CONVERTERS = {name: globals()["from_" + name] for name in FORMATS}


def _first_bad(bad: list, message: str) -> list:
    more = f" ({len(bad) - 1} more)" if len(bad) > 1 else ""
    return [message.format(*bad[0]) + more] if bad else []


def row_problems(row: dict) -> list:
    out = []
    prompt, steps, labels = row["prompt"], row["completions"], row["labels"]
    chat = isinstance(prompt, list) and prompt and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in prompt)
    if not (chat or isinstance(prompt, str)):
        out.append(f"field 'prompt': expected text or [{{role, content}}], got {_kind(prompt)}")
    if not isinstance(steps, list) or not steps:
        out.append(f"field 'completions': expected a non-empty list, got {_kind(steps)}")
    else:
        bad = [(i, "empty" if isinstance(s, str) else _kind(s)) for i, s in enumerate(steps)
               if not isinstance(s, str) or is_blank(s)]
        out += _first_bad(bad, "field 'completions': step {} is {}")
    if not isinstance(labels, list):
        return out + [f"field 'labels': expected a list, got {_kind(labels)}"]
    bad = [(i, p) for i, y in enumerate(labels) for p in [label_problem(y)] if p]
    out += _first_bad(bad, "field 'labels': label {}: {}")
    if isinstance(steps, list) and steps and len(labels) != len(steps):
        out.append(f"field 'labels': {len(labels)} labels for {len(steps)} steps")
    elif labels and not bad and all(y is None for y in labels) and "group" not in row:  # best-of-N
        out.append("field 'labels': no step is labeled")
    return out


def token_problems(row: dict) -> list:
    """Every problem of a pre-tokenized row."""
    ids, labels, mask = row["input_ids"], row["labels"], row.get("attention_mask")
    out = []
    if not isinstance(ids, list) or not ids:
        out.append(f"field 'input_ids': expected a non-empty list, got {_kind(ids)}")
    else:  # True is no token id; the column is int64
        bad = [(i, _kind(x)) for i, x in enumerate(ids)
               if type(x) is not int or not 0 <= x < 2 ** 63]
        out += _first_bad(bad, "field 'input_ids': position {}: {} is not a token id")
    if not isinstance(labels, list):
        return out + [f"field 'labels': expected a list, got {_kind(labels)}"]
    bad = [(i, p) for i, y in enumerate(labels) if type(y) not in (int, float) or y != IGNORE
           for p in [label_problem(y) if y is not None else "null is not a label"] if p]
    out += _first_bad(bad, "field 'labels': position {}: {}, nor -100")
    if isinstance(ids, list) and len(labels) != len(ids):
        return out + [f"field 'labels': {len(labels)} labels for {len(ids)} input_ids"]
    n = len(labels)
    if mask is not None:
        if not isinstance(mask, list) or len(mask) != n or any(
                type(m) not in (int, bool) or m not in (0, 1) for m in mask) or any(
                mask[sum(mask):]):
            return out + [f"field 'attention_mask': expected {n} ones then zeros (right padding), "
                          f"got {_kind(mask)}"]
        n = sum(mask)
        padded = [i for i in range(n, len(labels)) if labels[i] != IGNORE]
        if padded and not bad:
            out.append(f"field 'labels': position {padded[0]} is padding but has a label")
    if not bad and all(y == IGNORE for y in labels[:n]):
        out.append("field 'labels': no position is labeled")
    return out


def to_rows(record, fmt: str, neutral: str = "negative"):
    """(rows, problems) of a record; no rows if any problem."""
    if not isinstance(record, dict):
        return [], [f"expected a JSON object, got {_kind(record)}"]
    try:
        rows = CONVERTERS[fmt](record, neutral)
    except BadField as e:
        return [], [str(e)]
    check = token_problems if fmt == "pretokenized" else row_problems
    problems = [p for row in rows for p in check(row)]
    if problems:
        return [], list(dict.fromkeys(problems))
    for n, row in enumerate(rows):
        if record.get("id") is not None:
            row["id"] = str(record["id"]) if len(rows) == 1 else f"{record['id']}/{n}"
        if fmt == "pretokenized":
            mask = row.pop("attention_mask")
            end = sum(mask) if mask else len(row["input_ids"])
            row["input_ids"] = row["input_ids"][:end]
            row["labels"] = [y if isinstance(y, float) else int(y) for y in row["labels"][:end]]
        else:
            labels = row["labels"]
            row["labels"] = [y if y is None or isinstance(y, float) else bool(y) for y in labels]
            if isinstance(row["prompt"], list):
                row["prompt"] = [{k: m[k] for k in ("role", "content")} for m in row["prompt"]]
    return rows, []
