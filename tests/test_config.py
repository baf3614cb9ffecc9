"""Config's per-field rules and what is derived from them, the auto (None) fields, TRL's / HF's flags with
their meaning (and the ones refused on purpose), the learning-rate schedules, a YAML alias bomb refused."""
import dataclasses
import json
import math
import subprocess
import sys
import types

import pytest

from conftest import ROOT, read_metrics, run_train
from prm.cli import ALIASES, parse_config
from prm.config import MAY_CHANGE, RULES, SCHEDULES, Config
from prm.errors import UsageError


def test_every_field_states_its_rules():
    """A field added without saying whether a resume may change it, whether it shapes the cached rows and
    whether eval.py takes it (and its TRL names, () for none) fails here, not as stale cached rows later."""
    for f in dataclasses.fields(Config):
        assert {"help", "rules", "trl"} <= set(f.metadata), f.name
        assert f.metadata["rules"] <= RULES and isinstance(f.metadata["trl"], tuple), f.name


def test_the_lists_derived_from_the_rules():
    import eval as eval_cli
    from prm.readers.sources import SHAPING
    assert set(SHAPING) == {"dataset", "eval_dataset", "train_split", "eval_split", "format", "eval_format",
                            "neutral_label", "skip_invalid", "eval_fraction", "seed", "cut_after_first_error"}
    assert set(eval_cli.SCORING) == {
        "tokenizer", "format", "neutral_label", "skip_invalid", "dataset_config", "eval_split", "num_proc",
        "max_length", "max_completion_length", "step_separator", "dtype", "packing", "eval_batch_size",
        "threshold", "seed", "trust_remote_code", "disable_tqdm"}
    assert set(MAY_CHANGE) == {
        "max_steps", "epochs", "eval_every", "save_every", "log_every", "keep_last", "resume", "output_dir",
        "num_proc", "eval_batch_size", "threshold", "compile", "gradient_checkpointing", "trust_remote_code",
        "max_grad_norm", "batch_size", "grad_accum", "report_to", "run_name", "overwrite", "packing",
        "pack_to", "eval_strategy", "save_strategy", "disable_tqdm", "use_peft"}
    assert {k: v[0] for k, v in ALIASES.items() if v[1] is None} == {
        "learning_rate": "lr", "per_device_train_batch_size": "batch_size", "num_train_epochs": "epochs",
        "gradient_accumulation_steps": "grad_accum", "logging_steps": "log_every", "save_steps": "save_every",
        "save_total_limit": "keep_last", "eval_steps": "eval_every", "model_name_or_path": "model",
        "dataset_name": "dataset", "per_device_eval_batch_size": "eval_batch_size",
        "dataset_num_proc": "num_proc", "dataset_train_split": "train_split",
        "dataset_test_split": "eval_split", "torch_compile": "compile", "resume_from_checkpoint": "resume"}


def test_use_peft_false_is_full_fine_tuning_whatever_lora_r_says(tmp_path):
    """As in TRL, whose dumped configs carry ModelConfig's lora_r 16 beside use_peft false; --lora-r alone is LoRA."""
    (tmp_path / "trl.yaml").write_text("use_peft: false\nlora_r: 16\nlora_alpha: 32\n")
    out = ["--output-dir", str(tmp_path / "out")]
    rank = lambda *flags: parse_config([*flags, *out]).resolve().lora_r
    assert rank("--config", str(tmp_path / "trl.yaml")) == rank("--use_peft", "false", "--lora_r", "16") == 0
    assert rank("--lora-r", "16", "--no-use-peft") == 0
    assert (rank("--lora-r", "8"), rank("--use_peft"), rank("--use-peft", "true", "--lora-r", "4")) == (8, 16, 4)
    assert Config(lora_r=16, use_peft=False, lora_base_dtype="bf16").problems()[0].startswith("--lora-base-dtype")
    # on resume use_peft may change, the LoRA rank it resolves to may not
    saved = Config(lora_r=16).resolve()
    assert Config(use_peft=True).resolve().resume_conflicts(saved, 1, 1)[0] == []
    assert Config(use_peft=False, lora_r=16).resolve().resume_conflicts(saved, 1, 1)[0][0].startswith("--lora-r 0")


def test_auto_fields_are_none_0_or_auto_still_means_auto_and_resolve_returns_a_new_config(tmp_path):
    (tmp_path / "zero.yaml").write_text("lr: 0\nbatch_size: 0\nlora_alpha: 0\neval_batch_size: 0\nnum_proc: 0\n"
                                        "dtype: auto\nformat: auto\neval_format: auto\n")
    cfg = Config(lr=0.0, batch_size=0, lora_alpha=0.0, eval_batch_size=0, num_proc=0, dtype="auto", format="auto",
                 eval_format="auto")
    assert cfg == Config() and cfg.lr is cfg.batch_size is cfg.lora_alpha is cfg.eval_batch_size is None
    assert cfg.num_proc is cfg.dtype is cfg.format is cfg.eval_format is None
    # parse_config returns the config resolved: the auto fields filled in, as when no flag is given
    for parsed in (parse_config(["--lr", "0", "--batch-size", "0", "--lora-alpha", "0", "--eval-batch-size", "0",
                                 "--num-proc", "0", "--dtype", "auto", "--format", "auto", "--eval-format", "auto"]),
                   parse_config(["--config", str(tmp_path / "zero.yaml")])):
        assert parsed == parse_config([]) == Config().resolve() and parsed.dtype is None
    cfg = Config(model="some/model", use_peft=True)
    done = cfg.resolve()
    assert done is not cfg and cfg.lr is None and cfg.lora_r == 0  # the original is left as it was
    assert (done.lr, done.batch_size, done.eval_batch_size) == (1e-4, 8, 16)
    assert (done.lora_r, done.lora_alpha) == (16, 32.0)
    assert Config().resolve().lr == 1e-3 and Config(model="m").resolve().lr == 1e-5
    assert done.resolve() == done


def test_help_says_what_auto_means(capsys):
    with pytest.raises(SystemExit):
        parse_config(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default/0: 1e-3 for 'tiny'" in text and "(default: None)" not in text
    assert "--gradient-checkpointing [BOOL], --no-gradient-checkpointing [BOOL]" in text


ALIAS_BOMB = "lr: [&a [1,1,1,1,1,1,1,1,1], " + ", ".join(
    f"&{b} [{', '.join(['*' + a] * 9)}]" for a, b in zip("abcdefgh", "bcdefghi")) + "]\n"


def test_a_yaml_alias_bomb_is_refused_before_it_expands(tmp_path):
    (tmp_path / "bomb.yaml").write_text(ALIAS_BOMB)  # 9**9 items once expanded
    with pytest.raises(UsageError) as e:
        parse_config(["--config", str(tmp_path / "bomb.yaml")])
    assert "over 20 aliases" in str(e.value) and len(str(e.value)) < 300


def test_a_huge_wrong_value_is_shown_as_a_short_preview(tmp_path):
    (tmp_path / "few.yaml").write_text("lr: [&a [1,1,1], &b [*a, *a, *a], &c [*b, *b, *b], [*c, *c, *c]]\n")
    (tmp_path / "big.json").write_text('{"lr": [' + ", ".join(["[1, 2, 3]"] * 100000) + "]}")
    (tmp_path / "long.yaml").write_text("dtype: " + "x" * 10 ** 6 + "\n")
    (tmp_path / "huge.yaml").write_text("lr: 1" + "0" * 400 + "\n")  # an int no float can hold
    for name in ("few.yaml", "big.json", "long.yaml", "huge.yaml"):
        with pytest.raises(UsageError) as e:
            parse_config(["--config", str(tmp_path / name)])
        assert "must be" in str(e.value) and len(str(e.value)) < 400, name


@pytest.mark.parametrize("argv, want", [
    (["--bf16"], {"dtype": "bf16"}), (["--bf16", "false"], {"dtype": "fp32"}),
    (["--fp16", "True"], {"dtype": "fp16"}),
    (["--no-bf16"], {"dtype": "fp32"}), (["--torch_dtype", "bfloat16"], {"dtype": "bf16"}),
    (["--torch-dtype", "float32"], {"dtype": "fp32"}),
    (["--use_peft", "--lora_r", "8", "--lora_alpha", "4", "--lora_dropout", "0.05"],
     {"use_peft": True, "lora_r": 8, "lora_alpha": 4.0, "lora_dropout": 0.05}),
    (["--lora_target_modules", "q_proj", "v_proj"], {"lora_targets": "q_proj,v_proj"}),
    (["--lora_target_modules", "all-linear"], {"lora_targets": "*"}),
    (["--lr_scheduler_type", "linear", "--warmup_ratio", "0.1"],
     {"lr_scheduler_type": "linear", "warmup_ratio": 0.1}),
    (["--adam_beta1", "0.8", "--adam_beta2", "0.999", "--adam_epsilon", "1e-6"],
     {"adam_beta1": 0.8, "adam_beta2": 0.999, "adam_epsilon": 1e-6}),
    (["--eval_strategy", "epoch", "--eval_steps", "5"], {"eval_strategy": "epoch", "eval_every": 5}),
    (["--save_strategy", "no", "--save_steps", "3", "--save_total_limit", "1"],
     {"save_strategy": "no", "save_every": 3, "keep_last": 1}),
    (["--logging_steps", "5", "--disable_tqdm", "--report_to", "tensorboard"],
     {"log_every": 5, "disable_tqdm": True, "report_to": "tensorboard"}),
    (["--gradient_checkpointing", "True", "--packing", "false"],
     {"gradient_checkpointing": True, "packing": False}),
    (["--disable_dropout", "false"], {"disable_dropout": False}), ([], {"disable_dropout": True}),
    (["--no-disable-dropout"], {"disable_dropout": False}),
])
def test_trl_and_hf_flags_set_their_meaning(argv, want):
    cfg = parse_config(argv)
    assert {k: getattr(cfg, k) for k in want} == want


@pytest.mark.parametrize("argv, dtype", [
    (["--bf16", "--fp16", "false"], "bf16"), (["--bf16", "true", "--no-fp16"], "bf16"),
    (["--no-fp16", "--bf16"], "bf16"), (["--fp16", "--no-bf16"], "fp16"), (["--dtype", "fp16", "--no-bf16"], "fp16"),
    (["--no-bf16", "--no-fp16"], "fp32"), (["--dtype", "bf16", "--no-bf16"], "fp32"),
    (["--dtype", "fp32", "--bf16"], "bf16"),
])
def test_a_false_precision_switch_means_not_this_one_in_any_order(argv, dtype):
    """As in HF: `--fp16 false` beside `--bf16` is bf16, not fp32."""
    assert parse_config(argv).dtype == dtype


@pytest.mark.parametrize("argv", [["--bf16", "--fp16"], ["--fp16", "true", "--bf16", "True"],
                                  ["--dtype", "bf16", "--fp16"]])
def test_bf16_and_fp16_both_true_are_refused_as_in_hf(argv):
    with pytest.raises(UsageError) as e:
        parse_config(argv)
    assert e.value.code == 2 and "both true" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("text, dtype", [
    ("bf16: true\nfp16: false\n", "bf16"), ("fp16: false\nbf16: true\n", "bf16"),
    ("fp16: true\nbf16: false\n", "fp16"), ("bf16: false\nfp16: false\n", "fp32"),
    ("dtype: fp16\nbf16: false\n", "fp16"),
    ("dtype: bf16\nbf16: false\n", "fp32"),  # in order, as `--dtype bf16 --no-bf16`
    ("bf16: true\nfp16: true\n", "'fp16' and bf16 both true"),
])
def test_a_trl_recipe_with_bf16_true_and_fp16_false_is_bf16(text, dtype, tmp_path):
    (tmp_path / "recipe.yaml").write_text(text)
    argv = ["--config", str(tmp_path / "recipe.yaml")]
    if " " in dtype:  # a real conflict stays refused
        with pytest.raises(UsageError, match=dtype):
            parse_config(argv)
    else:
        assert parse_config(argv).dtype == dtype


def test_a_trl_config_file_reads_as_its_flags(tmp_path):
    (tmp_path / "trl.yaml").write_text("bf16: true\nuse_peft: true\nlora_target_modules: [q_proj, v_proj]\n"
                                       "lr_scheduler_type: linear\nwarmup_ratio: 0.1\npush_to_hub: false\n")
    flags = ["--bf16", "--use_peft", "--lora_target_modules", "q_proj", "v_proj", "--lr_scheduler_type",
             "linear", "--warmup_ratio", "0.1"]
    assert parse_config(["--config", str(tmp_path / "trl.yaml")]) == parse_config(flags)
    (tmp_path / "hub.yaml").write_text("push_to_hub: true\n")
    with pytest.raises(UsageError, match="'push_to_hub' is not supported: upload"):
        parse_config(["--config", str(tmp_path / "hub.yaml")])
    (tmp_path / "dtype.yaml").write_text("torch_dtype: int8\n")
    with pytest.raises(UsageError, match="'torch_dtype': expected one of auto, bfloat16"):
        parse_config(["--config", str(tmp_path / "dtype.yaml")])


@pytest.mark.parametrize("argv, message", [
    (["--push_to_hub"], "--push_to_hub is not supported: upload final/ yourself"),
    (["--hub-model-id", "me/prm"], "--hub-model-id is not supported: upload"),
    (["--deepspeed", "ds.json"], "--deepspeed is not supported: use torchrun"),
    (["--fsdp_config", "f.json"], "--fsdp_config is not supported: use torchrun"),
    (["--do_eval"], "--do_eval is not supported: train.py always does both"),
    (["--optim", "adamw_torch"], "--optim is not supported: AdamW only"),
    (["--adam_eps", "1e-8"], "(did you mean --adam_epsilon?)"),
    (["--warmup-ratios", "0.1"], "(did you mean --warmup-ratio?)"),
    (["--lr_scheduler", "linear"], "(did you mean --lr_scheduler_type?)"),
    (["--logging_step", "5"], "(did you mean --logging_steps?)"),
    (["--resume_from_checkpoint", "true"], "--resume 'true': takes a folder or 'auto'"),
    (["--torch_dtype", "int8"], "--torch_dtype: expected one of auto, bfloat16, float16, float32, got 'int8'"),
    (["--bf16", "maybe"], "argument --bf16: invalid boolean value: 'maybe'"),
    (["--lr-scheduler-type", "cosine", "--warmup-steps", "2", "--lr-scheduler-type", "constant"],
     "--lr-scheduler-type 'constant': takes no warmup: use constant_with_warmup"),
    (["--step-separator", ""], "--step-separator '': must not be empty"),
    (["--batch-size", "-1"], "--batch-size -1: must be in [0, 16777216]"),
    (["--lr", "nan"], "--lr nan: must be finite"),
    (["--lr", "-1"], "--lr -1.0: must be finite and >= 0"),
    (["--max-steps", "0"], "--max-steps 0: must be -1"),
    (["--threshold", "1.5"], "--threshold 1.5: must be in [0, 1]"),
    (["--max-length", "-5"], "--max-length -5: must be >= 1"),
    (["--eval-fraction", "1.0"], "--eval-fraction 1.0: must be in (0, 1)"),
    (["--eval-fraction", "0"], "--eval-fraction 0.0: must be in (0, 1)"),
    (["--output-dir", ""], "--output-dir : not a writable folder"),
    (["--epochs", "1e308"], "--epochs 1e+308: must be in (0, 2147483648)"),
    (["--grad-accum", str(10 ** 20)], f"--grad-accum {10 ** 20}: must be in [1, 16777216]"),
])
def test_refused_flags_say_why_in_one_line(argv, message):
    with pytest.raises(UsageError) as e:
        parse_config(argv)
    assert e.value.code == 2 and message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("flag", ["--padding_free", "--lora_task_type"])  # TRL flags we lack, like no flag
def test_a_flag_or_key_near_no_other_gets_no_suggestion(flag, tmp_path):
    with pytest.raises(UsageError) as e:
        parse_config([flag, "1"])
    assert str(e.value) == f"unrecognized arguments: {flag} 1"
    (tmp_path / "c.yaml").write_text(f"{flag[2:]}: 1\n")
    with pytest.raises(UsageError) as e:
        parse_config(["--config", str(tmp_path / "c.yaml")])
    assert str(e.value).endswith(f"unknown key '{flag[2:]}'")


def test_a_checkpoint_folder_named_true_is_still_resumed_from(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "true").mkdir()
    assert parse_config(["--resume", "true"]).resume == "true"


def test_train_py_refuses_a_flag_in_one_line_and_exit_status_2(tmp_path):
    r = subprocess.run([sys.executable, "train.py", "--push_to_hub", "--output-dir", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: --push_to_hub is not supported") and \
        r.stderr.count("\n") == 1, r.stderr


def test_strategies_choose_the_evaluation_and_checkpoint_cadence():
    every = lambda kind, **kw: Config(**kw).resolve().every(kind, 7)
    assert every("eval", eval_every=5) == 5 and every("save", save_every=3) == 3
    assert every("eval", eval_every=5, eval_strategy="epoch") == 7
    assert every("save", save_every=3, save_strategy="no") == 0


@pytest.mark.parametrize("argv, eval_every, save_every", [
    ([], 0, 0), (["--eval_strategy", "steps"], 5, 0), (["--save_strategy", "steps"], 0, 500),
    (["--eval-steps", "3", "--save-steps", "4"], 3, 4), (["--eval_strategy", "steps", "--eval_steps", "2"], 2, 0),
    (["--eval_strategy", "epoch", "--save_strategy", "epoch"], 7, 7),
])
def test_a_strategy_steps_given_without_its_interval_follows_hf(argv, eval_every, save_every, tmp_path):
    """HF's: --eval_strategy steps without --eval_steps evaluates every logging_steps, --save_strategy steps without
    --save_steps saves every 500; given neither, evaluation only at the end and no checkpoint, as before. The saved
    config.train.json reruns the same (read by --config, or by --resume and eval.py)."""
    cfg = parse_config([*argv, "--logging_steps", "5", "--output-dir", str(tmp_path)]).resolve()
    assert (cfg.every("eval", 7), cfg.every("save", 7)) == (eval_every, save_every)
    cfg.save(tmp_path)
    assert parse_config(["--config", str(tmp_path / "config.train.json")]).resolve() == Config.load(tmp_path) == cfg


def test_eval_strategy_steps_alone_evaluates_at_every_log_step(tmp_path):
    run_train(tmp_path, max_steps=4, log_every=2, eval_strategy="steps")
    assert [r["step"] for r in read_metrics(tmp_path) if "eval_step_accuracy" in r] == [2]  # 4: the final record


def lr_shares(cfg: Config, total: int = 10) -> list:
    """The learning rate, as a share of --lr, at optimizer steps 0 to total of the run's own scheduler."""
    import torch
    from conftest import training
    make_scheduler = training().make_scheduler
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler, shares = make_scheduler(optimizer, cfg, total), []
    for _ in range(total + 1):
        shares.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return shares


def test_schedules_follow_hf_after_a_warmup():
    for name in Config.__dataclass_fields__["lr_scheduler_type"].metadata["choices"]:  # each builds a schedule
        assert len(lr_shares(Config(lr_scheduler_type=name))) == 11
    at = lambda step, **kw: lr_shares(Config(**kw))[step]
    assert [at(s, lr_scheduler_type="linear") for s in (0, 5, 10)] == [1.0, 0.5, 0.0]
    assert [at(s, lr_scheduler_type="cosine") for s in (0, 10)] == [1.0, 0.0]
    assert at(10) == pytest.approx(0.1) and at(0) == 1.0  # the default: cosine down to 10% of --lr
    with_warmup = [at(s, lr_scheduler_type="constant_with_warmup", warmup_steps=4) for s in (0, 3, 9)]
    assert with_warmup == [0.0, 0.75, 1.0]  # the first step at lr 0, as in HF
    assert [at(s, lr_scheduler_type="constant", warmup_ratio=0.0) for s in (0, 9)] == [1.0, 1.0]
    ratio = [at(s, lr_scheduler_type="linear", warmup_ratio=0.15) for s in (0, 1, 2, 3)]
    assert ratio == [0.0, 0.5, 1.0, 0.875]  # ceil(0.15 x 10) = 2 warmup steps


# the schedules as formulas of the progress p after warmup (0 to 1), as HF's docs state them
DECAY = {"linear": lambda p: 1 - p, "cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)),
         "cosine_with_min_lr": lambda p: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)),
         "constant": lambda p: 1.0, "constant_with_warmup": lambda p: 1.0}


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("warmup", [{}, {"warmup_steps": 3}, {"warmup_ratio": 0.15}])
def test_every_schedule_equals_hf_get_scheduler_at_every_step(name, warmup):
    import torch
    from transformers import TrainingArguments, get_scheduler
    if name == "constant" and warmup:  # refused: HF's constant ignores any warmup
        with pytest.raises(UsageError, match="takes no warmup: use constant_with_warmup"):
            Config(lr_scheduler_type=name, **warmup).resolve()
        return
    total, ours = 10, lr_shares(Config(lr_scheduler_type=name, **warmup))
    # transformers 5 spells a warmup ratio as a warmup_steps below 1 (its TrainingArguments needs accelerate)
    args = types.SimpleNamespace(warmup_steps=warmup.get("warmup_steps", warmup.get("warmup_ratio", 0)))
    n_warmup = TrainingArguments.get_warmup_steps(args, total)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    hf = get_scheduler(name, optimizer, num_warmup_steps=n_warmup, num_training_steps=total,
                       scheduler_specific_kwargs={"min_lr_rate": 0.1} if name == "cosine_with_min_lr" else None)
    for step in range(total):
        formula = step / n_warmup if step < n_warmup else DECAY[name]((step - n_warmup) / (total - n_warmup))
        assert ours[step] == pytest.approx(hf.get_last_lr()[0], abs=1e-12), step
        assert ours[step] == pytest.approx(formula, abs=1e-12), step
        optimizer.step()
        hf.step()


def test_a_warmup_steps_below_1_is_a_warmup_ratio_as_in_transformers_5(tmp_path):
    (tmp_path / "hf.yaml").write_text("warmup_steps: 0.1\n")
    for cfg in (parse_config(["--warmup_steps", "0.1"]), parse_config(["--config", str(tmp_path / "hf.yaml")])):
        assert (cfg.warmup_steps, cfg.warmup_ratio) == (0, 0.1)
    assert parse_config(["--warmup-steps", "3"]).warmup_steps == 3
    with pytest.raises(UsageError, match="--warmup-steps 2.5: must be a whole number"):
        parse_config(["--warmup-steps", "2.5"])


def test_the_optimizer_takes_the_betas_and_epsilon():
    import torch
    from conftest import training
    cfg = Config(adam_beta1=0.8, adam_beta2=0.999, adam_epsilon=1e-6, lr=1e-3)
    group = training().make_optimizer(torch.nn.Linear(2, 2), cfg, torch.device("cpu")).param_groups[0]
    assert (group["betas"], group["eps"]) == ((0.8, 0.999), 1e-6)


def test_a_run_follows_the_chosen_schedule(tmp_path):
    run_train(tmp_path, max_steps=4, lr_scheduler_type="linear")
    lrs = [r["lr"] for r in read_metrics(tmp_path) if "loss" in r]
    assert lrs == pytest.approx([0.75e-3, 0.5e-3, 0.25e-3, 0.0])  # each step logs the lr the next one uses


def test_an_fp16_step_skipped_for_inf_gradients_leaves_the_schedule_where_it_was(tmp_path, monkeypatch):
    """As HF's Trainer (accelerate): the optimizer step GradScaler skips is no step of the schedule either."""
    import functools
    import torch
    # the first step's loss scale overflows fp16 gradients; after its backoff the next steps update
    scaler = functools.partial(torch.amp.GradScaler, init_scale=2.0 ** 120, backoff_factor=2.0 ** -110)
    monkeypatch.setattr(torch.amp, "GradScaler", scaler)
    run_train(tmp_path, max_steps=4, lr_scheduler_type="linear", dtype="fp16")
    records = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert [r["lr"] for r in records] == pytest.approx([1e-3, 0.75e-3, 0.5e-3, 0.25e-3])  # step 1 skipped


def test_a_saved_config_with_the_old_spellings_of_auto_still_loads(tmp_path):
    """An older run's config.train.json (read by --resume, eval.py and PRMReward) spelled auto 0 or 'auto'."""
    old = {**json.loads(Config().resolve().to_json()), "dtype": "auto", "num_proc": 0, "format": "auto",
           "eval_format": "auto", "lora_alpha": 0.0}
    (tmp_path / "config.train.json").write_text(json.dumps(old))
    cfg = Config.load(str(tmp_path))
    assert (cfg.dtype, cfg.num_proc, cfg.format, cfg.eval_format, cfg.lora_alpha) == (None,) * 5
    assert cfg.resolve() == Config().resolve()
    assert parse_config(["--config", str(tmp_path / "config.train.json")]) == cfg


def test_a_saved_config_with_a_key_given_twice_is_refused(tmp_path):
    (tmp_path / "config.train.json").write_text('{"lr": 0.001, "lr": 0.002}')
    with pytest.raises(UsageError, match="config.train.json: key 'lr' given twice"):
        Config.load(str(tmp_path))
