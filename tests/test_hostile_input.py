"""Hostile data files: each is refused with exit status 2 and a message naming the file, the line (or row) and the
field, or read correctly; never a traceback, never a silently kept value."""
import json
import os

import pytest

from prm.config import Config
from prm.errors import exit_status
from prm.readers.sources import DataError, read_rows

ROW = json.dumps({"prompt": "p", "completions": ["a"], "labels": [True]})


def stepwise(steps, **extra):
    """A stepwise row; ~ in a step stands for a backslash written raw (json.dumps would escape it)."""
    return json.dumps({"prompt": "p", "completions": steps, "labels": [True] * len(steps), **extra}).replace("~", "\\")


CASES = {  # name: (file contents, what the message names after the file)
    "nested.jsonl": (ROW + "\n" + "[" * 100000, "line 2: malformed JSON: nested too deeply"),
    "nested.json": ("[" * 100000, ": malformed JSON: nested too deeply"),
    "digits.jsonl": (ROW + "\n" + ROW[:-1] + ', "id": 1' + "0" * 5000 + "}", "line 2: unreadable JSON: Exceeds the "
                     "limit (4300 digits)"),
    # 650 deep (json reads it) with a surrogate pair's escape, which has every field checked for a lone one
    "deep.jsonl": (ROW + "\n" + '{"prompt": "p", "labels": [true], "completions": ' + "[" * 650 + r'"\ud83d\ude00"'
                   + "]" * 650 + "}", "line 2: field 'completions': step 0 is list [[["),
    "surrogate.jsonl": (stepwise(["a", "~ud800"]), "line 1: field 'completions[1]': a lone UTF-16 surrogate"),
    "surrogate.json": ("[" + ROW + ", " + stepwise(["a", "b~udfff"]) + "]",
                       "row 1: field 'completions[1]': a lone UTF-16 surrogate '\\udfff' at 1"),
    "big_id.jsonl": (json.dumps({"input_ids": [1, 2 ** 63], "labels": [-100, 1]}),
                     "line 1: field 'input_ids': position 1: int 9223372036854775808 is not a token id"),
    "duplicate.jsonl": (ROW + "\n" + ROW[:-1] + ', "labels": [false]}', "line 2: field 'labels': given twice"),
    "duplicate.json": ("[" + ROW + ", " + json.dumps({"prompt": [{"role": "user", "content": "c"}],
                                                      "completions": ["a"], "labels": [True]}).replace(
                           '"role": "user"', '"role": "user", "role": "system"') + "]",
                       "row 1: field 'prompt[0].role': given twice"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_hostile_data_file_exits_2_naming_file_line_and_field(tmp_path, name, capsys):
    text, named = CASES[name]
    (tmp_path / name).write_text(text, encoding="utf-8")
    with pytest.raises(SystemExit) as e, exit_status():
        read_rows(str(tmp_path / name), "train", Config())
    assert e.value.code == 2 and f"{tmp_path / name}{'' if named.startswith(':') else ' '}{named}" in \
        capsys.readouterr().err


def test_a_folder_named_like_a_data_file_is_named(tmp_path):
    (tmp_path / "a.jsonl").write_text(ROW + "\n")
    (tmp_path / "b.jsonl").mkdir()
    with pytest.raises(DataError, match=f"{tmp_path / 'b.jsonl'}: a folder"):
        read_rows(str(tmp_path), "train", Config())


def test_surrogate_pairs_and_repeated_keys_in_separate_objects_are_read(tmp_path):
    path = tmp_path / "fine.jsonl"
    path.write_text(stepwise(["~ud83d~ude00 fine"]) + "\n" + stepwise(["a"], meta=[{"k": 1}, {"k": 2}]) + "\n")
    rows = read_rows(str(path), "train", Config())
    assert [r["completions"] for r in rows] == [["\U0001F600 fine"], ["a"]]


@pytest.mark.parametrize("output, cause", [("folder", "Is a directory"),
                                           ("missing/out.jsonl", "No such file or directory")])
def test_convert_to_an_unwritable_output_exits_2_with_the_path(tmp_path, output, cause, capsys):
    from prm.convert import main
    (tmp_path / "in.jsonl").write_text(ROW + "\n")
    (tmp_path / "folder").mkdir()  # a folder apart from the input's (one holding it is refused first)
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "in.jsonl"), str(tmp_path / output)])
    assert e.value.code == 2 and f"could not write {tmp_path / output}: {cause}" in capsys.readouterr().err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_convert_to_a_full_disk_exits_1_a_failed_write(tmp_path, capsys):
    from prm.convert import main
    (tmp_path / "in.jsonl").write_text(ROW + "\n")
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "in.jsonl"), "/dev/full"])
    assert e.value.code == 1 and "could not write /dev/full: No space left on device" in capsys.readouterr().err


@pytest.mark.parametrize("template, cause", [(None, "ValueError: Cannot use chat template"),
                                             ("{{ raise_exception('no system role') }}", "no system role")])
def test_a_chat_prompt_without_a_working_chat_template_exits_2_naming_prompt_and_cause(template, cause, capsys):
    from datasets import Dataset

    from prm.readers.ingest import tokenize_dataset
    from prm.readers.synthetic import char_tokenizer
    tokenizer = char_tokenizer()
    tokenizer.chat_template = template
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": "c"}], "completions": ["a"], "labels": [True]}])
    with pytest.raises(SystemExit) as e, exit_status():
        tokenize_dataset(ds, tokenizer, Config(), is_eval=False)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "field 'prompt': chat template" in err and cause in err and "Traceback" not in err


@pytest.mark.parametrize("skip", [False, True])
def test_a_chat_template_failing_on_every_row_is_one_line_without_row_advice(skip, capsys):
    from datasets import Dataset

    from prm.readers.ingest import tokenize_dataset
    from prm.readers.synthetic import char_tokenizer
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": c}], "completions": ["a"], "labels": [True]}
                            for c in "cde"])
    with pytest.raises(SystemExit) as e, exit_status():
        tokenize_dataset(ds, char_tokenizer(), Config(skip_invalid=skip), is_eval=False)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--skip-invalid" not in err and "row 1" not in err
    message = err[err.index("error: "):].strip()  # after datasets' progress bar
    assert "\n" not in message
    assert message.startswith("error: the chat template fails on all 3 training rows; training row 0: ")


TEMPLATE = ("{% for m in messages %}{% if m['content'] == 'bad' %}{{ raise_exception('no bad prompts') }}{% endif %}"
            "{{ m['content'] }}{% endfor %}")


@pytest.mark.parametrize("skip", [False, True])
def test_a_chat_template_that_raises_on_a_later_row_names_it_or_skips_it(skip, capsys):
    from datasets import Dataset

    from prm.readers.ingest import tokenize_dataset
    from prm.readers.synthetic import char_tokenizer
    tokenizer = char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": c}], "completions": ["a"], "labels": [True]}
                            for c in ["c", "d", "e", "bad", "f"]])
    if not skip:
        with pytest.raises(SystemExit) as e, exit_status():
            tokenize_dataset(ds, tokenizer, Config(), is_eval=False)
        err = capsys.readouterr().err
        assert e.value.code == 2 and "training row 3: field 'prompt': chat template" in err
        assert "no bad prompts" in err and "Traceback" not in err and "--skip-invalid" in err
        return
    tok, report = tokenize_dataset(ds, tokenizer, Config(skip_invalid=True), is_eval=False)
    assert len(tok) == report["examples"] == 4 and report["examples_dropped"] == 1  # the skipped row counts
    assert "skipped 1 rows the chat template cannot render" in capsys.readouterr().err


def test_the_json_reader_keeps_no_process_state_and_serves_data_and_server_alike():
    import prm.serve
    import prm.readers.sources
    from prm.readers.formats import read_json
    assert not any(hasattr(prm.readers.sources, name) for name in ("SAID", "_REPEATS", "_loads", "exit_on_data_error"))
    value, problem, _ = read_json('{"a": 1, "a": 2}')
    assert problem == "field 'a': given twice"
    assert read_json('{"a": 1}') == ({"a": 1}, None, None)  # the earlier repeat left nothing behind
    with pytest.raises(prm.serve.BadRequest, match="the body: field 'a': given twice"):
        prm.serve.parse(b'{"a": 1, "a": 2}')


def test_bad_data_is_a_usage_error_with_the_same_message(tmp_path, capsys):
    from prm.errors import UsageError
    (tmp_path / "d.jsonl").write_text(ROW + "\n" + "{\n")
    with pytest.raises(UsageError) as e:
        read_rows(str(tmp_path / "d.jsonl"), "train", Config())
    assert e.value.code == 2 and str(e.value).splitlines() == [
        "1 invalid rows (lines 1-based, rows 0-based; --skip-invalid drops them):",
        f"  {tmp_path / 'd.jsonl'} line 2: malformed JSON: Expecting property name enclosed in double quotes "
        "(column 2)"]
