"""Batched per-step P(correct) for a tokenized set (sharded over ranks), its metrics, and a scoring API. Depends on: torch, prm.data, prm.metrics, prm.runtime."""
import contextlib

import torch
from tqdm import tqdm

from prm.data import IGNORE, collate, eval_batches, pad_token_id, tokenize_example
from prm.metrics import step_metrics
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
def score(model, tokenizer, prompt, steps: list, step_separator: str = "\n", max_length=None) -> list:
    """P(correct) for each step of one solution, tokenized exactly as in training."""
    return score_batch(model, tokenizer, [(prompt, steps)], step_separator, max_length)[0]


@torch.inference_mode()
def score_batch(model, tokenizer, solutions: list, step_separator: str = "\n", max_length=None,
                batch_size: int = 16) -> list:
    """[(prompt, steps), ...] -> [[P(correct) per step], ...]; steps cut by max_length get no score."""
    device = next(model.parameters()).device
    rows = [tokenize_example({"prompt": p, "completions": s, "labels": [1] * len(s)}, tokenizer, step_separator,
                             max_length, is_eval=True) for p, s in solutions]
    preds = predict(model, rows, batch_size, pad_token_id(tokenizer), device, progress=False)
    return [p for p, _ in preds]
