"""The model card: deterministic, names the command that made the run, describes the label convention."""
from importlib.metadata import version

from conftest import run_train, small_config
from prm.training.report import config_command, launch_command, model_card


def test_launch_command_under_python_and_torchrun():
    argv = ["train.py", "--model", "Qwen/Qwen2-0.5B", "--step-separator", "\n\n"]
    assert launch_command(argv, env={}) == "python train.py --model Qwen/Qwen2-0.5B --step-separator '\n\n'"
    env = {"LOCAL_WORLD_SIZE": "8", "WORLD_SIZE": "16"}
    assert launch_command(argv[:3], env).startswith("torchrun --nnodes 2 --nproc_per_node 8 train.py --model")


def test_config_command_lists_what_differs_from_the_defaults(tmp_path):
    cfg = small_config(tmp_path, gradient_checkpointing=True, group_by_length=False)
    cmd = config_command(cfg)
    assert cmd.startswith("python train.py ") and "--max-steps 4" in cmd and "--dtype fp32" in cmd
    assert "--gradient-checkpointing" in cmd and "--no-group-by-length" in cmd and "--model" not in cmd


def test_card_is_deterministic_and_carries_metrics_and_convention(tmp_path):
    a = run_train(tmp_path / "a", max_steps=2)
    run_train(tmp_path / "b", max_steps=2)
    card_a = (tmp_path / "a" / "final" / "README.md").read_text()
    card_b = (tmp_path / "b" / "final" / "README.md").read_text()
    assert card_a == card_b.replace(str(tmp_path / "b"), str(tmp_path / "a"))  # only the output dir differs
    assert a["train_tokens_per_second"] != 0 and "tokens_per_second" not in card_a
    assert f"| auroc | {a['auroc']:.4f} |" in card_a and f"| n_steps | {a['n_steps']} |" in card_a
    for text in ("class 1 = `correct`", "LAST token of its separator", "Step separator: `'\\n'`",
                 "Uesato", "Lightman", "full fine-tuning"):
        assert text in card_a, text


def test_card_names_base_model_and_hub_dataset(tmp_path):
    cfg = small_config(tmp_path, model="Qwen/Qwen2-0.5B", dataset="trl-lib/prm800k", lora_r=16).resolve()
    card = model_card(cfg, {"step_accuracy": 0.5, "precision_0": None}, "python train.py")
    assert "base_model: Qwen/Qwen2-0.5B" in card and "- trl-lib/prm800k" in card
    assert "LoRA (rank 16, alpha 32" in card and "| precision_0 | n/a |" in card


def test_card_has_license_versions_and_a_transformers_only_snippet(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "README.md").write_text("---\nlicense: apache-2.0\ntags: [x]\n---\n# A base model\n")
    card = model_card(small_config(tmp_path, model=str(base)).resolve(), {"step_accuracy": 0.5}, "python train.py")
    assert "\nlicense: apache-2.0\n" in card and "Base model license: apache-2.0." in card
    assert "base_model:" not in card  # the hub's base_model is a hub id, never a local folder
    assert f"torch {version('torch')}, transformers {version('transformers')}" in card
    snippet = card.split("```python\n")[1].split("```")[0]
    assert "AutoModelForTokenClassification" in snippet and "prm." not in snippet.replace('config.prm[', '')
    tiny = model_card(small_config(tmp_path).resolve(), {}, "python train.py")
    assert "license:" not in tiny.split("---")[1] and "random initialization" in tiny
    hub = model_card(small_config(tmp_path, model="no-such-org/no-such-model").resolve(), {}, "python train.py")
    assert "Base model license: unknown" in hub  # not cached here, and no network call is made
