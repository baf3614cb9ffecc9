"""prm.label under hostile input: a second run on one output, blank samples, odd patterns and numbers,
flags and rows refused before anything is written, a damaged settings file, failed writes and Ctrl-C, each one
line and its exit status. Depends on: pytest, prm."""
import errno
import json
import os
import sys

import pytest

from prm.errors import UsageError, WriteFailed
from prm.answers import extract_answer, judge, same_answer
from prm.label import LabelOptions, label_file, main
from conftest import LABEL_ROWS as ROWS, read_text as read
from conftest import random_policy, scripted, write_rows


def exits(argv) -> int:
    """main's exit status; a KeyboardInterrupt that escapes is caught here, not by pytest."""
    try:
        main(argv)
    except BaseException as e:  # SystemExit, or what would have been a traceback
        return e.code if isinstance(e, SystemExit) else repr(e)
    return 0


def test_a_second_run_on_an_output_being_written_is_refused_and_the_first_finishes_whole(tmp_path, capsys):
    data, opts = write_rows(tmp_path / "in.jsonl", ROWS), LabelOptions(rollouts=2, samples=2)
    label_file(data, str(tmp_path / "whole.jsonl"), random_policy, opts, show=False)
    out, seen = str(tmp_path / "out.jsonl"), []

    def meanwhile(prompts, n, seed):  # a second run starts while the first is labeling
        if not seen:
            with pytest.raises(UsageError, match="out.jsonl is in use by another run") as e:
                label_file(data, out, random_policy, opts, show=False)
            seen.append(exits(["--policy", "p", "--dataset", data, "--output", out, "--rollouts", "2",
                               "--samples", "2"]))
            seen.append((e.value.code, capsys.readouterr().err))
        return random_policy(prompts, n, seed)
    label_file(data, out, meanwhile, opts, show=False)
    code, err = seen[0], seen[1][1]
    assert code == 2 and err.count("\n") == 1 and "is in use by another run" in err
    assert seen[1][0] == 2 and read(out) == read(tmp_path / "whole.jsonl")
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".lock")]
    label_file(data, out, random_policy, opts, show=False)  # the lock went with the run that held it
    assert read(out) == read(tmp_path / "whole.jsonl")


def test_an_output_that_is_the_dataset_is_refused_before_anything_is_written(tmp_path, capsys):
    data = write_rows(tmp_path / "in.jsonl", ROWS)
    assert exits(["--policy", "no/such/policy", "--dataset", data, "--output", data]) == 2
    assert capsys.readouterr().err == f"error: --output {data} would overwrite --dataset {data}, " \
                                      "which it reads: choose another path\n"
    assert os.listdir(tmp_path) == ["in.jsonl"]


def test_a_row_whose_samples_are_all_blank_is_recorded_once_and_not_sampled_again(tmp_path, capsys):
    rows = [{"prompt": "blank\n", "answer": "1"}, {"prompt": "Q\n", "answer": "1", "completions": ["a", "1"]}]
    data, out, opts = write_rows(tmp_path / "in.jsonl", rows), str(tmp_path / "out.jsonl"), LabelOptions(samples=3)
    complete, log = scripted(lambda p, n: n)
    blank = lambda prompts, n, seed: [[" \n\u200b\n"] * n] if prompts == ["blank\n"] else complete(prompts, n, seed)
    label_file(data, out, blank, opts, show=False)
    assert "row 0: its 3 sampled solutions are all blank" in capsys.readouterr().err
    assert [json.loads(line)["row"] for line in read(out).splitlines()] == [1]
    assert json.loads(read(out + ".blank")) == {"row": 0, "lines": 1, "blank_samples": 3}

    def nothing_left(prompts, n, seed):
        raise AssertionError("every row has its record")
    label_file(data, out, nothing_left, opts, show=False)


def test_a_blank_record_cut_by_a_kill_is_dropped_on_resume(tmp_path):
    data, out = write_rows(tmp_path / "in.jsonl", [{"prompt": "Q\n", "answer": "1"}]), str(tmp_path / "out.jsonl")
    blank = lambda prompts, n, seed: [[" \n"] * n]
    label_file(data, out, blank, LabelOptions(samples=2), show=False)
    whole = read(out + ".blank")
    (tmp_path / "out.jsonl.blank").write_text(whole[:len(whole) // 2])  # a kill cut its only line
    label_file(data, out, blank, LabelOptions(samples=2), show=False)  # the row is sampled again

    def nothing_left(prompts, n, seed):
        raise AssertionError("every row has its record")
    label_file(data, out, nothing_left, LabelOptions(samples=2), show=False)
    assert read(out + ".blank") == whole


def test_settings_are_written_only_by_the_run_holding_the_lock(tmp_path):
    """Two first runs started together with other --rollouts: the one that finds the lock taken writes none."""
    from prm.files import locked
    data, out = write_rows(tmp_path / "in.jsonl", ROWS), str(tmp_path / "out.jsonl")
    with locked(out):  # the other run holds the lock and has not written its settings yet
        with pytest.raises(UsageError):
            label_file(data, out, random_policy, LabelOptions(rollouts=2), show=False)
        assert not os.path.exists(out + ".settings")
    label_file(data, out, random_policy, LabelOptions(rollouts=3), show=False)
    assert json.loads(read(out + ".settings"))["rollouts"] == 3


def test_an_answer_pattern_gives_its_first_group_that_took_part():
    pattern = r"answer: (\d+)|#### (\d+)"
    assert extract_answer("so 8\n#### 72", pattern) == "72" and extract_answer("answer: 5", pattern) == "5"
    assert judge("72", LabelOptions(answer_pattern=pattern))("so 8 \n#### 72")
    assert extract_answer("x = 72", r"x = (y)?\d+") == "x = 72"  # no group took part: the whole match


def test_numbers_too_long_for_int_are_compared_as_text(tmp_path):
    big = "7" * 5000
    assert same_answer(big, big) and not same_answer(big, "2") and not same_answer(big + ".5", big)
    assert judge(big, LabelOptions())(f"so the answer is {big}.")
    data = write_rows(tmp_path / "in.jsonl", [{"prompt": "Q\n", "answer": big, "completions": [big, big]}])
    complete, _ = scripted(lambda p, n: 0, wrong=big)
    label_file(data, str(tmp_path / "out.jsonl"), complete, LabelOptions(rollouts=1), show=False)
    assert json.loads(read(tmp_path / "out.jsonl"))["labels"] == [1.0, 1.0]


def test_the_default_answer_extractor_takes_a_long_run_of_spaces_in_one_pass():
    text = "the answer is a" + " " * 1_000_000 + "b"  # a backtracking search would take hours here
    assert extract_answer(text) == text[len("the answer is "):]


def test_an_answer_pattern_that_backtracks_without_end_is_one_line():
    with pytest.raises(UsageError, match=r"--answer-pattern '\(a\|aa\)\+\$': no result within 2 s") as e:
        extract_answer("a" * 80 + "!", "(a|aa)+$")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("flags, says", [(["--answer-pattern", "("], "--answer-pattern '(': not a regular"),
                                         (["--step-separator", ""], "--step-separator '': must not be empty"),
                                         (["--checker", "math-verify"], "pip install 'math-verify")])
def test_flags_that_would_fail_later_are_exit_2_before_anything_is_written(tmp_path, capsys, monkeypatch, flags,
                                                                           says):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # not installed
    data = write_rows(tmp_path / "in.jsonl", ROWS)
    assert exits(["--policy", "no/such/policy", "--dataset", data, "--output", str(tmp_path / "o.jsonl"),
                  *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and os.listdir(tmp_path) == ["in.jsonl"]


def test_plain_and_chat_prompts_mixed_are_refused_before_any_rollout(tmp_path):
    rows = [{"prompt": "1?", "answer": "1"}, {"prompt": [{"role": "user", "content": "1?"}], "answer": "1"}]
    data = write_rows(tmp_path / "in.jsonl", rows)
    with pytest.raises(UsageError, match="line 2: field 'prompt': plain-text and conversational prompts are mixed"):
        label_file(data, str(tmp_path / "out.jsonl"), scripted(lambda p, n: n)[0], LabelOptions(), show=False)
    assert os.listdir(tmp_path) == ["in.jsonl"]


@pytest.mark.parametrize("settings", [b'{"rollouts": 8, "lab', b"[8, 4]", b'{"seed": "\xff"}'])
def test_a_damaged_settings_file_is_one_line_and_exit_2(tmp_path, capsys, settings):
    data = write_rows(tmp_path / "in.jsonl", ROWS)
    (tmp_path / "o.jsonl.settings").write_bytes(settings)
    assert exits(["--policy", "no/such/policy", "--dataset", data, "--output", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "o.jsonl.settings: not the settings prm.label writes" in err and err.count("\n") == 1


def test_a_failed_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    data = write_rows(tmp_path / "in.jsonl", ROWS)

    def full_disk(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(WriteFailed, match="could not write .*o.jsonl: No space left"):
        label_file(data, str(tmp_path / "o.jsonl"), random_policy, LabelOptions(), show=False)
    # the merge failed: the rows labeled stay, no temporary file
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "o.jsonl", "o.jsonl.settings"]


def test_ctrl_c_is_one_line_and_exit_130_and_the_rerun_continues(tmp_path, capsys, monkeypatch):
    import prm.label as label
    data, out = write_rows(tmp_path / "in.jsonl", ROWS), str(tmp_path / "out.jsonl")

    class Interrupted:  # the policy: Ctrl-C arrives inside its third generate call
        calls = 0

        def __init__(self, opts, **kwargs):
            self.render = lambda prompt: prompt

        def __call__(self, prompts, n, seed):
            Interrupted.calls += 1
            if Interrupted.calls == 3:
                raise KeyboardInterrupt
            return random_policy(prompts, n, seed)
    monkeypatch.setattr(label, "Generator", Interrupted)
    argv = ["--policy", "p", "--dataset", data, "--output", out, "--rollouts", "2", "--samples", "2"]
    assert exits(argv) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "stopped by SIGINT" in err and "Traceback" not in err
    assert exits(argv) == 0
    label_file(data, str(tmp_path / "whole.jsonl"), random_policy, LabelOptions(rollouts=2, samples=2), show=False)
    assert read(out) == read(tmp_path / "whole.jsonl")


def test_a_math_verify_found_but_failing_to_import_is_refused(tmp_path, monkeypatch):
    (tmp_path / "math_verify").mkdir()
    (tmp_path / "math_verify" / "__init__.py").write_text("raise ImportError('no antlr4')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "math_verify", raising=False)
    with pytest.raises(UsageError, match="pip install 'math-verify"):
        LabelOptions(policy="p", checker="math-verify")
