"""Metrics PRM papers report: step classes, AUROC, ProcessBench, best-of-N, PRMBench's score."""
import bisect
import math
import random
from collections import Counter, defaultdict
from itertools import groupby


def _ratio(a, b):
    return a / b if b else None


def auroc(scores: list, positives: list):
    """P(a positive outscores a negative), ties half; None: a class empty or a NaN."""
    if any(s != s for s in scores):
        return None
    n_pos = sum(map(bool, positives))
    n_neg = len(positives) - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    wins, negs_below = 0.0, 0
    for _, group in groupby(sorted(zip(scores, positives)), key=lambda pair: pair[0]):
        labels = [y for _, y in group]
        group_pos = sum(map(bool, labels))
        group_neg = len(labels) - group_pos
        wins += group_pos * (negs_below + 0.5 * group_neg)
        negs_below += group_neg
    return wins / (n_pos * n_neg)


def step_metrics(probs: list, labels: list, threshold: float = 0.5) -> dict:
    """Accuracy, per-class precision/recall/F1 (class 0: wrong step), AUROC."""
    truth = [y >= 0.5 for y in labels]
    n = Counter(zip(truth, (p >= threshold for p in probs)))  # (truth, predicted) -> steps
    out = {"n_steps": len(truth), "step_accuracy": _ratio(n[0, 0] + n[1, 1], len(truth)),
           "positive_rate": _ratio(sum(truth), len(truth))}
    for cls in (0, 1):
        tp, fp, fn = n[cls, cls], n[1 - cls, cls], n[cls, 1 - cls]
        out[f"precision_{cls}"], out[f"recall_{cls}"] = _ratio(tp, tp + fp), _ratio(tp, tp + fn)
        out[f"f1_{cls}"] = _ratio(2 * tp, 2 * tp + fp + fn)
    out["auroc"] = auroc(probs, truth)
    return out


def first_error(probs: list, threshold: float = 0.5) -> int:
    """The first step with P(correct) < threshold; -1: none."""
    return next((i for i, p in enumerate(probs) if p < threshold), -1)


def harmonic_mean(a, b):
    if a is None or b is None:
        return None
    return 2 * a * b / (a + b) if a + b else 0.0


def processbench_metrics(predicted: list, truth: list) -> dict:
    """First-error indices (-1: none) -> accuracy with and without an error, their F1."""
    hits_error = [p == t for p, t in zip(predicted, truth) if t >= 0]
    hits_correct = [p == -1 for p, t in zip(predicted, truth) if t < 0]
    acc_error = _ratio(sum(hits_error), len(hits_error))
    acc_correct = _ratio(sum(hits_correct), len(hits_correct))
    return {"acc_error": acc_error, "acc_correct": acc_correct,
            "f1": harmonic_mean(acc_error, acc_correct),
            "n_with_error": len(hits_error), "n_without_error": len(hits_correct)}


def chance_f1(truth: list, n_steps: list, grid: int = 500) -> float:
    """ProcessBench F1 of flagging each step wrong with the best probability q."""
    n_errors, n_passes = sum(t >= 0 for t in truth), sum(t < 0 for t in truth)
    if not n_errors or not n_passes:
        return None
    hittable = Counter(t for t, n in zip(truth, n_steps) if 0 <= t < n)  # error index -> solutions
    passes = Counter(n for t, n in zip(truth, n_steps) if t < 0)  # steps -> error-free solutions
    def f1(q):
        hit = sum(c * (1 - q) ** t * q for t, c in hittable.items()) / n_errors
        return harmonic_mean(hit, sum(c * (1 - q) ** n for n, c in passes.items()) / n_passes)
    return max(f1(k / grid) for k in range(1, grid))


AGGREGATES = {"min": min, "prod": math.prod, "last": lambda ps: ps[-1],
              "mean": lambda ps: sum(ps) / len(ps)}
VOTES = (*(f"weighted_{a}" for a in AGGREGATES), "majority_vote")
BEST_OF_N_METHODS = (*AGGREGATES, *VOTES, "oracle", "random")


def outcome_metrics(step_probs: list, final_correct: list) -> dict:
    kept = [(ps, bool(y)) for ps, y in zip(step_probs, final_correct) if ps and y is not None]
    return {f"outcome_auroc_{name}": auroc([agg(ps) for ps, _ in kept], [y for _, y in kept])
            for name, agg in AGGREGATES.items()}


def _hit_interval(probs: list, truth: int):
    """(lo, hi): first_error(probs, t) == truth iff lo < t <= hi."""
    if truth < 0:
        return -math.inf, min(probs, default=math.inf)
    if truth >= len(probs):
        return None
    lo, hi = probs[truth], min(probs[:truth], default=math.inf)
    return (lo, hi) if lo < hi else None


def tune_threshold(step_probs: list, truth: list):
    """(threshold, f1) of the best ProcessBench F1, mid-way between hit-interval ends."""
    n_error = sum(t >= 0 for t in truth)
    n_correct = len(truth) - n_error
    if not n_error or not n_correct:
        raise ValueError("tuning the threshold needs solutions both with and without an error")
    intervals = {True: [], False: []}  # has an error -> (lo, hi)
    for probs, t in zip(step_probs, truth):
        interval = _hit_interval(probs, t)
        if interval:
            intervals[t >= 0].append(interval)
    ends = {e: (sorted(lo for lo, _ in v), sorted(hi for _, hi in v)) for e, v in intervals.items()}

    def hits(has_error, t):  # intervals with lo < t <= hi
        lows, highs = ends[has_error]
        return bisect.bisect_left(lows, t) - bisect.bisect_left(highs, t)

    points = sorted({x for lows, highs in ends.values() for x in lows + highs if math.isfinite(x)})
    best, left = None, -math.inf
    for right in points:  # the stretch (left, right] predicts alike
        t = (left + right) / 2
        t, left = t if t > left else right, right  # the first stretch, two adjacent floats: right
        f1 = harmonic_mean(hits(True, t) / n_error, hits(False, t) / n_correct)
        if best is None or (f1, -abs(t - 0.5)) > (best[1], -abs(best[0] - 0.5)):
            best = (t, f1)
    return best if best else (0.5, 0.0)


def solution_score(step_probs: list, how: str) -> float:  # no scored step: ranks last
    return AGGREGATES[how](step_probs) if step_probs else -math.inf


def picked(keys: list, scores: list, how: str, aggregate: str) -> list:
    """The tied winners (lists of candidate indices) by `how`: best-of-n (top aggregate), majority
    or weighted (the answer key with most candidates, or top aggregate sum; unscored: 0)."""
    if how == "best-of-n":
        values = [solution_score(s, aggregate) for s in scores]
        return [[i] for i, v in enumerate(values) if v == max(values)]
    votes, members = defaultdict(float), defaultdict(list)
    for i, (key, s) in enumerate(zip(keys, scores)):
        if key is not None:
            votes[key] += 1 if how == "majority" else AGGREGATES[aggregate](s) if s else 0.0
            members[key].append(i)
    # weights tied (e.g. nothing scored): the most candidates
    best = max(((v, len(members[k])) for k, v in votes.items()), default=None)
    return [members[k] for k, v in votes.items() if (v, len(members[k])) == best]


def pick_accuracy(cands: list, method: str) -> float:
    """Expected accuracy of `method` picking among `cands`; ties share it."""
    correct = [bool(c["correct"]) for c in cands]
    if method == "oracle":
        return float(any(correct))
    if method == "random":
        return sum(correct) / len(correct)
    how, aggregate = ("best-of-n", method) if method in AGGREGATES else \
        ("majority", "min") if method == "majority_vote" else ("weighted", method[9:])
    wins = picked([c.get("answer") for c in cands], [c["step_probs"] for c in cands], how,
                  aggregate)
    return sum(sum(correct[i] for i in w) / len(w) for w in wins) / len(wins) if wins else 0.0


def _subsets(n: int, size: int, draws: int, rng: random.Random) -> list:
    """Each draw shuffles range(n) and cuts disjoint subsets; the rest sits out."""
    if size >= n:
        return [list(range(n))]
    out = []
    for _ in range(draws):
        order = list(range(n))
        rng.shuffle(order)
        out += [order[i:i + size] for i in range(0, n - size + 1, size)]
    return out


def best_of_n(groups: list, *, draws: int = 8, seed: int = 0) -> dict:
    """{method: {"1": acc, ..., "all": acc}}: mean accuracy over problems and subsets of N."""
    if not groups or not all(groups):
        raise ValueError("best-of-N needs at least one problem, each with a candidate")
    largest = max(len(g) for g in groups)
    sizes = [2 ** k for k in range(largest.bit_length()) if 2 ** k < largest] + [largest]
    voting = any(c.get("answer") is not None for g in groups for c in g)
    methods = [m for m in BEST_OF_N_METHODS if voting or m not in VOTES]
    out = {m: {} for m in methods}
    for size in sizes:
        rng = random.Random(f"{seed}/{size}")
        picks = [[[g[i] for i in idx] for idx in _subsets(len(g), size, draws, rng)]
                 for g in groups]
        for m in methods:
            per_group = [sum(pick_accuracy(s, m) for s in subs) / len(subs) for subs in picks]
            out[m]["all" if size == largest else str(size)] = sum(per_group) / len(per_group)
    return out


def prmbench_metrics(step_probs: list, step_ok: list, categories: list,
                     threshold: float = 0.5) -> dict:
    """PRMScore overall (but category "correct") and per category."""
    pooled = defaultdict(list)  # category -> [(P(correct), correct)]
    for ps, ok, cat in zip(step_probs, step_ok, categories):
        pooled[cat] += [(p, y) for p, y in zip(ps, ok) if y is not None]
    overall = [pair for cat, pairs in pooled.items() if cat != "correct" for pair in pairs]
    pooled.pop(None, None)
    per_cat = {cat: _prmscore(pairs, threshold) for cat, pairs in sorted(pooled.items())}
    return {**_prmscore(overall, threshold), "categories": per_cat}


def _prmscore(pairs: list, threshold: float) -> dict:
    m = step_metrics([p for p, _ in pairs], [y for _, y in pairs], threshold)
    score = None if None in (m["f1_1"], m["f1_0"]) else 0.5 * m["f1_1"] + 0.5 * m["f1_0"]
    return {"prmscore": score, "f1": m["f1_1"], "f1_neg": m["f1_0"], "n_steps": m["n_steps"]}
