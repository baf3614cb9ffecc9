"""Each supported format, parsed from real fixture rows to the expected prompt / steps / labels; row checks."""
import json
import math
import os

import pytest

from prm.readers.formats import FORMATS, detect_format, format_help, label_problem, row_problems, to_rows, token_problems

FIX = os.path.join(os.path.dirname(__file__), "fixtures")


def records(name):
    with open(os.path.join(FIX, name), encoding="utf-8") as f:
        return json.load(f) if name.endswith(".json") else [json.loads(line) for line in f if line.strip()]


def convert(record, fmt, neutral="negative"):
    rows, problems = to_rows(record, fmt, neutral)
    assert problems == []
    return rows


def test_detection_names_each_format_and_explains_misses():
    assert detect_format(records("stepwise_train.jsonl")[0]) == "stepwise"
    assert detect_format(records("math_shepherd.jsonl")[0]) == "math_shepherd"
    assert detect_format(records("prm800k.jsonl")[0]) == "prm800k"
    assert detect_format(records("processbench.json")[0]) == "processbench"
    assert detect_format({"input_ids": [1, 2], "labels": [-100, 1]}) == "pretokenized"
    assert detect_format({"input_ids": [1], "labels": [1], "prompt": "p", "completions": ["a"]}) == "pretokenized"
    bad = {"prompt": "p", "completion": ["a"], "labels": [True]}
    assert detect_format(bad) is None
    assert "'completion' -> 'completions'" in format_help(bad)


def test_stepwise_rows_pass_through():
    for r in records("stepwise_train.jsonl") + records("stepwise_test.jsonl"):
        assert convert(r, "stepwise") == [{"prompt": r["prompt"], "completions": r["completions"],
                                           "labels": r["labels"]}]


def test_math_shepherd_real_row():
    row, = convert(records("math_shepherd.jsonl")[0], "math_shepherd")
    assert row["prompt"].startswith("Janet pays $40/hour") and row["prompt"].endswith("clarinet lessons in a year?")
    assert len(row["completions"]) == 5
    assert row["completions"][0] == ("Step 1: Janet spends 3 hours + 5 hours = <<3+5=8>>8 hours per week on music "
                                     "lessons.")
    assert row["completions"][4].endswith("The answer is: 13520")  # no tag, no trailing whitespace
    assert row["labels"] == [True, True, True, True, False]
    for r in records("math_shepherd.jsonl"):  # every real row: one label per tag
        out, = convert(r, "math_shepherd")
        assert len(out["labels"]) == r["input"].count("ки") == len(out["completions"])


def test_math_shepherd_soft_labels_as_a_list():
    r = {"input": "Q? Step 1: a ки\nStep 2: b ки", "label": [0.625, 1.0]}
    assert convert(r, "math_shepherd")[0] == {"prompt": "Q?", "completions": ["Step 1: a", "Step 2: b"],
                                              "labels": [0.625, 1.0]}


def test_prm800k_expands_alternatives_and_handles_give_up():
    recs = records("prm800k.jsonl")
    give_up = recs[4]  # finish_reason give_up: the last step has `completions: null`
    assert give_up["label"]["finish_reason"] == "give_up" and give_up["label"]["steps"][-1]["completions"] is None
    rows = convert(give_up, "prm800k")
    # 6 rejected alternatives at step 8 (each a row ending there, labeled wrong), then the trajectory with the
    # labeler's own rewrite (labeled right) in their place; the null step adds nothing
    assert [len(r["completions"]) for r in rows] == [8] * 6 + [8]
    assert all(r["labels"] == [True] * 7 + [False] for r in rows[:6])
    assert rows[-1]["labels"] == [True] * 8
    assert rows[-1]["completions"][-1] == give_up["label"]["steps"][7]["human_completion"]["text"]
    assert all(r["prompt"] == give_up["question"]["problem"] for r in rows)


def test_prm800k_found_error_is_not_repeated_as_a_bare_prefix():
    rec = records("prm800k.jsonl")[1]  # found_error: no completion chosen at the last step
    assert rec["label"]["finish_reason"] == "found_error"
    rows = convert(rec, "prm800k")
    assert [len(r["completions"]) for r in rows] == [7, 7, 7, 7]
    assert [r["labels"][-1] for r in rows] == [False, True, True, True]


@pytest.mark.parametrize("neutral, expected", [("negative", False), ("positive", True), ("drop", None)])
def test_prm800k_neutral_rating(neutral, expected):
    rec = records("prm800k.jsonl")[1]
    assert rec["label"]["steps"][1]["completions"][0]["rating"] == 0  # chosen, rated neutral
    rows = convert(rec, "prm800k", neutral)
    assert all(r["labels"][1] is expected for r in rows)


def test_prm800k_unrated_completions_and_bad_problem_give_no_rows():
    rec, = records("prm800k_give_up_unrated.jsonl")
    last = rec["label"]["steps"][-1]["completions"]
    assert all(c["rating"] is None for c in last)
    rows = convert(rec, "prm800k")
    assert max(len(r["completions"]) for r in rows) == len(rec["label"]["steps"]) - 1
    assert all(y is not None for r in rows for y in r["labels"])
    bad = dict(rec, label=dict(rec["label"], finish_reason="bad_problem"))
    assert convert(bad, "prm800k") == []


def test_stepwise_rows_keep_and_check_every_meta_column():
    r = {"prompt": "p", "completions": ["a"], "labels": [None], "group": "g1", "category": "redundency",
         "final_answer_correct": True, "response_answer": "4"}
    assert convert(r, "stepwise") == [{**r, "labels": [None]}]
    for col in ("group", "category", "response_answer"):
        assert to_rows({**r, col: 3}, "stepwise")[1] == [f"field '{col}': expected text, got int 3"]
    assert to_rows({**r, "final_answer_correct": "yes"}, "stepwise")[1] == [
        "field 'final_answer_correct': expected true/false, got str 'yes'"]


@pytest.mark.parametrize("chosen", [True, 1.0, "1"])
def test_prm800k_chosen_completion_must_be_an_int_index(chosen):
    step = {"completions": [{"text": "a", "rating": 1}, {"text": "b", "rating": 1}],
            "chosen_completion": chosen}
    rec = {"question": {"problem": "p"}, "label": {"steps": [step], "finish_reason": "solution"}}
    assert to_rows(rec, "prm800k")[1] == [
        f"field 'label.steps[0].chosen_completion': {chosen!r} is not an index"]
    rows = convert(dict(rec, label={"steps": [dict(step, chosen_completion=1)]}), "prm800k")
    assert rows[-1]["completions"] == ["b"]


STEP = {"completions": [{"text": "a", "rating": 1}]}
PRM800K = {"question": {"problem": "p"}, "label": {"steps": [STEP], "finish_reason": "solution"}}
CANDIDATE = {"response": "s1 \u043a\u0438", "label": True}


@pytest.mark.parametrize("record, fmt, problem", [
    ({**PRM800K, "question": {"problem": 3}}, "prm800k", "field 'question.problem': expected text, got int 3"),
    ({**PRM800K, "question": "p"}, "prm800k", "field 'question': expected an object, got str 'p'"),
    ({**PRM800K, "label": {"steps": {}}}, "prm800k", "field 'label.steps': expected a list, got dict {}"),
    ({**PRM800K, "label": {"steps": ["x"]}}, "prm800k", "field 'label.steps[0]': expected an object, got str 'x'"),
    ({**PRM800K, "label": {"steps": [{"completions": "a"}]}}, "prm800k",
     "field 'label.steps[0].completions': expected a list, got str 'a'"),
    ({"question": "q", "outputs": [CANDIDATE, {**CANDIDATE, "label": 1}]}, "candidates",
     "field 'outputs[1].label': expected true/false, got int 1"),
    ({"question": "q", "outputs": [{**CANDIDATE, "response_answer": 2}]}, "candidates",
     "field 'outputs[0].response_answer': expected text, got int 2"),
    ({"question": "q", "outputs": [{"label": True}]}, "candidates", "field 'outputs[0].response': missing"),
])
def test_nested_fields_are_type_checked_and_named_by_their_path(record, fmt, problem):
    assert convert(PRM800K, "prm800k") and convert({"question": "q", "outputs": [CANDIDATE]}, "candidates")
    assert to_rows(record, fmt)[1] == [problem]


def test_processbench_rows():
    recs = records("processbench.json")
    rows = [convert(r, "processbench")[0] for r in recs]
    for r, out in zip(recs, rows):
        assert out["prompt"] == r["problem"] and out["completions"] == r["steps"] and out["id"] == r["id"]
        assert out["first_error"] == r["label"] and out["final_answer_correct"] == r["final_answer_correct"]
    assert rows[0]["labels"] == [False, None, None, None]  # gsm8k-17: wrong at step 0, nothing known after
    assert rows[1]["labels"] == [True] * 4 + [False, None, None]  # gsm8k-74: first error at step 4 of 7
    assert rows[2]["labels"] == [True] * 5  # gsm8k-222: label -1, all correct


def test_mrben_rows_read_as_processbench(tmp_path):
    """Mr-Ben's own file (an object of arrays: question id -> its solutions) gives ProcessBench rows: the options
    appended to the question, "Step k: " dropped, the 1-based first error step (or "N/A") as a 0-based index."""
    from prm.config import Config
    from prm.readers.sources import DataError, read_rows
    rows = read_rows(os.path.join(FIX, "mrben.json"), "train", Config())
    assert [r["id"] for r in rows] == ["mrben-855fe031-17d9-482d-b10f-a2646a14786f-Claude2",
                                       "mrben-855fe031-17d9-482d-b10f-a2646a14786f-GPT3.5",
                                       "mrben-1b2038d9-ea05-4e45-9a11-7d73463cdd20-GPT3.5"]
    question = "The shortest distance from the curve xy = 8 to the origin is"
    assert rows[0]["prompt"] == question + "\nA: 4 \nB: 8 \nC: 16 \nD: 2sqrt(2)"  # the last trailing space dropped
    step = "The point where this perpendicular line x = 0 intersects the hyperbola xy = 8 is (0, 8)."
    assert rows[0]["completions"][3] == step  # "Step 4: " and the trailing space dropped
    assert rows[0]["completions"][-1] == "Solution: Choice_B"  # a final line without "Step k:" stays as it is
    assert [r["first_error"] for r in rows] == [0, 4, -1]
    assert [r["final_answer_correct"] for r in rows] == [False, False, True]
    assert rows[1]["labels"] == [True] * 4 + [False] + [None] * 6 and rows[2]["labels"] == [True] * 10
    bad = records("mrben.json")
    bad["855fe031-17d9-482d-b10f-a2646a14786f"][1]["Model_Solution_First_Error_Step"] = "12"  # 11 steps
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(DataError) as e:
        read_rows(str(tmp_path / "bad.json"), "train", Config())
    assert "855fe031-17d9-482d-b10f-a2646a14786f[1]: field 'Model_Solution_First_Error_Step'" in str(e.value)
    assert "'12' is not 1-11 or N/A" in str(e.value)


@pytest.mark.parametrize("y", [True, False, 0, 1, 0.0, 0.5, 1.0, None])
def test_valid_labels(y):
    assert label_problem(y) is None


@pytest.mark.parametrize("y", ["yes", "[invalid]", "1", 2, -1, 1.5, -0.1, math.nan, [1], {}])
def test_invalid_labels(y):
    assert label_problem(y)


def test_row_problems_name_the_field():
    ok = {"prompt": "p", "completions": ["a", "b"], "labels": [True, 0.5]}
    assert row_problems(ok) == []
    assert row_problems({**ok, "labels": [True]}) == ["field 'labels': 1 labels for 2 steps"]
    assert row_problems({**ok, "completions": []})[0].startswith("field 'completions'")
    assert "step 1 is empty" in row_problems({**ok, "completions": ["a", " "]})[0]
    assert "step 1 is int" in row_problems({**ok, "completions": ["a", 3]})[0]
    assert "'yes'" in row_problems({**ok, "labels": [True, "yes"]})[0]
    assert row_problems({**ok, "labels": [None, None]}) == ["field 'labels': no step is labeled"]
    chat = [{"role": "user", "content": "hi"}]
    assert row_problems({**ok, "prompt": chat}) == []
    assert row_problems({**ok, "prompt": [{"role": "user"}]})[0].startswith("field 'prompt'")


def test_hard_labels_become_bools_soft_stay_floats():
    rows = convert({"prompt": "p", "completions": ["a", "b", "c"], "labels": [1, 0.25, None]}, "stepwise")
    assert rows[0]["labels"] == [True, 0.25, None] and rows[0]["labels"][0] is True


def test_non_object_record():
    assert to_rows([1, 2], "stepwise")[1] == ["expected a JSON object, got list [1, 2]"]


def test_pretokenized_rows_are_checked_and_right_padding_stripped():
    ok = {"input_ids": [1, 5, 6, 7], "labels": [-100, True, -100.0, 0.25]}
    assert token_problems(ok) == []
    rows, problems = to_rows({**ok, "id": 3}, "pretokenized")
    assert problems == [] and rows == [{"input_ids": [1, 5, 6, 7], "labels": [-100, 1, -100.0, 0.25], "id": "3"}]
    assert type(rows[0]["labels"][1]) is int  # a bool label becomes 0/1, never True in a float column
    padded = {"input_ids": [1, 5, 0, 0], "labels": [-100, 1, -100, -100], "attention_mask": [1, 1, 0, 0]}
    assert to_rows(padded, "pretokenized")[0] == [{"input_ids": [1, 5], "labels": [-100, 1]}]
    problems = {
        "field 'input_ids': expected a non-empty list": {**ok, "input_ids": [], "labels": []},
        "field 'input_ids': position 1: str '5' is not a token id": {**ok, "input_ids": [1, "5", 6, 7]},
        "field 'input_ids': position 0: int -1 is not a token id": {**ok, "input_ids": [-1, 5, 6, 7]},
        "field 'input_ids': position 0: bool True": {**ok, "input_ids": [True, 5, 6, 7]},
        "field 'labels': position 1: int 2 is not a bool, 0/1 or a float in [0, 1], nor -100": {**ok, "labels": [
            -100, 2, -100, 1]},
        "field 'labels': position 0: null is not a label": {**ok, "labels": [None, 1, -100, 1]},
        "field 'labels': 3 labels for 4 input_ids": {**ok, "labels": [-100, 1, 0]},
        "field 'labels': no position is labeled": {**ok, "labels": [-100] * 4},
        "field 'labels': position 3 is padding": {**padded, "labels": [-100, 1, -100, 0]},
        "field 'attention_mask': expected 4 ones then zeros": {**padded, "attention_mask": [0, 0, 1, 1]},
        "field 'attention_mask': expected 4 ones then zeros (right padding), got list [1, 2": {
            **padded, "attention_mask": [1, 2, 0, 0]},
    }
    for message, row in problems.items():
        assert [p for p in token_problems(row) if p.startswith(message)], (message, token_problems(row))
    assert to_rows({"input_ids": [1]}, "pretokenized")[1] == ["field 'labels': missing"]


def test_the_format_flag_offers_exactly_the_formats_read():
    """--format's choices (prm.config, which imports no reader) and the readers (prm.readers.formats) name one list."""
    import prm.config
    assert prm.config.FORMATS[0] == "auto" and sorted(prm.config.FORMATS[1:]) == sorted(FORMATS)
