"""prm.search: beam search and DVTS against a brute-force reference on a scripted policy
and PRM, beams kept within their problem, broken policies, tokens counted, resume after a kill, bad
input refused before any model loads, PRMReward.score's shape, every method end to end with tiny
Hugging Face models."""
import collections
import json
import math
import os

import pytest

from prm.core.metrics import AGGREGATES
from prm.errors import UsageError
from prm.answers import extract_answer, judge
from prm.search import RESULT, SearchOptions, main, pick, search_block, search_file, table
from prm.trees import Beam, Problem, cached, tree_search
from conftest import SEP, proposal, scripted_policy, scripted_score, step_score, write_problems


def brute_force(text: str, question: str, method: str, n: int, m: int, max_steps: int,
                aggregate="last", select="weighted") -> tuple:
    """(the prefixes extended, the finished beams' steps sorted, the answers `select` may pick:
    more than one on a tie) of one problem searched alone, written as plainly as the method reads:
    beams ranked by `aggregate` over their steps' scores."""
    w = min(n, m)
    groups = [[()] * (n // w)] if method == "beam" else [[()] for _ in range(n // w)]
    keep = n // w if method == "beam" else 1

    def value(beam):  # the aggregate of the beam's step scores; no step: last
        scores = [step_score(question, list(beam[:k + 1])) for k in range(len(beam))]
        return AGGREGATES[aggregate](scores) if scores else -math.inf
    extended, done = [], []
    for _ in range(max_steps):
        seen = collections.Counter()
        for gi, group in enumerate(groups):
            going = []
            for beam in group:
                prefix = text + "".join(s + SEP for s in beam)
                extended.append(prefix)
                seen[prefix] += 1
                for j in range(w):
                    out = proposal(prefix, (seen[prefix] - 1) * w + j, SEP)
                    head, found, _ = out.partition(SEP)
                    if not head.strip():
                        done.append(beam)
                    elif found:
                        going.append(beam + (head,))
                    else:
                        done.append(beam + (head,))
            going.sort(key=lambda b: -value(b))
            groups[gi] = going[:keep]
    done += [b for g in groups for b in g]
    answer = {beam: extract_answer(SEP.join(beam)) for beam in done}
    if select == "best-of-n":
        top = max(map(value, done), default=None)
        return extended, sorted(map(list, done)), {answer[b] for b in done if value(b) == top}
    votes = collections.defaultdict(float)
    for beam in done:
        if answer[beam] is not None:
            votes[answer[beam]] += 1 if select == "majority" else value(beam)
    top = max(votes.values(), default=None)
    return extended, sorted(map(list, done)), {a for a, v in votes.items() if v == top} or {None}


def run(tmp_path, name="out.jsonl", propose=None, rows=5, count=lambda q, text: 0, **opts):
    """search_file's summary and output lines."""
    out = str(tmp_path / name)
    summary = search_file(write_problems(tmp_path / "p.jsonl", rows), out,
                          propose or scripted_policy(), scripted_score, SearchOptions(**opts),
                          count=count, show=False)
    with open(out) as f:
        return summary, [json.loads(line) for line in f]


@pytest.mark.parametrize("method,n",
                         [("beam", 8), ("dvts", 8), ("beam", 4), ("dvts", 2), ("beam", 1)])
def test_beam_and_dvts_equal_a_brute_force_reference(tmp_path, method, n):
    log = []
    _, records = run(tmp_path, propose=scripted_policy(log), methods=(method,), n=(n,),
                     beam_width=2, max_steps=5, problems=3)
    assert sorted(r["row"] for r in records) == list(range(5))
    want = []
    for r in records:
        [x] = r["results"]
        question = f"problem {r['row']}:"
        extended, done, answers = brute_force(question + SEP, question, method, n, 2, 5)
        assert sorted(c["steps"] for c in x["candidates"]) == done
        assert {x["answer"]} == answers and x["correct"] == (x["answer"] == str(r["row"] % 3))
        assert sum(x["ends"].values()) == len(done)
        want += extended
    # the same beams survive each step: the prefixes extended are the reference's
    assert sorted(p for call in log for p in call) == sorted(want)
    for call in log:  # one step per call, the beams of its group of problems only
        assert len({p.count(SEP) for p in call}) == 1
        assert len({int(p.split()[1][:-1]) // 3 for p in call}) == 1


@pytest.mark.parametrize("select", ["majority", "best-of-n", "weighted"])
@pytest.mark.parametrize("aggregate", ["min", "prod"])
def test_trees_rank_by_the_aggregate_and_pick_by_select_as_the_reference(tmp_path, aggregate,
                                                                         select):
    for method in ("beam", "dvts"):
        _, records = run(tmp_path, f"{method}.jsonl", methods=(method,), n=(8,), beam_width=2,
                         max_steps=5, problems=3, aggregate=aggregate, select=select)
        for r in records:
            [x] = r["results"]
            question = f"problem {r['row']}:"
            _, done, answers = brute_force(question + SEP, question, method, 8, 2, 5, aggregate,
                                           select)
            assert sorted(c["steps"] for c in x["candidates"]) == done
            assert x["answer"] in answers


def copies_alike(prefixes, n, seed, stop):
    """proposal()'s first n texts of each prefix, whatever else the call holds."""
    outs = [[proposal(p, j, stop) for j in range(n)] for p in prefixes]
    copies_alike.usage = [[(len(t), t.startswith("cut")) for t in ts] for ts in outs]
    return outs


def alone(problem: Problem, method: str, n: int, width: int, opts, count) -> tuple:
    """tree_search driven by hand, a request at a time, with copies_alike and scripted_score:
    (its candidates, policy tokens, PRM tokens)."""
    search, answer, costs = tree_search(problem, method, n, width, opts), None, [0, 0]
    question = problem.row["prompt"]
    while True:
        try:
            kind, asked, *_ = search.send(answer)
        except StopIteration as stop:
            return stop.value, *costs
        if kind == "propose":
            outs = copies_alike([problem.text + "".join(s + SEP for s in b.steps) for b in asked],
                                width, 0, SEP)
            answer = [[(t, cut) for t, (_, cut) in zip(texts, use)]
                      for texts, use in zip(outs, copies_alike.usage)]
            costs[0] += sum(k for use in copies_alike.usage for k, _ in use)
        else:
            texts = [SEP.join(steps) for _, steps in asked]
            [scores] = scripted_score([question], [texts])
            answer = [Beam(steps, s, None) for (_, steps), s in zip(asked, scores)]
            costs[1] += sum(count(question, t) for t in texts)


def test_the_batched_layer_equals_each_problem_searched_alone(tmp_path):
    opts = dict(methods=("beam", "dvts"), n=(1, 2, 4, 8), beam_width=2, max_steps=5, problems=3,
                aggregate="min")
    count = lambda question, text: len(question + text)  # noqa: E731
    _, records = run(tmp_path, propose=copies_alike, count=count, **opts)
    options = SearchOptions(**opts)
    for r in records:
        question = f"problem {r['row']}:"
        problem = Problem(r["row"], {"prompt": question}, question + SEP,
                          judge(str(r["row"] % 3), options))
        for x in r["results"]:
            if "same_as" not in x:  # dvts at N <= M: beam's run
                assert (x["candidates"], x["policy_tokens"], x["prm_tokens"]) == \
                    alone(problem, x["method"], x["n"], min(x["n"], 2), options, count)
    assert len(records) == 5 and all(len(r["results"]) == 8 for r in records)


def test_beams_stay_in_their_problem_and_beam_and_dvts_differ(tmp_path):
    _, records = run(tmp_path, methods=("beam", "dvts", "weighted"), n=(1, 4, 8), beam_width=2,
                     max_steps=5, problems=3)
    for r in records:
        cands = [c for x in r["results"] for c in x.get("candidates", [])] + r["samples"]
        assert cands and all(f"p{r['row']}" in step for c in cands for step in c["steps"])
    results = {(r["row"], x["method"], x["n"]): x["candidates"]
               for r in records for x in r["results"] if "candidates" in x}
    assert any(results[k] != results[k[0], "dvts", k[2]] for k in results
               if k[1] == "beam" and k[2] > 2)
    ends = collections.Counter(c["end"] for x in results.values() for c in x)
    assert set(ends) == {"eos", "empty", "cut", "max_steps"}  # every kind of end happens


def test_beam_and_dvts_at_n_up_to_m_are_one_run_reported_once(tmp_path):
    logs, opts = ([], [], []), dict(methods=("beam", "dvts"), n=(1, 2, 4), beam_width=2)

    def logged(log):  # copies_alike: a tree grows alike whatever else a call holds
        def propose(prefixes, n, seed, stop):
            log.extend(prefixes)
            outs, propose.usage = copies_alike(prefixes, n, seed, stop), copies_alike.usage
            return outs
        return propose
    out, records = run(tmp_path, propose=logged(logs[0]), **opts)
    run(tmp_path, "b.jsonl", propose=logged(logs[1]), **{**opts, "methods": ("beam",)})
    run(tmp_path, "d.jsonl", propose=logged(logs[2]), **{**opts, "methods": ("dvts",), "n": (4,)})
    assert sorted(logs[0]) == sorted(logs[1] + logs[2])  # dvts at N <= M proposed nothing
    for r in records:
        x = {(x["method"], x["n"]): x for x in r["results"]}
        for n in (1, 2):
            assert x["dvts", n] == {"method": "dvts", **{k: v for k, v in x["beam", n].items()
                                    if k in RESULT}, "same_as": "beam"}
        assert "same_as" not in x["dvts", 4] and "candidates" in x["dvts", 4]
    assert [out["results"]["dvts"][n].get("same_as") for n in "124"] == ["beam", "beam", None]
    assert "dvts          2   = beam (the same run)" in table(out).splitlines()


def test_a_problem_is_done_as_soon_as_its_beams_end(tmp_path):
    log = []

    def propose(prefixes, n, seed, stop):  # problem 0 answers at once, problem 1 never ends
        log.append(prefixes)
        return [["the answer is 0" if p.startswith("problem 0") else "s" + SEP] * n
                for p in prefixes]
    block = [Problem(i, {"prompt": f"problem {i}:", "answer": "0"}, f"problem {i}:{SEP}", bool)
             for i in range(2)]
    opts = SearchOptions(methods=("beam",), n=(2,), beam_width=2, max_steps=5)
    got = [(r["row"], len(log)) for r in search_block(block, propose, scripted_score,
                                                       lambda q, t: 0, opts, 0)]
    assert got == [(0, 1), (1, 5)] and [len(call) for call in log] == [2, 1, 1, 1, 1]


def test_pick_majority_best_of_n_weighted():
    cands = [{"answer": "1", "scores": [0.9, 0.2]}, {"answer": "2", "scores": [0.5, 0.6]},
             {"answer": " 2", "scores": [0.1, 0.3]}, {"answer": None, "scores": [1.0, 1.0]},
             {"answer": "1.", "scores": [0.5, 0.45]}]
    assert pick(cands, "majority", "last") == 0  # "1", "1." tie with "2", " 2": the first answer
    assert pick(cands, "best-of-n", "last") == 3 and pick(cands[:3], "best-of-n", "min") == 1
    assert pick(cands, "weighted", "last") == 1  # 0.6 + 0.3 > 0.2 + 0.45
    assert pick(cands, "weighted", "min") == 0  # 0.2 + 0.45 > 0.5 + 0.1
    assert pick([{"answer": None, "scores": []}], "majority", "last") is None
    assert pick([], "best-of-n", "min") is None


def test_sampled_methods_take_the_first_n_and_count_their_costs(tmp_path):
    _, records = run(tmp_path, methods=("majority", "best-of-n", "weighted"), n=(1, 3), problems=2,
                     count=lambda question, text: len(question + text))
    for r in records:
        texts = [proposal(f"problem {r['row']}:{SEP}", j, None) for j in range(3)]
        assert [c["policy_tokens"] for c in r["samples"]] == list(map(len, texts))
        question = f"problem {r['row']}:"
        assert [c["prm_tokens"] for c in r["samples"]] == [len(question + t) for t in texts]
        for x in r["results"]:
            first = r["samples"][:x["n"]]
            assert x["policy_tokens"] == sum(c["policy_tokens"] for c in first)
            prm = sum(c["prm_tokens"] for c in first)
            assert x["prm_tokens"] == (prm if x["method"] != "majority" else 0)
            assert x["answer"] == first[pick(first, x["method"], "last")]["answer"]


def test_a_policy_giving_too_few_texts_or_a_chat_prompt_without_render_is_refused(tmp_path):
    few = lambda prefixes, n, seed, stop: [["the answer is 1"] * (n - 1) for _ in prefixes]  # noqa
    with pytest.raises(UsageError, match=r"propose\(\) must give 4 texts for each of its 2 "):
        run(tmp_path, "few.jsonl", few, rows=2, methods=("beam",), n=(4,), beam_width=4)
    data = write_problems(tmp_path / "chat.jsonl", 1)
    chat = [{"role": "user", "content": "problem 0:"}]
    with open(data, "w") as f:
        f.write(json.dumps({"prompt": chat, "answer": "0"}) + "\n")
    with pytest.raises(UsageError, match="a chat prompt needs render="):
        search_file(data, str(tmp_path / "c.jsonl"), scripted_policy(), scripted_score,
                    SearchOptions(), show=False)


def test_broken_policies_end_their_beams_without_a_traceback(tmp_path):
    def policy(text):
        def propose(prefixes, n, seed, stop):
            propose.usage = [[(5, text == "no end")] * n for _ in prefixes]
            return [[text] * n for _ in prefixes]
        return propose
    cases = [("", "empty", 0), (SEP, "empty", 0), (" \t" + SEP, "empty", 0), ("no end", "cut", 1),
             ("s" + SEP, "max_steps", 3)]
    for k, (text, end, steps) in enumerate(cases):
        _, records = run(tmp_path, f"{k}.jsonl", policy(text), problems=2, methods=("beam", "dvts"),
                         n=(2, 4), beam_width=2, max_steps=3, count=lambda q, t: 11)
        for x in (x for r in records for x in r["results"] if "same_as" not in x):
            # beam and dvts alike: N/M beams from the root, each proposing M; all ending alike
            beams = x["n"] // 2 if end == "max_steps" else x["n"]
            assert x["ends"] == {end: beams}
            assert {len(c["steps"]) for c in x["candidates"]} == {steps}
            assert x["policy_tokens"] == 5 * x["n"] * max(steps, 1)
            assert x["prm_tokens"] == (end != "empty") * x["n"] * max(steps, 1) * 11


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(policy, PRM): a tiny random causal LM and a tiny PRM, both with the character tokenizer."""
    import torch
    from transformers import Qwen2ForCausalLM
    from prm.readers.synthetic import char_tokenizer
    from prm.loading import tiny_config
    from conftest import save_tiny
    policy, tokenizer = str(tmp_path_factory.mktemp("policy")), char_tokenizer()
    torch.manual_seed(0)
    Qwen2ForCausalLM(tiny_config(tokenizer)).save_pretrained(policy)
    tokenizer.save_pretrained(policy)
    return policy, save_tiny(str(tmp_path_factory.mktemp("prm")))


def test_every_method_end_to_end_with_hugging_face_models(models, tmp_path, capsys):
    policy, prm = models
    data, out = write_problems(tmp_path / "p.jsonl", 3), str(tmp_path / "out.jsonl")
    argv = ["--dataset", data, "--output", out, "--policy", policy, "--model", prm, "--n", "1,2",
            "--beam-width", "2", "--max-new-tokens", "6", "--max-steps", "2", "--problems", "2",
            "--step-separator", "=", "--temperature", "1.0"]
    main(argv)
    summary = json.loads(capsys.readouterr().out)
    assert summary["problems"] == 3
    assert set(summary["results"]) == {"majority", "best-of-n", "weighted", "beam", "dvts"}
    assert all(set(by_n) == {"1", "2"} for by_n in summary["results"].values())
    with open(out) as f:
        records = [json.loads(line) for line in f]
    for x in (x for r in records for x in r["results"]):
        assert x["policy_tokens"] > 0 and (x["prm_tokens"] > 0) == (x["method"] != "majority")
        for c in x.get("candidates", []):  # a step ended at the separator, or the beam ended there
            assert all("=" not in s for s in c["steps"])
            assert c["end"] in ("eos", "cut", "empty", "max_steps")
    main(argv)  # the finished file: nothing searched again, the same summary
    assert json.loads(capsys.readouterr().out) == summary


def test_generator_ends_each_text_after_its_first_stop_and_counts_tokens(models):
    import torch
    from prm.label import Generator, LabelOptions
    gen = Generator(LabelOptions(policy=models[0], max_new_tokens=12, temperature=1.0),
                    device=torch.device("cpu"))
    prompts = ["problem 1:\n", "problem 2:\n"]
    free, free_usage = gen(prompts, 3, 0), gen.usage
    special = "".join(gen.tokenizer().all_special_tokens)  # "p" would stop at a sampled <pad>
    stop = next(c for c in free[0][0][2:] if c not in special)  # the first text ends there
    texts = gen(prompts, 3, 0, stop)
    assert texts[0][0] == free[0][0][:free[0][0].index(stop) + 1]
    assert any(cut for use in free_usage for _, cut in use)  # 12 tokens, no EOS: cut
    for ts, fs, use, free_use in zip(texts, free, gen.usage, free_usage):
        for t, f, (k, cut), (free_k, free_cut) in zip(ts, fs, use, free_use):
            # the same samples, each ended at its first stop; the tokens made, no more
            assert t == (f[:f.index(stop) + 1] if stop in f else f)
            assert (k, cut) == (free_k, free_cut) if stop not in f else k <= free_k and not cut
    greedy = Generator(LabelOptions(policy=models[0], max_new_tokens=5, temperature=0.0),
                       device=torch.device("cpu"))
    assert greedy(prompts, 3, 0) and len(greedy.usage) == 2
    assert all(use[0][0] > 0 and [k for k, _ in use[1:]] == [0, 0] for use in greedy.usage)


def timeless(records: list) -> list:
    """The records without their seconds (the one figure a rerun changes)."""
    return sorted(json.dumps({**r, "results": [{**x, "seconds": 0} for x in r["results"]]})
                  for r in records)


def test_a_rerun_after_a_kill_continues_to_the_same_results(tmp_path):
    opts = dict(methods=("majority", "best-of-n", "weighted", "beam", "dvts"), n=(1, 4),
                beam_width=2, max_steps=4, problems=2, seeds=(0, 1))
    whole, records = run(tmp_path, "whole.jsonl", scripted_policy(seeded=True), **opts)
    seeds = [[r for r in records if r["seed"] == s] for s in (0, 1)]
    assert timeless(seeds[0]) != timeless([{**r, "seed": 0} for r in seeds[1]])  # seeds matter
    out = tmp_path / "out.jsonl"
    for calls in (8, 20):  # killed twice, part of the way
        with pytest.raises(KeyboardInterrupt):
            run(tmp_path, "out.jsonl", scripted_policy(seeded=True, stop_after=calls), **opts)
        assert 0 < len(out.read_text().splitlines()) < len(records)
    with open(out, "a") as f:
        f.write('{"row": 4, "lines": 2, "se')  # a line a kill cut short
    again, resumed = run(tmp_path, "out.jsonl", scripted_policy(seeded=True), **opts)
    assert timeless(resumed) == timeless(records)
    assert {m: {n: {k: v for k, v in r.items() if k != "seconds"} for n, r in by_n.items()}
            for m, by_n in again["results"].items()} == \
        {m: {n: {k: v for k, v in r.items() if k != "seconds"} for n, r in by_n.items()}
         for m, by_n in whole["results"].items()}
    with pytest.raises(UsageError, match="written with other settings: max_steps 4 \\(now 3\\)"):
        run(tmp_path, "out.jsonl", **{**opts, "max_steps": 3})


def exits(argv: list, capsys) -> tuple:
    """(main's exit status, its stderr lines)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    return e.value.code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("flags,message", [
    (["--n", "1,6"], "--n 6: not a multiple of --beam-width 4"),
    (["--methods", "beam,greedy"], "--methods 'greedy': expected majority, best-of-n, "),
    (["--n", "0"], "--n 0: must be in [1, 65536]"),
    (["--n", "1,99999999999999999999"], "--n 99999999999999999999: must be in [1, 65536]"),
    (["--beam-width", "0"], "--beam-width 0: must be >= 1"),
    (["--n", "1,a"], "argument --n: invalid comma_list value: '1,a'"),
    (["--max-steps", "0"], "--max-steps 0: must be >= 1"),
    (["--answer-pattern", "("], "--answer-pattern '(': not a regular expression"),
    (["--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
    (["--shard", "2/2"], "--shard '2/2': expected i/n with 0 <= i < n"),
])
def test_bad_flags_exit_2_before_any_model_loads(tmp_path, capsys, flags, message):
    out = str(tmp_path / "o.jsonl")
    argv = ["--dataset", write_problems(tmp_path / "p.jsonl"), "--output", out, "--policy",
            "no-such-policy", "--model", "no-such-prm"]
    code, err = exits(argv + flags, capsys)
    assert code == 2 and len(err) == 1 and message in err[0] and os.listdir(tmp_path) == ["p.jsonl"]
    # a budget below the width is searched with width N; without beam and dvts, no width
    assert SearchOptions(n=(1, 2, 4)) and SearchOptions(methods=("weighted",), n=(6,))


def test_no_reference_answer_or_a_prm_that_cannot_score_exits_2_first(models, tmp_path, capsys):
    data = write_problems(tmp_path / "p.jsonl", 2)
    with open(data, "a") as f:
        f.write(json.dumps({"prompt": "problem 2:"}) + "\n")
    base = ["--output", str(tmp_path / "o.jsonl"), "--policy", "no-such-policy"]
    code, err = exits(base + ["--dataset", data, "--model", "no-such-prm"], capsys)
    assert code == 2 and "line 3: field 'answer': missing" in "\n".join(err)
    good = write_problems(tmp_path / "good.jsonl", 2)
    code, err = exits(base + ["--dataset", good, "--model", models[1], "--scorer", "step-tag"],
                      capsys)
    assert code == 2 and err[-1].startswith("error: --scorer step-tag needs --step-tag")
    code, err = exits(base + ["--dataset", good, "--model", str(tmp_path / "none")], capsys)
    assert code == 2 and "none" in err[-1] and "no-such-policy" not in err[-1]


def test_prm_reward_score_has_search_and_learns_shape(models):
    from prm.scoring.reward import PRMReward
    reward = PRMReward(models[1], device="cpu")
    questions = ["count from 1:", "count from 7:", "count from 3:"]
    outputs = [["1+1=2\n2+1=3", "1+1=3"], [], ["3+1=4\n4+1=5\n5+1=7"]]
    got = reward.score(questions, outputs)
    assert [[len(steps) for steps in out] for out in got] == [[2, 1], [], [3]]
    alone = [reward.step_probs([q], [o])[0] for q, outs in zip(questions, outputs) for o in outs]
    assert [p for out in got for steps in out for p in steps] == \
        pytest.approx([p for steps in alone for p in steps], abs=1e-6)
    with pytest.raises(ValueError, match="3 questions for 2 lists of outputs"):
        reward.score(questions, outputs[:2])


def test_a_problems_samples_do_not_depend_on_batching(models, tmp_path, capsys, monkeypatch):
    """--problems and --batch-size are speed knobs: the records are the same (fp32: the PRM's scores
    within float rounding of the batch's shapes)."""
    monkeypatch.setenv("PRM_CPU_BF16", "0")  # pinned precision: fp32 policy and PRM
    data = write_problems(tmp_path / "p.jsonl", 3)
    argv = ["--dataset", data, "--policy", models[0], "--model", models[1], "--n", "1,2",
            "--beam-width", "2", "--max-new-tokens", "6", "--max-steps", "2", "--step-separator",
            "=", "--temperature", "1.0", "--dtype", "fp32"]
    records = []
    for k, knobs in enumerate([["--problems", "1", "--batch-size", "1"], ["--problems", "8"]]):
        main(argv + knobs + ["--output", str(tmp_path / f"{k}.jsonl")])
        lines = (tmp_path / f"{k}.jsonl").read_text().splitlines()
        records.append(timeless(map(json.loads, lines)))
    capsys.readouterr()
    assert len(records[0]) == 3
    for a, b in zip(*records):
        a, b = json.loads(a), json.loads(b)
        assert steps_and_answers(a) == steps_and_answers(b)
        assert all_scores(a) == pytest.approx(all_scores(b), abs=1e-5)


def candidates(record: dict) -> list:
    return record.get("samples", []) + [c for x in record["results"]
                                        for c in x.get("candidates", [])]


def steps_and_answers(record: dict) -> list:
    cands = candidates(record)
    return [(c["steps"], c["answer"], c["end"]) for c in cands] + \
        [(x["method"], x["n"], x["answer"], x["policy_tokens"], x["prm_tokens"])
         for x in record["results"]]


def all_scores(record: dict) -> list:
    return [p for c in candidates(record) for p in c["scores"]]


def test_tokens_not_counted_are_none_and_said_so(models, tmp_path):
    """A propose() without .usage and a score() that is no PRMReward's: tokens None, 'not counted';
    a PRMReward's score counts its own, at most its max_length."""
    from prm.scoring.reward import PRMReward
    from prm.search import table

    def bare(prefixes, n, seeds, stop):
        return [[f"s{j}{SEP}the answer is {j}" for j in range(n)] for _ in prefixes]
    opts = SearchOptions(methods=("majority", "weighted", "beam"), n=(2,), beam_width=2,
                         max_steps=2)
    data = write_problems(tmp_path / "p.jsonl", 2)
    out = search_file(data, str(tmp_path / "a.jsonl"), bare, scripted_score, opts, show=False)
    costs = out["results"]["weighted"]["2"]
    assert costs["policy_tokens"] is None and costs["prm_tokens"] is None
    assert "not counted" in table(out) and " 0 " not in table(out).splitlines()[2]
    reward = PRMReward(models[1], device="cpu", max_length=12)
    out = search_file(data, str(tmp_path / "b.jsonl"), bare, reward.score, opts, show=False)
    with open(tmp_path / "b.jsonl") as f:
        samples = [c for line in f for c in json.loads(line)["samples"]]
    assert {c["prm_tokens"] for c in samples} == {12}  # problem, separator, text: cut at 12
    assert out["results"]["beam"]["2"]["prm_tokens"] > 0


def test_a_propose_that_drops_the_stop_is_refused_by_name(tmp_path):
    """vLLM's include_stop_str_in_output=False: every beam would end after its first step."""
    policy = scripted_policy()

    def dropping(prefixes, n, seeds, stop):
        texts = policy(prefixes, n, seeds, stop)
        return [[t.split(stop)[0] if stop else t for t in ts] for ts in texts]
    with pytest.raises(UsageError, match="include_stop_str_in_output=True"):
        run(tmp_path, propose=dropping, methods=("beam",), n=(4,), beam_width=2, problems=1)


def test_wrong_shapes_are_refused_in_the_apis_terms(models):
    from prm.scoring.reward import PRMReward
    reward = PRMReward(models[1], device="cpu")
    for outputs in (["5+1=6\n6+1=7"], [None]):
        with pytest.raises(ValueError, match=r"outputs\[0\] .*: expected a list of solutions"):
            reward.score(["q"], outputs)
    with pytest.raises(UsageError, match=r"^SearchOptions\(methods='beam'\): expected a tuple, "
                                         r"such as \('beam',\)$"):
        SearchOptions(methods="beam")


def test_math500_rows_a_system_prompt_and_the_prms_own_settings(models, tmp_path, monkeypatch,
                                                                capsys):
    """--prompt-field problem reads a MATH-500 row; --system-prompt reaches the policy's chat
    template, not the PRM; --prm-batch-size, --dtype, --max-length reach the PRM; --help says
    what is required, lists as typed, --problems a speed knob."""
    import prm.scoring.reward as reward_module
    from prm.label import Generator
    data = tmp_path / "math500.jsonl"
    data.write_text(json.dumps({"problem": "problem 0:", "answer": "0"}) + "\n")
    seen, rendered = {}, []

    class Reward(reward_module.PRMReward):
        def __init__(self, *args, **kw):
            seen.update(kw, batch_size=args[3])
            super().__init__(*args, **kw)

        def score(self, questions, outputs):
            seen["questions"] = questions
            return super().score(questions, outputs)
    monkeypatch.setattr(reward_module, "PRMReward", Reward)
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}a: "

    def render(self, prompt):
        self.tokenizer().chat_template = template
        rendered.append(Generator.render.__wrapped__(self, prompt))
        return rendered[-1]
    render.__wrapped__ = Generator.render
    monkeypatch.setattr(Generator, "render", render)
    main(["--dataset", str(data), "--output", str(tmp_path / "o.jsonl"), "--policy", models[0],
          "--model", models[1], "--prompt-field", "problem", "--system-prompt", "be brief",
          "--methods", "weighted", "--n", "2", "--max-new-tokens", "4", "--prm-batch-size", "3",
          "--dtype", "fp32", "--max-length", "64"])
    assert rendered == ["system: be brief\nuser: problem 0:\na: "]
    assert seen["questions"] == ["problem 0:"] and seen["batch_size"] == 3
    assert seen["dtype"] == "fp32" and seen["max_length"] == 64
    with pytest.raises(SystemExit):
        main(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for words in ("--dataset DATASET problems", "--policy POLICY the model rolled out",
                  "(default: 1,4,16)", "a speed knob"):
        assert words in shown


def test_two_shards_combine_into_one_process(tmp_path):
    opts = dict(methods=("majority", "weighted", "beam", "dvts"), n=(1, 4), beam_width=2,
                max_steps=3, problems=2, seeds=(0, 1))
    whole, records = run(tmp_path, "whole.jsonl", scripted_policy(seeded=True), **opts)
    data, out = str(tmp_path / "p.jsonl"), str(tmp_path / "out.jsonl")
    shares = [search_file(data, out, scripted_policy(seeded=True), scripted_score,
                          SearchOptions(**opts), part=(p, 2), count=lambda q, t: 0, show=False)
              for p in (1, 0)]
    assert [s["problems"] for s in shares] == [2, 3]  # rows 1, 3 and rows 0, 2, 4
    assert sorted(os.listdir(tmp_path)) == ["out.jsonl.part0of2", "out.jsonl.part1of2",
                                            "out.jsonl.settings", "p.jsonl", "whole.jsonl",
                                            "whole.jsonl.settings"]
    merged = search_file(data, out, scripted_policy(), scripted_score, SearchOptions(**opts),
                         count=lambda q, t: 0, show=False)  # nothing left: the shards merged
    assert not any(".part" in name for name in os.listdir(tmp_path))
    assert timeless(map(json.loads, open(out).read().splitlines())) == timeless(records)
    strip = lambda s: {m: {n: {k: v for k, v in r.items() if k != "seconds"}  # noqa: E731
                           for n, r in by_n.items()} for m, by_n in s["results"].items()}
    assert strip(merged) == strip(whole)


def test_kv_cached_scores_equal_full_rescoring_and_count_the_tokens_run(models):
    from prm.scoring.reward import PRMReward
    # fp32 pinned: cached and whole forwards differ by float rounding only (~1e-7)
    reward = PRMReward(models[1], device="cpu", dtype="fp32", batch_size=3)  # pasts of many lengths
    runs = []  # per backbone forward on a cache: the new tokens run (the mask's last columns)
    reward.model.backbone.register_forward_pre_hook(lambda module, args, kw: runs.append(
        int(kw["attention_mask"][:, -kw["input_ids"].shape[1]:].sum()))
        if kw.get("use_cache") else None, with_kwargs=True)
    question = "count from 1:"
    prompt = len(reward.tokenizer(question)["input_ids"]) + (reward.tokenizer.bos_token_id
                                                             is not None)
    root = reward.start(question)
    first = reward.extend([root, root, root], ["1+1=2", "1+1=3", " 1+1=2 "])
    second = reward.extend([first[0][0], first[2][0], first[1][0]], ["2+1=3", "2+1=3", "3+1=5"])
    third = reward.extend([second[0][0]], ["3+1=4 and so on for a long while"])
    texts = ["1+1=2\n2+1=3", " 1+1=2 \n2+1=3", "1+1=3\n3+1=5", "1+1=2\n2+1=3\n3+1=4 and so on "
             "for a long while"]
    assert [t for _, _, t in first] == [prompt + 6, 6, 8] and sum(runs) == prompt + 20 + 18 + 33
    [full] = reward.score([question], [texts])
    got = [[first[0][1], second[0][1]], [first[2][1], second[1][1]], [first[1][1], second[2][1]],
           [first[0][1], second[0][1], third[0][1]]]
    assert got == [pytest.approx(ps, abs=1e-5) for ps in full]
    reward.max_length = prompt + 11  # a second step ends past it: unscored, and not run
    short = reward.extend([reward.start(question)] * 2, ["1+1=2", "1+1=2 and more"])
    assert [(p, t) for _, p, t in reward.extend([short[0][0]], ["2+1=3"])] == [(None, 0)]
    assert short[1][1:] == (None, 0) and short[0][1:] == (pytest.approx(first[0][1], abs=1e-5),
                                                          prompt + 6)
    assert reward.score([question], [[texts[0]]]) == [[[pytest.approx(first[0][1], abs=1e-5)]]]
    reward.max_length = None
    opts = SearchOptions(methods=("beam", "dvts"), n=(4,), beam_width=2, max_steps=3,
                         aggregate="min")
    block = [Problem(i, {"prompt": f"problem {i}:", "answer": "0"}, f"problem {i}:{SEP}", bool)
             for i in range(2)]
    whole = list(search_block(block, copies_alike, reward.score, lambda q, t: 0, opts, 0))
    runs.clear()
    fast = list(search_block(block, copies_alike, reward.score, lambda q, t: 0, opts, 0,
                             cached(reward)))
    tokens = 0
    for a, b in zip(whole, fast):
        for x, y in zip(a["results"], b["results"]):
            cands = x.get("candidates", []), y.get("candidates", [])
            assert [{**c, "scores": 0} for c in cands[0]] == [{**c, "scores": 0} for c in cands[1]]
            assert [c["scores"] for c in cands[1]] == \
                [pytest.approx(c["scores"], abs=1e-5) for c in cands[0]]
            tokens += y["prm_tokens"]
    assert tokens == sum(runs) > 0  # every token the PRM ran is counted, once
