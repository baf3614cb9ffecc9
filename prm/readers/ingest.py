"""Rows -> tokenized rows (COLUMNS), and the data report."""
import os

import pyarrow.compute as pc
from datasets import Features, Sequence, Value
from datasets.fingerprint import Hasher

from prm.core.data import (COLUMNS, IGNORE, columns, make_row, normalize_label, tokenize_batch,
                           tokenize_example)
from prm.errors import UsageError, WriteFailed
from prm.readers.sources import META, DataError, say

FEATURES = {k: Sequence(Value(t[0])) if isinstance(t, list) else Value(t)
            for k, t in COLUMNS.items()}
AUTO_PROC_ROWS = 20_000  # --num-proc 0: several processes from this many rows on


def processes(num_proc: int, n_rows: int) -> int:
    """--num-proc, or for 0: one per usable core (at most 8) on big data."""
    if num_proc or n_rows < AUTO_PROC_ROWS:
        return num_proc or 1
    usable = getattr(os, "sched_getaffinity", None)
    return min(len(usable(0)) if usable else os.cpu_count() or 1, 8)


def tokenize_dataset(ds, tokenizer, cfg, *, is_eval: bool, num_proc: int = 0,
                     desc: str = "tokenize", drop_unlabeled: bool = True, tokenize=None):
    """(dataset, report); rows with no labeled step dropped if drop_unlabeled."""
    features = Features({**FEATURES, **{k: v for k, v in ds.features.items() if k in META}})
    kwargs = dict(max_length=cfg.max_length, is_eval=is_eval,
                  train_on_last_step_only=cfg.train_on_last_step_only)
    if "input_ids" in ds.column_names:
        check_pretokenized(ds, tokenizer, cfg)
        fn, fingerprint = cut_pretokenized, None
    else:
        fn = tokenize or tokenize_batch
        kwargs.update(tokenizer=tokenizer, step_separator=cfg.step_separator,
                      max_completion_length=cfg.max_completion_length)
        fingerprint = map_fingerprint(ds, tokenizer, kwargs, fn)
    n_proc = processes(num_proc, len(ds))
    try:
        tok = ds.map(fn, fn_kwargs=kwargs, batched=True, batch_size=256, features=features,
                     remove_columns=[c for c in ds.column_names if c not in META],
                     num_proc=n_proc if n_proc > 1 else None, desc=desc,
                     new_fingerprint=fingerprint)
    except OSError as e:
        why = e.strerror or e
        raise WriteFailed(f"cannot write tokenized rows to the datasets cache: {why}") from None
    except Exception:
        which = "held-out" if is_eval else "training"
        bad = template_problems(ds, tokenizer, which)
        if not bad:
            raise
        if len(bad) == len(ds):  # the template is at fault, not the rows
            raise UsageError(f"the chat template fails on all {len(ds)} {which} rows; {bad[0][1]}")
        if not (cfg.skip_invalid and drop_unlabeled):
            raise DataError([p for _, p in bad], total_rows=len(bad)) from None
        say(f"skipped {len(bad)} rows the chat template cannot render: {bad[0][1]}")
        keep = sorted(set(range(len(ds))) - {i for i, _ in bad})
        tok, report = tokenize_dataset(ds.select(keep), tokenizer, cfg, is_eval=is_eval,
                                       num_proc=num_proc, desc=desc, tokenize=tokenize)
        return tok, {**report, "examples_dropped": report["examples_dropped"] + len(bad)}
    kept = tok.filter(lambda b: [n > 0 for n in b["n_labeled"]], batched=True,
                      desc="drop unlabeled")
    return (kept if drop_unlabeled else tok), dataset_report(ds, tok, kept, cfg.step_separator)


def _total(values) -> int:
    return pc.sum(values).as_py() or 0


def template_problems(ds, tokenizer, which: str) -> list:
    """(index, message) per row the chat template cannot render."""
    if "prompt" not in ds.column_names or len(ds) == 0 or not isinstance(ds[0]["prompt"], list):
        return []
    out = []
    ids = ds["id"][:] if "id" in ds.column_names else [None] * len(ds)
    for i, (prompt, id_) in enumerate(zip(ds["prompt"][:], ids)):
        try:
            tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        except Exception as e:
            row = f"{which} row {i}" + (f" (id {id_})" if id_ else "")
            why = str(e).strip().splitlines()[0][:200]
            out.append((i, f"{row}: field 'prompt': chat template: {type(e).__name__}: {why}"))
    return out


def map_fingerprint(ds, tokenizer, kwargs: dict, tokenize=tokenize_batch) -> str:
    """map's fingerprint: cheaper than map's own."""
    backend = getattr(tokenizer, "backend_tokenizer", None)  # its JSON: cheaper to hash
    tok = Hasher.hash(tokenizer if backend is None else backend.to_str())
    special = (tokenizer.bos_token_id, getattr(tokenizer, "chat_template", None))
    settings = {k: v for k, v in kwargs.items() if k != "tokenizer"}
    code = [Hasher.hash(f) for f in (tokenize, tokenize_example, make_row, normalize_label)]
    return Hasher.hash([ds._fingerprint, tok, special, settings, code])


def check_pretokenized(ds, tokenizer, cfg):
    """DataError for ids past the vocabulary, or --max-completion-length."""
    if cfg.max_completion_length:
        raise DataError([f"--max-completion-length {cfg.max_completion_length}: pre-tokenized rows "
                         "have no prompt to cut; use --max-length"])
    n_vocab, ids = len(tokenizer), ds.with_format("arrow")["input_ids"]
    over = pc.greater_equal(pc.list_flatten(ids), n_vocab)
    bad = pc.unique(pc.filter(pc.list_parent_indices(ids), over)).to_pylist()  # row indices
    if bad:
        raise DataError([f"{r.get('where', f'row {i}')}: field 'input_ids': token id "
                         f"{max(r['input_ids'])} is out of the tokenizer's {n_vocab} tokens"
                         for i in bad for r in [ds[i]]])


def cut_pretokenized(batch: dict, **kw) -> dict:
    """Pre-tokenized rows as tokenize_batch returns them, a step per labeled token."""
    ends = [[i for i, y in enumerate(labels) if y != IGNORE] for labels in batch["labels"]]
    return columns([make_row(ids, e, [labels[i] for i in e], **kw)
                    for ids, labels, e in zip(batch["input_ids"], batch["labels"], ends)])


def dataset_report(ds, tok, kept, separator: str) -> dict:
    """The data report of rows read (ds), tokenized (tok) and kept."""
    t = kept.with_format("arrow")
    lengths, labels = t["length"], pc.list_flatten(t["labels"])
    labels = pc.filter(labels, pc.not_equal(labels, IGNORE))
    n = len(labels)
    every = tok.with_format("arrow")  # steps cut by a length cap, counted in every row
    cut = _total(pc.list_value_length(every["step_labels"])) - _total(every["steps_kept"])
    with_sep = 0
    if "completions" in ds.column_names:
        steps = pc.list_flatten(ds.with_format("arrow")["completions"])
        with_sep = _total(pc.match_substring(steps, separator))
    return {"examples": len(kept), "labeled_steps": n,
            "positive_rate": round(_total(pc.greater_equal(labels, 0.5)) / max(n, 1), 4),
            "mean_tokens": round(_total(lengths) / max(len(lengths), 1), 1),
            "max_tokens": pc.max(lengths).as_py() or 0,
            "examples_dropped": len(ds) - len(kept), "steps_truncated": cut,
            "steps_with_separator": with_sep}
