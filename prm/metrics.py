"""Metrics PRM papers report, computed from flat lists of per-step P(correct) and labels. Depends on: stdlib only."""


def _div(a, b):
    return a / b if b else 0.0


def auroc(scores: list, positives: list):
    """P(score of a random positive > score of a random negative), ties counted half; None if a class is empty."""
    pairs = sorted(zip(scores, positives))
    n_pos = sum(1 for _, y in pairs if y)
    n_neg = len(pairs) - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    wins, negs_below, i = 0.0, 0, 0
    while i < len(pairs):  # walk groups of equal score
        j = i
        while j < len(pairs) and pairs[j][0] == pairs[i][0]:
            j += 1
        group_pos = sum(1 for _, y in pairs[i:j] if y)
        group_neg = (j - i) - group_pos
        wins += group_pos * (negs_below + 0.5 * group_neg)
        negs_below += group_neg
        i = j
    return wins / (n_pos * n_neg)


def step_metrics(probs: list, labels: list, threshold: float = 0.5) -> dict:
    """Counted over the whole set: accuracy, per-class precision/recall/F1 (class 0 = wrong step), positive rate.

    Soft labels count as correct when >= 0.5."""
    truth = [y >= 0.5 for y in labels]
    pred = [p >= threshold for p in probs]
    out = {"n_steps": len(truth), "step_accuracy": _div(sum(t == q for t, q in zip(truth, pred)), len(truth)),
           "positive_rate": _div(sum(truth), len(truth))}
    for cls in (0, 1):
        tp = sum(t == cls and q == cls for t, q in zip(truth, pred))
        precision, recall = _div(tp, sum(q == cls for q in pred)), _div(tp, sum(t == cls for t in truth))
        out[f"precision_{cls}"], out[f"recall_{cls}"] = precision, recall
        out[f"f1_{cls}"] = _div(2 * precision * recall, precision + recall)
    out["auroc"] = auroc(probs, truth)
    return out
