"""Step labels on tokens, the collator, the packer, and batch plans by which 2 ranks equal 1.
A row: prompt, completions (step texts), labels (one per step, put on the last token of the step's
separator)."""
import math
import random

import torch

IGNORE = -100  # the loss skips it
# A tokenized row's columns ([t]: a list of t); step_labels: every step's, cut ones too.
COLUMNS = {"input_ids": ["int32"], "labels": ["float32"], "steps_kept": "int32", "length": "int32",
           "step_ends": ["int32"], "n_labeled": "int32", "step_labels": ["float64"]}


def label_problem(y):
    """Why y is no step label (bool, 0/1, float in [0, 1], None: unscored); None if it is."""
    hard = y is None or isinstance(y, bool) or (type(y) is int and y in (0, 1))
    if hard or isinstance(y, float) and 0.0 <= y <= 1.0:
        return None
    return f"{type(y).__name__} {y!r}"[:80] + " is not a bool, 0/1 or a float in [0, 1]"


def normalize_label(label):
    """bool, 0/1 -> int; floats stay (soft labels); None (unscored) -> IGNORE."""
    if problem := label_problem(label):
        raise ValueError(f"label {problem}")
    if label is None:
        return IGNORE
    return label if isinstance(label, float) else int(label)


def prompt_ids(prompt, tokenizer) -> list:
    """BOS + prompt ids; a chat (a list of {role, content}) goes through its template."""
    if isinstance(prompt, list):  # the template adds its special tokens
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return bos + tokenizer(prompt, add_special_tokens=False)["input_ids"]


def separator_ids(tokenizer, step_separator: str) -> list:
    ids = tokenizer(step_separator, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError(f"step separator {step_separator!r} tokenizes to nothing")
    return ids


def make_row(ids: list, ends: list, labels: list, *, first: int = 0, max_length=None,
             max_completion_length=None, train_on_last_step_only=False, is_eval=False) -> dict:
    """The row from ids, label positions (`ends`) and labels; first: the first step token.
    Caps (0/None: none) keep whole steps; none kept: the prompt alone."""
    step_labels = [normalize_label(y) for y in labels]
    if len(ends) != len(step_labels):
        raise ValueError(f"{len(ends)} steps but {len(labels)} labels")
    if train_on_last_step_only and not is_eval:
        # an unscored last step after a wrong one is wrong too
        last = 0 if step_labels[-1] == IGNORE and 0 in step_labels else step_labels[-1]
        step_labels = [IGNORE] * (len(step_labels) - 1) + [last]
    kept = [e for e in ends if (max_length is None or e < max_length)
            and not (max_completion_length and e - first >= max_completion_length)]
    ids = ids[:kept[-1] + 1] if kept else ids[:first][:max_length]
    out = [IGNORE] * len(ids)
    for e, y in zip(kept, step_labels):
        out[e] = y
    return {"input_ids": ids, "labels": out, "steps_kept": len(kept), "step_ends": kept,
            "length": len(ids), "n_labeled": len(out) - out.count(IGNORE),
            "step_labels": [None if y is None else float(y) for y in labels]}


def tokenize_example(example, tokenizer, step_separator="\n", max_length=None,
                     train_on_last_step_only=False, is_eval=False,
                     max_completion_length=None) -> dict:
    """{prompt, completions, labels} -> the tokenized row. With BOS id 1, separator "\\n" = 9:

        {"prompt": "q", "completions": ["ab", "c"], "labels": [True, False]}
        input_ids: [ 1,    q,    a,    b,  9,    c,  9]
        labels:    [-100, -100, -100, -100, 1, -100, 0]   steps_kept: 2, step_ends: [4, 6]
        length: 7, n_labeled: 2, step_labels: [1.0, 0.0]
    Steps and separator are tokenized apart (joined text merges differently with BPE)."""
    sep, steps = separator_ids(tokenizer, step_separator), example["completions"]
    ids = prompt_ids(example["prompt"], tokenizer)
    first, ends = len(ids), []
    for step in tokenizer(steps, add_special_tokens=False)["input_ids"] if steps else []:
        ids += step + sep
        ends.append(len(ids) - 1)
    return make_row(ids, ends, example["labels"], first=first, max_length=max_length,
                    max_completion_length=max_completion_length,
                    train_on_last_step_only=train_on_last_step_only, is_eval=is_eval)


def tokenize_batch(batch: dict, tokenizer, step_separator="\n", **kw) -> dict:
    """tokenize_example over columns (datasets.map's batched form)."""
    examples = zip(batch["prompt"], batch["completions"], batch["labels"])
    return columns([tokenize_example({"prompt": p, "completions": c, "labels": y}, tokenizer,
                                     step_separator, **kw) for p, c, y in examples])


def columns(rows: list) -> dict:
    """Rows -> {column: values}, datasets.map's batched form."""
    return {k: [r[k] for r in rows] for k in COLUMNS}


def collate(rows: list, pad_id: int) -> dict:
    """Right padding; ids and mask int64, labels float32."""
    width = max(len(r["input_ids"]) for r in rows)
    shape = (len(rows), width)  # (B, T)
    ids = torch.full(shape, pad_id, dtype=torch.long)
    mask = torch.zeros(shape, dtype=torch.long)
    labels = torch.full(shape, float(IGNORE), dtype=torch.float32)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.as_tensor(r["input_ids"], dtype=torch.long)
        mask[i, :n] = 1
        labels[i, :n] = torch.as_tensor(r["labels"], dtype=torch.float32)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def pack(rows: list, pad_id: int, pack_to: int = 0) -> dict:
    """The rows back to back in ONE row, in transformers' padding-free keywords. pack_to > 0 pads
    to a multiple of pack_to with one more example (batches share shapes). For [a b c], [d e]:
      input_ids    [a b c d e]        with pack_to=4: [a b c d e P P P]
      position_ids [0 1 2 0 1]                        [0 1 2 0 1 0 1 2]
      cu_seq_lens  [0 3 5]                            [0 3 5 8]"""
    lengths = [len(r["input_ids"]) for r in rows]
    n = sum(lengths)
    width = -(-n // pack_to) * pack_to if pack_to else n
    if pack_to:
        lengths.append(width - n)
    ids = torch.full((1, width), pad_id, dtype=torch.long)  # (1, N)
    labels = torch.full((1, width), float(IGNORE), dtype=torch.float32)  # (1, N)
    pos = torch.cat([torch.arange(k) for k in lengths]).unsqueeze(0)  # (1, N)
    ids[0, :n] = torch.as_tensor([t for r in rows for t in r["input_ids"]], dtype=torch.long)
    labels[0, :n] = torch.as_tensor([y for r in rows for y in r["labels"]], dtype=torch.float32)
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)  # (n + 1,)
    # an upper bound suffices; with pack_to, the same in every batch
    max_length = width if pack_to else max(lengths)
    return {"input_ids": ids, "position_ids": pos, "labels": labels, "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu, "max_length_q": max_length, "max_length_k": max_length}


def pad_token_id(tokenizer) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad nor an EOS token: set its pad_token")
    return pad


def global_batches(lengths: list, global_batch: int, seed: int, epoch: int,
                   group_by_length: bool) -> list:
    """The epoch's batches from (seed, epoch) alone; grouping sorts windows of 64 batches by
    length, then shuffles the batches."""
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    n = math.ceil(len(order) / global_batch) * global_batch
    # the first indices fill the last batch: every rank runs as many micro-batches
    order = (order * math.ceil(n / max(len(order), 1)))[:n]
    if group_by_length:
        window = 64 * global_batch
        order = [i for w in range(0, len(order), window)
                 for i in sorted(order[w:w + window], key=lambda i: lengths[i])]
    batches = [order[b:b + global_batch] for b in range(0, n, global_batch)]
    if group_by_length:
        rng.shuffle(batches)
    return batches


def micro_batches(batch: list, lengths: list, world_size: int, rank: int, grad_accum: int) -> list:
    """This rank's chunks of the length-sorted batch: micro-step a of rank r takes chunk
    a x world_size + r, so every split sees the same examples."""
    ordered = sorted(batch, key=lambda i: lengths[i])
    per, n = len(batch) // (world_size * grad_accum), world_size * grad_accum
    return [ordered[c * per:(c + 1) * per] for c in range(n)][rank::world_size]


def padded_tokens(batch: list, lengths: list, n_chunks: int, pack_to=None) -> int:
    """Tokens with padding in micro_batches' chunks, padded (pack_to None) or packed."""
    ordered = sorted(lengths[i] for i in batch)
    per = len(batch) // n_chunks
    if pack_to is not None:
        unit = pack_to or 1
        return sum(-(-sum(ordered[c * per:(c + 1) * per]) // unit) * unit for c in range(n_chunks))
    return sum(per * ordered[(c + 1) * per - 1] for c in range(n_chunks))


def eval_batches(lengths: list, batch_size: int) -> list:
    """Length-sorted evaluation batches."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
