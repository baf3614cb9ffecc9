"""Batched per-step P(correct) (sharded over ranks), a scoring API, and the full metric report of a set. Depends on: torch, tqdm, prm.data, prm.metrics, prm.runtime."""
import contextlib

import torch
from tqdm import tqdm

from prm.data import IGNORE, collate, eval_batches, pad_token_id, tokenize_batch
from prm.metrics import first_error, outcome_metrics, processbench_metrics, step_metrics
from prm.runtime import Runtime, gather_objects


@torch.inference_mode()
def predict(model, rows, batch_size: int, pad_id: int, device, amp_dtype=None, rt: Runtime = Runtime(),
            progress: bool = True) -> list:
    """For each row (dict with input_ids/labels), in the input order: (P(correct) per labeled step, labels).

    Length-sorted batches are dealt to ranks; the per-rank results are gathered once, so the output is the same
    whatever the world size."""
    was_training = model.training
    model.eval()
    lengths = [len(r["input_ids"]) for r in rows]
    batches = eval_batches(lengths, batch_size, rt.world_size, rt.rank)
    amp = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype else contextlib.nullcontext()
    local = {}
    for idx in tqdm(batches, desc="eval", disable=not (progress and rt.is_main), leave=False):
        batch = collate([rows[i] for i in idx], pad_id)
        with amp:
            logits = model(batch["input_ids"].to(device), batch["attention_mask"].to(device))  # (B, T, 2)
        probs = torch.softmax(logits.float(), dim=-1)[..., 1].cpu()  # (B, T)
        for b, i in enumerate(idx):
            mask = batch["labels"][b] != IGNORE
            local[i] = (probs[b][mask].tolist(), batch["labels"][b][mask].tolist())
    merged = {}
    for part in gather_objects(local, rt):
        merged.update(part)
    model.train(was_training)
    return [merged[i] for i in range(len(rows))]


def evaluate(model, rows, batch_size: int, pad_id: int, device, amp_dtype=None, threshold: float = 0.5,
             rt: Runtime = Runtime(), progress: bool = True) -> dict:
    """Step metrics over every labeled step of the set (counted, never a mean of batch means)."""
    preds = predict(model, rows, batch_size, pad_id, device, amp_dtype, rt, progress)
    probs = [p for ps, _ in preds for p in ps]
    labels = [y for _, ys in preds for y in ys]
    return {**step_metrics(probs, labels, threshold), "n_examples": len(rows)}


@torch.inference_mode()
def score(model, tokenizer, prompt, steps: list, step_separator: str = "\n", max_length=None,
          max_completion_length=None) -> list:
    """P(correct) for each step of one solution, tokenized exactly as in training."""
    return score_batch(model, tokenizer, [(prompt, steps)], step_separator, max_length,
                       max_completion_length=max_completion_length)[0]


@torch.inference_mode()
def score_batch(model, tokenizer, solutions: list, step_separator: str = "\n", max_length=None,
                batch_size: int = 16, amp_dtype=None, rt: Runtime = Runtime(), progress: bool = False,
                max_completion_length=None) -> list:
    """[(prompt, steps), ...] -> [[P(correct) per step], ...], every step scored whatever its label.

    Truncation keeps whole steps, so each list is a prefix: steps cut by max_completion_length or max_length get
    no score."""
    device = next(model.parameters()).device
    rows = []
    for start in range(0, len(solutions), 256):  # one tokenizer call per chunk of solutions
        chunk = solutions[start:start + 256]
        cols = tokenize_batch({"prompt": [p for p, _ in chunk], "completions": [list(s) for _, s in chunk],
                               "labels": [[1] * len(s) for _, s in chunk]},  # a dummy label marks every step end
                              tokenizer, step_separator, max_length, is_eval=True,
                              max_completion_length=max_completion_length)
        rows += [{"input_ids": ids, "labels": labels} for ids, labels in zip(cols["input_ids"], cols["labels"])]
    scored = [i for i, r in enumerate(rows) if any(y != IGNORE for y in r["labels"])]  # no step fits: no forward
    preds = predict(model, [rows[i] for i in scored], batch_size, pad_token_id(tokenizer), device, amp_dtype, rt,
                    progress)
    out = [[] for _ in rows]
    for i, (p, _) in zip(scored, preds):
        out[i] = p
    return out


def true_first_error(row: dict) -> int:
    """The row's `first_error` if it has one, else the first step labeled wrong (unlabeled steps skipped), or -1."""
    if row.get("first_error") is not None:
        return row["first_error"]
    return next((i for i, y in enumerate(row["labels"]) if y is not None and y < 0.5), -1)


def report(step_probs: list, rows: list, threshold: float = 0.5, processbench: bool = False) -> dict:
    """Every metric of one set, from each row's scored-step P(correct) (score_batch) and its truth.

    rows: dicts with completions, labels (None = unlabeled step), optionally first_error and final_answer_correct.
    Unlabeled steps are scored (ProcessBench needs them) but stay out of the step metrics. A row without a single
    scored step is left out of every metric and counted in examples_dropped; a truncated row (some steps unscored)
    is kept and its first error is looked for among its scored steps only."""
    kept = [(ps, row) for ps, row in zip(step_probs, rows) if ps]
    pairs = [(p, float(y)) for ps, row in kept for p, y in zip(ps, row["labels"]) if y is not None]
    out = {"n_examples": len(kept), **step_metrics([p for p, _ in pairs], [y for _, y in pairs], threshold),
           "examples_dropped": len(rows) - len(kept),
           "examples_truncated": sum(len(ps) < len(row["completions"]) for ps, row in kept)}
    if processbench:
        out.update(processbench_metrics([first_error(ps, threshold) for ps, _ in kept],
                                        [true_first_error(row) for _, row in kept]))
    outcomes = [row.get("final_answer_correct") for _, row in kept]
    if any(y is not None for y in outcomes):
        out.update(outcome_metrics([ps for ps, _ in kept], outcomes))
    return out
