"""Local files and directories, the bad-input matrix (exit status 2, row named), soft and chat data, training."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from datasets import Dataset

from prm.config import Config
from prm.convert import main as convert_main
from prm.core.data import IGNORE, collate, normalize_label
from prm.readers.ingest import tokenize_dataset
from prm.core.model import step_loss
from prm.readers.sources import DataError, cut_after_first_error, load_eval, load_splits, read_rows
from prm.readers.synthetic import char_tokenizer, train_eval_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures")
BAD = os.path.join(FIX, "bad")


def _none_labels_supported():
    try:
        return normalize_label(None) == IGNORE
    except ValueError:
        return False


needs_unlabeled_steps = pytest.mark.skipif(not _none_labels_supported(),
                                           reason="prm.core.data.normalize_label must map None (unlabeled step) to -100")


@pytest.fixture(autouse=True, scope="module")
def datasets_cache(tmp_path_factory):
    """Arrow files of these tests go to a temporary cache, not the user's; caching on, whatever ran before."""
    import datasets
    was_on = datasets.is_caching_enabled()
    datasets.enable_caching()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf_datasets")))
        yield
    if not was_on:
        datasets.disable_caching()


def cfg_for(dataset, **kw):
    return Config(dataset=dataset, **kw)


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


@pytest.mark.parametrize("name, fmt, n_rows", [
    ("stepwise_train.jsonl", "stepwise", 17), ("math_shepherd.jsonl", "math_shepherd", 7),
    ("prm800k.jsonl", "prm800k", 36), ("processbench.json", "processbench", 5)])
def test_fixtures_load_with_detected_format(name, fmt, n_rows, capsys):
    path = os.path.join(FIX, name)
    train, held = load_splits(cfg_for(path, eval_dataset=path))
    assert len(train) == len(held) == n_rows
    assert f"format {fmt} (detected from columns" in capsys.readouterr().err
    assert {"prompt", "completions", "labels"} <= set(train.column_names)
    assert train.features["labels"].feature.dtype == "bool"


def test_processbench_keeps_benchmark_columns():
    path = os.path.join(FIX, "processbench.json")
    ds = load_eval(Config(), path)
    assert ds["first_error"] == [0, 4, -1, 1, -1] and ds["final_answer_correct"] == [False, False, True, True, True]
    assert ds["id"][0] == "gsm8k-17" and ds[0]["labels"] == [False, None, None, None]


def test_forced_format(capsys):
    path = os.path.join(FIX, "math_shepherd.jsonl")
    assert len(read_rows(path, "train", Config(format="math_shepherd"))) == 7
    assert "forced by --format" in capsys.readouterr().err
    with pytest.raises(DataError) as e:
        read_rows(path, "train", Config(format="stepwise"))
    assert "math_shepherd.jsonl line 1: field 'prompt': missing" in str(e.value)


def test_json_parquet_and_directory_read_the_same_rows(tmp_path):
    rows = read_rows(os.path.join(FIX, "stepwise_train.jsonl"), "train", Config())
    Dataset.from_list(rows).to_parquet(str(tmp_path / "part.parquet"))
    (tmp_path / "array.json").write_text(json.dumps(rows))
    assert read_rows(str(tmp_path / "part.parquet"), "train", Config()) == rows
    assert read_rows(str(tmp_path / "array.json"), "train", Config()) == rows
    both = read_rows(str(tmp_path), "train", Config())  # the directory: every supported file, sorted by name
    assert both == rows + rows


@pytest.mark.parametrize("record", [{"input_ids": [1, 2, 3], "labels": [-100, -100, 1]},
                                    {"prompt": [{"role": "user", "content": "hi"}], "completions": ["a"],
                                     "labels": [True]}])
def test_a_one_line_json_file_of_one_record_of_list_columns_is_that_record(record, tmp_path):
    # an object of lists is Mr-Ben's grouped layout only when the lists hold records (objects)
    for ext in ("json", "jsonl"):
        (tmp_path / f"one.{ext}").write_text(json.dumps(record))
    one, twin = (read_rows(str(tmp_path / f"one.{ext}"), "train", Config()) for ext in ("json", "jsonl"))
    where = lambda rows: [{**r, "where": r.get("where", "").replace(".jsonl", ".json")} for r in rows]
    assert where(one) == where(twin) and len(one) == 1


def test_parquet_rows_of_null_first_error_read_as_not_given(tmp_path):
    # a parquet column mixing ProcessBench-derived rows with others holds null where no first error is known
    rows = [{"prompt": "a", "completions": ["x", "y"], "labels": [True, False], "first_error": 1},
            {"prompt": "b", "completions": ["x"], "labels": [True], "first_error": None}]
    Dataset.from_list(rows).to_parquet(str(tmp_path / "fe.parquet"))
    got = read_rows(str(tmp_path / "fe.parquet"), "train", Config())
    assert got[0]["first_error"] == 1 and "first_error" not in got[1] and got[1]["labels"] == [True]


def test_directory_may_mix_formats(tmp_path):
    for name in ("math_shepherd.jsonl", "stepwise_train.jsonl"):
        (tmp_path / name).write_bytes(open(os.path.join(FIX, name), "rb").read())
    assert len(read_rows(str(tmp_path), "train", Config())) == 7 + 17


def test_hub_names_go_through_the_same_checks(monkeypatch, capsys):
    """No network here: a stand-in for datasets.load_dataset with a train split only."""
    import prm.readers.sources
    rows = read_rows(os.path.join(FIX, "stepwise_train.jsonl"), "train", Config())
    bad = rows[:3] + [{**rows[3], "labels": rows[3]["labels"][:1]}]

    def fake_load(name, config, split):
        assert config == "main"
        if split != "train":
            raise ValueError(f'Unknown split "{split}". Should be one of [\'train\'].')
        return Dataset.from_list(rows if name == "org/good" else bad)

    monkeypatch.setattr(prm.readers.sources, "load_dataset", fake_load)
    train, held = load_splits(Config(dataset="org/good", dataset_config="main", eval_fraction=0.2))
    assert len(train) + len(held) == len(rows) and len(held) > 0  # no test split: a share held out by prompt
    assert "held out" in capsys.readouterr().err
    with pytest.raises(DataError, match=r"org/bad\[train\] row 3: field 'labels': 1 labels for 2 steps"):
        load_splits(Config(dataset="org/bad", dataset_config="main"))
    with pytest.raises(DataError, match="Unknown split"):
        load_splits(Config(dataset="org/good", dataset_config="main", train_split="nope"))


def test_eval_fraction_holds_out_whole_problems(capsys):
    path = os.path.join(FIX, "prm800k.jsonl")  # 36 rows from 6 problems
    train, held = load_splits(cfg_for(path, eval_fraction=0.3, seed=1))
    assert len(train) + len(held) == 36 and len(held) > 0
    assert not set(train["prompt"]) & set(held["prompt"])
    assert "held out" in capsys.readouterr().err
    again = load_splits(cfg_for(path, eval_fraction=0.3, seed=1))[1]
    assert again["prompt"] == held["prompt"]  # seeded: eval.py rebuilds the same held-out set


def test_loaded_data_is_cached_on_disk():
    path = os.path.join(FIX, "stepwise_train.jsonl")
    a, b = load_eval(Config(), path), load_eval(Config(), path)
    assert a.cache_files and a.cache_files == b.cache_files  # file-backed: the tokenization map is cached too
    tok, cfg = char_tokenizer(), Config()
    first, _ = tokenize_dataset(a, tok, cfg, is_eval=True)
    second, _ = tokenize_dataset(b, tok, cfg, is_eval=True)
    assert first.cache_files == second.cache_files


# the bad-input matrix: (file, where the problem is, what the message says)
MATRIX = [
    ("missing_column.jsonl", "line 2", "field 'labels': missing"),
    ("misnamed_column.jsonl", "line 1", "'completion' -> 'completions'"),
    ("length_mismatch.jsonl", "line 2", "field 'labels': 2 labels for 3 steps"),
    ("empty_step_list.jsonl", "line 2", "field 'completions': expected a non-empty list"),
    ("non_string_step.jsonl", "line 2", "field 'completions': step 1 is int"),
    ("empty_step.jsonl", "line 2", "field 'completions': step 1 is empty"),
    ("label_string.jsonl", "line 2", "field 'labels': label 1: str 'yes'"),
    ("label_invalid_marker.jsonl", "line 2", "field 'labels': label 1: str '[invalid]'"),
    ("label_out_of_range.jsonl", "line 2", "field 'labels': label 0: float 1.5"),
    ("first_error_out_of_range.json", "row 1", "field 'label': first error int 2 is out of range for 2 steps"),
    ("malformed_json.jsonl", "line 2", "malformed JSON"),
    ("malformed_json_array.json", "line 3", "malformed JSON: Expecting ',' delimiter"),
    ("math_shepherd_bad_marks.jsonl", "line 2", "field 'label': not 'input' with +/- per 'ки' at step 2"),
    ("prm800k_bad_rating.jsonl", "line 2", "field 'label.steps[0].completions[0].rating'"),
    ("bad_chat_prompt.jsonl", "line 2", "field 'prompt': expected text or [{role, content}], got list"),
]

FILE_LEVEL = ("misnamed_column.jsonl", "malformed_json_array.json")  # the whole file is unusable: nothing to skip


@pytest.mark.parametrize("name, where, message", MATRIX)
def test_bad_input_exits_2_naming_file_row_and_field(name, where, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        convert_main([os.path.join(BAD, name), str(tmp_path / "out.jsonl")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"{name} {where}: " in err and message in err
    assert len(err.splitlines()) < 25  # one screen


@pytest.mark.parametrize("name, where, message", [m for m in MATRIX if m[0] not in FILE_LEVEL])
def test_skip_invalid_drops_the_bad_row_and_says_so(name, where, message, capsys):
    path = os.path.join(BAD, name)
    rows = read_rows(path, "train", Config(skip_invalid=True))
    assert len(rows) == (2 if name == "malformed_json.jsonl" else 1)
    err = capsys.readouterr().err
    assert "skipped 1 invalid records (--skip-invalid)" in err and where in err


def test_bad_input_in_a_subprocess_has_no_traceback():
    r = subprocess.run([sys.executable, "-m", "prm.convert", os.path.join(BAD, "label_string.jsonl")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "label_string.jsonl line 2: field 'labels'" in r.stderr and r.stdout == ""


def test_convert_refuses_to_write_over_its_input(tmp_path, capsys):
    data = shutil.copy(os.path.join(FIX, "stepwise_train.jsonl"), tmp_path)
    before = open(data).read()
    with pytest.raises(SystemExit) as e:
        convert_main([data, data])
    assert e.value.code == 2 and open(data).read() == before
    assert capsys.readouterr().err == \
        f"error: output {data} would overwrite input {data}, which it reads: choose another path\n"


def test_convert_takes_every_spelling_of_its_flags_and_a_bad_one_is_one_line(tmp_path):
    bad = os.path.join(BAD, "label_string.jsonl")
    for flags in (["--skip_invalid", "--dataset_config", "x", "--neutral_label", "drop"],
                  ["--skip-invalid", "--dataset-config", "x", "--neutral-label", "drop"]):
        r = subprocess.run([sys.executable, "-m", "prm.convert"] + flags + [bad], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0 and "skipped 1 invalid records" in r.stderr, (flags, r.stderr)
    r = subprocess.run([sys.executable, "-m", "prm.convert", "--bogus", bad], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and r.stderr == "error: unrecognized arguments: --bogus\n" and r.stdout == ""


def test_train_py_exits_2_on_bad_data(tmp_path):
    r = subprocess.run([sys.executable, "train.py", "--dataset", os.path.join(BAD, "length_mismatch.jsonl"),
                        "--output-dir", str(tmp_path / "run")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "length_mismatch.jsonl line 2" in r.stderr


@pytest.mark.parametrize("name", ["stepwise_train.jsonl", "math_shepherd.jsonl", "prm800k.jsonl", "processbench.json"])
def test_convert_writes_exactly_what_the_trainer_reads(name, tmp_path):
    out = str(tmp_path / "out.jsonl")
    convert_main([os.path.join(FIX, name), out])
    written = [json.loads(line) for line in open(out, encoding="utf-8")]
    assert written == read_rows(os.path.join(FIX, name), "train", Config())
    assert read_rows(out, "train", Config()) == written  # and it reads back unchanged as stepwise


def test_converted_candidates_and_prmbench_read_back_with_group_and_category(tmp_path):
    cands = write_jsonl(tmp_path / "cands.jsonl", [
        {"idx": 7, "question": "1+1?", "outputs": [
            {"response": "1+1=2ки", "label": True, "response_answer": "2"},
            {"response": "1+1=3ки", "label": False}]}])
    for name, src in (("cands", cands), ("prmbench", os.path.join(FIX, "prmbench.jsonl"))):
        out = str(tmp_path / f"{name}.out.jsonl")
        convert_main([src, out])
        written = [json.loads(line) for line in open(out, encoding="utf-8")]
        assert all(("group" if name == "cands" else "category") in r for r in written)
        back = read_rows(out, "train", Config())  # all-unlabeled candidates: their group exempts them
        assert [{k: v for k, v in r.items() if v is not None} for r in back] == \
            [{k: v for k, v in r.items() if v is not None} for r in written]


def test_soft_labels_reach_the_loss_as_floats(tmp_path):
    path = write_jsonl(tmp_path / "soft.jsonl", [
        {"prompt": "a", "completions": ["b", "c"], "labels": [0.625, 1]},
        {"prompt": "d", "completions": ["e"], "labels": [0.25]}])
    ds = load_eval(Config(), path)
    assert ds.features["labels"].feature.dtype == "float64" and ds[0]["labels"] == [0.625, 1.0]
    tok, _ = tokenize_dataset(ds, char_tokenizer(), Config(), is_eval=True)
    batch = collate(tok.to_list(), 0)
    targets = batch["labels"][batch["labels"] != IGNORE]
    assert targets.tolist() == [0.625, 1.0, 0.25]
    logits = torch.zeros(*batch["labels"].shape, 2)
    logits[..., 1] = torch.log(torch.tensor(3.0))  # P(correct) = 0.75 everywhere
    loss, _, _ = step_loss(logits, batch["labels"], 3)
    p = torch.tensor(0.75)
    expected = -sum(y * p.log() + (1 - y) * (1 - p).log() for y in (0.625, 1.0, 0.25)) / 3
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)  # a label cast to int would give another value


def chat_tokenizer():
    tok = char_tokenizer()
    tok.chat_template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    return tok


def test_conversational_prompts_go_through_the_chat_template(tmp_path):
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": chat, "completions": ["2+2=4", "so 4"],
                                                  "labels": [True, False]}])
    ds = load_eval(Config(), path)
    assert ds[0]["prompt"] == chat
    tokenizer = chat_tokenizer()
    tok, _ = tokenize_dataset(ds, tokenizer, Config(), is_eval=True)
    assert tokenizer.decode(tok[0]["input_ids"]) == "system: be brief\nuser: 2+2?\nassistant: 2+2=4\nso 4\n"


def test_mixed_plain_and_chat_prompts_name_the_row(tmp_path):
    path = write_jsonl(tmp_path / "mixed.jsonl", [
        {"prompt": "plain", "completions": ["a"], "labels": [True]},
        {"prompt": [{"role": "user", "content": "chat"}], "completions": ["a"], "labels": [True]}])
    with pytest.raises(DataError, match="mixed.jsonl line 2: chat-prompt rows mixed with plain-prompt"):
        read_rows(path, "train", Config())


def test_a_first_record_not_an_object_is_an_invalid_row_the_format_read_from_the_next(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [[1, 2], {"prompt": "q", "completions": ["a"], "labels": [True]}])
    with pytest.raises(DataError, match=r"a.jsonl line 1: expected a JSON object, got list \[1, 2\]"):
        read_rows(path, "train", Config())
    assert read_rows(path, "train", Config(skip_invalid=True)) == [
        {"prompt": "q", "completions": ["a"], "labels": [True]}]


@needs_unlabeled_steps
def test_processbench_steps_after_the_first_error_are_unlabeled():
    ds = load_eval(Config(), os.path.join(FIX, "processbench.json"))
    tok, report = tokenize_dataset(ds, char_tokenizer(), Config(max_length=4096), is_eval=True)
    assert report["labeled_steps"] == 1 + 5 + 5 + 2 + 4  # first errors at 0, 4, -1, 1, -1 of 4, 7, 5, 4, 4 steps
    labeled = [[y for y in row if y != IGNORE] for row in tok["labels"]]
    assert labeled[0] == [0.0] and labeled[1] == [1.0] * 4 + [0.0]


def test_cut_after_first_error_ends_each_solution_at_its_first_wrong_label():
    row = {"prompt": "p", "completions": ["a", "b", "c", "d"], "labels": [True, None, False, False], "id": "x"}
    assert cut_after_first_error(row) == {**row, "completions": ["a", "b", "c"], "labels": [True, None, False]}
    soft = {"prompt": "p", "completions": ["a", "b", "c"], "labels": [0.4, 0.0, 1.0]}  # 0.4 is not known wrong
    assert cut_after_first_error(soft)["completions"] == ["a", "b"]
    clean = {"prompt": "p", "completions": ["a", "b"], "labels": [True, 0.5]}
    assert cut_after_first_error(clean) is clean
    tokens = {"input_ids": [5, 6, 7, 8, 9], "labels": [IGNORE, 1, IGNORE, 0, IGNORE]}
    assert cut_after_first_error(tokens) == {"input_ids": [5, 6, 7, 8], "labels": [IGNORE, 1, IGNORE, 0]}


def test_cut_after_first_error_cuts_training_rows_only():
    path = os.path.join(FIX, "prmbench.jsonl")
    whole, _ = load_splits(cfg_for(path, eval_dataset=path, skip_invalid=True))
    train, held = load_splits(cfg_for(path, eval_dataset=path, skip_invalid=True, cut_after_first_error=True))
    assert held["completions"] == whole["completions"]  # judged on whole solutions
    cut = 0
    for full, row in zip(whole, train):
        k = full["labels"].index(False) + 1 if False in full["labels"] else len(full["labels"])
        assert row["completions"] == full["completions"][:k] and row["labels"] == full["labels"][:k]
        cut += k < len(full["labels"])
    assert cut > 0


@pytest.mark.parametrize("n,seed", [(1, 0), (63, 0), (200, 3), (32000, 0)])
def test_synthetic_held_out_rows_are_no_training_rows(n, seed):
    train, held = train_eval_rows(n, seed)
    seen = {(r["prompt"], tuple(r["completions"])) for r in train}
    assert [r for r in held if (r["prompt"], tuple(r["completions"])) in seen] == []
    assert len(held) >= 1 and len(train) + len(held) == n and train_eval_rows(n, seed) == (train, held)
    if n >= 200:  # a share of about 10%: its solutions are not equally frequent
        assert 0.05 <= len(held) / n <= 0.15


def test_cut_after_first_error_cuts_synthetic_training_rows_only():
    whole_train, whole_held = load_splits(cfg_for("synthetic", synthetic_size=200))
    train, held = load_splits(cfg_for("synthetic", synthetic_size=200, cut_after_first_error=True))
    assert held["completions"] == whole_held["completions"]
    n_wrong = lambda ds: [sum(not y for y in labels) for labels in ds["labels"]]
    assert n_wrong(train) == [min(1, n) for n in n_wrong(whole_train)]  # each solution ends at its slip
    assert sum(map(len, train["labels"])) < sum(map(len, whole_train["labels"]))  # the slips' later steps are gone


def short_records():
    """One short file per format, so a training run over all of them stays fast."""
    return {
        "a_stepwise.jsonl": [{"prompt": f"start {i}:", "completions": [f"{i}+1={i + 1}", f"{i + 1}+1={i + 3}"],
                              "labels": [True, False]} for i in range(6)],
        "b_soft.jsonl": [{"prompt": f"go {i}:", "completions": [f"{i}*2={2 * i}"], "labels": [0.75]} for i in range(4)],
        "c_shepherd.jsonl": [{"input": f"What is {i}+{i}? Step 1: {i}+{i}={2 * i} ки\nStep 2: so {2 * i} ки",
                              "label": f"What is {i}+{i}? Step 1: {i}+{i}={2 * i} +\nStep 2: so {2 * i} -"}
                             for i in range(4)],
        "d_prm800k.jsonl": [{"question": {"problem": f"What is {i}-1?"}, "label": {"finish_reason": "solution",
                             "steps": [{"completions": [{"text": f"{i}-1={i - 1}", "rating": 1},
                                                        {"text": f"{i}-1={i}", "rating": -1}], "chosen_completion": 0},
                                       {"completions": [{"text": f"so {i - 1}", "rating": 0}],
                                        "chosen_completion": 0}]}}
                            for i in range(4)],
        **({"e_processbench.json": [{"id": f"pb-{i}", "problem": f"What is {i}*3?", "steps": [f"{i}*3={3 * i + 1}",
            "so it is"], "label": 0, "final_answer_correct": False} for i in range(4)]}
           if _none_labels_supported() else {}),
    }


def test_every_format_trains_and_evaluates(tmp_path):
    from conftest import step_accuracy_by_hand, train
    data = tmp_path / "data"
    data.mkdir()
    for name, rows in short_records().items():
        (data / name).write_text(json.dumps(rows) if name.endswith(".json") else
                                 "".join(json.dumps(r) + "\n" for r in rows))
    cfg = Config(dataset=str(data), eval_fraction=0.3, max_steps=2, batch_size=4, max_length=128,
                 output_dir=str(tmp_path / "out"), dtype="fp32", log_every=1)
    final = train(cfg)
    assert final["train_data"]["examples"] > 0 and final["eval_data"]["labeled_steps"] > 0
    by_hand = step_accuracy_by_hand(tmp_path / "out" / "final", tmp_path / "p.jsonl")
    assert final["step_accuracy"] == by_hand  # eval.py finds the run's held-out 30%
    losses = [json.loads(line).get("loss") for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert all(torch.isfinite(torch.tensor(x)) for x in losses if x is not None)


def test_a_folder_of_files_named_for_splits_is_read_as_those_splits(tmp_path, capsys):
    """train.jsonl trains and test.jsonl is held out, as datasets.load_dataset(folder) reads them; a folder whose
    files name no split is one pool, held out by --eval-fraction; eval.py given the folder reads all of it."""
    rows = lambda tag, n: [{"prompt": f"{tag} {i}:", "completions": ["a", "b"], "labels": [True, False]}
                           for i in range(n)]
    split = tmp_path / "split"
    split.mkdir()
    write_jsonl(split / "train.jsonl", rows("train", 6))
    write_jsonl(split / "test-00000-of-00001.jsonl", rows("test", 3))
    train, held = load_splits(cfg_for(str(split), eval_fraction=0.5))
    assert sorted(train["prompt"]) == sorted(r["prompt"] for r in rows("train", 6))
    assert sorted(held["prompt"]) == sorted(r["prompt"] for r in rows("test", 3))
    assert len(load_eval(Config(), whole=str(split))) == 9
    with pytest.raises(DataError, match="no file named for split 'dev' among test-00000-of-00001.jsonl, tr"):
        load_splits(cfg_for(str(split), train_split="dev"))
    write_jsonl(split / "extra.jsonl", rows("extra", 2))  # read by no split: refused, never left out silently
    with pytest.raises(DataError, match=r"split: extra.jsonl named for no split, unlike the others"):
        load_splits(cfg_for(str(split)))
    (split / "extra.jsonl").unlink()
    (split / "test-00000-of-00001.jsonl").unlink()  # no held-out file: --eval-fraction of the train split
    train, held = load_splits(cfg_for(str(split), eval_fraction=0.5))
    assert len(train) == len(held) == 3 and all(p.startswith("train") for p in held["prompt"])
    write_jsonl(split / "heldout.jsonl", rows("held", 2))  # a split of the run's own name, on either side
    train, held = load_splits(cfg_for(str(split), eval_split="heldout"))
    assert len(train) == 6 and sorted(held["prompt"]) == ["held 0:", "held 1:"]
    (split / "heldout.jsonl").rename(split / "dev.jsonl")  # validation's words: dev, val, valid, validation
    assert len(load_splits(cfg_for(str(split), eval_split="validation"))[1]) == 2
    other = write_jsonl(tmp_path / "other.jsonl", rows("other", 4))  # --eval-dataset: a folder's eval split
    train, held = load_splits(cfg_for(other, eval_dataset=str(split), eval_split="valid"))
    assert len(train) == 4 and sorted(held["prompt"]) == ["held 0:", "held 1:"]
    pool = tmp_path / "pool"
    pool.mkdir()
    write_jsonl(pool / "part1.jsonl", rows("train", 6))
    write_jsonl(pool / "part2.jsonl", rows("test", 3))
    train, held = load_splits(cfg_for(str(pool), eval_fraction=0.5))
    assert len(train) + len(held) == 9 and len(held) in (4, 5)


def test_a_folders_file_named_for_two_splits_is_refused_naming_it(tmp_path):
    """test_train.jsonl would be read by both splits, its rows trained on and held out at once."""
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": "p", "completions": ["a"], "labels": [True]}])
    write_jsonl(tmp_path / "test_train.jsonl", [{"prompt": "q", "completions": ["a"], "labels": [True]}])
    with pytest.raises(DataError, match=f"{tmp_path}: test_train.jsonl \\(train and test\\) named for more than one "
                                        "split"):
        load_splits(cfg_for(str(tmp_path)))


def test_a_folders_split_words_and_extensions_are_read_in_any_case(tmp_path):
    """Test.JSONL is the test split (datasets' keywords): its rows are held out, the training file's all train."""
    rows = lambda tag, n: [{"prompt": f"{tag} {i}:", "completions": ["a"], "labels": [True]} for i in range(n)]
    write_jsonl(tmp_path / "train.jsonl", rows("train", 4))
    write_jsonl(tmp_path / "Test.JSONL", rows("test", 5))
    train, held = load_splits(cfg_for(str(tmp_path)))
    assert sorted(train["prompt"]) == [f"train {i}:" for i in range(4)]
    assert sorted(held["prompt"]) == [f"test {i}:" for i in range(5)]


def test_chat_prompts_train_with_a_saved_tokenizer(tmp_path):
    from conftest import train
    chat_tokenizer().save_pretrained(str(tmp_path / "tok"))
    rows = [{"prompt": [{"role": "user", "content": f"start {i}:"}], "completions": [f"{i}+1={i + 1}"],
             "labels": [i % 2 == 0]} for i in range(8)]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    cfg = Config(dataset=path, eval_dataset=path, tokenizer=str(tmp_path / "tok"), max_steps=1, batch_size=4,
                 max_length=128, output_dir=str(tmp_path / "out"), dtype="fp32")
    final = train(cfg)
    assert final["train_data"]["examples"] == 8 and final["eval_data"]["labeled_steps"] == 8


def test_validated_rows_are_read_back_while_files_and_settings_are_unchanged(tmp_path, monkeypatch, capsys):
    import prm.readers.sources
    rows = [{"prompt": f"q{i}", "completions": ["a", "b"], "labels": [True, i % 2 == 0]} for i in range(30)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    first_train, first_held = load_splits(cfg_for(data))
    ours = lambda err: [line for line in err.splitlines() if line.startswith((data, "held out"))]
    said = ours(capsys.readouterr().err)
    assert len(said) == 2 and "format stepwise" in said[0]
    real = prm.readers.sources.read_records
    monkeypatch.setattr(prm.readers.sources, "read_records", lambda path: pytest.fail("read again"))
    train, held = load_splits(cfg_for(data))
    again = capsys.readouterr().err
    assert ours(again) == said and "rows read back" in again  # the read's messages said again, and where from
    assert train.to_list() == first_train.to_list() and held.to_list() == first_held.to_list()
    assert train._fingerprint == first_train._fingerprint  # so tokenization reads its own cache too
    monkeypatch.setattr(prm.readers.sources, "read_records", real)
    calls = []
    monkeypatch.setattr(prm.readers.sources, "read_records", lambda path: calls.append(path) or real(path))
    load_splits(cfg_for(data, seed=1))  # another held-out draw
    write_jsonl(tmp_path / "d.jsonl", rows[:-1] + [{**rows[-1], "labels": [False, False]}])  # same size, new labels
    changed, _ = load_splits(cfg_for(data))
    assert calls == [data, data]
    assert {r["prompt"]: r["labels"] for r in changed}.get("q29", [False, False]) == [False, False]


def scorer_steps(text: str, separator: str = "\n") -> list:
    """The steps PRMReward (and so prm.serve) scores in a completion."""
    from prm.readers.formats import step_spans
    from prm.scoring.reward import PRMReward
    scorer = PRMReward.__new__(PRMReward)  # no model needed to split a text
    scorer.step_separator = separator
    return [text[a:b] for a, b in step_spans(scorer.text(text), separator)]  # as step_scores splits


def test_a_training_step_holding_the_separator_stays_whole_as_trl_tokenizes_it(tmp_path):
    """TRL 1.13's PRMTrainer: prompt ids, then per step ids(step) + ids(separator), the label on the step's last
    separator token; a separator inside a step is text, and a step keeps its own whitespace."""
    steps = ["a\nb", "c\n", "  d\n\n e", "f "]
    rows = [{"prompt": f"p{i}", "completions": steps, "labels": [True, False, True, None]} for i in range(2)]
    path = write_jsonl(tmp_path / "sep.jsonl", rows)
    train, held = load_splits(cfg_for(path, eval_dataset=path))
    assert train[0]["completions"] == steps == held[0]["completions"]
    assert train[0]["labels"] == [True, False, True, None]
    tok = char_tokenizer()
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]
    expected, ends = [tok.bos_token_id] + ids(train[0]["prompt"]), []
    for step in steps:
        expected += ids(step) + ids("\n")
        ends.append(len(expected) - 1)
    row = tokenize_dataset(train, tok, Config(), is_eval=False)[0][0]
    assert row["input_ids"] == expected
    assert {i: y for i, y in enumerate(row["labels"]) if y != IGNORE} == {ends[0]: 1, ends[1]: 0, ends[2]: 1}
    assert load_splits(cfg_for(path, eval_dataset=path, step_separator=" "))[0][0]["completions"] == steps


@pytest.mark.parametrize("blank", ["", " \t", "\u200b", "\ufeff\u200b \u2060"])
def test_a_blank_step_is_an_invalid_row_and_no_step_when_scoring(tmp_path, blank):
    rows = [{"prompt": "p", "completions": ["a"], "labels": [True]},
            {"prompt": "p", "completions": ["a", blank], "labels": [True, True]}]
    path = write_jsonl(tmp_path / "blank.jsonl", rows)
    with pytest.raises(DataError, match=r"blank.jsonl line 2: field 'completions': step 1 is empty"):
        read_rows(path, "train", Config())
    assert len(read_rows(path, "train", Config(skip_invalid=True))) == 1
    assert scorer_steps(f"a\n{blank}\nb\n{blank}") == ["a", "b"]


def test_encodings_are_named_and_a_bom_is_accepted(tmp_path):
    from prm.config import Config
    from prm.readers.sources import DataError, read_rows
    row = {"prompt": "p", "completions": ["a"], "labels": [True]}
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps(row).encode() + b"\n")
    assert read_rows(str(tmp_path / "bom.jsonl"), "train", Config()) == [row]
    latin1 = json.dumps({**row, "prompt": "caf\u00e9"}, ensure_ascii=False).encode("latin-1")  # \xe9, not UTF-8
    (tmp_path / "latin1.jsonl").write_bytes(json.dumps(row).encode() + b"\n" + latin1 + b"\n")
    with pytest.raises(DataError, match=r"latin1.jsonl line 2: not UTF-8 text"):
        read_rows(str(tmp_path / "latin1.jsonl"), "train", Config())
