"""prm.search and prm.label outputs under hostile input: never a file they did not write erased or rewritten,
never a FIFO waited on, a lock never followed through a link, settings that name what is at a model's path, one
answer per number, 0 rows refused, a failed start that leaves nothing; each one line and its exit status. The
policies and PRMs are scripted (main's models replaced by fakes): no model loads but the tiny masked LM's."""
import json
import os
import signal

import pytest

import prm.search as search
from prm.errors import UsageError
from prm.files import locked, write_lines
from prm.files import check_settings
from prm.answers import same_answer
from prm.label import LabelOptions, label_file
from prm.search import SearchOptions, pick, search_file
from conftest import scripted_policy, scripted_score, write_problems

FAST = dict(methods=("majority", "weighted"), n=(2,), problems=2)


def searched(data, out, **opts):
    return search_file(str(data), str(out), scripted_policy(), scripted_score, SearchOptions(**{**FAST, **opts}),
                       show=False)


def exits(argv: list, capsys) -> tuple:
    """(search main's exit status, its stderr)."""
    with pytest.raises(SystemExit) as e:
        search.main(argv)
    return e.value.code, capsys.readouterr().err


class FakePRM:
    """PRMReward for main: scripted scores, a character per token, 20 tokens read at most."""
    step_separator, max_length, device, cacheable = "\n", 20, "cpu", False

    def __init__(self, model, *args, **kwargs):
        self.tokenizer = lambda text: {"input_ids": list(text)}

    def score(self, questions, outputs):
        return scripted_score(questions, outputs)


class FakePolicy:
    def __init__(self, opts, **kwargs):
        self.propose, self.render = scripted_policy(), lambda prompt: prompt

    def __call__(self, *args):
        out = self.propose(*args)
        self.usage = self.propose.usage
        return out


@pytest.fixture
def fakes(monkeypatch):
    import prm.scoring.reward as reward
    monkeypatch.setattr(reward, "PRMReward", FakePRM)
    monkeypatch.setattr(search, "Generator", FakePolicy)


def argv(tmp_path, data, out, *more):
    return ["--dataset", str(data), "--output", str(out), "--policy", "p", "--model", str(tmp_path / "prm"),
            "--methods", "majority,weighted", "--n", "2", *more]


def test_an_output_that_is_or_lies_in_the_dataset_is_refused_before_anything_is_written(tmp_path, fakes, capsys):
    data = tmp_path / "d.json"
    data.write_text(json.dumps([{"prompt": "problem 0:", "answer": "0"}]))  # one line, no newline
    code, err = exits(argv(tmp_path, data, data), capsys)
    assert code == 2 and "--output" in err and "would overwrite --dataset" in err and err.count("\n") == 1
    assert sorted(os.listdir(tmp_path)) == ["d.json"] and json.loads(data.read_text())[0]["answer"] == "0"
    folder = tmp_path / "data"
    folder.mkdir()
    write_problems(folder / "p.jsonl", 2)
    code, err = exits(argv(tmp_path, folder, folder / "out.jsonl"), capsys)  # it would be read as problems
    assert code == 2 and "would overwrite --dataset" in err and os.listdir(folder) == ["p.jsonl"]


@pytest.mark.parametrize("program", ["search", "label"])
def test_a_file_neither_wrote_is_refused_not_taken_for_a_cut_line(tmp_path, program):
    data, notes = write_problems(tmp_path / "p.jsonl", 2), tmp_path / "notes.txt"
    notes.write_text("my notes")
    with pytest.raises(UsageError, match=f"notes.txt: not written by prm.{program}"):
        if program == "search":
            searched(data, notes)
        else:
            label_file(data, str(notes), lambda prompts, n, seed: [["the answer is 0"] * n for _ in prompts],
                       LabelOptions(), show=False)
    assert notes.read_text() == "my notes" and sorted(os.listdir(tmp_path)) == ["notes.txt", "p.jsonl"]


def test_the_lock_is_never_opened_through_a_symlink_and_its_owner_is_printed_safely(tmp_path):
    out, target = str(tmp_path / "out.jsonl"), tmp_path / "precious"
    target.write_text("123@host")
    os.symlink(target, out + ".lock")
    with pytest.raises(UsageError, match="out.jsonl.lock is a symbolic link"):
        with locked(out):
            pass
    assert target.read_text() == "123@host"
    os.remove(out + ".lock")
    with open(out + ".lock", "w") as f:  # a live owner's lock on another host, with escapes and a newline
        f.write("1@elsewhere\x1b[31m\nred\x07")
    with pytest.raises(UsageError, match=r"in use by another run \(1@elsewhere\?\[31m\?red\?\)") as e:
        with locked(out):
            pass
    assert "\x1b" not in str(e.value) and "\n" not in str(e.value)


def test_a_model_saved_again_at_the_same_path_is_other_settings(tmp_path, fakes, capsys):
    data, out, prm = write_problems(tmp_path / "p.jsonl", 2), tmp_path / "o.jsonl", tmp_path / "prm"
    prm.mkdir()
    (prm / "model.safetensors").write_bytes(b"first")
    search.main(argv(tmp_path, data, out))
    (prm / "model.safetensors").write_bytes(b"again")  # retrained into the same folder
    code, err = exits(argv(tmp_path, data, out), capsys)
    assert code == 2 and "with other settings: model_files" in err
    # a policy's too (prm.label and prm.search alike)
    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "model.safetensors").write_bytes(b"first")
    searched(data, tmp_path / "s.jsonl", policy=str(policy))
    (policy / "model.safetensors").write_bytes(b"second")
    with pytest.raises(UsageError, match="policy_files"):
        searched(data, tmp_path / "s.jsonl", policy=str(policy))


def test_equal_numbers_are_one_answer_in_the_vote():
    cands = [{"answer": a, "scores": [0.5]} for a in ("7", "7", "0.5", "1/2", "\\frac{1}{2}")]
    assert pick(cands, "majority", "last") == 2 and same_answer("0.5", "\\dfrac{1}{2}")
    # every score missing (prompts past the PRM's length): the most candidates, not the first
    assert pick([{**c, "scores": []} for c in cands], "weighted", "last") == 2


def test_prm_tokens_count_what_the_prm_reads_and_ctrl_c_at_start_is_one_line(tmp_path, fakes, capsys, monkeypatch):
    data, out = write_problems(tmp_path / "p.jsonl", 2), tmp_path / "o.jsonl"
    search.main(argv(tmp_path, data, out))
    samples = [c for line in out.read_text().splitlines() for c in json.loads(line)["samples"]]
    assert max(c["prm_tokens"] for c in samples) == FakePRM.max_length  # the texts are longer

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(FakePRM, "__init__", interrupted)  # Ctrl-C while the PRM loads
    capsys.readouterr()
    code, err = exits(argv(tmp_path, data, tmp_path / "o2.jsonl"), capsys)
    assert code == 130 and err.count("\n") == 1 and "stopped by SIGINT" in err


def test_a_rows_cache_edited_since_it_was_written_is_read_again(tmp_path, monkeypatch):
    import glob
    import datasets
    from prm.config import Config
    from prm.readers.sources import load_splits
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    was_on = datasets.is_caching_enabled()
    datasets.enable_caching()
    try:
        data = tmp_path / "d.jsonl"
        data.write_text("".join(json.dumps({"prompt": f"q{i}", "completions": ["a"], "labels": [i % 2 == 0]}) + "\n"
                                for i in range(20)))
        first = [d.to_list() for d in load_splits(Config(dataset=str(data)))]
        found = glob.glob(str(tmp_path / "cache" / "**" / "*.arrow"), recursive=True)
        [arrow] = [f for f in found if "-train/" in f]
        with open(arrow, "rb") as f:
            raw = f.read()
        with open(arrow, "wb") as f:  # a prompt edited in place: the file still reads
            f.write(raw.replace(b"q1", b"z1"))
        assert [d.to_list() for d in load_splits(Config(dataset=str(data)))] == first
    finally:
        if not was_on:
            datasets.disable_caching()


def test_a_masked_language_model_is_refused_as_a_policy(tmp_path):
    import torch
    from transformers import BertConfig, BertForMaskedLM
    from prm.label import Generator
    from prm.readers.synthetic import char_tokenizer
    tok = char_tokenizer()
    BertForMaskedLM(BertConfig(vocab_size=len(tok), hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                               intermediate_size=8)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with pytest.raises(UsageError, match="a masked language model \\(BertForMaskedLM\\) writes no text"):
        Generator(LabelOptions(policy=str(tmp_path)), device=torch.device("cpu")).tokenizer()


def test_a_symlinked_output_stays_a_link(tmp_path):
    data, target = write_problems(tmp_path / "p.jsonl", 2), tmp_path / "kept" / "o.jsonl"
    target.parent.mkdir()
    target.write_text("")
    os.symlink(target, tmp_path / "link.jsonl")
    searched(data, tmp_path / "link.jsonl")
    assert os.path.islink(tmp_path / "link.jsonl") and len(target.read_text().splitlines()) == 2


def test_shards_starting_together_with_other_settings_do_not_both_pass(tmp_path, monkeypatch):
    out = str(tmp_path / "o.jsonl")
    real, seen = os.path.isfile, []

    def not_yet(path):  # the other shard writes its settings between this one's look and its write
        if path.endswith(".settings") and not seen:
            seen.append(path)
            return False
        return real(path)
    check_settings(out, {"writer": "prm.label", "rollouts": 8})
    monkeypatch.setattr(os.path, "isfile", not_yet)
    with pytest.raises(UsageError, match="rollouts 8 \\(now 4\\)"):
        check_settings(out, {"writer": "prm.label", "rollouts": 4})


@pytest.mark.parametrize("kind", ["fifo", "folder", "empty", "missing folder", "long name"])
def test_an_output_that_cannot_be_a_results_file_is_refused_naming_it(tmp_path, kind):
    data = write_problems(tmp_path / "p.jsonl", 2)
    out = {"fifo": tmp_path / "f", "folder": tmp_path, "empty": "", "missing folder": tmp_path / "no" / "o.jsonl",
           "long name": tmp_path / ("o" * 250)}[kind]
    if kind == "fifo":
        os.mkfifo(out)
    def hung(*args):
        raise TimeoutError("hung")
    signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)  # the FIFO hung here: opened for writing, waiting for a reader
    try:
        with pytest.raises(UsageError, match="--output .*; pass another --output"):
            searched(data, out)
    finally:
        signal.alarm(0)
    assert sorted(os.listdir(tmp_path)) == sorted(["p.jsonl"] + (["f"] if kind == "fifo" else []))
    write_lines(str(tmp_path / ("o" * 254)), ["a"])  # the longest name writes: its temporary name is short
    assert (tmp_path / ("o" * 254)).read_text() == "a\n"


def test_outputs_not_utf8_or_of_another_program_are_one_line(tmp_path):
    data, out = write_problems(tmp_path / "p.jsonl", 2), tmp_path / "o.jsonl"
    searched(data, out)
    out.write_bytes(b'{"row": 0, "lines": 1, "x": "\xff"}\n')
    with pytest.raises(UsageError, match="o.jsonl line 1: not a line prm.search writes"):
        searched(data, out)
    label = tmp_path / "l.jsonl"
    label_file(data, str(label), lambda prompts, n, seed: [["the answer is 0"] * n for _ in prompts],
               LabelOptions(samples=1), show=False)
    with pytest.raises(UsageError, match="writer 'prm.label' \\(now 'prm.search'\\)"):
        searched(data, label)
    other = tmp_path / "other.jsonl"
    searched(data, other)
    with open(other, "a") as f:
        f.write("garbage\n")
    with pytest.raises(UsageError, match="other.jsonl line 3: not a line prm.search writes"):
        searched(data, other)


def test_no_rows_are_refused(tmp_path):
    (tmp_path / "p.jsonl").write_text("")
    with pytest.raises(UsageError, match="p.jsonl: no rows"):
        searched(tmp_path / "p.jsonl", tmp_path / "o.jsonl")
    with pytest.raises(UsageError, match="p.jsonl: no rows"):
        label_file(str(tmp_path / "p.jsonl"), str(tmp_path / "l.jsonl"), None, LabelOptions(), show=False)
    assert os.listdir(tmp_path) == ["p.jsonl"]


def test_a_run_refused_at_its_first_problem_leaves_no_file_and_the_rerun_starts(tmp_path):
    data, out = write_problems(tmp_path / "p.jsonl", 2), tmp_path / "o.jsonl"

    def refused(prompt):  # as Generator.render when --policy cannot load
        raise UsageError("--policy bad: cannot load it")
    with pytest.raises(UsageError, match="--policy bad"):
        search_file(str(data), str(out), scripted_policy(), scripted_score, SearchOptions(**FAST), render=refused,
                    show=False)
    assert os.listdir(tmp_path) == ["p.jsonl"]
    assert searched(data, out)["problems"] == 2
