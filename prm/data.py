"""Step-label tokenization (or the cut of pre-tokenized rows), padding, and deterministic (length-grouped) batch plans. Depends on: torch, datasets, prm.formats."""
import math
import random

import torch

from prm.formats import IGNORE  # label of every position that is not the end of a step


def normalize_label(label):
    """bool and 0/1 ints become int; floats in [0,1] stay floats (soft Monte-Carlo labels); None = not scored."""
    if label is None:  # a step kept as context but not scored (e.g. ProcessBench steps after the first error)
        return IGNORE
    if isinstance(label, bool):
        return int(label)
    if isinstance(label, int) and label in (0, 1):
        return label
    if isinstance(label, float) and 0.0 <= label <= 1.0:  # NaN fails both comparisons
        return label
    raise ValueError(f"label {label!r} is not a bool, 0/1, or a float in [0, 1]")


def prompt_ids(prompt, tokenizer) -> list:
    """BOS (only if the tokenizer has one) + prompt ids; a list of {role, content} goes through the chat template."""
    if isinstance(prompt, list):  # conversational: the template writes its own special tokens
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return with_bos(tokenizer(prompt, add_special_tokens=False)["input_ids"], tokenizer)


def with_bos(ids: list, tokenizer) -> list:
    return ([tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []) + ids


def separator_ids(tokenizer, step_separator: str) -> list:
    ids = tokenizer(step_separator, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError(f"step separator {step_separator!r} tokenizes to nothing: no token could carry the label")
    return ids


def assemble(prompt: list, steps: list, sep: list, labels: list, max_length=None,
             train_on_last_step_only=False, is_eval=False, max_completion_length=None) -> dict:
    """Concatenate already-tokenized pieces; the label sits on each step's last separator token.

    Truncation drops whole steps from the end, so a label never slides onto another token: first those past
    max_completion_length tokens of steps (0/None: no cap), then those past max_length tokens in all."""
    labels = [normalize_label(x) for x in labels]
    if len(steps) != len(labels):
        raise ValueError(f"{len(steps)} steps but {len(labels)} labels")
    if train_on_last_step_only and not is_eval:
        labels = [IGNORE] * (len(labels) - 1) + labels[-1:]
    input_ids, out_labels, steps_kept = list(prompt), [IGNORE] * len(prompt), 0
    for step, label in zip(steps, labels):
        piece = step + sep
        if max_completion_length and len(input_ids) - len(prompt) + len(piece) > max_completion_length:
            break
        if max_length is not None and len(input_ids) + len(piece) > max_length:
            break
        input_ids += piece
        out_labels += [IGNORE] * (len(piece) - 1) + [label]
        steps_kept += 1
    if max_length is not None and steps_kept == 0:  # even the prompt may not fit: keep nothing labeled
        input_ids, out_labels = input_ids[:max_length], out_labels[:max_length]
    return {"input_ids": input_ids, "labels": out_labels, "steps_kept": steps_kept}


def tokenize_example(example, tokenizer, step_separator="\n", max_length=None, train_on_last_step_only=False,
                     is_eval=False, max_completion_length=None) -> dict:
    """One row {prompt, completions, labels} -> {input_ids, labels, steps_kept}; plain lists, no model needed."""
    steps = [tokenizer(s, add_special_tokens=False)["input_ids"] for s in example["completions"]]
    return assemble(prompt_ids(example["prompt"], tokenizer), steps, separator_ids(tokenizer, step_separator),
                    example["labels"], max_length, train_on_last_step_only, is_eval, max_completion_length)


def tokenize_batch(batch: dict, tokenizer, step_separator="\n", max_length=None, train_on_last_step_only=False,
                   is_eval=False, max_completion_length=None) -> dict:
    """Column-batch version of tokenize_example for datasets.map: one tokenizer call for all prompts and steps."""
    sep = separator_ids(tokenizer, step_separator)
    flat = [s for steps in batch["completions"] for s in steps]
    plain = all(isinstance(p, str) for p in batch["prompt"])
    texts = (list(batch["prompt"]) if plain else []) + flat
    ids = tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"] if texts else []
    if plain:
        prompts, flat_ids = [with_bos(x, tokenizer) for x in ids[:len(batch["prompt"])]], ids[len(batch["prompt"]):]
    else:
        prompts, flat_ids = [prompt_ids(p, tokenizer) for p in batch["prompt"]], ids
    out = {"input_ids": [], "labels": [], "steps_kept": [], "length": [], "n_labeled": []}
    start = 0
    for prompt, steps, labels in zip(prompts, batch["completions"], batch["labels"]):
        row = assemble(prompt, flat_ids[start:start + len(steps)], sep, labels, max_length,
                       train_on_last_step_only, is_eval, max_completion_length)
        start += len(steps)
        # ints and floats mixed: the float32 feature in tokenize_dataset makes one arrow type for hard and soft labels
        row["length"], row["n_labeled"] = len(row["input_ids"]), len(row["labels"]) - row["labels"].count(IGNORE)
        for k in out:
            out[k].append(row[k])
    return out


def map_fingerprint(ds, tokenizer, kwargs: dict) -> str:
    """datasets would dill-hash fn_kwargs, the whole tokenizer included (1.4 s for Qwen2's 151k vocabulary), on
    every map, cache on or off. Same inputs, hashed cheaply: data fingerprint, tokenizer content, settings, code."""
    import hashlib
    from datasets.fingerprint import Hasher
    backend = getattr(tokenizer, "backend_tokenizer", None)
    tok = hashlib.sha256(backend.to_str().encode()).hexdigest() if backend is not None else Hasher.hash(tokenizer)
    special = (tokenizer.bos_token_id, getattr(tokenizer, "chat_template", None))
    settings = {k: v for k, v in kwargs.items() if k != "tokenizer"}
    return Hasher.hash([ds._fingerprint, tok, special, settings, Hasher.hash(tokenize_batch)])


def tokenize_dataset(ds, tokenizer, cfg, is_eval: bool, num_proc: int = 1, desc: str = "tokenize"):
    """datasets.map(tokenize_batch), or cut_tokenized for pre-tokenized rows, then drop rows with no labeled step.
    Returns (dataset, report dict)."""
    import pyarrow.compute as pc
    from datasets import Features, Sequence, Value
    features = Features({"input_ids": Sequence(Value("int32")), "labels": Sequence(Value("float32")),
                         "steps_kept": Value("int32"), "length": Value("int32"), "n_labeled": Value("int32"),
                         **{k: v for k, v in ds.features.items() if k == "id"}})
    table = ds.with_format("arrow")
    if "input_ids" in ds.column_names:  # pre-tokenized: its labeled positions are its steps
        check_tokenized(ds, tokenizer, cfg)
        fn, kwargs, fingerprint = cut_tokenized, dict(max_length=cfg.max_length, is_eval=is_eval,
                                                      train_on_last_step_only=cfg.train_on_last_step_only), None
        n_steps_in = pc.sum(pc.not_equal(pc.list_flatten(table["labels"]), IGNORE)).as_py() or 0
    else:
        fn = tokenize_batch
        kwargs = dict(tokenizer=tokenizer, step_separator=cfg.step_separator, max_length=cfg.max_length,
                      max_completion_length=cfg.max_completion_length,
                      train_on_last_step_only=cfg.train_on_last_step_only, is_eval=is_eval)
        fingerprint = map_fingerprint(ds, tokenizer, kwargs)
        n_steps_in = pc.sum(pc.list_value_length(table["completions"])).as_py() or 0
    tok = ds.map(fn, fn_kwargs=kwargs, batched=True, batch_size=256, features=features,
                 remove_columns=[c for c in ds.column_names if c != "id"], num_proc=num_proc if num_proc > 1 else None,
                 desc=desc, new_fingerprint=fingerprint)
    kept = tok.filter(lambda b: [n > 0 for n in b["n_labeled"]], batched=True,
                      desc="drop unlabeled")
    report = dataset_report(kept, n_rows_in=len(ds), n_steps_in=n_steps_in)
    return kept, report


def check_tokenized(ds, tokenizer, cfg):
    """Raise DataError for pre-tokenized rows the run cannot use: ids past the tokenizer's vocabulary (data
    tokenized with another tokenizer would fail inside the embedding), or a --max-completion-length to apply."""
    import pyarrow.compute as pc
    from prm.sources import DataError
    if cfg.max_completion_length:
        raise DataError([f"--max-completion-length {cfg.max_completion_length}: pre-tokenized rows carry no "
                         "prompt/step boundary to apply it to; set it to 0 and cap them with --max-length"])
    n_vocab, bad, offset = len(tokenizer), [], 0
    for chunk in ds.with_format("arrow")["input_ids"].chunks:  # parent indices count from each chunk's start
        over = pc.filter(pc.list_parent_indices(chunk), pc.greater_equal(pc.list_flatten(chunk), n_vocab))
        bad += [offset + i for i in pc.unique(over).to_pylist()]
        offset += len(chunk)
    if bad:
        where = ds["where"] if "where" in ds.column_names else [f"row {i}" for i in range(len(ds))]
        raise DataError([f"{where[i]}: field 'input_ids': token id {max(ds[i]['input_ids'])} is out of the "
                         f"tokenizer's {n_vocab} tokens: was it tokenized with another tokenizer?" for i in bad])


def cut_tokenized(batch: dict, max_length=None, train_on_last_step_only=False, is_eval=False) -> dict:
    """Pre-tokenized rows (labels: -100 or a step's label) cut after max_length tokens, as tokenize_batch returns.

    The model is causal, so cutting the tail never changes what an earlier label means; labels past the cut are lost.
    steps_kept counts the labeled positions kept, before train_on_last_step_only hides all but the last."""
    out = {"input_ids": [], "labels": [], "steps_kept": [], "length": [], "n_labeled": []}
    for ids, labels in zip(batch["input_ids"], batch["labels"]):
        ids, cut = ids[:max_length], labels[:max_length]  # a None max_length keeps everything
        steps_kept = len(cut) - cut.count(IGNORE)
        if train_on_last_step_only and not is_eval:  # the row's last label, wherever the cut leaves it
            last = max((i for i, y in enumerate(labels) if y != IGNORE), default=-1)
            cut = [y if i == last else IGNORE for i, y in enumerate(cut)]
        out["input_ids"].append(ids)
        out["labels"].append(cut)
        out["steps_kept"].append(steps_kept)
        out["length"].append(len(ids))
        out["n_labeled"].append(len(cut) - cut.count(IGNORE))
    return out


def dataset_report(tok, n_rows_in: int, n_steps_in: int) -> dict:
    """Counted in Arrow: no per-token Python loop over the labels."""
    import pyarrow.compute as pc
    t = tok.with_format("arrow")
    lengths, labels = t["length"], pc.list_flatten(t["labels"])
    labels = pc.filter(labels, pc.not_equal(labels, IGNORE))
    n = len(labels)
    total = lambda a: pc.sum(a).as_py() or 0
    return {"examples": len(tok), "labeled_steps": n,
            "positive_rate": round(total(pc.greater_equal(labels, 0.5)) / max(n, 1), 4),
            "mean_tokens": round(total(lengths) / max(len(lengths), 1), 1),
            "max_tokens": (pc.max(lengths).as_py() or 0) if len(lengths) else 0,
            "examples_dropped": n_rows_in - len(tok), "steps_truncated": n_steps_in - total(t["steps_kept"])}


def collate(rows: list, pad_id: int) -> dict:
    """Right padding (causal model: real tokens keep positions 0..n-1); ids/mask int64, labels float32 with -100.

    Float labels carry hard (0/1) and soft targets in one tensor."""
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # (B, T)
    mask = torch.zeros((len(rows), width), dtype=torch.long)  # (B, T)
    labels = torch.full((len(rows), width), float(IGNORE), dtype=torch.float32)  # (B, T)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.as_tensor(r["input_ids"], dtype=torch.long)
        mask[i, :n] = 1
        labels[i, :n] = torch.as_tensor(r["labels"], dtype=torch.float32)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def pad_token_id(tokenizer) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad nor an EOS token: set tokenizer.pad_token")
    return pad


def global_batches(lengths: list, global_batch: int, seed: int, epoch: int, group_by_length: bool) -> list:
    """The epoch's optimizer-step batches: lists of exactly `global_batch` dataset indices, whatever the world size.

    Shuffled from (seed, epoch). With grouping, windows of 64 batches are sorted by length before cutting, then
    the batch order is shuffled again, so neighbours in a batch have similar lengths but the order stays random.
    The last batch is completed with the epoch's first indices so every rank runs the same number of steps."""
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    n_batches = math.ceil(len(order) / global_batch)
    order = (order * math.ceil(n_batches * global_batch / max(len(order), 1)))[: n_batches * global_batch]
    if group_by_length:
        window = 64 * global_batch
        order = [i for w in range(0, len(order), window)
                 for i in sorted(order[w:w + window], key=lambda i: lengths[i])]
    batches = [order[b * global_batch:(b + 1) * global_batch] for b in range(n_batches)]
    if group_by_length:
        rng.shuffle(batches)
    return batches


def micro_batches(batch: list, lengths: list, world_size: int, rank: int, grad_accum: int) -> list:
    """This rank's `grad_accum` micro-batches of one global batch; sorted by length first so padding stays small."""
    ordered = sorted(batch, key=lambda i: lengths[i])
    per = len(batch) // (world_size * grad_accum)
    return [ordered[(a * world_size + rank) * per:(a * world_size + rank + 1) * per] for a in range(grad_accum)]


def eval_batches(lengths: list, batch_size: int, world_size: int = 1, rank: int = 0) -> list:
    """Length-sorted evaluation batches, dealt round-robin to ranks; every example is seen exactly once."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    return batches[rank::world_size]
