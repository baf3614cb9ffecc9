"""The loop (prm.tools.loop) at tiny sizes: a policy, its Monte-Carlo labels, a PRM, search."""
import json
import re

import pytest

from prm.errors import UsageError
from prm.label import LabelOptions, label_file
from prm.readers.synthetic import make_rows, step_truth


def counter(prompts, n, seed, slips=0):
    """A policy that counts on from the prefix's last number, the steps the prompt has left; from 7
    its first `slips` of n continuations write 7+1=9."""
    out = []
    for p in prompts:
        count, x = map(int, re.findall(r"\d+", p.split("\n")[0]))
        done = re.findall(r"=(\d)", p)
        texts = []
        for j in range(n):
            y, steps = int(done[-1]) if done else x, ""
            for _ in range(count - len(done)):
                steps, y = steps + f"{y}+1={(y + 1 + (y == 7 and j < slips)) % 10}\n", \
                    (y + 1 + (y == 7 and j < slips)) % 10
            texts.append(steps)
        out.append(texts)
    return out


def test_progress_labels_judge_the_step_where_soft_ones_judge_the_odds_after_it(tmp_path):
    # from 7, 3 of 4 rollouts slip: a right step before the 7 keeps the value (1/4) it had, the
    # slip loses all of it; one more call of rollouts per row: from the prompt alone
    right, slip = ["4+1=5", "5+1=6", "6+1=7"], [["7+1=8", "8+1=9"], ["7+1=9", "9+1=0"]]
    rows = [{"prompt": "count 5 steps from 4:", "completions": right + s, "answer": "9"}
            for s in slip]
    for r in rows:
        r["labels"] = step_truth(r["prompt"], r["completions"])
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got, calls = {}, []

    def slipping(prompts, n, seed):
        calls.append(len(prompts))
        return counter(prompts, n, seed, slips=3)
    for label in ("soft", "progress"):
        opts = LabelOptions(policy="p", rollouts=4, label=label)
        spent = label_file(str(tmp_path / "in.jsonl"), str(tmp_path / f"{label}.jsonl"), slipping,
                           opts, show=False)
        got[label] = [json.loads(x) for x in (tmp_path / f"{label}.jsonl").read_text().splitlines()]
        assert spent == 2 * 4 * 4 + 2 * 4 * (label == "progress")
    assert calls == [4, 4, 5, 5]
    assert got["soft"][0]["labels"] == [0.25, 0.25, 0.25, 1.0, 1.0]
    for line, r in zip(got["progress"], rows):
        assert [y >= 0.5 for y in line["labels"]] == r["labels"] and line["start"] == [4, 1]
        assert set(line["labels"]) <= {0.0, 1.0}


def test_the_prover_rolls_out_and_the_policy_writes_the_solutions(tmp_path):
    rows = [{"prompt": "count 4 steps from 5:", "answer": "9"}]
    (tmp_path / "in.jsonl").write_text(json.dumps(rows[0]) + "\n")
    made = []

    def policy(prompts, n, seed):  # writes 5+1=6, 6+1=7, 7+1=9, 9+1=0
        made.append(prompts)
        return counter(prompts, n, seed, slips=n)
    opts = LabelOptions(policy="p", prover="q", rollouts=2, samples=1, label="progress")
    label_file(str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), policy, opts,
               prover=counter, show=False)
    line = json.loads((tmp_path / "out.jsonl").read_text())
    assert len(made) == 1 and line["completions"][2] == "7+1=9"
    assert line["labels"] == [1.0, 1.0, 0.0, 0.0] and line["successes"][:2] == [2, 2]
    with pytest.raises(UsageError, match="--label progress needs --search all"):
        LabelOptions(policy="p", label="progress", search="binary")


@pytest.mark.parametrize("label,search", [("soft", "all"), ("hard", "all"), ("hard", "binary")])
def test_mc_labels_are_1_before_the_known_first_error_0_at_and_after(tmp_path, label, search):
    rows = make_rows(40, 1)
    assert all(step_truth(r["prompt"], r["completions"]) == r["labels"] for r in rows)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    opts = LabelOptions(policy="counter", rollouts=3, label=label, search=search)
    label_file(str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), counter, opts, show=False)
    for r, line in zip(rows, (tmp_path / "out.jsonl").read_text().splitlines()):
        n = len(r["labels"])
        first = r["labels"].index(False) if False in r["labels"] else n
        after = [0.0] * (n - first) if search == "all" else ([0.0] + [None] * n)[:n - first]
        assert json.loads(line)["labels"] == [1.0] * first + after  # binary: unlabeled after it


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    """policy (2 optimizer steps) -> prm.label -> train.py's trainer (2 steps): the folder."""
    from prm.config import Config
    from prm.label import main as label
    from prm.tools.loop import LoopOptions, train_policy, write_problems
    from conftest import train
    tmp = tmp_path_factory.mktemp("loop")
    write_problems(str(tmp), LoopOptions(rows=3, test=3, valid=3))
    train_policy(str(tmp / "policy"), steps=2, batch=4)
    label(["--policy", str(tmp / "policy"), "--dataset", str(tmp / "label.jsonl"), "--output",
           str(tmp / "labels.jsonl"), "--rollouts", "2", "--samples", "2", "--max-new-tokens", "12",
           "--temperature", "1.0"])
    train(Config(model=str(tmp / "policy"), dataset=str(tmp / "labels.jsonl"), max_steps=2,
                 output_dir=str(tmp / "prm"), batch_size=4, dtype="fp32", lr=1e-3,
                 eval_fraction=0.3))
    return tmp


def search(loop, out):
    from prm.search import main
    main(["--policy", str(loop / "policy"), "--model", str(loop / "prm" / "final"), "--dataset",
          str(loop / "test.jsonl"), "--output", str(out), "--n", "1,4", "--beam-width", "2",
          "--seeds", "0,1", "--max-new-tokens", "12", "--temperature", "1.0"])
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_search_repeats_its_results_and_counts_policy_and_prm_tokens(loop, tmp_path):
    first, again = search(loop, tmp_path / "a.jsonl"), search(loop, tmp_path / "b.jsonl")
    results = [x for r in first for x in r["results"]]
    timeless = [{k: v for k, v in x.items() if k != "seconds"} for r in again for x in r["results"]]
    assert [{k: v for k, v in x.items() if k != "seconds"} for x in results] == timeless
    assert {x["method"] for x in results} == {"majority", "best-of-n", "weighted", "beam", "dvts"}
    for x in (x for x in results if "same_as" not in x):  # same_as: beam's run, repeated
        # a tree whose first steps all came out empty: nothing scored
        trees = any(c["steps"] for c in x.get("candidates", []))
        scored = x["method"] in ("best-of-n", "weighted") or trees
        assert x["policy_tokens"] > 0 and (x["prm_tokens"] > 0) == scored


def test_each_beam_grows_from_its_own_problem_only(loop, tmp_path):
    import torch
    from prm.label import Generator
    from prm.scoring.reward import PRMReward
    from prm.search import SearchOptions, search_file
    opts = SearchOptions(policy=str(loop / "policy"), methods=("beam", "dvts"), n=(4,),
                         beam_width=2, max_new_tokens=12, temperature=1.0)
    gen, made = Generator(opts, device=torch.device("cpu")), {}

    def propose(prefixes, n, seed, stop):  # the policy, recording each prefix's next steps
        texts = gen(prefixes, n, seed, stop)
        propose.usage = gen.usage
        for p, ts in zip(prefixes, texts):
            made.setdefault(p, set()).update(t.partition(stop)[0] for t in ts)
        return texts
    search_file(str(loop / "test.jsonl"), str(tmp_path / "s.jsonl"), propose,
                PRMReward(str(loop / "prm" / "final")).score, opts, show=False)
    prompts = [json.loads(x)["prompt"] for x in (loop / "test.jsonl").read_text().splitlines()]
    assert len(set(prompts)) > 1
    for r in map(json.loads, (tmp_path / "s.jsonl").read_text().splitlines()):
        for steps in (c["steps"] for x in r["results"] for c in x["candidates"]):
            assert all(s in made[prompts[r["row"]] + "\n" + "".join(t + "\n" for t in steps[:j])]
                       for j, s in enumerate(steps))


def test_the_task_holds_out_many_prompts_and_labels_validation_by_the_truth(tmp_path):
    from prm.tools.loop import LoopOptions, write_problems
    write_problems(str(tmp_path), LoopOptions())
    parts = {k: [json.loads(x) for x in (tmp_path / f"{k}.jsonl").read_text().splitlines()]
             for k in ("label", "valid", "test")}
    prompts = {k: {r["prompt"] for r in v} for k, v in parts.items()}
    assert [len(prompts[k]) for k in ("label", "valid", "test")] == [180, 60, 120]
    assert len(set.union(*prompts.values())) == 360  # disjoint
    for r in parts["valid"]:
        assert r["labels"] == step_truth(r["prompt"], r["completions"])
    assert 0 < sum(all(r["labels"]) for r in parts["valid"]) < 60
    assert step_truth("count 3 steps of 4 from 7:", ["7+4=1", "1+4=5", "5+4=9"]) == [True] * 3
    assert step_truth("count 3 steps of 4 from 7:", ["7+4=2", "2+4=6", "6+4=0"]) == [False] * 3


def loop_main(argv, capsys):
    from prm.tools.loop import main
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return e.value.code, err


def test_the_loop_refuses_to_replace_what_it_did_not_write(tmp_path, capsys):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "label.jsonl").write_text("my notes")
    code, err = loop_main(["policy", str(tmp_path / "mine"), "--steps", "1"], capsys)
    assert code == 2 and "label.jsonl exists" in err
    code, err = loop_main(["bench", str(tmp_path / "mine"), "--steps", "1"], capsys)
    assert code == 2 and "not empty" in err
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["label.jsonl"]
    assert (tmp_path / "mine" / "label.jsonl").read_text() == "my notes"


@pytest.mark.parametrize("flags,status,words", [
    (["--rows", "-1"], 2, "--rows -1: must be >= 1"),
    (["--test", "0"], 2, "--test 0: must be >= 1"),
    (["--steps", "-3"], 2, "--steps -3: must be >= 1"),
    (["--rows", "300"], 2, "the task has 360 prompts"),
    ([], 2, "not a folder")])
def test_the_loop_refuses_bad_flags_and_places_in_one_line(tmp_path, capsys, flags, status, words):
    (tmp_path / "file").write_text("x")
    where = str(tmp_path / ("file" if not flags else "new"))
    code, err = loop_main(["policy", where, *flags], capsys)
    assert code == status and words in err and not (tmp_path / "new").exists()


def test_the_loop_refuses_an_empty_name_and_a_folder_under_a_file(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert loop_main(["policy", ""], capsys)[0] == 2
    code, err = loop_main(["policy", str(tmp_path / "file" / "sub"), "--steps", "1"], capsys)
    assert code == 1 and str(tmp_path / "file") in err


def test_the_loop_runs_outside_the_repository_root(tmp_path):
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    r = subprocess.run([sys.executable, "-m", "prm.tools.loop", "policy", "run", "--steps", "1"],
                       cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == \
        ["label.jsonl", "policy", "test.jsonl", "valid.jsonl"]


def test_the_interval_resamples_each_pipelines_prompts():
    from prm.tools.loop import interval
    assert interval([[1, 1, 1], [1, 1]]) == (1, 1)
    lo, hi = interval([[1, 0, 0, 1, 0, 1, 1, 0] * 5, [0, 1] * 20])
    assert lo < 0.5 < hi and hi - lo < 0.4
    assert interval([[1] * 40, [0] * 40]) == (0.5, 0.5)  # pipelines kept whole: no spread


def test_a_figure_no_pipeline_has_reads_none_not_a_crash():
    from prm.tools.loop import mean_se
    assert mean_se([None, float("nan")]) == "none"
    assert mean_se([0.5, 0.7]).startswith("0.600 ± ")


def test_the_prm_step_figures_against_the_truth():
    from prm.tools.loop import prm_steps
    wrong, right = ["0+1=1", "1+1=3", "3+1=4"], ["0+1=1", "1+1=2", "2+1=3"]  # truth: T F F; T T T
    samples = [{"steps": wrong, "scores": [0.9, 0.2, 0.1]},  # first error found at 1: right
               {"steps": right, "scores": [0.9, 0.4, 0.8]},  # an error where none is
               {"steps": wrong, "scores": [0.3, 0.6]}]  # found at 0, truth at 1; scored 2 steps
    got = prm_steps([{"row": 0, "samples": samples}], [{"prompt": "count 3 steps of 1 from 0:"}])
    assert got == {"auroc": pytest.approx(13 / 15), "prec": pytest.approx(1 / 3), "recall": 0.5}


def test_choose_takes_the_settings_best_on_validation(monkeypatch):
    import prm.tools.loop as loop
    right = {"answer": "c", "correct": True, "scores": [0.95, 0.95, 0.3]}  # best only by mean
    samples = [right] + [{"answer": f"w{k}", "correct": False, "scores": [0.7] * 3} for k in range(15)]
    sampled = {"samples": samples, "results": [{"method": m, "n": n} for m in ("best-of-n", "weighted")
                                               for n in (4, 16)]}
    votes = [{"answer": "c", "correct": True, "scores": [0.1]}] * 2 + [  # right only by majority
        {"answer": "w1", "correct": False, "scores": [0.9]}, {"answer": "w2", "correct": False, "scores": [0.8]}]
    wrong = [{"answer": "w", "correct": False, "scores": [0.9]}]
    trees = lambda cands: {"results": [{"method": m, "n": n, "candidates": cands}  # noqa: E731
                                       for m in ("beam", "dvts") for n in (4, 16)]}
    found = {"valid": sampled, "valid-m4": trees(wrong), "valid-m2": trees(votes)}
    monkeypatch.setattr(loop, "searched", lambda folder, name, *a, **kw: [found[name]])
    assert loop.choose("", None, 0) == {"aggregate": "mean", "beam_width": 2, "select": "majority"}
