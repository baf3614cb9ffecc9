"""Best-of-N: a hand-made set where each aggregation picks another candidate, bounds on random sets, and eval.py
--best-of-n end to end, recomputed from --predictions. Depends on: pytest, prm, eval.py."""
import json
import os
import random
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import eval as eval_cli  # noqa: E402
from prm.errors import UsageError  # noqa: E402
from prm.core.evaluate import candidate_groups  # noqa: E402
from prm.core.metrics import BEST_OF_N_METHODS, best_of_n, pick_accuracy  # noqa: E402

BIRM = os.path.join(ROOT, "..", "shared", "data", "birm")


def cand(probs, correct, answer=None):
    return {"step_probs": probs, "correct": correct, "answer": answer}


# problem 1: min picks B, prod picks C, last picks A, mean picks D (scores in the comments)
A = cand([0.1, 0.99], True, "7")  # min .1   prod .099  last .99  mean .545
B = cand([0.6, 0.6, 0.6], False, "8")  # min .6   prod .216  last .6   mean .6
C = cand([0.55], True, "7")  # min .55  prod .55   last .55  mean .55
D = cand([0.98, 0.3], False, "8")  # min .3   prod .294  last .3   mean .64
# problem 2: E is best by every aggregation; F and G share the wrong answer "2"
E, F, G = cand([0.9], True, "1"), cand([0.2], False, "2"), cand([0.4], False, "2")
GROUPS = [[A, B, C, D], [E, F, G]]


def test_each_aggregation_picks_its_own_candidate():
    assert [pick_accuracy([A, B, C, D], m) for m in ("min", "prod", "last", "mean")] == [0, 1, 1, 0]
    # each pick is the one claimed above: drop it and the choice moves
    assert pick_accuracy([A, C, D], "min") == 1.0  # without B, min picks C (.55)
    assert pick_accuracy([A, B, D], "prod") == 0.0  # without C, prod picks D (.294)
    assert pick_accuracy([B, C, D], "last") == 0.0  # without A, last picks B (.6)
    assert pick_accuracy([A, B, C], "mean") == 0.0  # without D, mean picks B (.6)


def test_voting_by_hand():
    # weighted_min (sum of min scores): "7" = .1 + .55 = .65, "8" = .6 + .3 = .9 -> "8", wrong
    assert pick_accuracy([A, B, C, D], "weighted_min") == 0.0
    assert pick_accuracy([A, B, C, D], "majority_vote") == 0.5  # 2 against 2: a tie counts half
    assert pick_accuracy([E, F, G], "weighted_min") == 1.0  # "1" = .9 against "2" = .2 + .4
    assert pick_accuracy([E, F, G], "majority_vote") == 0.0  # "2" twice
    assert pick_accuracy([cand([0.9], True)], "majority_vote") == 0.0  # no answer, no vote: counted wrong


def test_best_of_n_by_hand():
    out = best_of_n(GROUPS, draws=4, seed=0)
    assert set(out) == set(BEST_OF_N_METHODS) and all(set(v) == {"1", "2", "all"} for v in out.values())
    # N = all: problem 1 as above, problem 2 picked right by every aggregation and weighted voting
    expected_all = {"min": (0 + 1) / 2, "prod": 1.0, "last": 1.0, "mean": (0 + 1) / 2, "weighted_min": (0 + 1) / 2,
                    "weighted_prod": 1.0, "weighted_last": 1.0, "weighted_mean": (0 + 1) / 2,  # "7": .649, 1.54
                    "majority_vote": (0.5 + 0) / 2, "oracle": 1.0, "random": (2 / 4 + 1 / 3) / 2}
    assert {m: v["all"] for m, v in out.items()} == pytest.approx(expected_all)
    # N = 1: every method takes the one candidate, so each equals the mean correctness (per problem, then over them)
    assert all(v["1"] == pytest.approx((2 / 4 + 1 / 3) / 2) for m, v in out.items())


def test_bounds_and_determinism_on_random_sets():
    rng = random.Random(1)
    groups = [[cand([rng.random() for _ in range(rng.randint(0, 4))], rng.random() < 0.4, rng.choice("abc"))
               for _ in range(rng.randint(1, 9))] for _ in range(25)]  # some candidates have no scored step
    out = best_of_n(groups, draws=3, seed=7)
    assert out == best_of_n(groups, draws=3, seed=7)
    assert set(out["min"]) == {"1", "2", "4", "8", "all"}
    for n in out["oracle"]:
        for m in BEST_OF_N_METHODS:
            assert 0.0 <= out[m][n] <= out["oracle"][n] + 1e-12, (m, n)
    mean_correct = sum(sum(c["correct"] for c in g) / len(g) for g in groups) / len(groups)
    assert all(out[m]["1"] == pytest.approx(mean_correct) for m in BEST_OF_N_METHODS)


def test_unscored_candidate_ranks_last():
    assert pick_accuracy([cand([], False), cand([0.01], True)], "prod") == 1.0  # prod of nothing would be 1


def candidates_file(path):
    """3 problems x 5 candidates in the candidates format (BiRM's shape): steps tagged with the step tag."""
    rng = random.Random(0)
    with open(path, "w") as f:
        for q in range(3):
            outputs = []
            for j in range(5):
                x = rng.randrange(5)
                steps = [f"{x + k}+1={x + k + 1}" for k in range(rng.randint(1, 3))]
                answer = str(x + len(steps))
                outputs.append({"response": "".join(s + "ки\n" for s in steps).rstrip("\n"), "label": j % 2 == 0,
                                "response_answer": answer if j != 3 else None})
            f.write(json.dumps({"idx": 100 + q, "question": f"count {q}:", "outputs": outputs}) + "\n")
    return path


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def recompute(lines, draws=8, seed=0):
    groups = {}
    for x in lines:
        groups.setdefault(x["group"], []).append(cand(x["step_probs"], x["correct"], x["response_answer"]))
    return best_of_n(list(groups.values()), draws=draws, seed=seed)


def run(model_dir, *args):
    return eval_cli.main(["--model", model_dir, "--dtype", "fp32", "--eval-batch-size", "4", *args])


def test_eval_best_of_n_is_recomputable_from_predictions(model_dir, tmp_path):
    data, pred = candidates_file(str(tmp_path / "cands.jsonl")), str(tmp_path / "pred.jsonl")
    out = run(model_dir, "--dataset", data, "--best-of-n", "--best-of-n-draws", "3", "--seed", "5",
              "--predictions", pred)
    lines = read_jsonl(pred)
    assert len(lines) == 15 and [x["group"] for x in lines[:6]] == ["100"] * 5 + ["101"]
    assert [x["id"] for x in lines[:2]] == ["100/0", "100/1"] and lines[3]["response_answer"] is None
    assert out["n_problems"] == 3 and out["candidates_per_problem"] == [5]
    assert out["candidates_with_answer"] == 12  # candidate 3 of each has none
    assert out["best_of_n"] == recompute(lines, draws=3, seed=5)
    assert set(out["best_of_n"]["min"]) == {"1", "2", "4", "all"}
    assert out["best_of_n"]["random"]["1"] == pytest.approx(3 / 5)  # candidates 0, 2, 4 of each are right
    assert out["n_steps"] == 0  # no step labels in this file: candidates are judged by their final answer


def test_flat_rows_are_grouped_by_prompt(model_dir, tmp_path, capsys):
    path, pred = str(tmp_path / "flat.jsonl"), str(tmp_path / "pred.jsonl")
    rows = [{"prompt": f"count {k % 2}:", "completions": ["1+1=2", f"2+1={3 + k % 3}"], "labels": [True, k % 3 == 0],
             "final_answer_correct": k % 3 == 0} for k in range(6)]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    out = run(model_dir, "--dataset", path, "--best-of-n", "--predictions", pred)
    lines = read_jsonl(pred)
    assert out["n_problems"] == 2 and {x["group"] for x in lines} == {"count 0:", "count 1:"}
    assert out["best_of_n"] == recompute(lines) and "weighted_min" not in out["best_of_n"]  # no answers given
    assert out["best_of_n"]["oracle"]["all"] == 1.0  # k = 0 (count 0:) and k = 3 (count 1:) are right
    # the votes left out are said to be so, in the JSON and the table
    assert out["candidates_with_answer"] == 0
    assert "flat: weighted_*, majority_vote n/a (no extractable answer)" in \
        capsys.readouterr().err


def test_best_of_n_without_outcomes_stops_with_a_message(model_dir, tmp_path):
    path = str(tmp_path / "plain.jsonl")
    with open(path, "w") as f:
        f.write(json.dumps({"prompt": "p", "completions": ["1+1=2"], "labels": [True]}) + "\n")
    with pytest.raises(UsageError, match="best-of-N needs final_answer_correct"):
        run(model_dir, "--dataset", path, "--best-of-n")


def test_candidates_without_a_problem_are_refused():
    with pytest.raises(ValueError, match="row x: best-of-N needs the problem"):
        candidate_groups([[0.5]], [{"id": "x", "final_answer_correct": True}])  # e.g. pre-tokenized: no prompt
    assert candidate_groups([[0.5], []], [{"group": "g", "final_answer_correct": True, "response_answer": "1"},
                                          {"group": "g", "final_answer_correct": False}]) == \
        [[cand([0.5], True, "1"), cand([], False)]]  # an unscored candidate stays in its group


@pytest.mark.skipif(not os.path.isdir(BIRM), reason="needs ../shared")
def test_real_birm_file(model_dir, tmp_path):
    name = "Qwen2.5_3b_BiRM__train__example_responses_n15_qwen2.5_3b_math_process.jsonl"
    pred = str(tmp_path / "pred.jsonl")
    out = run(model_dir, "--dataset", os.path.join(BIRM, name), "--best-of-n", "--max-length", "4096",
              "--predictions", pred)
    assert out["n_problems"] == 10 and out["candidates_per_problem"] == [15]
    assert set(out["best_of_n"]["min"]) == {"1", "2", "4", "8", "all"}
    assert out["best_of_n"]["oracle"]["all"] == 1.0  # every problem has a right candidate
    assert out["best_of_n"] == recompute(read_jsonl(pred))


def test_eval_and_search_pick_the_same_answer_alike(model_dir, tmp_path):
    """One picking function: answers equal in value vote together (3 x 1/2 against 2 x 7) in eval.py's
    best-of-N and in prm.search, and eval.py's weighted_<aggregate> is prm.search's weighted vote."""
    from prm.answers import answer_key
    from prm.search import pick
    answers = ["0.5", "7", "1/2", "7", "\\frac{1}{2}"]
    outputs = [{"response": "1+1=2ки", "label": a != "7", "response_answer": a} for a in answers]
    data, pred = str(tmp_path / "c.jsonl"), str(tmp_path / "pred.jsonl")
    with open(data, "w") as f:
        f.write(json.dumps({"idx": 1, "question": "half?", "outputs": outputs}) + "\n")
    out = run(model_dir, "--dataset", data, "--best-of-n", "--predictions", pred)["best_of_n"]
    assert out["majority_vote"]["all"] == 1.0
    cands = [{"answer": x["response_answer"], "scores": x["step_probs"]} for x in read_jsonl(pred)]
    assert pick(cands, "majority", "last") == 0
    for agg in ("min", "prod", "last", "mean"):
        i = pick(cands, "weighted", agg)
        assert out[f"weighted_{agg}"]["all"] == float(answers[i] != "7")
        keyed = [cand(c["scores"], a != "7", answer_key(a)) for c, a in zip(cands, answers)]
        assert pick_accuracy(keyed, f"weighted_{agg}") == float(answers[i] != "7")
