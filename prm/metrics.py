"""Metrics PRM papers report (step classes, AUROC, ProcessBench first error, outcome ranking), counted over the whole set. Depends on: stdlib only."""
import bisect
import math


def _ratio(a, b):
    """None when nothing was counted: an undefined metric prints as null, never as a flattering 0 or 1."""
    return a / b if b else None


def auroc(scores: list, positives: list):
    """P(score of a random positive > score of a random negative), ties counted half; None if a class is empty
    or a score is NaN (a diverged model: no ranking to measure)."""
    if any(s != s for s in scores):  # NaN is the one value unequal to itself; it would also stall the walk below
        return None
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

    A step is predicted correct when P(correct) >= threshold; soft labels count as correct when >= 0.5.
    positive_rate is the share of truly correct steps: the accuracy of always answering "correct"."""
    truth = [y >= 0.5 for y in labels]
    pred = [p >= threshold for p in probs]
    out = {"n_steps": len(truth), "step_accuracy": _ratio(sum(t == q for t, q in zip(truth, pred)), len(truth)),
           "positive_rate": _ratio(sum(truth), len(truth))}
    for cls in (0, 1):
        tp = sum(t == cls and q == cls for t, q in zip(truth, pred))
        fp = sum(t != cls and q == cls for t, q in zip(truth, pred))
        fn = sum(t == cls and q != cls for t, q in zip(truth, pred))
        out[f"precision_{cls}"], out[f"recall_{cls}"] = _ratio(tp, tp + fp), _ratio(tp, tp + fn)
        out[f"f1_{cls}"] = _ratio(2 * tp, 2 * tp + fp + fn)  # defined whenever the class is predicted or present
    out["auroc"] = auroc(probs, truth)
    return out


def first_error(probs: list, threshold: float = 0.5) -> int:
    """ProcessBench's prediction: the index of the first step with P(correct) < threshold, or -1 if there is none."""
    return next((i for i, p in enumerate(probs) if p < threshold), -1)


def harmonic_mean(a, b):
    if a is None or b is None:
        return None
    return 2 * a * b / (a + b) if a + b else 0.0


def processbench_metrics(predicted: list, truth: list) -> dict:
    """First-error indices (-1 = no error) -> acc_error (exact index, solutions with an error), acc_correct
    (-1 predicted, solutions without one) and ProcessBench's F1, their harmonic mean."""
    hits_error = [p == t for p, t in zip(predicted, truth) if t >= 0]
    hits_correct = [p == -1 for p, t in zip(predicted, truth) if t < 0]
    acc_error = _ratio(sum(hits_error), len(hits_error))
    acc_correct = _ratio(sum(hits_correct), len(hits_correct))
    return {"acc_error": acc_error, "acc_correct": acc_correct, "f1": harmonic_mean(acc_error, acc_correct),
            "n_with_error": len(hits_error), "n_without_error": len(hits_correct)}


AGGREGATES = {"min": min, "prod": math.prod, "last": lambda ps: ps[-1], "mean": lambda ps: sum(ps) / len(ps)}


def outcome_metrics(step_probs: list, final_correct: list) -> dict:
    """AUROC of each per-solution aggregate of step scores against final-answer correctness.

    Solutions without a scored step or without a known outcome (None) are left out."""
    kept = [(ps, bool(y)) for ps, y in zip(step_probs, final_correct) if ps and y is not None]
    return {f"outcome_auroc_{name}": auroc([agg(ps) for ps, _ in kept], [y for _, y in kept])
            for name, agg in AGGREGATES.items()}


def _hit_interval(probs: list, truth: int):
    """The thresholds t (an interval lo < t <= hi) for which first_error(probs, t) == truth; None if there are none.

    No error: every step must stay >= t. Error at k: steps before k stay >= t and step k falls below it. An error
    step that was never scored (truncated) can never be hit."""
    if truth < 0:
        return -math.inf, min(probs, default=math.inf)
    if truth >= len(probs):
        return None
    lo, hi = probs[truth], min(probs[:truth], default=math.inf)
    return (lo, hi) if lo < hi else None


def tune_threshold(step_probs: list, truth: list):
    """The threshold maximizing ProcessBench F1 on a dev set, found exactly: (threshold, f1).

    Each solution is right on one interval of thresholds, so F1 only changes at interval ends; every stretch
    between two ends is tried, and the middle of the best one is returned (ties: the stretch nearest 0.5)."""
    n_error = sum(t >= 0 for t in truth)
    n_correct = len(truth) - n_error
    if not n_error or not n_correct:
        raise ValueError("tuning the threshold needs solutions both with and without an error")
    ends = {True: ([], []), False: ([], [])}  # has_error -> (sorted lows, sorted highs)
    for probs, t in zip(step_probs, truth):
        interval = _hit_interval(probs, t)
        if interval:
            ends[t >= 0][0].append(interval[0])
            ends[t >= 0][1].append(interval[1])
    for lows, highs in ends.values():
        lows.sort()
        highs.sort()

    def hits(has_error, t):  # intervals with lo < t <= hi (every non-empty interval with hi < t also has lo < t)
        lows, highs = ends[has_error]
        return bisect.bisect_left(lows, t) - bisect.bisect_left(highs, t)

    points = sorted({x for lows, highs in ends.values() for x in lows + highs if math.isfinite(x)})
    best = None
    for j, right in enumerate(points):  # the stretch (points[j-1], right] gives the same predictions throughout
        t = right if j == 0 else (points[j - 1] + right) / 2
        t = t if j == 0 or t > points[j - 1] else right  # two adjacent floats have no middle
        f1 = harmonic_mean(hits(True, t) / n_error, hits(False, t) / n_correct)
        if best is None or (f1, -abs(t - 0.5)) > (best[1], -abs(best[0] - 0.5)):
            best = (t, f1)
    return best if best else (0.5, 0.0)
