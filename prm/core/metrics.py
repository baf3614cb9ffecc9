"""Metrics PRM papers report (step classes, AUROC, ProcessBench first error, outcome ranking, best-of-N,
PRMBench's PRMScore), counted over the whole set. Depends on: stdlib only."""
import bisect
import math
import random
from collections import Counter, defaultdict
from itertools import groupby


def _ratio(a, b):
    """None when nothing was counted: an undefined metric prints as null, never as a flattering 0 or 1."""
    return a / b if b else None


def auroc(scores: list, positives: list):
    """P(score of a random positive > score of a random negative), ties counted half; None if a class is
    empty or a score is NaN (a diverged model: no ranking to measure)."""
    if any(s != s for s in scores):  # NaN is the one value unequal to itself; it would also break the sort
        return None
    n_pos = sum(1 for y in positives if y)
    n_neg = len(positives) - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    wins, negs_below = 0.0, 0
    for _, group in groupby(sorted(zip(scores, positives)), key=lambda pair: pair[0]):  # equal scores
        labels = [y for _, y in group]
        group_pos = sum(1 for y in labels if y)
        group_neg = len(labels) - group_pos
        wins += group_pos * (negs_below + 0.5 * group_neg)
        negs_below += group_neg
    return wins / (n_pos * n_neg)


def step_metrics(probs: list, labels: list, threshold: float = 0.5) -> dict:
    """Accuracy, per-class precision/recall/F1 (class 0 = wrong step), positive rate, AUROC.
    A step is predicted correct when P(correct) >= threshold; soft labels count as correct when >= 0.5.
    positive_rate is the share of truly correct steps: the accuracy of always answering "correct"."""
    truth = [y >= 0.5 for y in labels]
    n = Counter(zip(truth, (p >= threshold for p in probs)))  # (truly correct, predicted correct) -> steps
    out = {"n_steps": len(truth), "step_accuracy": _ratio(n[0, 0] + n[1, 1], len(truth)),
           "positive_rate": _ratio(sum(truth), len(truth))}
    for cls in (0, 1):
        tp, fp, fn = n[cls, cls], n[1 - cls, cls], n[cls, 1 - cls]
        out[f"precision_{cls}"], out[f"recall_{cls}"] = _ratio(tp, tp + fp), _ratio(tp, tp + fn)
        out[f"f1_{cls}"] = _ratio(2 * tp, 2 * tp + fp + fn)  # defined when the class is predicted or present
    out["auroc"] = auroc(probs, truth)
    return out


def first_error(probs: list, threshold: float = 0.5) -> int:
    """ProcessBench's prediction: the index of the first step with P(correct) < threshold; -1: none."""
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


def chance_f1(truth: list, n_steps: list, grid: int = 500) -> float:
    """ProcessBench F1 of a scorer that knows nothing: it calls each step wrong at random with one probability
    q, the best q on a grid of 1/grid. A solution's first error t is then hit with probability (1-q)^t q, one
    with n steps and no error passes with (1-q)^n; F1 is taken of those expected accuracies. An F1 near this
    one comes from the threshold (how many steps are flagged), not from the ranking of steps."""
    n_errors, n_passes = sum(t >= 0 for t in truth), sum(t < 0 for t in truth)
    if not n_errors or not n_passes:
        return None
    # counts of each distinct error index and step count: the grid loop runs over a few values, not every row
    hittable = Counter(t for t, n in zip(truth, n_steps) if 0 <= t < n)  # past the scored steps: never hit
    passes = Counter(n for t, n in zip(truth, n_steps) if t < 0)
    def f1(q):
        hit = sum(c * (1 - q) ** t * q for t, c in hittable.items()) / n_errors
        return harmonic_mean(hit, sum(c * (1 - q) ** n for n, c in passes.items()) / n_passes)
    return max(f1(k / grid) for k in range(1, grid))


AGGREGATES = {"min": min, "prod": math.prod, "last": lambda ps: ps[-1], "mean": lambda ps: sum(ps) / len(ps)}


def outcome_metrics(step_probs: list, final_correct: list) -> dict:
    """AUROC of each per-solution aggregate of step scores against final-answer correctness.
    Solutions without a scored step or without a known outcome (None) are left out."""
    kept = [(ps, bool(y)) for ps, y in zip(step_probs, final_correct) if ps and y is not None]
    return {f"outcome_auroc_{name}": auroc([agg(ps) for ps, _ in kept], [y for _, y in kept])
            for name, agg in AGGREGATES.items()}


def _hit_interval(probs: list, truth: int):
    """The thresholds t (an interval lo < t <= hi) for which first_error(probs, t) == truth; None: none.
    No error: every step must stay >= t. Error at k: steps before k stay >= t and step k falls below it. An
    error step that was never scored (truncated) can never be hit."""
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
    intervals = {True: [], False: []}  # has_error -> the solutions' hit intervals
    for probs, t in zip(step_probs, truth):
        interval = _hit_interval(probs, t)
        if interval:
            intervals[t >= 0].append(interval)
    ends = {e: (sorted(lo for lo, _ in v), sorted(hi for _, hi in v)) for e, v in intervals.items()}  # sorted

    def hits(has_error, t):  # intervals with lo < t <= hi (a non-empty interval with hi < t has lo < t too)
        lows, highs = ends[has_error]
        return bisect.bisect_left(lows, t) - bisect.bisect_left(highs, t)

    points = sorted({x for lows, highs in ends.values() for x in lows + highs if math.isfinite(x)})
    best = None
    for j, right in enumerate(points):  # all of the stretch (points[j-1], right] predicts alike
        t = right if j == 0 else (points[j - 1] + right) / 2
        t = t if j == 0 or t > points[j - 1] else right  # two adjacent floats have no middle
        f1 = harmonic_mean(hits(True, t) / n_error, hits(False, t) / n_correct)
        if best is None or (f1, -abs(t - 0.5)) > (best[1], -abs(best[0] - 0.5)):
            best = (t, f1)
    return best if best else (0.5, 0.0)


def solution_score(step_probs: list, how: str) -> float:
    """One number per solution from its step scores; a solution with no scored step (all cut) ranks last."""
    return AGGREGATES[how](step_probs) if step_probs else -math.inf


def _expected_hit(values: list, correct: list) -> float:
    """Accuracy of taking the candidate with the highest value, ties broken at random (their expectation)."""
    top = max(values)
    tied = [c for v, c in zip(values, correct) if v == top]
    return sum(tied) / len(tied)


VOTE_AGGREGATE = "min"  # what weighted voting sums per answer: each candidate's min step score


def pick_accuracy(cands: list, method: str) -> float:
    """How often `method` picks a correct candidate of `cands` ({"step_probs", "correct", "answer"}): 0, 1, or
    an expectation over its ties. min/prod/last/mean: the best aggregated score; weighted_vote: the answer
    whose candidates' scores sum highest; majority_vote: the most frequent answer (candidates without one do
    not vote; if none has one: wrong); oracle: any correct; random: the mean."""
    correct = [bool(c["correct"]) for c in cands]
    if method in AGGREGATES:
        return _expected_hit([solution_score(c["step_probs"], method) for c in cands], correct)
    if method == "oracle":
        return float(any(correct))
    if method == "random":
        return sum(correct) / len(correct)
    votes, right = defaultdict(float), defaultdict(list)  # answer -> vote total, its candidates' correctness
    weighted = method == "weighted_vote"
    for c, ok in zip(cands, correct):
        if c.get("answer") is not None:
            votes[c["answer"]] += solution_score(c["step_probs"], VOTE_AGGREGATE) if weighted else 1
            right[c["answer"]].append(ok)
    if not votes:
        return 0.0
    return _expected_hit(list(votes.values()), [sum(r) / len(r) for r in right.values()])  # same key order


def _subsets(n: int, size: int, draws: int, rng: random.Random) -> list:
    """Index lists of `size` candidates: each draw shuffles all n and cuts them into disjoint subsets (a
    remainder sits that draw out), so every candidate is used equally often; N = 1 sees each once per draw."""
    if size >= n:
        return [list(range(n))]  # the whole group; its order never matters (ties count as expectations)
    out = []
    for _ in range(draws):
        order = list(range(n))
        rng.shuffle(order)
        out += [order[i:i + size] for i in range(0, n - size + 1, size)]
    return out


BEST_OF_N_METHODS = ("min", "prod", "last", "mean", "weighted_vote", "majority_vote", "oracle", "random")


def best_of_n(groups: list, *, draws: int = 8, seed: int = 0) -> dict:
    """Best-of-N accuracy: {method: {"1": acc, "2": acc, "4": ..., "all": acc}}, the mean over problems of the
    mean over that problem's subsets of N candidates (_subsets; fewer than N candidates: all of them). groups:
    per problem, in a fixed order, its candidates ({"step_probs", "correct", "answer"}); subsets are drawn
    from random.Random(seed) per N, then per group. Voting methods need a candidate with an answer."""
    if not groups or not all(groups):
        raise ValueError("best-of-N needs at least one problem, each with at least one candidate")
    largest = max(len(g) for g in groups)
    sizes = [2 ** k for k in range(largest.bit_length()) if 2 ** k < largest] + [largest]
    voting = any(c.get("answer") is not None for g in groups for c in g)
    methods = [m for m in BEST_OF_N_METHODS if voting or not m.endswith("_vote")]
    out = {m: {} for m in methods}
    for size in sizes:
        rng = random.Random(f"{seed}/{size}")  # a stream per N: adding an N changes no other figure
        picks = [[[g[i] for i in idx] for idx in _subsets(len(g), size, draws, rng)] for g in groups]
        for m in methods:
            per_group = [sum(pick_accuracy(s, m) for s in subsets) / len(subsets) for subsets in picks]
            out[m]["all" if size == largest else str(size)] = sum(per_group) / len(per_group)
    return out


def prmscore(n: dict) -> dict:
    """PRMScore = 0.5 x F1 (correct steps) + 0.5 x F1 (erroneous steps, PRMBench's "negative F1"), counted.
    F1 as 2tp / (2tp + fp + fn): the harmonic mean of precision and recall wherever both are defined; null
    when the class is neither present nor predicted. PRMScore is null when either F1 is."""
    f1 = _ratio(2 * n["tp"], 2 * n["tp"] + n["fp"] + n["fn"])
    f1_neg = _ratio(2 * n["tn"], 2 * n["tn"] + n["fn"] + n["fp"])
    score = None if f1 is None or f1_neg is None else 0.5 * f1 + 0.5 * f1_neg
    return {"prmscore": score, "f1": f1, "f1_neg": f1_neg, "n_steps": sum(n.values())}


def prmbench_metrics(step_probs: list, step_ok: list, categories: list, threshold: float = 0.5) -> dict:
    """PRMScore overall and per error category, from confusion counts pooled over their steps, a correct step
    the positive class (tp: a correct step judged correct; fp: an erroneous one judged correct). step_ok: per
    solution, True for each correct step, None for an unlabeled one; steps unlabeled or with no score
    (truncated) are not counted. Category "correct" (the error-free originals) is reported alone and left out
    of the overall figure, as PRMBench does."""
    overall, pooled = Counter(), defaultdict(Counter)  # {"tp": count, ...}: all errors, per category
    for ps, ok, cat in zip(step_probs, step_ok, categories):
        counts = pooled[cat]  # a category is reported even when none of its steps was scored
        for p, y in ((p, y) for p, y in zip(ps, ok) if y is not None):
            kind = ("t" if (p >= threshold) == y else "f") + ("p" if p >= threshold else "n")
            counts[kind] += 1
            if cat != "correct":
                overall[kind] += 1
    pooled.pop(None, None)  # a row of no category counts in the overall figure only
    return {**prmscore(overall), "categories": {cat: prmscore(n) for cat, n in sorted(pooled.items())}}
