"""Evaluation (predict, then report) for training and eval.py; the scoring API; best-of-N."""
import contextlib

import torch
from tqdm import tqdm

from .data import collate, eval_batches, pack, pad_token_id, tokenize_batch
from .metrics import (best_of_n, chance_f1, first_error, outcome_metrics, prmbench_metrics,
                         processbench_metrics, step_metrics)
from .model import input_settings
from .runtime import Runtime, gather_objects
from .varlen import is_packed


@torch.inference_mode()
def predict(model, rows, *, batch_size: int, pad_id: int, amp_dtype=None, rt: Runtime = Runtime(),
            progress: bool = True, lockstep: bool = False) -> list:
    """P(correct) at each row's `step_ends`, gathered on all ranks. lockstep: all ranks run as
    many forwards (as a sharded model needs)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    todo = [i for i, r in enumerate(rows) if r["step_ends"]]
    every = eval_batches([len(rows[i]["input_ids"]) for i in todo], batch_size)
    batches = every[rt.rank::rt.world_size]
    if lockstep and todo:  # the spare forwards rerun the first batch and drop its output
        batches += [None] * (-(-len(every) // rt.world_size) - len(batches))
    amp = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype else contextlib.nullcontext()
    local = {}
    off = not (progress and rt.is_main) or None  # None: a bar on a terminal only
    for batch in tqdm(batches, desc="eval", disable=off, leave=False):
        idx = [todo[j] for j in (batch or every[0])]
        probs = _forward(model, [rows[i] for i in idx], pad_id, amp, device)
        for b, i in enumerate(idx if batch else []):
            local[i] = probs[b][rows[i]["step_ends"]].tolist()
    merged = {i: p for part in gather_objects(local, rt) for i, p in part.items()}
    model.train(was_training)
    return [merged.get(i, []) for i in range(len(rows))]


def _forward(model, rows: list, pad_id: int, amp, device) -> list:
    """P(correct) at every token: one (T_i,) CPU tensor per row."""
    mb = pack(rows, pad_id) if is_packed(model) else collate(rows, pad_id)
    with amp:
        logits = model(**{k: v.to(device) if torch.is_tensor(v) else v
                          for k, v in mb.items() if k != "labels"})  # (B, T, 2); packed: (1, N, 2)
    probs = torch.softmax(logits.float(), dim=-1)[..., 1].cpu()  # (B, T); packed: (1, N)
    cu = mb["cu_seq_lens_q"].tolist() if "cu_seq_lens_q" in mb else None
    return probs if cu is None else [probs[0, s:e] for s, e in zip(cu, cu[1:])]


def true_first_error(row: dict) -> int:
    """The row's `first_error`, else its first step labeled wrong, else -1."""
    if row.get("first_error") is not None:
        return row["first_error"]
    return next((i for i, y in enumerate(row["step_labels"]) if y is not None and y < 0.5), -1)


def report(step_probs: list, rows: list, threshold: float = 0.5,
           processbench: bool = False) -> dict:
    """Every metric of one set from predict's output and the rows (step_labels, optional
    first_error, final_answer_correct, category). Rows with no scored step are dropped."""
    kept = [(ps, row) for ps, row in zip(step_probs, rows) if ps]
    scores, kept_rows = [ps for ps, _ in kept], [row for _, row in kept]
    pairs = [(p, y) for ps, row in kept for p, y in zip(ps, row["step_labels"]) if y is not None]
    probs, truth = [p for p, _ in pairs], [y for _, y in pairs]
    out = {"n_examples": len(kept), **step_metrics(probs, truth, threshold),
           "examples_dropped": len(rows) - len(kept),
           "examples_truncated": sum(len(ps) < len(row["step_labels"]) for ps, row in kept)}
    if processbench:
        truth = [true_first_error(row) for row in kept_rows]
        out.update(processbench_metrics([first_error(ps, threshold) for ps in scores], truth),
                   chance_f1=chance_f1(truth, [len(ps) for ps in scores]))
    outcomes = [row.get("final_answer_correct") for row in kept_rows]
    if any(y is not None for y in outcomes):
        out.update(outcome_metrics(scores, outcomes))
    categories = [row.get("category") for row in kept_rows]
    if any(c is not None for c in categories):
        ok = [[None if y is None else y >= 0.5 for y in row["step_labels"]] for row in kept_rows]
        out["prmbench"] = prmbench_metrics(scores, ok, categories, threshold)
    return out


def candidate_groups(step_probs: list, rows: list) -> list:
    """The candidates of each problem (`group`), in input order."""
    groups = {}
    for i, (ps, row) in enumerate(zip(step_probs, rows)):
        if row.get("final_answer_correct") is None:
            raise ValueError(f"row {row.get('id', i)}: best-of-N needs final_answer_correct "
                             "(a candidate's 'label')")
        if row.get("group") is None:
            raise ValueError(f"row {row.get('id', i)}: best-of-N needs the problem (a prompt or "
                             "question)")
        groups.setdefault(row["group"], []).append({
            "step_probs": ps, "correct": row["final_answer_correct"],
            "answer": row.get("response_answer")})
    return list(groups.values())


def best_of_n_report(step_probs: list, rows: list, *, draws: int, seed: int) -> dict:
    """best_of_n's accuracies and the candidate counts."""
    groups = candidate_groups(step_probs, rows)
    return {"best_of_n": best_of_n(groups, draws=draws, seed=seed), "n_problems": len(groups),
            "candidates_per_problem": sorted({len(g) for g in groups}),
            "candidates_with_answer": sum(c["answer"] is not None for g in groups for c in g)}


def score(model, tokenizer, prompt, steps: list, step_separator: str = None, **kw) -> list:
    """P(correct) for each step of one solution; kw: score_batch's."""
    return score_batch(model, tokenizer, [(prompt, steps)], step_separator, **kw)[0]


@torch.inference_mode()
def score_batch(model, tokenizer, solutions: list, step_separator: str = None, *, max_length=None,
                max_completion_length=None, batch_size: int = 16, amp_dtype=None,
                rt: Runtime = Runtime(), progress: bool = False, tokenize=None) -> list:
    """[(prompt, steps), ...] -> [[P(correct) per step], ...], tokenized as in training. Separator
    and caps default to the model's saved ones (else "\n", none; 0: none); cut steps get none."""
    saved = input_settings(getattr(model, "config", None))
    sep = step_separator if step_separator is not None else saved.get("step_separator", "\n")
    caps = {"max_length": max_length, "max_completion_length": max_completion_length}
    caps = {k: (v if v is not None else saved.get(k)) or None for k, v in caps.items()}
    rows = []
    for start in range(0, len(solutions), 256):
        chunk = solutions[start:start + 256]
        batch = {"prompt": [p for p, _ in chunk], "completions": [list(s) for _, s in chunk],
                 "labels": [[None] * len(s) for _, s in chunk]}  # unlabeled: all scored
        cols = (tokenize or tokenize_batch)(batch, tokenizer, sep, is_eval=True, **caps)
        rows += [dict(zip(cols, row)) for row in zip(*cols.values())]
    return predict(model, rows, batch_size=batch_size, pad_id=pad_token_id(tokenizer),
                   amp_dtype=amp_dtype, rt=rt, progress=progress)
