"""PRMBench: real rows converted, bad error indices reported, PRMScore by hand from a fixed fake model, and eval.py's
report recomputed from --predictions. Depends on: pytest, torch, prm, eval.py."""
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import eval as eval_cli  # noqa: E402
from prm.loading import build_model  # noqa: E402
from prm.config import Config  # noqa: E402
from prm.core.data import pad_token_id  # noqa: E402
from prm.core.evaluate import predict, report  # noqa: E402
from prm.readers.formats import detect_format, to_rows  # noqa: E402
from prm.readers.ingest import tokenize_dataset  # noqa: E402
from prm.core.metrics import prmbench_metrics  # noqa: E402
from prm.readers.sources import DataError, read_rows, to_dataset  # noqa: E402
from prm.readers.synthetic import char_tokenizer  # noqa: E402

FIX = os.path.join(ROOT, "tests", "fixtures")
FIXTURE = os.path.join(FIX, "prmbench.jsonl")
BAD = os.path.join(FIX, "bad", "prmbench_error_past_end.jsonl")
SHARED = os.path.join(ROOT, "..", "shared", "data", "prmbench")


def records():
    with open(FIXTURE) as f:
        return [json.loads(line) for line in f]


def test_real_rows_convert_with_1_based_error_steps():
    redundancy, circular = records()
    assert detect_format(redundancy) == "prmbench" == detect_format(circular)
    rows, problems = to_rows(redundancy, "prmbench")
    assert problems == [] and len(rows) == 2  # the modified solution, then the error-free original
    assert rows[0]["labels"] == [True, True, False, True, True, True]  # error_steps [3]
    assert rows[0]["category"] == "redundency" and rows[0]["first_error"] == 2
    assert rows[0]["id"] == "redundency_prm_test_p1_49" and rows[0]["prompt"] == redundancy["modified_question"]
    assert rows[1]["completions"] == redundancy["original_process"] and rows[1]["labels"] == [True] * 5
    assert rows[1]["category"] == "correct" and rows[1]["first_error"] == -1
    assert rows[1]["id"] == "correct_prm_test_p1_49"
    rows, problems = to_rows(circular, "prmbench")  # other categories give their modified solution only
    assert problems == [] and [r["labels"] for r in rows] == [[True, False, False, False, True]]


def test_error_steps_past_the_end_are_ignored_as_prmbench_does():
    # PRMBench's harness labels the steps a row has: an index past its last step is never a label
    rows = read_rows(BAD, "test", Config())
    assert len(rows) == 2 and rows[1]["id"] == "circular_prm_test_p1_62"  # line 2: error_steps [16, 34], 33 steps
    assert rows[1]["labels"] == [k != 15 for k in range(33)] and rows[1]["first_error"] == 15
    with open(BAD) as f:
        partial = [json.loads(line) for line in f][1]
    _, problems = to_rows({**partial, "error_steps": [34, 40]}, "prmbench")  # every index past the end
    assert problems == ["field 'error_steps': every error step [34, 40] is past the 33 steps"]
    for bad in (0, -1, True, "3"):
        _, problems = to_rows({**records()[1], "error_steps": [bad]}, "prmbench")
        assert problems == [f"field 'error_steps': {type(bad).__name__} {bad!r} is not a 1-based step index"]


def test_steps_lose_their_number_as_prmbench_harness_reads_them():
    steps = ["1. Add.", " step 2.  Then 3 + 4", "3.5 is half of 7.", "Step 4 holds no dot", "64.", "So 7."]
    rows, problems = to_rows({**records()[0], "modified_process": steps, "original_process": steps}, "prmbench")
    expected = ["Add.", "Then 3 + 4", "5 is half of 7.", "Step 4 holds no dot", "64.", "So 7."]
    assert problems == [] and rows[0]["completions"] == expected == rows[1]["completions"]


def test_one_row_per_category_and_idx_as_prmbench_harness_keeps(tmp_path, capsys):
    redundancy, circular = records()
    again = [{**r, "modified_process": r["modified_process"][:4]} for r in (redundancy, circular)]
    other = {**circular, "idx": "prm_test_p1_50"}
    path = tmp_path / "repeated.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [redundancy, circular, *again, other]))
    rows = read_rows(str(path), "test", Config())
    assert [r["id"] for r in rows] == ["redundency_prm_test_p1_49", "correct_prm_test_p1_49",
                                       "circular_prm_test_p1_49", "circular_prm_test_p1_50"]
    assert len(rows[0]["completions"]) == 6 and len(rows[2]["completions"]) == 5  # the first of each id
    assert "5 records -> 4 examples; dropped 3 rows of a PRMBench id read before" in capsys.readouterr().err


class ParityPRM(torch.nn.Module):
    """A fixed fake PRM: P(correct) = 0.9 at the 1st, 3rd, 5th... separator of a row, 0.2 at the 2nd, 4th..."""

    def __init__(self, sep_id: int):
        super().__init__()
        self.sep_id = sep_id
        self.unused = torch.nn.Parameter(torch.zeros(1))  # predict() reads the device from the parameters

    def forward(self, input_ids, attention_mask=None):
        n = torch.cumsum(input_ids == self.sep_id, dim=1)  # (B, T): separators so far
        p = torch.where(n % 2 == 1, 0.9, 0.2)  # (B, T)
        return torch.stack([torch.log1p(-p), torch.log(p)], dim=-1)  # (B, T, 2): softmax gives back [1 - p, p]


def test_prmscore_by_hand_from_a_fixed_fake_model():
    tok = char_tokenizer()
    rows = tokenize_dataset(to_dataset(read_rows(FIXTURE, "test", Config())), tok, Config(), is_eval=True,
                            drop_unlabeled=False)[0].to_list()
    newline = tok("\n", add_special_tokens=False)["input_ids"][-1]
    probs = predict(ParityPRM(newline), rows, batch_size=2, pad_id=pad_token_id(tok), progress=False)
    assert [r["category"] for r in rows] == ["redundency", "correct", "circular"]
    assert [[round(p, 6) for p in ps] for ps in probs] == [[0.9, 0.2, 0.9, 0.2, 0.9, 0.2], [0.9, 0.2, 0.9, 0.2, 0.9],
                                                           [0.9, 0.2, 0.9, 0.2, 0.9]]
    # judged correct: steps 1, 3, 5. redundancy truth T T F T T T: tp 2 (1, 5), fn 3 (2, 4, 6), fp 1 (3), tn 0
    # circular truth T F F F T: tp 2 (1, 5), tn 2 (2, 4), fp 1 (3), fn 0; correct (all T): tp 3, fn 2
    # F1 = 2tp / (2tp + fp + fn); negative F1 = 2tn / (2tn + fn + fp); PRMScore = their mean
    pb = report(probs, rows, threshold=0.5)["prmbench"]
    by_hand = {"redundency": (4 / 8, 0 / 4), "circular": (4 / 5, 4 / 5), "correct": (6 / 8, 0 / 2)}
    for cat, (f1, f1_neg) in by_hand.items():
        got = pb["categories"][cat]
        assert (got["f1"], got["f1_neg"], got["prmscore"]) == pytest.approx((f1, f1_neg, (f1 + f1_neg) / 2)), cat
    # overall: redundancy + circular (the error-free originals stay out): tp 4, fn 3, fp 2, tn 2
    assert (pb["f1"], pb["f1_neg"]) == pytest.approx((8 / 13, 4 / 9))
    assert pb["prmscore"] == pytest.approx((8 / 13 + 4 / 9) / 2) and pb["n_steps"] == 11


def test_undefined_f1_is_null_not_a_sentinel():
    out = prmbench_metrics([[0.9, 0.8]], [[True, True]], ["multi_solutions"])  # no erroneous step, none predicted
    assert out["categories"]["multi_solutions"] == {"prmscore": None, "f1": 1.0, "f1_neg": None, "n_steps": 2}


def test_a_row_of_no_category_counts_once_in_the_overall_figure():
    out = prmbench_metrics([[0.9, 0.2], [0.8]], [[True, False], [False]], [None, "circular"])
    assert out["n_steps"] == 3 and list(out["categories"]) == ["circular"]  # tp 1, tn 1, fp 1
    assert (out["f1"], out["f1_neg"]) == pytest.approx((2 / 3, 2 / 3))


def test_unlabeled_steps_stay_out_of_prmscore():
    rows = [{"step_labels": [1.0, None], "category": "arith"}, {"step_labels": [0.0, 0.0], "category": "arith"}]
    pb = report([[0.9, 0.2], [0.8, 0.1]], rows)["prmbench"]  # tp 1 (row 1, step 1), fp 1, tn 1
    assert pb["n_steps"] == 3 and (pb["f1"], pb["f1_neg"]) == pytest.approx((2 / 3, 2 / 3))


def test_eval_reports_prmscore_recomputable_from_predictions(tmp_path):
    model_dir = str(tmp_path / "model")
    tokenizer = char_tokenizer()
    build_model("tiny", tokenizer, seed=0).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    pred = str(tmp_path / "pred.jsonl")
    out = eval_cli.main(["--model", model_dir, "--dtype", "fp32", "--dataset", FIXTURE, "--predictions", pred])
    with open(pred) as f:
        lines = [json.loads(line) for line in f]
    assert [x["category"] for x in lines] == ["redundency", "correct", "circular"]
    expected = prmbench_metrics([x["step_probs"] for x in lines], [[y >= 0.5 for y in x["labels"]] for x in lines],
                                [x["category"] for x in lines], out["threshold"])
    assert out["prmbench"] == expected  # the same floats, through JSON and back: exact
    assert set(out["prmbench"]["categories"]) == {"redundency", "correct", "circular"}
    assert "f1" in out and out["n_with_error"] == 2  # ProcessBench's first-error metrics, beside it


@pytest.mark.skipif(not os.path.isdir(SHARED), reason="needs ../shared")
def test_every_shared_prmbench_file_reads_with_its_bad_rows_named():
    with pytest.raises(DataError) as e:
        read_rows(SHARED, "test", Config())
    # 16 rows whose every error index is past their end, 3 with an empty step; 84 more with such an index read
    assert "19 invalid rows" in str(e.value) and "field 'error_steps': every error step" in str(e.value)
    rows = read_rows(SHARED, "test", Config(skip_invalid=True))
    cats = {r["category"] for r in rows}
    assert "correct" in cats and "multi_solutions" in cats and len(cats) == 10
    assert len(rows) == 6950 and len({(r["category"], r["id"]) for r in rows}) == 6950  # 5 repeated ids dropped
    assert sum(r["category"] == "multi_solutions" for r in rows) == 160
