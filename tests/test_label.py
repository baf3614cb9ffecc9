"""prm.label: answer extraction, the Monte-Carlo estimate and the binary search against scripted policies,
resumable and sharded output files, the generate path with a tiny random model (torchrun included), train.py
on its output."""
import json
import math
import os
import random
import re
import subprocess
import sys

import pytest

from conftest import LABEL_ROWS as ROWS, read_text as read
from conftest import ROOT, random_policy, read_metrics, scripted, small_config, write_rows
from prm.answers import extract_answer, judge, same_answer
from prm.errors import UsageError
from prm.label import LabelOptions, label_file, label_solutions, main
from prm.readers.sources import DataError


def steps_in(prompt: str) -> int:
    return prompt.count("\n") - 1  # "Q\n" then one line per step


def test_soft_and_hard_labels_are_the_counted_share_and_any():
    wins = {1: 4, 2: 1, 3: 0, 4: 3}
    for last, final in (("the answer is 1.", True), ("the answer is 2.", False)):
        steps = ["a", "b", "c", "d", last]
        complete, log = scripted(lambda p, n: wins[steps_in(p)])
        soft = label_solutions("Q\n", [steps], judge("1", LabelOptions()), complete, LabelOptions(rollouts=4, label="soft"), 0)
        assert soft == [{"labels": [1.0, 0.25, 0.0, 0.75, float(final)], "rollouts": [4, 4, 4, 4, 0],
                         "successes": [4, 1, 0, 3, 0]}]
        assert sorted(map(steps_in, log)) == [1, 2, 3, 4]  # the last step is judged by its own answer
        hard = label_solutions("Q\n", [steps], judge("1", LabelOptions()), complete,
                               LabelOptions(rollouts=4, label="hard"), 0)
        assert hard[0]["labels"] == [True, True, False, True, final]


@pytest.mark.parametrize("rest,rescued", [("I hope it is correct.", True), ("", True),
                                          ("so the answer is 2.", False)])
def test_a_rollout_is_judged_with_the_steps_before_it(rest, rescued):
    # step 2 states the right answer; a rollout from it that only closes the solution (or stops) gives the
    # completed solution that answer, one that answers otherwise does not
    steps = ["0 + 1 = 1", "So the result is \\boxed{1}.", "Wait: \\boxed{2}."]
    complete, _ = scripted(lambda p, n: 0 if "boxed" in p else n, wrong=rest)
    soft = label_solutions("Q\n", [steps], judge("1", LabelOptions()), complete, LabelOptions(rollouts=4, label="soft"), 0)[0]
    assert soft["labels"] == [1.0, float(rescued), 0.0] and soft["successes"] == [4, 4 * rescued, 0]
    binary = label_solutions("Q\n", [steps], judge("1", LabelOptions()), complete, LabelOptions(search="binary"), 0)
    assert binary[0]["labels"] == ([True, True, False] if rescued else [True, False, None])


def first_error_at(prompt: str, n: int) -> int:
    """Steps are named e<first error>s<k>: rollouts all succeed before the error, none after."""
    e, k = map(int, re.fullmatch(r"e(\d+)s(\d+)", prompt.splitlines()[-1]).groups())
    return n if k < e else 0


def test_binary_search_finds_every_first_error_within_log2_prefixes():
    opts = LabelOptions(rollouts=3, search="binary")
    for n in range(1, 13):
        solutions, expected = [], []
        for e in range(1, n + 2):  # e = n + 1: no error, the final answer is right
            steps = [f"e{e}s{k}" for k in range(1, n)] + ["the answer is " + ("1" if e > n else "2")]
            complete, log = scripted(first_error_at)
            got = label_solutions("Q\n", [steps], judge("1", opts), complete, opts, 0)[0]
            want = [True] * n if e > n else [True] * (e - 1) + [False] + [None] * (n - e)
            assert got["labels"] == want, (n, e)
            assert len(log) <= math.ceil(math.log2(n)) + 1 and (e <= n or not log), (n, e, log)
            assert sum(got["rollouts"]) == 3 * len(log)
            solutions.append(steps)
            expected.append(want)
        complete, log = scripted(first_error_at)  # all solutions of a problem searched together
        got = label_solutions("Q\n", solutions, judge("1", opts), complete, opts, 0)
        assert [g["labels"] for g in got] == expected


def test_soft_labels_lie_within_binomial_bounds_of_the_success_rate():
    p = {k: 0.05 + 0.09 * k for k in range(1, 11)}
    rng = random.Random(0)
    complete, _ = scripted(lambda prompt, n: sum(rng.random() < p[steps_in(prompt)] for _ in range(n)))
    steps = [f"s{k}" for k in range(1, 11)] + ["the answer is 1"]
    n = 400
    got = label_solutions("Q\n", [steps], judge("1", LabelOptions()), complete, LabelOptions(rollouts=n, label="soft"), 0)
    got = got[0]["labels"]
    for k in range(1, 11):
        assert abs(got[k - 1] - p[k]) <= 4.5 * math.sqrt(p[k] * (1 - p[k]) / n), (k, got[k - 1], p[k])
    assert got[-1] == 1.0


@pytest.mark.parametrize("text, answer", [
    ("so \\boxed{\\frac{1}{2}} and done", "\\frac{1}{2}"),  # nested braces
    ("\\boxed{1} first, then \\boxed{x^{2}+1}", "x^{2}+1"),  # the last one
    ("The answer is 1,000.", "1,000"),
    ("The answer is: $42$.\nCheck: fine", "$42$"),
    ("3 apples and 12 pears", "12"),
    ("no number at all", None),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def test_answers_match_after_normalization_and_never_without_one():
    for found, ref in (("\\frac{1}{2}", "0.5"), ("\\dfrac{1}{2}", "1/2"), ("-\\frac{3}{4}", "-0.75"),
                       ("1,000", "1000"), ("42.", "42"), ("$42$", "42"), ("x = 5", "5"),
                       ("10\\text{ cm}", "10cm")):
        assert same_answer(found, ref), (found, ref)
    for found, ref in (("1,000", "100"), ("\\frac{1}{3}", "0.33"), ("12", "1/2"), (None, "1"), ("1/0", "0")):
        assert not same_answer(found, ref), (found, ref)
    assert extract_answer("#### 72", "####\\s*(\\S+)") == "72" and extract_answer("#### 72", "\\d+") == "72"
    assert judge("72", LabelOptions(answer_pattern="####\\s*(\\S+)"))("so 8 \n#### 72")


def test_math_verify_checker_missing_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import fails as when it is not installed
    with pytest.raises(UsageError, match="pip install 'math-verify"):
        judge("1", LabelOptions(checker="math-verify"))


def test_a_killed_run_continues_to_the_file_of_an_uninterrupted_one(tmp_path):
    data, opts = write_rows(tmp_path / "in.jsonl", ROWS), LabelOptions(rollouts=3, samples=2)
    label_file(data, str(tmp_path / "whole.jsonl"), random_policy, opts)
    whole = read(tmp_path / "whole.jsonl")
    assert len(whole.splitlines()) > len(ROWS) and '"id": "p1/1"' in whole
    calls = [0]

    def dies(prompts, n, seed):
        calls[0] += 1
        if calls[0] > 7:
            raise KeyboardInterrupt
        return random_policy(prompts, n, seed)
    out = str(tmp_path / "out.jsonl")
    with pytest.raises(KeyboardInterrupt):
        label_file(data, out, dies, opts)
    kept = read(out)
    assert 0 < len(kept) < len(whole) and whole.startswith(kept)
    rest = whole[len(kept):]
    assert json.loads(rest.split("\n")[0])["lines"] == 2
    with open(out, "a") as f:  # a kill inside a row's second line: its first line is there, whole
        f.write(rest[:rest.index("\n") + 30])
    label_file(data, out, random_policy, opts)
    assert read(out) == whole
    with pytest.raises(UsageError, match="rollouts 3 \\(now 4\\)") as e:
        label_file(data, out, random_policy, LabelOptions(rollouts=4, samples=2))
    assert e.value.code == 2
    write_rows(tmp_path / "mine.jsonl", [{"mine": 1}])
    with pytest.raises(UsageError, match="mine.jsonl: not written by prm.label"):
        label_file(data, str(tmp_path / "mine.jsonl"), random_policy, opts)


def test_two_shards_merged_are_one_process(tmp_path):
    data, opts = write_rows(tmp_path / "in.jsonl", ROWS), LabelOptions(rollouts=2, search="binary")
    label_file(data, str(tmp_path / "whole.jsonl"), random_policy, opts)
    out = str(tmp_path / "out.jsonl")
    for i in range(2):
        label_file(data, out, random_policy, opts, part=(i, 2))
    assert sorted(os.listdir(tmp_path)) == sorted(["in.jsonl", "whole.jsonl", "whole.jsonl.settings",
                                                   "out.jsonl.settings", "out.jsonl.part0of2",
                                                   "out.jsonl.part1of2"])

    def nothing_left(prompts, n, seed):
        raise AssertionError("every row was labeled by the shards")
    label_file(data, out, nothing_left, opts)  # the run without a share merges
    assert read(out) == read(tmp_path / "whole.jsonl")
    assert not [f for f in os.listdir(tmp_path) if ".part" in f]


def test_bad_rows_name_file_line_and_field_or_are_skipped(tmp_path, capsys):
    rows = ROWS[:3] + [{"prompt": "p\n", "answer": None}, {"prompt": 3, "answer": "1"},
                       {"prompt": "p\n", "answer": "1", "completions": ["a", ""]}, {"prompt": "p\n"}]
    data = write_rows(tmp_path / "in.jsonl", rows)
    with pytest.raises(DataError) as e:
        label_file(data, str(tmp_path / "out.jsonl"), random_policy, LabelOptions())
    for where in ("line 4: field 'answer': expected", "line 5: field 'prompt'",
                  "line 6: field 'completions': step 1", "line 7: field 'answer': missing"):
        assert f"{data} {where}" in str(e.value)
    with pytest.raises(SystemExit) as e:
        main(["--policy", "x", "--dataset", data, "--output", str(tmp_path / "o.jsonl")])
    assert e.value.code == 2 and "line 7: field 'answer': missing" in capsys.readouterr().err
    label_file(data, str(tmp_path / "out.jsonl"), random_policy, LabelOptions(), skip_invalid=True)
    assert {json.loads(line)["row"] for line in read(tmp_path / "out.jsonl").splitlines()} == {0, 1, 2}


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    """A tiny random causal LM (the tiny preset's Qwen2 shape) with the character tokenizer."""
    import torch
    from transformers import Qwen2ForCausalLM
    from prm.loading import tiny_config
    from prm.readers.synthetic import char_tokenizer
    path = str(tmp_path_factory.mktemp("policy"))
    tokenizer = char_tokenizer()
    torch.manual_seed(0)
    Qwen2ForCausalLM(tiny_config(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def cli(policy, data, out):
    return ["--policy", policy, "--dataset", data, "--output", out, "--rollouts", "2", "--samples", "2",
            "--max-new-tokens", "8", "--batch-size", "3", "--temperature", "1.0"]


TINY_ROWS = [{"prompt": f"count from {i}:\n", "answer": str(i + 3)} if i % 2 else
             {"prompt": f"count from {i}:\n", "answer": str(i + 2), "completions": [f"{i}+1={i + 1}",
                                                                                  f"{i + 1}+1={i + 2}"]}
             for i in range(5)]


@pytest.fixture(scope="module")
def one_process(policy_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one")
    data = write_rows(tmp / "in.jsonl", TINY_ROWS)
    main(cli(policy_dir, data, str(tmp / "out.jsonl")))
    return data, read(tmp / "out.jsonl")


def test_generate_path_is_seeded_and_trains(policy_dir, one_process, tmp_path):
    data, first = one_process
    main(cli(policy_dir, data, str(tmp_path / "again.jsonl")))
    assert read(tmp_path / "again.jsonl") == first
    rows = [json.loads(line) for line in first.splitlines()]
    assert {r["row"] for r in rows} >= {0, 2, 4}
    assert all(len(r["labels"]) == len(r["completions"]) for r in rows)
    assert all(r["rollouts"][:-1] == [2] * (len(r["labels"]) - 1) for r in rows)
    main(cli(policy_dir, data, str(tmp_path / "seed1.jsonl")) + ["--seed", "1"])
    assert read(tmp_path / "seed1.jsonl") != first  # each row's seed comes from --seed
    from conftest import train
    final = train(small_config(tmp_path / "run", dataset=str(tmp_path / "again.jsonl"), max_steps=2,
                               batch_size=2))
    assert final is not None and len([m for m in read_metrics(tmp_path / "run") if "loss" in m]) == 2


def test_the_batch_size_is_a_speed_knob(policy_dir, one_process, tmp_path, monkeypatch):
    """Each text is sampled from its own seeded generator: --batch-size changes no label."""
    monkeypatch.setenv("PRM_CPU_BF16", "0")  # fp32: a row's logits do not move with its batch
    data, outs = one_process[0], []
    for size in ("3", "1"):
        main(cli(policy_dir, data, str(tmp_path / f"{size}.jsonl"))[:-4] + [
            "--batch-size", size, "--temperature", "1.0"])
        outs.append(read(tmp_path / f"{size}.jsonl"))
    assert outs[0] == outs[1] and outs[0]


def test_a_causal_lm_loaded_as_a_backbone_prints_no_load_report(policy_dir):
    """Its lm_head is expected to be left out: saved_weights checks the keys itself."""
    import logging
    from prm.loading import pretrained
    logger, seen = logging.getLogger("transformers.modeling_utils"), []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:
        pretrained(policy_dir, False)
    finally:
        logger.removeHandler(handler)
    assert not [m for m in seen if "LOAD REPORT" in m]


def test_two_ranks_under_torchrun_are_one_process(policy_dir, one_process, tmp_path):
    data, first = one_process
    out = str(tmp_path / "out.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "prm.label"] + cli(policy_dir, data, out)
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert read(out) == first
    assert sorted(os.listdir(tmp_path)) == ["out.jsonl", "out.jsonl.settings"]


def test_generator_renders_text_and_chat_prompts(policy_dir):
    import torch
    from prm.label import Generator
    gen = Generator(LabelOptions(policy=policy_dir), device=torch.device("cpu"))
    assert gen.render("count:") == "count:"  # the character tokenizer adds no BOS of its own
    with pytest.raises(UsageError, match="cannot render a chat prompt"):
        gen.render([{"role": "user", "content": "count:"}])
    gen.tokenizer().chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}a: "
    assert gen.render([{"role": "user", "content": "count:"}]) == "user: count:\na: "
    assert [len(texts) for texts in gen(["count:", "a"], 3, 0)] == [3, 3]


def test_a_chat_template_that_refuses_the_messages_is_a_usage_error(policy_dir):
    import torch
    from prm.label import Generator
    gen = Generator(LabelOptions(policy=policy_dir), device=torch.device("cpu"))
    gen.tokenizer().chat_template = ("{% for m in messages %}{% if m.role != 'user' %}{{ raise_exception('only "
                                     "user turns') }}{% endif %}{{ m.content }}{% endfor %}")
    assert gen.render([{"role": "user", "content": "count:"}]) == "count:"
    with pytest.raises(UsageError, match="cannot render a chat prompt: only user turns"):
        gen.render([{"role": "system", "content": "be brief"}, {"role": "user", "content": "count:"}])
    gen.tokenizer().chat_template = "{% for m in messages %}"  # no endfor: a syntax error
    with pytest.raises(UsageError, match="cannot render a chat prompt") as e:
        gen.render([{"role": "user", "content": "count:"}])
    assert "\n" not in str(e.value)


def test_greedy_decoding_generates_each_prompt_once(policy_dir):
    import torch
    from prm.label import Generator
    gen = Generator(LabelOptions(policy=policy_dir, temperature=0.0, max_new_tokens=4), device=torch.device("cpu"))
    gen.tokenizer()
    generate, rows = gen.model.generate, []
    gen.model.generate = lambda **kw: rows.append(len(kw["input_ids"])) or generate(**kw)
    texts = gen(["count:", "a"], 4, 0)
    assert sum(rows) == 2 and [len(set(t)) for t in texts] == [1, 1] and list(map(len, texts)) == [4, 4]


@pytest.mark.parametrize("native", ["1", "0"])
def test_the_policy_holds_bf16_weights_where_bf16_is_native_else_fp32(policy_dir, monkeypatch, native):
    import torch
    from prm.label import Generator
    monkeypatch.setenv("PRM_CPU_BF16", native)  # the probe prm.core.runtime.autocast_dtype reads
    gen = Generator(LabelOptions(policy=policy_dir, max_new_tokens=3), device=torch.device("cpu"))
    texts = gen(["count:"], 2, 0)
    want = torch.bfloat16 if native == "1" else torch.float32
    assert {p.dtype for p in gen.model.parameters()} == {want} and len(texts[0]) == 2
    assert gen(["count:"], 2, 0) == texts  # seeded: the same texts again


def test_an_output_in_a_missing_folder_is_exit_status_2_naming_the_folder(tmp_path, capsys):
    data = write_rows(tmp_path / "in.jsonl", ROWS)
    with pytest.raises(SystemExit) as e:
        main(["--policy", "x", "--dataset", data, "--output", str(tmp_path / "no" / "out.jsonl")])
    assert e.value.code == 2 and f"no folder {tmp_path / 'no'}; pass another --output" in capsys.readouterr().err


def test_a_bad_flag_is_one_line_and_exit_status_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "prm.label", "--policy", "p", "--dataset", "d.jsonl", "--output",
                        str(tmp_path / "o.jsonl"), "--shard", "3/2"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--shard '3/2'" in r.stderr, r.stderr[-2000:]


def test_help_shows_the_newline_separator_as_an_escape(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0 and "understood) (default: '\\n')" in text and "(default: )" not in text


def test_rollout_prompts_start_each_step_on_its_own_and_drop_blank_sampled_steps():
    from prm.label import label_row
    complete, log = scripted(lambda p, n: n)
    lines = label_row({"prompt": "What is 1+1?", "answer": "1", "completions": ["1+1", "so 1"]}, 0, complete,
                      lambda prompt: prompt, LabelOptions(rollouts=1))
    assert log == ["What is 1+1?\n1+1\n"] and json.loads(lines[0])["labels"] == [1.0, 1.0]

    def sampled(prompts, n, seed):  # a zero-width piece is no step (formats.split_steps), as train.py sees it
        return [["a\n\u200b\n \\boxed{1}"] * n] if prompts == ["Q\n"] else [["\\boxed{1}"] * n] * len(prompts)
    row = json.loads(label_row({"prompt": "Q\n", "answer": "1"}, 0, sampled, lambda prompt: prompt,
                               LabelOptions(rollouts=1, samples=1))[0])
    assert row["completions"] == ["a", " \\boxed{1}"]  # each step verbatim, as training keeps it


def test_a_chat_prompt_without_render_is_a_usage_error_naming_the_row(tmp_path):
    data = write_rows(tmp_path / "chat.jsonl", [{"prompt": [{"role": "user", "content": "1?"}], "answer": "1",
                                                 "completions": ["a", "\\boxed{1}"]}])
    with pytest.raises(UsageError, match="row 0: a chat prompt needs render="):
        label_file(data, str(tmp_path / "out.jsonl"), scripted(lambda p, n: n)[0], LabelOptions(rollouts=1),
                   show=False)


@pytest.mark.parametrize("flags", [["--top-p", "0"], ["--top-p", "1.5"], ["--temperature", "-1"]])
def test_sampling_settings_transformers_would_refuse_are_exit_2_before_loading(tmp_path, flags):
    data = write_rows(tmp_path / "in.jsonl", ROWS)
    r = subprocess.run([sys.executable, "-m", "prm.label", "--policy", "no/such/policy", "--dataset", data,
                        "--output", str(tmp_path / "o.jsonl"), *flags], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and flags[0] in r.stderr, r.stderr[-2000:]
