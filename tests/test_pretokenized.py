"""Pre-tokenized input (input_ids + labels): same training as the text it came from, row checks, cuts, padding."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT, read_metrics, run_train
from prm.config import Config
from prm.convert import main as convert_main
from prm.core.data import IGNORE, tokenize_example
from prm.readers.ingest import tokenize_dataset
from prm.readers.sources import DataError, load_eval, load_splits, read_rows
from prm.readers.synthetic import char_tokenizer, train_eval_rows


@pytest.fixture(autouse=True, scope="module")
def datasets_cache(tmp_path_factory):
    """Arrow files of these tests go to a temporary cache, not the user's."""
    import datasets
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf_datasets")))
        yield


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def pretokenized(rows, tok):
    """The project's own tokenization, written out as input_ids + labels."""
    out = []
    for r in rows:
        t = tokenize_example(r, tok)
        out.append({"id": r["id"], "input_ids": t["input_ids"], "labels": t["labels"]})
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same synthetic rows trained as text and as pre-tokenized rows: {kind: (run dir, final, eval file)}."""
    data = tmp_path_factory.mktemp("data")
    train, held = train_eval_rows(64, seed=0)
    tok = char_tokenizer()
    files = {"text": (write_jsonl(data / "train.jsonl", train), write_jsonl(data / "held.jsonl", held)),
             "tokens": (write_jsonl(data / "train_tok.jsonl", pretokenized(train, tok)),
                        write_jsonl(data / "held_tok.jsonl", pretokenized(held, tok)))}
    out = {}
    for kind, (train_file, held_file) in files.items():
        run_dir = tmp_path_factory.mktemp(kind)
        final = run_train(run_dir, dataset=train_file, eval_dataset=held_file, max_steps=3)
        out[kind] = (run_dir, final, held_file)
    return out


def test_pretokenized_rows_train_exactly_like_their_text(runs):
    (text_dir, text, _), (tok_dir, tokens, _) = runs["text"], runs["tokens"]
    a = [r["loss"] for r in read_metrics(text_dir) if "loss" in r]
    b = [r["loss"] for r in read_metrics(tok_dir) if "loss" in r]
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert abs(x - y) <= 1e-6 * abs(x)
    assert tokens["train_data"] == text["train_data"] and tokens["eval_data"] == text["eval_data"]
    assert tokens["step_accuracy"] == text["step_accuracy"] and tokens["n_steps"] == text["n_steps"]


def test_eval_py_scores_a_pretokenized_held_out_set(runs, tmp_path):
    import eval as eval_cli
    (text_dir, _, text_file), (tok_dir, trained, tok_file) = runs["text"], runs["tokens"]
    rebuilt = eval_cli.main(["--model", str(tok_dir / "final"), "--dtype", "fp32"])  # the run's own held-out set
    assert rebuilt["step_accuracy"] == trained["step_accuracy"] and rebuilt["n_steps"] == trained["n_steps"]
    model = str(text_dir / "final")
    args = ["--model", model, "--dtype", "fp32", "--eval-batch-size", "4", "--predictions"]
    text = eval_cli.main(args + [str(tmp_path / "text.jsonl"), "--dataset", text_file])
    tokens = eval_cli.main(args + [str(tmp_path / "tok.jsonl"), "--dataset", tok_file])
    assert tokens["n_steps"] == text["n_steps"] > 0 and tokens["step_accuracy"] == text["step_accuracy"]
    lines = [[json.loads(x) for x in open(tmp_path / f)] for f in ("text.jsonl", "tok.jsonl")]
    for a, b in zip(*lines):
        assert a["id"] == b["id"] and b["step_probs"] == pytest.approx(a["step_probs"], abs=1e-6)
        assert b["labels"] == [float(y) for y in a["labels"]]


GOOD = {"input_ids": [1, 10, 11, 12], "labels": [-100, -100, -100, 1]}
BAD_ROWS = [
    ({"input_ids": [1, 10, 11, 12], "labels": [-100, 2, -100, 1]}, "field 'labels': position 1: int 2"),
    ({"input_ids": [1, 10, 11, 12], "labels": [-100, 1, 0]}, "field 'labels': 3 labels for 4 input_ids"),
    ({"input_ids": [1, 10, 11, 12], "labels": [-100] * 4}, "field 'labels': no position is labeled"),
    ({"input_ids": [1, 10, 0, 0], "labels": [-100, 1, -100, 0], "attention_mask": [1, 1, 0, 0]},
     "field 'labels': position 3 is padding but has a label"),
    ({"input_ids": [1, 10, 11.5, 12], "labels": [-100, -100, -100, 1]},
     "field 'input_ids': position 2: float 11.5 is not a token id"),
    ({"input_ids": [0, 0, 10, 12], "labels": [-100, -100, -100, 1], "attention_mask": [0, 0, 1, 1]},
     "field 'attention_mask': expected 4 ones then zeros (right padding)"),
]


@pytest.mark.parametrize("bad, message", BAD_ROWS)
def test_bad_rows_name_file_line_and_field(bad, message, tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, bad])
    with pytest.raises(DataError) as e:
        read_rows(path, "train", Config())
    assert f"bad.jsonl line 2: {message}" in str(e.value)


def test_ids_past_the_vocabulary_name_the_line(tmp_path):
    tok = char_tokenizer()
    path = write_jsonl(tmp_path / "other_tokenizer.jsonl", [GOOD, {**GOOD, "input_ids": [1, len(tok), 11, 12]}])
    with pytest.raises(DataError) as e:
        tokenize_dataset(load_eval(Config(), path), tok, Config(), is_eval=False)
    assert (f"other_tokenizer.jsonl line 2: field 'input_ids': token id {len(tok)} is out of the tokenizer's "
            f"{len(tok)} tokens") in str(e.value)
    r = subprocess.run([sys.executable, "train.py", "--dataset", path, "--eval-dataset", path, "--output-dir",
                        str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "other_tokenizer.jsonl line 2: field 'input_ids': token id" in r.stderr


def test_max_length_cuts_pretokenized_rows_and_counts_lost_labels(tmp_path):
    rows = [{"input_ids": list(range(1, 11)), "labels": [-100, -100, -100, 1, -100, -100, 0, -100, -100, 1]},
            {"input_ids": list(range(1, 10)), "labels": [-100] * 8 + [0.5]}]
    ds = load_eval(Config(), write_jsonl(tmp_path / "tok.jsonl", rows))
    tok = char_tokenizer()
    out, report = tokenize_dataset(ds, tok, Config(max_length=7), is_eval=True)
    assert out["input_ids"] == [list(range(1, 8))] and out["labels"] == [rows[0]["labels"][:7]]
    assert out[0]["steps_kept"] == out[0]["n_labeled"] == 2 and out[0]["length"] == 7
    assert report["steps_truncated"] == 2 and report["examples_dropped"] == 1 and report["labeled_steps"] == 2
    whole, report = tokenize_dataset(ds, tok, Config(), is_eval=True)
    assert whole["input_ids"] == [r["input_ids"] for r in rows] and report["steps_truncated"] == 0
    last, _ = tokenize_dataset(ds, tok, Config(train_on_last_step_only=True), is_eval=False)
    assert [[y for y in r if y != IGNORE] for r in last["labels"]] == [[1.0], [0.5]]
    with pytest.raises(DataError, match="--max-completion-length 4: pre-tokenized rows have no prompt"):
        tokenize_dataset(ds, tok, Config(max_completion_length=4), is_eval=True)


def test_right_padding_is_stripped(tmp_path):
    rows = [{"input_ids": [1, 10, 11, 0, 0], "labels": [-100, -100, 1, -100, -100], "attention_mask": [1, 1, 1, 0, 0]},
            {"input_ids": [1, 10, 11, 12, 13], "labels": [-100, 0, -100, -100, 1], "attention_mask": [1] * 5}]
    path = write_jsonl(tmp_path / "padded.jsonl", rows)
    ds = load_eval(Config(), path)
    assert ds.features["input_ids"].feature.dtype == "int64" and ds.features["labels"].feature.dtype == "float64"
    assert ds["input_ids"] == [[1, 10, 11], [1, 10, 11, 12, 13]] and "attention_mask" not in ds.column_names
    out, _ = tokenize_dataset(ds, char_tokenizer(), Config(), is_eval=True)
    assert out["length"] == [3, 5] and out["n_labeled"] == [1, 2]
    convert_main([path, str(tmp_path / "out.jsonl")])  # convert passes them through, validated and stripped
    written = [json.loads(line) for line in open(tmp_path / "out.jsonl")]
    assert written == [{"input_ids": [1, 10, 11], "labels": [-100, -100, 1]},
                       {"input_ids": [1, 10, 11, 12, 13], "labels": [-100, 0, -100, -100, 1]}]


def test_mixing_with_text_rows_and_holding_out_a_share(tmp_path):
    (tmp_path / "mix").mkdir()
    write_jsonl(tmp_path / "mix" / "a.jsonl", [GOOD])
    write_jsonl(tmp_path / "mix" / "b.jsonl", [{"prompt": "p", "completions": ["a"], "labels": [True]}])
    with pytest.raises(DataError, match="b.jsonl line 1: plain-prompt rows mixed with pre-tokenized rows"):
        read_rows(str(tmp_path / "mix"), "train", Config())
    rows = [{**GOOD, "input_ids": [1, 10 + i, 11, 12]} for i in range(10)]
    train, held = load_splits(Config(dataset=write_jsonl(tmp_path / "tok.jsonl", rows), eval_fraction=0.3))
    assert len(train) == 7 and len(held) == 3  # no prompt to group by: each row held out on its own
