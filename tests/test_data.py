"""Tokenization, collation and batch plans against hand-built expectations."""
import pytest
import torch

from prm.core.data import (IGNORE, collate, eval_batches, global_batches, micro_batches, pad_token_id, tokenize_batch,
                      tokenize_example)


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_layout_with_bos_and_multi_token_separator(char_tok):
    row = {"prompt": "q?", "completions": ["1+1=2", "2+1=4"], "labels": [True, False]}
    out = tokenize_example(row, char_tok, step_separator="\n\n")
    sep = ids(char_tok, "\n\n")
    assert len(sep) == 2
    expected = [char_tok.bos_token_id] + ids(char_tok, "q?") + ids(char_tok, "1+1=2") + sep + ids(char_tok, "2+1=4")
    expected += sep
    assert out["input_ids"] == expected
    labeled = [i for i, y in enumerate(out["labels"]) if y != IGNORE]
    assert labeled == [1 + 2 + 5 + 1, 1 + 2 + 5 + 2 + 5 + 1]  # the LAST separator token of each step
    assert [out["labels"][i] for i in labeled] == [1, 0]
    assert all(type(out["labels"][i]) is int for i in labeled)


def test_no_bos_when_tokenizer_has_none(char_tok_no_bos):
    out = tokenize_example({"prompt": "q", "completions": ["a"], "labels": [1]}, char_tok_no_bos)
    assert out["input_ids"] == ids(char_tok_no_bos, "q") + ids(char_tok_no_bos, "a") + ids(char_tok_no_bos, "\n")
    assert out["labels"] == [IGNORE, IGNORE, 1]


def test_steps_tokenized_alone_not_joined(qwen2_tok):
    """Qwen2 merges '.\\n' into one token: joined text would lose the separator token the label sits on."""
    row = {"prompt": "Solve.", "completions": ["First step.", "Second step."], "labels": [True, True]}
    out = tokenize_example(row, qwen2_tok)
    joined = ids(qwen2_tok, "Solve.First step.\nSecond step.\n")
    assert out["input_ids"] != joined
    nl = ids(qwen2_tok, "\n")[-1]
    assert [out["input_ids"][i] for i, y in enumerate(out["labels"]) if y != IGNORE] == [nl, nl]
    assert qwen2_tok.bos_token_id is None and out["input_ids"][0] == ids(qwen2_tok, "Solve.")[0]


def test_label_never_on_prompt_token(char_tok):
    row = {"prompt": "x\ny\n", "completions": ["s"], "labels": [0]}
    out = tokenize_example(row, char_tok)
    n_prompt = 1 + len(ids(char_tok, "x\ny\n"))
    assert all(y == IGNORE for y in out["labels"][:n_prompt])
    assert out["labels"][-1] == 0


def test_truncation_keeps_whole_steps(char_tok):
    row = {"prompt": "pp", "completions": ["aaa", "bbb", "ccc"], "labels": [1, 0, 1]}
    full = tokenize_example(row, char_tok)
    assert len(full["input_ids"]) == 3 + 3 * 4
    at_boundary = tokenize_example(row, char_tok, max_length=3 + 2 * 4)
    inside = tokenize_example(row, char_tok, max_length=3 + 2 * 4 + 2)  # cuts inside the third step
    for out in (at_boundary, inside):
        assert out["input_ids"] == full["input_ids"][:11]
        assert out["labels"] == full["labels"][:11]
        assert out["steps_kept"] == 2
    nothing = tokenize_example(row, char_tok, max_length=5)
    assert all(y == IGNORE for y in nothing["labels"]) and nothing["steps_kept"] == 0


def test_last_step_only_in_training_all_steps_in_eval(char_tok):
    row = {"prompt": "p", "completions": ["a", "b", "c"], "labels": [1, 1, 0]}
    train = tokenize_example(row, char_tok, train_on_last_step_only=True)
    evaluation = tokenize_example(row, char_tok, train_on_last_step_only=True, is_eval=True)
    assert [y for y in train["labels"] if y != IGNORE] == [0]
    assert [y for y in evaluation["labels"] if y != IGNORE] == [1, 1, 0]


def test_soft_labels_stay_floats(char_tok):
    out = tokenize_example({"prompt": "p", "completions": ["a", "b"], "labels": [0.25, 1.0]}, char_tok)
    assert [y for y in out["labels"] if y != IGNORE] == [0.25, 1.0]
    assert all(isinstance(y, float) for y in out["labels"] if y != IGNORE)


@pytest.mark.parametrize("bad", ["yes", 2, -0.5, 1.5, float("nan"), "[invalid]"])
def test_bad_labels_raise(char_tok, bad):
    with pytest.raises(ValueError):
        tokenize_example({"prompt": "p", "completions": ["a"], "labels": [bad]}, char_tok)


@pytest.mark.parametrize("cap", [0, 2, 3, 5])
def test_batch_tokenization_equals_per_row(char_tok, cap):
    rows = [{"prompt": "p1", "completions": ["ab", "c"], "labels": [True, 0.5]},
            {"prompt": "p2", "completions": ["de"], "labels": [False]}]
    batch = tokenize_batch({k: [r[k] for r in rows] for k in rows[0]}, char_tok, max_length=8,
                           max_completion_length=cap)
    for i, row in enumerate(rows):
        one = tokenize_example(row, char_tok, max_length=8, max_completion_length=cap)
        assert batch["input_ids"][i] == one["input_ids"]
        assert batch["labels"][i] == [float(y) for y in one["labels"]]
        assert batch["steps_kept"][i] == one["steps_kept"]


def test_completion_cap_keeps_whole_steps(char_tok):
    row = {"prompt": "pp", "completions": ["a", "bbbbbb", "c"], "labels": [1, 0, 1]}  # steps of 2, 7, 2 tokens
    full = tokenize_example(row, char_tok)
    for cap in (2, 5, 8):  # the second step crosses each cap: it goes, and the third (which would fit) with it
        out = tokenize_example(row, char_tok, max_completion_length=cap)
        assert out["input_ids"] == full["input_ids"][:3 + 2] and out["labels"] == full["labels"][:5]
        assert out["labels"][-1] == 1 and out["steps_kept"] == 1  # the label still on the separator token
    two = tokenize_example(row, char_tok, max_completion_length=9)  # a cap right at a step boundary keeps it
    assert two["input_ids"] == full["input_ids"][:12] and two["labels"][-1] == 0 and two["steps_kept"] == 2
    none = tokenize_example(row, char_tok, max_completion_length=1)
    assert none["input_ids"] == full["input_ids"][:3] and none["steps_kept"] == 0  # the prompt alone, no label
    assert tokenize_example(row, char_tok, max_completion_length=0) == full  # 0: no cap


def test_completion_cap_counts_steps_only_and_comes_before_max_length(char_tok):
    row = {"prompt": "pppppp", "completions": ["aa", "bb", "cc"], "labels": [1, 1, 0]}  # prompt 7, steps 3 tokens
    kept = lambda **kw: tokenize_example(row, char_tok, **kw)["steps_kept"]
    assert kept(max_completion_length=6, max_length=100) == 2  # the cap bites; a 7-token prompt does not count
    assert kept(max_completion_length=100, max_length=7 + 3) == 1  # max_length bites
    assert kept(max_completion_length=6, max_length=7 + 6) == 2  # both allow exactly two
    assert kept(max_completion_length=3, max_length=7 + 6) == 1  # the tighter one wins, whichever it is
    assert kept(max_completion_length=6, max_length=7 + 3) == 1
    prompt_too_long = tokenize_example(row, char_tok, max_completion_length=6, max_length=4)
    assert len(prompt_too_long["input_ids"]) == 4 and prompt_too_long["steps_kept"] == 0


def test_completion_cap_reaches_the_dataset_report_and_the_cache_key(char_tok):
    from datasets import Dataset

    from prm.config import Config
    from prm.readers.ingest import map_fingerprint, tokenize_dataset
    ds = Dataset.from_list([{"prompt": "pp", "completions": ["a", "bbbbbb", "c"], "labels": [True, False, True]},
                            {"prompt": "q", "completions": ["dddddd"], "labels": [True]}])
    tok, report = tokenize_dataset(ds, char_tok, Config(max_completion_length=5), is_eval=False)
    assert len(tok) == 1 and tok[0]["steps_kept"] == 1
    assert report["steps_truncated"] == 3 and report["examples_dropped"] == 1
    settings = dict(step_separator="\n", max_length=64, is_eval=False)
    assert map_fingerprint(ds, char_tok, {**settings, "max_completion_length": 5}) != \
        map_fingerprint(ds, char_tok, {**settings, "max_completion_length": 0})


def test_the_data_report_counts_the_steps_holding_the_separator(char_tok):
    """So a user can pick a separator no step holds: such a step trains whole, while a scorer cuts text there."""
    from datasets import Dataset

    from prm.config import Config
    from prm.readers.ingest import tokenize_dataset
    ds = Dataset.from_list([{"prompt": "p", "completions": ["a\nb", "c", "d\n\ne\n"], "labels": [True] * 3},
                            {"prompt": "q", "completions": ["f\n\n"], "labels": [None]}])  # dropped, counted
    count = lambda sep: tokenize_dataset(ds, char_tok, Config(step_separator=sep), is_eval=False)[1][
        "steps_with_separator"]
    assert (count("\n"), count("\n\n"), count(";")) == (3, 2, 0)


def test_scoring_uses_the_completion_cap(char_tok):
    from prm.loading import build_model
    from prm.core.evaluate import score, score_batch
    model = build_model("tiny", char_tok, seed=0)
    steps = ["1+1=2", "2+1=3", "3+1=4"]
    full = score(model, char_tok, "count:", steps)
    assert len(full) == 3
    assert score(model, char_tok, "count:", steps, max_completion_length=13) == pytest.approx(full[:2], abs=1e-6)
    assert score_batch(model, char_tok, [("count:", steps)], max_completion_length=5) == [[]]


def test_collate_pads_right_with_ignored_labels(char_tok):
    rows = [{"input_ids": [5, 6, 7], "labels": [IGNORE, IGNORE, 1.0]}, {"input_ids": [8], "labels": [0.3]}]
    b = collate(rows, pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b["labels"][1].tolist() == pytest.approx([0.3, IGNORE, IGNORE])
    assert b["input_ids"].dtype == torch.long and b["labels"].dtype == torch.float32


def test_pad_falls_back_to_eos(char_tok):
    from prm.readers.synthetic import char_tokenizer
    tok = char_tokenizer()
    tok.pad_token = None
    assert pad_token_id(tok) == tok.eos_token_id
    assert pad_token_id(char_tok) == char_tok.pad_token_id


@pytest.mark.parametrize("group", [False, True])
def test_global_batches_do_not_depend_on_world_size(group):
    lengths = [(i * 37) % 50 + 1 for i in range(23)]
    plan = global_batches(lengths, 8, seed=3, epoch=1, group_by_length=group)
    assert len(plan) == 3 and all(len(b) == 8 for b in plan)  # last batch completed by wrap-around
    assert set(i for b in plan for i in b) == set(range(23))
    assert plan != global_batches(lengths, 8, seed=3, epoch=2, group_by_length=group)  # reshuffled per epoch
    for batch in plan:
        for world, accum in ((1, 1), (2, 1), (2, 2), (4, 2)):
            parts = [m for r in range(world) for m in micro_batches(batch, lengths, world, r, accum)]
            assert sorted(i for m in parts for i in m) == sorted(batch)
            assert len({len(m) for m in parts}) == 1


def test_eval_batches_cover_every_example_once():
    lengths = [5, 1, 9, 3, 3, 7, 2]
    batches = eval_batches(lengths, 2)
    assert sorted(i for b in batches for i in b) == list(range(7)) and [len(b) for b in batches] == [2, 2, 2, 1]
    assert [lengths[i] for b in batches for i in b] == sorted(lengths)  # length-sorted: little padding


def test_none_label_keeps_the_step_unscored(char_tok):
    out = tokenize_example({"prompt": "p", "completions": ["a", "b"], "labels": [True, None]}, char_tok)
    assert [y for y in out["labels"] if y != IGNORE] == [1] and out["steps_kept"] == 2


def test_auto_processes_start_only_for_large_datasets_and_give_the_same_rows(char_tok, monkeypatch):
    from datasets import Dataset

    import prm.readers.ingest as ingest
    from prm.config import Config
    monkeypatch.setattr(ingest.os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert ingest.processes(0, ingest.AUTO_PROC_ROWS - 1) == 1  # start-up would cost more than it saves
    assert ingest.processes(0, ingest.AUTO_PROC_ROWS) == 3 and ingest.processes(5, 10) == 5  # given: as given
    monkeypatch.setattr(ingest, "AUTO_PROC_ROWS", 8)  # 40 rows: auto starts 2 processes here
    ds = Dataset.from_list([{"prompt": f"p{i}", "completions": ["a" * (i % 5 + 1), "b"], "labels": [True, i % 2 == 0]}
                            for i in range(40)])
    monkeypatch.setattr(ingest.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    two, _ = tokenize_dataset_uncached(ingest, ds, char_tok, Config())
    one, _ = tokenize_dataset_uncached(ingest, ds, char_tok, Config(num_proc=1))
    assert two.to_list() == one.to_list()


def tokenize_dataset_uncached(ingest, ds, tok, cfg):
    from datasets import disable_caching, enable_caching
    disable_caching()  # a second map with the same fingerprint would read the first one's cache
    try:
        return ingest.tokenize_dataset(ds, tok, cfg, is_eval=False, num_proc=cfg.num_proc)
    finally:
        enable_caching()


def test_last_step_only_takes_the_outcome_of_a_solution_whose_tail_is_unscored(char_tok):
    """ProcessBench-style rows leave the steps after the first error unscored (null): the last step's label is
    then the solution's outcome, wrong, not a missing label that drops the row; steps_truncated counts only steps a
    length cap cut."""
    from datasets import Dataset

    from prm.config import Config
    from prm.readers.ingest import tokenize_dataset
    rows = [{"prompt": "p", "completions": ["a", "b", "c"], "labels": [True, False, None]},
            {"prompt": "q", "completions": ["a", "b"], "labels": [True, None]},  # no wrong step: unknown outcome
            {"prompt": "r", "completions": ["a", "b"], "labels": [True, True]}]
    tok, report = tokenize_dataset(Dataset.from_list(rows), char_tok, Config(train_on_last_step_only=True),
                                   is_eval=False)
    assert [[y for y in r if y != IGNORE] for r in tok["labels"]] == [[0], [1]]
    assert report["examples_dropped"] == 1 and report["steps_truncated"] == 0
    whole = tokenize_example(rows[0], char_tok, train_on_last_step_only=True, is_eval=True)  # evaluation: as given
    assert [y for y in whole["labels"] if y != IGNORE] == [1, 0]
