"""--config FILE (YAML or JSON) against the equivalent flags, overrides, unknown keys, TRL's names, reproducing a saved
run, and the --help text of train.py and eval.py."""
import json

import pytest

from conftest import read_metrics
from prm.cli import parse_config
from prm.config import Config
from prm.errors import UsageError
from conftest import train

FLAGS = ["--synthetic-size", "64", "--max-steps", "3", "--batch-size", "4", "--log-every", "1", "--dtype", "fp32",
         "--lr", "1e-3", "--step-separator", "\\n\\n", "--no-group-by-length"]
YAML = """\
# the same settings as FLAGS
synthetic_size: 64
max_steps: 3
batch_size: 4
log_every: 1
dtype: fp32
lr: 1e-3            # YAML 1.1 reads this as a string: it must still become the float 0.001
step_separator: "\\n\\n"
group_by_length: false
"""
AS_DICT = {"synthetic_size": 64, "max_steps": 3, "batch_size": 4, "log_every": 1, "dtype": "fp32", "lr": 0.001,
           "step_separator": "\n\n", "group_by_length": False}


def losses(out) -> list:
    return [r["loss"] for r in read_metrics(out) if "loss" in r]


def test_yaml_and_json_configs_train_like_the_flags(tmp_path):
    (tmp_path / "run.yaml").write_text(YAML)
    (tmp_path / "run.json").write_text(json.dumps(AS_DICT))
    runs = {"flags": FLAGS, "yaml": ["--config", str(tmp_path / "run.yaml")],
            "json": ["--config", str(tmp_path / "run.json")]}
    cfgs = {name: parse_config(argv + ["--output-dir", str(tmp_path / name)]) for name, argv in runs.items()}
    for name, cfg in cfgs.items():
        assert {k: getattr(cfg, k) for k in AS_DICT} == AS_DICT, name
        train(cfg)
    assert len(losses(tmp_path / "flags")) == 3
    assert losses(tmp_path / "yaml") == losses(tmp_path / "flags") == losses(tmp_path / "json")


def test_flags_given_override_the_file_and_the_rest_keeps_its_values(tmp_path):
    (tmp_path / "run.yaml").write_text(YAML)
    cfg = parse_config(["--config", str(tmp_path / "run.yaml"), "--max-steps", "7", "--group-by-length",
                        "--step-separator", "\\n"])
    assert (cfg.max_steps, cfg.group_by_length, cfg.step_separator) == (7, True, "\n")
    assert (cfg.batch_size, cfg.lr, cfg.dtype) == (4, 0.001, "fp32")
    assert cfg.model == Config().model  # neither in the file nor on the command line: the default


@pytest.mark.parametrize("text, message", [
    ("max_lenght: 512\n", "unknown key 'max_lenght' (did you mean max_length?)"),
    ("learnin_rate: 1.0e-5\n", "unknown key 'learnin_rate' (did you mean learning_rate?)"),  # TRL's name, mistyped
    ("lr: 1.0e-5\nlearning_rate: 1.0e-5\n", "'lr' and 'learning_rate' both set --lr: give one"),  # as flags
    ("max_length: long\n", "'max_length' must be int, got 'long'"),
    ("dtype: fp8\n", "'dtype' must be one of"),
    ("- lr\n", "expected a mapping, got list"),
])
def test_bad_config_files_exit_2_naming_the_problem(tmp_path, text, message):
    (tmp_path / "bad.yaml").write_text(text)
    with pytest.raises(UsageError) as e:
        parse_config(["--config", str(tmp_path / "bad.yaml")])
    assert e.value.code == 2
    assert message in str(e.value)


def test_config_of_a_saved_run_reproduces_its_losses(tmp_path):
    train(parse_config(FLAGS + ["--output-dir", str(tmp_path / "a"), "--grad-accum", "2", "--warmup-steps", "2"]))
    again = parse_config(["--config", str(tmp_path / "a" / "config.train.json"), "--output-dir", str(tmp_path / "b")])
    assert (again.grad_accum, again.warmup_steps, again.step_separator) == (2, 2, "\n\n")
    train(again)
    assert len(losses(tmp_path / "a")) == 3 and losses(tmp_path / "b") == losses(tmp_path / "a")


def test_help_shows_escaped_defaults_and_eval_options_first(capsys):
    import eval as eval_cli
    with pytest.raises(SystemExit):
        parse_config(["--help"])
    text = capsys.readouterr().out
    assert "(default: '\\n')" in " ".join(text.split())  # the newline separator, visible
    assert "filled with repeats" in " ".join(text.split())  # --epochs: data.global_batches
    with pytest.raises(SystemExit):
        eval_cli.main(["--help"])
    text = capsys.readouterr().out
    own = [text.index(f"  --{name}") for name in ("model", "dataset", "predictions", "processbench", "tune-threshold")]
    assert max(own) < text.index("run settings") < text.index("  --max-length")


def test_trl_names_in_a_file_set_our_fields(tmp_path):
    """As on the command line: a TRL config's keys (and dashed spellings) read as ours."""
    (tmp_path / "trl.yaml").write_text("learning_rate: 1.0e-3\nper_device_train_batch_size: 4\nmax-steps: 3\n")
    (tmp_path / "ours.yaml").write_text("lr: 1.0e-3\nbatch_size: 4\nmax_steps: 3\n")
    trl, ours = (parse_config(["--config", str(tmp_path / name)]) for name in ("trl.yaml", "ours.yaml"))
    assert trl == ours and (trl.lr, trl.batch_size, trl.max_steps) == (0.001, 4, 3)


@pytest.mark.parametrize("key", ["resume", "resume_from_checkpoint"])
def test_a_saved_config_continues_no_run(tmp_path, capsys, key):
    """A resumed run's config.train.json keeps its resume: given with a new --output-dir, it starts afresh."""
    (tmp_path / "run.json").write_text(json.dumps({**AS_DICT, key: "auto"}))
    args = ["--config", str(tmp_path / "run.json"), "--output-dir", str(tmp_path / "new")]
    assert parse_config(args).resume == ""
    assert "resume ignored" in capsys.readouterr().err
    assert parse_config(args + ["--resume", "auto"]).resume == "auto"


@pytest.mark.parametrize("key", ["overwrite", "trust_remote_code"])  # deletes a run / runs a model's own code
def test_a_dangerous_setting_is_never_taken_from_a_file(tmp_path, capsys, key):
    (tmp_path / "run.json").write_text(json.dumps({**AS_DICT, key: True}))
    assert getattr(parse_config(["--config", str(tmp_path / "run.json")]), key) is False
    assert f"{key} ignored" in capsys.readouterr().err  # said, so a user who wrote it knows why it had no effect
    flag = "--" + key.replace("_", "-")
    assert getattr(parse_config(["--config", str(tmp_path / "run.json"), flag]), key) is True


@pytest.mark.parametrize("name, text, message", [
    ("run.yaml", "lr: 1.0e-3\nmax_steps: 3\nlr: 2.0e-3\n", "run.yaml: line 3, column 1: key 'lr' given twice"),
    ("run.yaml", "max-steps: 3\nmax-steps: 4\n", "run.yaml: line 2, column 1: key 'max-steps' given twice"),
    ("run.json", '{"lr": 0.001, "max_steps": 3, "lr": 0.002}', "run.json: key 'lr' given twice"),
])
def test_a_key_given_twice_in_a_config_file_is_refused_naming_file_key_and_yaml_line(tmp_path, name, text, message):
    """As data files and the server refuse a repeated key: neither value may silently win."""
    (tmp_path / name).write_text(text)
    with pytest.raises(UsageError) as e:
        parse_config(["--config", str(tmp_path / name)])
    assert e.value.code == 2 and str(e.value).startswith("--config ") and message in str(e.value)
    assert "\n" not in str(e.value)


def test_a_yaml_merge_may_still_override_a_merged_key():
    import yaml
    from prm.config import BoundedLoader
    assert yaml.load("a: &a {x: 1, y: 2}\nb:\n  <<: *a\n  x: 3\n", BoundedLoader)["b"] == {"x": 3, "y": 2}


def test_a_yaml_syntax_error_is_one_line_with_file_line_and_column_and_exit_2(tmp_path):
    import subprocess
    import sys
    from conftest import ROOT
    (tmp_path / "bad.yaml").write_text("lr: 1.0e-3\nmax_steps 3\nbatch_size: 4\n")
    r = subprocess.run([sys.executable, "train.py", "--config", str(tmp_path / "bad.yaml")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"error: --config {tmp_path / 'bad.yaml'}: line 3, column 1: could not find "
                               "expected ':' (while scanning a simple key at line 2, column 1)"), r.stderr


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_config_that_is_no_regular_file_is_refused_at_once(tmp_path, kind):
    import os
    import subprocess
    import sys
    from conftest import ROOT
    path = tmp_path / "run.yaml"
    os.mkfifo(path) if kind == "fifo" else path.mkdir()  # nobody writes the FIFO: open() waits
    r = subprocess.run([sys.executable, "train.py", "--config", str(path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr == f"error: --config {path}: not a regular file\n"
