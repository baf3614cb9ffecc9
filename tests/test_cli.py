"""The command lines: TRL / HF flag names and underscore spellings, the nearest flag for an unknown one, --help by
section and before torch loads, eval.py's own settings and its table, one format per data source, the log line."""
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import types

import pytest

from conftest import ROOT, run_train
from prm.cli import parse_config
from prm.config import Config
from prm.errors import UsageError

FIX = os.path.join(ROOT, "tests", "fixtures")
DASHED = ["--lr", "1e-4", "--batch-size", "2", "--grad-accum", "3", "--epochs", "2", "--model", "tiny",
          "--dataset", "synthetic", "--max-length", "64", "--gradient-checkpointing", "--no-packing",
          "--eval-every", "5", "--compile"]
ALIASES = ["--learning_rate", "1e-4", "--per_device_train_batch_size", "2", "--gradient-accumulation-steps", "3",
           "--num_train_epochs", "2", "--model_name_or_path", "tiny", "--dataset_name", "synthetic", "--max_length",
           "64", "--gradient_checkpointing", "--no-packing", "--eval_steps", "5", "--torch_compile"]


def test_trl_names_and_underscore_spellings_parse_to_the_same_config(tmp_path):
    out = ["--output-dir", str(tmp_path)]
    assert parse_config(DASHED + out) == parse_config(ALIASES + out) != parse_config(out)


@pytest.mark.parametrize("argv, hint", [(["--learnin_rate", "1"], "(did you mean --learning_rate?)"),
                                        (["--max-len", "64"], "(did you mean --max-length?)")])  # no abbreviations
def test_an_unknown_flag_exits_2_naming_the_nearest(argv, hint):
    with pytest.raises(UsageError) as e:
        parse_config(argv)
    assert e.value.code == 2 and "\n" not in str(e.value) and hint in str(e.value)  # one line, no usage dump


@pytest.mark.parametrize("argv, message", [(["--bogus"], "error: unrecognized arguments: --bogus"),
                                           (["--dataset", "x.json"], "error: --model is required"),
                                           (["--model", "m", "--best-of-n-draws", "0"],
                                            "error: --best-of-n-draws 0: must be >= 1"),
                                           (["--model", "m", "--dataset", "a.json", "--tune-threshold", "./a.json"],
                                            "error: --tune-threshold ./a.json is also read for the reported set"),
                                           (["--model", "m", "--dataset", "tests/fixtures", "--tune-threshold",
                                             "tests/fixtures/processbench.json"],  # a file of a --dataset folder
                                            "error: --tune-threshold tests/fixtures/processbench.json is also read")])
def test_eval_py_bad_flags_are_one_line_and_exit_2(argv, message):
    proc = subprocess.run([sys.executable, "eval.py", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith(message), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_eval_py_refuses_to_tune_on_the_runs_own_held_out_source(tmp_path):
    """Without --dataset eval.py reports the run's held-out rows: tuning on their file flatters them too."""
    from prm.config import Config
    held = str(tmp_path / "held.jsonl")
    Config(dataset="synthetic", eval_dataset=held).save(str(tmp_path / "run"))
    proc = subprocess.run([sys.executable, "eval.py", "--model", str(tmp_path / "run"), "--tune-threshold", held],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"error: --tune-threshold {held} is also read for the reported set ({held})" in proc.stderr


def test_help_has_a_section_per_group_of_fields_and_each_field_once(capsys):
    with pytest.raises(SystemExit):
        parse_config(["--help"])
    text = capsys.readouterr().out
    lines = text.splitlines()
    for f in dataclasses.fields(Config):  # a field naming a section starts it
        assert "section" not in f.metadata or f"\n{f.metadata['section']}:\n" in text
        # its invocation line: the dashed name, then a TRL name, a --no- form or the metavar
        flag = "--" + f.name.replace("_", "-")
        assert sum(bool(re.match(f"  {flag}([ ,]|$)", line)) for line in lines) == 1, flag  # 2 spaces in
    assert "--learning-rate" in text and "--gradient-accumulation-steps" in text  # TRL's names, dashed
    assert "--eval_every" not in text and "--gradient_accumulation_steps" not in text  # no underscore spellings


@pytest.mark.parametrize("script", ["train.py", "eval.py"])
def test_help_answers_before_torch_loads(script):
    probe = ("import runpy, sys, time\nt = time.perf_counter()\nsys.argv = [sys.argv[1], '--help']\n"
             "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\nexcept SystemExit:\n    pass\n"
             "print('seconds', time.perf_counter() - t, 'torch' in sys.modules, 'transformers' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", probe, script], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    *_, seconds, torch_loaded, transformers_loaded = proc.stdout.split()
    print(script, "--help:", seconds, "s")
    assert "usage:" in proc.stdout and (torch_loaded, transformers_loaded) == ("False", "False")


def test_eval_takes_the_settings_that_read_and_score_data_only():
    import eval as eval_cli
    text = eval_cli.build_eval_parser().format_help()
    assert "--max-length" in text and "--step-separator" in text and "--threshold" in text
    for flag in ("--save-every", "--overwrite", "--lora-r", "--lr", "--warmup-steps", "--output-dir"):
        assert flag not in text, flag
    with pytest.raises(UsageError) as e:
        eval_cli.parse_args(["--model", "x", "--save-every", "3"])
    assert e.value.code == 2 and "--save-every" in str(e.value)


def test_eval_prints_a_table_on_stderr_and_the_json_last_on_stdout(model_dir, capsys):
    import eval as eval_cli
    out = eval_cli.main(["--model", model_dir, "--dtype", "fp32", "--dataset", os.path.join(FIX, "processbench.json"),
                         os.path.join(FIX, "stepwise_test.jsonl"), "--max-length", "4096"])
    stdout, stderr = capsys.readouterr()
    assert json.loads(stdout.strip().splitlines()[-1]) == json.loads(json.dumps(out))
    table = stderr[stderr.index("subset "):].splitlines()
    assert table[0].split() == ["subset", "step_accuracy", "positive_rate", "f1_0", "auroc", "n_steps"]  # a
    # subset lacks f1; positive_rate beside step_accuracy: the accuracy of always answering "correct"
    assert f"threshold {out['threshold']:g}: a step with P(correct) below it is predicted wrong" in table
    assert table[1].split()[0] == "processbench" and table[2].split()[0] == "stepwise_test"
    n_steps = out["subsets"]["stepwise_test"]["n_steps"]
    assert table[2].split()[-1] == str(n_steps)


def test_eval_table_shows_processbench_columns_and_why_a_figure_is_n_a():
    import eval as eval_cli
    blocks = {"gsm8k": {"f1": 0.5, "acc_error": 0.25, "acc_correct": 1.0, "auroc": None, "chance_f1": 0.2,
                        "n_with_error": 4, "n_without_error": 4, "n_steps": 9, "positive_rate": 1.0},
              "math": {"f1": 0.3, "acc_error": 0.2, "acc_correct": 0.6, "auroc": 0.7, "chance_f1": 0.25}}
    lines = eval_cli.table(blocks, threshold=0.25).splitlines()
    assert [line.split() for line in lines[:4]] == [["subset", "f1", "acc_error", "acc_correct", "auroc", "chance_f1"],
                                                    ["gsm8k", "0.500", "0.250", "1.000", "n/a", "0.200"],
                                                    ["math", "0.300", "0.200", "0.600", "0.700", "0.250"],
                                                    ["mean", "0.400"]]
    assert lines[4:] == ["threshold 0.25: a step with P(correct) below it is predicted wrong",
                         "gsm8k: auroc n/a (every labeled step is correct)"]
    blocks["gsm8k"].update(f1=None, acc_correct=None, chance_f1=None, n_without_error=0)  # a set with no pass
    lines = eval_cli.table(blocks, threshold=0.25).splitlines()
    assert lines[1].split() == ["gsm8k", "n/a", "0.250", "n/a", "n/a", "n/a"] and lines[3].split() == ["mean", "n/a"]
    assert lines[5:] == ["gsm8k: f1, acc_correct, chance_f1 n/a (no error-free solutions)",
                         "gsm8k: auroc n/a (every labeled step is correct)"]


def test_eval_table_adds_best_of_n_and_prmscore_and_warns_of_a_one_class_verdict():
    import eval as eval_cli
    from prm.config import Config
    block = {"step_accuracy": 0.956, "positive_rate": 0.956, "f1_0": 0.0, "auroc": 0.61, "n_steps": 45,
             "precision_0": None, "precision_1": 0.956, "examples_truncated": 0, "examples_dropped": 0,
             "best_of_n": {"min": {"1": 0.5, "all": 0.75}, "oracle": {"1": 0.5, "all": 1.0}},
             "candidates_per_problem": [4], "prmbench": {"prmscore": 0.52, "f1": 0.9, "f1_neg": 0.14}}
    lines = eval_cli.table({"bench": block}, threshold=0.5).splitlines()
    assert lines[1].split() == ["bench", "0.956", "0.956", "0.000", "0.610", "45"]
    assert lines[3:] == ["bench: best-of-N accuracy with all 4 candidates: min 0.750, oracle 1.000",
                         "bench: PRMScore 0.520 (f1 0.900, f1_neg 0.140)"]
    assert eval_cli.warnings_for({"bench": block}, Config(), 0.5) == [
        "warning: bench: every labeled step is predicted correct at threshold 0.5: step_accuracy is that class's "
        "share"]
    assert eval_cli.warnings_for({"bench": {**block, "precision_0": 0.5}}, Config(), 0.5) == []


def test_each_data_source_keeps_its_own_format(tmp_path, capsys):
    """PRM800K training rows (--format prm800k) beside a ProcessBench dev set, detected on its own; the log says
    the run's steps and tokens before the first step."""
    final = run_train(tmp_path, dataset=os.path.join(FIX, "prm800k.jsonl"), format="prm800k", max_steps=2,
                      eval_dataset=os.path.join(FIX, "processbench.json"), max_length=384)
    assert final["eval_data"]["examples"] > 0 and "f1" in final  # read as ProcessBench: first-error metrics
    assert re.search(r"\| 2 steps, ~[0-9.]+k tokens \|", capsys.readouterr().out)


def test_log_line_shows_small_rates_in_full_and_undefined_metrics_as_n_a():
    from conftest import training
    short_number, log_line = training().short_number, training().log_line
    rec = {"step": 1, "loss": 0.5, "acc": 0.5, "lr": 1e-3, "norm": 1.0, "epoch": 0}
    assert log_line({**rec, "tok_per_s": 950.4}).endswith("| 950 tok/s")
    assert log_line({**rec, "tok_per_s": 18234.0}).endswith("| 18.2k tok/s")
    assert log_line({"step": 4, "eval_precision_0": None, "eval_f1_1": 0.5}) == \
        "step 4 | eval_precision_0 n/a | eval_f1_1 0.5000"
    assert (short_number(0), short_number(3.8e3), short_number(1.25e6)) == ("0", "3.8k", "1.2M")


def test_time_left_is_said_once_from_the_host_clock(monkeypatch, tmp_path):
    from conftest import small_config, training
    from prm.core.runtime import Runtime
    train = training()
    said, clock = [], iter([100.0, 101.0, 102.0, 103.0, 104.0, 105.0])
    monkeypatch.setattr(train.time, "perf_counter", lambda: next(clock))
    scaler = types.SimpleNamespace(is_enabled=lambda: False)
    run = types.SimpleNamespace(cfg=small_config(tmp_path).resolve(), rt=Runtime(), plan=types.SimpleNamespace(total=10),
                                step=0, packed=False, state=types.SimpleNamespace(scaler=scaler))
    log = train.TrainLog(run, quiet=True)
    log.pbar = type("Bar", (), {"write": lambda self, s: said.append(s)})()
    for step in range(1, 7):  # step 1 pays the one-time costs: the clock starts when it ends
        log.estimate(step)
    assert said == ["about 0:00:06 left (1.00 s per step)"]  # after step 4: 3 steps timed, 6 to go


def test_progress_bars_only_on_a_terminal_and_never_with_disable_tqdm(tmp_path, monkeypatch):
    from prm.core.runtime import progress_off
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert progress_off(False) is False and progress_off(True) is True
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert progress_off(False) is True  # a log file gets no redraws
    r = subprocess.run([sys.executable, "train.py", "--synthetic-size", "80", "--max-steps", "2", "--output-dir",
                        str(tmp_path / "run"), "--batch-size", "4", "--dtype", "fp32"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "\r" not in r.stderr and "it/s" not in r.stderr and "examples/s" not in r.stderr, r.stderr[-2000:]
    r = subprocess.run([sys.executable, "eval.py", "--model", str(tmp_path / "run" / "final")], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0 and "\r" not in r.stderr and "it/s" not in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("argv, message", [
    (["--learning-rate", "1e-5", "--lr", "2e-5"], "--learning-rate and --lr both set --lr: give one"),
    (["--lr", "1e-5", "--learning_rate", "2e-5"], "--lr and --learning_rate both set --lr: give one"),
    (["--batch_size", "4", "--per-device-train-batch-size", "8"],
     "--batch_size and --per-device-train-batch-size both set --batch-size: give one"),
    (["--use-peft", "--no-use_peft"], "--use-peft and --use_peft both set --use-peft: give one"),
])
def test_one_setting_under_two_of_its_names_is_refused_naming_both(argv, message):
    """As a config file refuses lr beside learning_rate; one name given twice: the last wins, as in argparse."""
    with pytest.raises(UsageError) as e:
        parse_config(argv)
    assert e.value.code == 2 and str(e.value) == message
    assert parse_config(["--lr", "1e-5", "--lr", "2e-5"]).lr == 2e-5
    assert parse_config(["--packing", "--no-packing"]).packing is False


def test_eval_py_refuses_one_setting_under_two_names_too():
    import eval as eval_cli
    with pytest.raises(UsageError, match="^--max-length and --max_length both set --max-length: give one$"):
        eval_cli.parse_args(["--model", "x", "--max-length", "8", "--max_length", "9"])


@pytest.mark.parametrize("argv, message", [
    (["--batch_size", "x"], "argument --batch-size: invalid int value: 'x'"),
    (["--per-device-train-batch-size", "x"], "argument --batch-size: invalid int value: 'x'"),
    (["--gradient_checkpointing", "maybe"], "argument --gradient-checkpointing: invalid boolean value: 'maybe'"),
    (["--dataset_test_split"], "argument --eval-split: expected one argument"),
])
def test_a_bad_value_names_the_flag_as_help_lists_it(argv, message):
    with pytest.raises(UsageError) as e:
        parse_config(argv)
    assert e.value.code == 2 and str(e.value) == message


def test_bad_paths_exit_2_with_a_message(tmp_path):
    from prm.cli import parse_config
    from prm.errors import UsageError
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError) as e:
        parse_config(["--output-dir", str(tmp_path / "file" / "out")])
    assert e.value.code == 2 and "not a writable folder" in str(e.value)
    (tmp_path / "no_config").mkdir()
    for kw, text in (({"tokenizer": str(tmp_path / "missing")}, "--tokenizer"),
                     ({"model": str(tmp_path / "no_config")}, "no config.json")):
        with pytest.raises(UsageError) as e:  # from prm.loading: train.py's exit_status() makes it exit status 2
            run_train(tmp_path / "out", max_steps=1, **kw)
        assert e.value.code == 2 and text in str(e.value)
    r = subprocess.run([sys.executable, "train.py", "--lr", "nan", "--output-dir", str(tmp_path / "o")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--lr nan" in r.stderr


def test_every_error_an_entry_point_reports_survives_pickling_whole():
    """Rank 0's error reaches the other ranks pickled (prm.core.runtime.decided_by_main): message, type, exit status
    and fields arrive as built."""
    import pickle

    from prm.errors import Diverged, Stopped, WriteFailed
    from prm.readers.sources import DataError, MissingSplit
    for error in (UsageError("bad flag"), WriteFailed("out: cannot write it: full", cause="full"),
                  Diverged("loss is nan"), Stopped("stopped by SIGTERM", signal.SIGTERM),
                  DataError(["a.jsonl line 2: field 'labels': missing"], total_rows=1),
                  MissingSplit(["d: no data file named for split 'dev'"])):
        back = pickle.loads(pickle.dumps(error))
        assert (type(back), str(back), back.code, vars(back)) == (type(error), str(error), error.code, vars(error))


def test_help_says_which_flags_are_required_and_shows_a_list_default_as_typed():
    from prm.cli import Parser
    from prm.search import SearchOptions, SearchRun
    p = Parser(SearchRun, SearchOptions, prog="python -m prm.search")
    text = " ".join(p.format_help().split())
    assert text.startswith("usage: python -m prm.search --dataset DATASET --output OUTPUT --model MODEL "
                           "--policy POLICY [options]")
    assert "the PRM, as eval.py's --model (required)" in text and "(default: 1,4,16)" in text
    with pytest.raises(UsageError, match="^--model, --policy are required$"):
        p.parse_args(["--dataset", "d.jsonl", "--output", "o.jsonl"])


def test_a_field_taken_like_another_keeps_its_checks_and_a_bad_value_names_its_flag():
    """prm.search's sampling flags are prm.label's fields (opt(like=...)): the same checks refuse the same values."""
    from prm.label import LabelOptions
    from prm.search import SearchOptions
    for cls in (LabelOptions, SearchOptions):
        with pytest.raises(UsageError, match=r"^--top-p 0: must be in \(0, 1\]; --batch-size 0: must be >= 1$"):
            cls(policy="p", top_p=0, batch_size=0)
