"""Metrics against hand-computed values, brute-force counts and a direct ProcessBench implementation.
Depends on: pytest, prm.core.metrics."""
import itertools
import math
import random

import pytest
import threading

from prm.core.metrics import (auroc, chance_f1, first_error, harmonic_mean, outcome_metrics, processbench_metrics,
                         step_metrics, tune_threshold)

approx = pytest.approx


def test_step_metrics_by_hand():
    # predicted correct: 1 0 1 0 1; truth: 1 0 0 1 1 -> right at steps 0, 1, 4
    m = step_metrics([0.9, 0.2, 0.6, 0.4, 0.8], [1, 0, 0, 1, 1], threshold=0.5)
    assert m["n_steps"] == 5 and m["step_accuracy"] == approx(3 / 5) and m["positive_rate"] == approx(3 / 5)
    # class 0: tp 1 (step 1), fp 1 (step 3), fn 1 (step 2); class 1: tp 2, fp 1, fn 1
    assert (m["precision_0"], m["recall_0"], m["f1_0"]) == approx((1 / 2, 1 / 2, 1 / 2))
    assert (m["precision_1"], m["recall_1"], m["f1_1"]) == approx((2 / 3, 2 / 3, 2 / 3))
    # positives 0.9 0.4 0.8 vs negatives 0.2 0.6: 2 + 1 + 2 of 6 pairs ordered right
    assert m["auroc"] == approx(5 / 6)


def test_threshold_is_inclusive_and_soft_labels_split_at_half():
    m = step_metrics([0.5, 0.49], [0.7, 0.3], threshold=0.5)  # P = threshold counts as correct
    assert m["step_accuracy"] == 1.0 and m["positive_rate"] == 0.5


def test_no_errors_in_the_set():
    m = step_metrics([0.9, 0.3, 0.7], [1, 1, 1])
    assert m["positive_rate"] == 1.0 and m["step_accuracy"] == approx(2 / 3)
    assert m["recall_0"] is None and m["precision_0"] == 0.0 and m["f1_0"] == 0.0  # one step called wrong, wrongly
    assert m["auroc"] is None
    m = step_metrics([0.9, 0.7], [1, 1])
    assert m["precision_0"] is None and m["recall_0"] is None and m["f1_0"] is None  # class 0 nowhere: undefined
    assert m["f1_1"] == 1.0


def test_all_errors():
    m = step_metrics([0.9, 0.3, 0.2], [0, 0, 0])
    assert m["positive_rate"] == 0.0 and m["step_accuracy"] == approx(2 / 3)
    assert (m["precision_0"], m["recall_0"]) == approx((1.0, 2 / 3)) and m["f1_0"] == approx(0.8)
    assert m["recall_1"] is None and m["precision_1"] == 0.0 and m["auroc"] is None


def test_threshold_that_predicts_everything_wrong():
    m = step_metrics([0.9, 0.3, 0.99, 0.1], [1, 0, 1, 1], threshold=1.01)
    assert m["step_accuracy"] == approx(1 / 4)  # only the one truly wrong step
    assert m["precision_1"] is None and m["recall_1"] == 0.0 and m["f1_1"] == 0.0
    assert (m["precision_0"], m["recall_0"]) == approx((1 / 4, 1.0)) and m["f1_0"] == approx(2 / 5)
    assert m["auroc"] == approx(2 / 3)  # a ranking metric: the threshold does not move it


def test_empty_set():
    m = step_metrics([], [])
    assert m["n_steps"] == 0 and m["step_accuracy"] is None and m["auroc"] is None


def brute_auroc(scores, positives):
    pairs = [(p, n) for p, yp in zip(scores, positives) if yp for n, yn in zip(scores, positives) if not yn]
    return sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in pairs) / len(pairs) if pairs else None


@pytest.mark.parametrize("seed", range(5))
def test_auroc_equals_brute_force_pair_count(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 60)
    scores = [round(rng.random(), 1) for _ in range(n)]  # rounding makes ties
    positives = [rng.random() < 0.6 for _ in range(n)]
    expected = brute_auroc(scores, positives)
    assert (auroc(scores, positives) is None) == (expected is None)
    if expected is not None:
        assert auroc(scores, positives) == approx(expected)


def test_auroc_extremes():
    assert auroc([0.1, 0.2, 0.8, 0.9], [0, 0, 1, 1]) == 1.0
    assert auroc([0.1, 0.2, 0.8, 0.9], [1, 1, 0, 0]) == 0.0
    assert auroc([0.5] * 4, [0, 1, 0, 1]) == 0.5
    assert auroc([0.3, 0.4], [1, 1]) is None


def test_first_error():
    assert first_error([0.9, 0.8, 0.3, 0.1]) == 2
    assert first_error([0.9, 0.5]) == -1  # P = threshold is not below it
    assert first_error([0.9, 0.5], threshold=0.6) == 1
    assert first_error([]) == -1
    assert first_error([0.2, 0.9], threshold=0.0) == -1


def direct_processbench_f1(step_probs, labels, threshold):
    """ProcessBench's evaluation as its authors wrote it, in percent: the first step below the threshold."""
    preds = []
    for probs in step_probs:
        pred = -1
        for i, p in enumerate(probs):
            if p < threshold:
                pred = i
                break
        preds.append(pred)
    error = [p == y for p, y in zip(preds, labels) if y != -1]
    correct = [p == y for p, y in zip(preds, labels) if y == -1]
    acc1, acc2 = sum(error) / len(error) * 100, sum(correct) / len(correct) * 100
    return 2 * acc1 * acc2 / (acc1 + acc2) if acc1 + acc2 else 0.0


ROWS = [  # (P(correct) per step, true first error)
    ([0.9, 0.8, 0.2, 0.4], 2),   # hit
    ([0.9, 0.3, 0.2], 2),        # predicted too early
    ([0.9, 0.8, 0.7], 1),        # missed
    ([0.1, 0.9], 0),             # hit at step 0
    ([0.9, 0.95, 0.6], -1),      # hit (no error)
    ([0.9, 0.45, 0.8], -1),      # false alarm
    ([0.7], -1),                 # hit
]


def test_processbench_against_the_direct_formula():
    probs, truth = [p for p, _ in ROWS], [t for _, t in ROWS]
    for threshold in (0.05, 0.3, 0.5, 0.65, 0.85, 1.0):
        m = processbench_metrics([first_error(p, threshold) for p in probs], truth)
        assert m["f1"] * 100 == approx(direct_processbench_f1(probs, truth, threshold))
    m = processbench_metrics([first_error(p) for p in probs], truth)
    assert (m["acc_error"], m["acc_correct"]) == approx((2 / 4, 2 / 3)) and m["f1"] == approx(4 / 7)
    assert (m["n_with_error"], m["n_without_error"]) == (4, 3)


def test_chance_f1_is_the_best_f1_of_random_flags():
    """Against every flag pattern of every solution, weighted by its probability, at each grid rate."""
    truth, n_steps = [0, 2, 1, 3, -1, -1, 4], [2, 3, 2, 4, 1, 3, 3]  # the last error lies past its 3 scored steps
    def expected_f1(q):
        hit, ok = [], []
        for t, n in zip(truth, n_steps):
            p = {f: math.prod(q if x else 1 - q for x in f) for f in itertools.product((0, 1), repeat=n)}
            pred = {f: f.index(1) if 1 in f else -1 for f in p}
            (hit if t >= 0 else ok).append(sum(p[f] for f in p if pred[f] == t))
        return harmonic_mean(sum(hit) / len(hit), sum(ok) / len(ok))
    assert chance_f1(truth, n_steps, grid=50) == approx(max(expected_f1(k / 50) for k in range(1, 50)))
    assert chance_f1([0, 1], [2, 2]) is None and chance_f1([-1], [3]) is None  # F1 needs both kinds


def test_processbench_edge_cases():
    m = processbench_metrics([-1, 1], [-1, -1])  # no solution with an error
    assert m["acc_error"] is None and m["acc_correct"] == 0.5 and m["f1"] is None
    m = processbench_metrics([0, 2], [0, 1])  # all with an error
    assert m["acc_error"] == 0.5 and m["acc_correct"] is None and m["f1"] is None
    m = processbench_metrics([0, 0, 0], [0, 1, -1])  # a threshold that calls every first step wrong
    assert (m["acc_error"], m["acc_correct"], m["f1"]) == (0.5, 0.0, 0.0)
    assert harmonic_mean(1.0, 1.0) == 1.0 and harmonic_mean(0.0, 0.0) == 0.0


def test_outcome_aggregates_by_hand():
    probs = [[0.9, 0.8], [0.5, 0.9], [0.95, 0.3, 0.99], [], [0.7]]
    final = [True, True, False, True, None]  # the empty and the unknown ones are left out
    # min 0.8 0.5 | 0.3 ; prod 0.72 0.45 | 0.282 ; last 0.8 0.9 | 0.99 ; mean 0.85 0.7 | 0.7467
    m = outcome_metrics(probs, final)
    assert m == {"outcome_auroc_min": 1.0, "outcome_auroc_prod": 1.0, "outcome_auroc_last": 0.0,
                 "outcome_auroc_mean": 0.5}
    assert outcome_metrics([[0.9], [0.2]], [True, True])["outcome_auroc_min"] is None


def brute_best_f1(step_probs, truth):
    """F1 at every threshold that can matter: each step score, midpoints of neighbours, and a fine grid."""
    values = sorted({p for ps in step_probs for p in ps})
    candidates = values + [(a + b) / 2 for a, b in zip(values, values[1:])] + [i / 1000 for i in range(1001)]
    return max(processbench_metrics([first_error(ps, t) for ps in step_probs], truth)["f1"] for t in candidates)


@pytest.mark.parametrize("seed", range(6))
def test_tuned_threshold_is_the_best_one(seed):
    rng = random.Random(seed)
    step_probs, truth = [], []
    for _ in range(rng.randint(4, 40)):
        n = rng.randint(1, 6)
        step_probs.append([round(rng.random(), 2) for _ in range(n)])
        truth.append(rng.choice([-1, rng.randrange(n), n]))  # n: the error step was truncated away
    if all(t < 0 for t in truth) or all(t >= 0 for t in truth):
        truth[0] = -1 if truth[0] >= 0 else 0
    threshold, f1 = tune_threshold(step_probs, truth)
    direct = processbench_metrics([first_error(ps, threshold) for ps in step_probs], truth)["f1"]
    assert f1 == approx(direct)  # the reported F1 is what that threshold really gives
    assert f1 == approx(brute_best_f1(step_probs, truth))  # and nothing does better


def test_tuned_threshold_by_hand_and_its_limits():
    # the error at step 1 is found for 0.2 < t <= 0.8; the clean solution stays clean for t <= 0.6
    threshold, f1 = tune_threshold([[0.8, 0.2], [0.9, 0.6]], [1, -1])
    assert f1 == 1.0 and 0.2 < threshold <= 0.6 and threshold == approx(0.4)  # the middle of (0.2, 0.6]
    with pytest.raises(ValueError):
        tune_threshold([[0.8, 0.2]], [1])


def test_auroc_returns_on_nan_scores():
    from prm.core.metrics import auroc
    out = {}
    worker = threading.Thread(target=lambda: out.update(v=auroc([0.1, float("nan"), 0.7], [False, True, True])),
                              daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive() and out["v"] is None
