"""Hostile model directories: each is refused with exit status 2 and one line naming the path and the cause."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import ROOT
from prm.loading import build_model
from prm.errors import UsageError


def test_a_sharded_index_naming_weights_outside_the_directory_is_refused(model_dir, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    os.replace(model / "model.safetensors", tmp_path / "outside.safetensors")
    from safetensors.torch import load_file
    keys = list(load_file(str(tmp_path / "outside.safetensors")))
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: "../outside.safetensors" for k in keys}}))
    with pytest.raises(UsageError) as e:
        build_model(str(model), None, seed=0)
    assert e.value.code == 2 and "weight_map names '../outside.safetensors', not a file inside" in str(e.value)


@pytest.mark.parametrize("path", ["/no/such/final", "./runs/none/final", "runs/none/final", "~/none"])
def test_a_model_path_that_does_not_exist_is_no_such_folder_not_a_bad_repo_id(path):
    from prm.loading import load_trained
    from prm.config import Config
    with pytest.raises(UsageError) as e:
        load_trained(Config(model=path), tokenizer_given=False)
    assert e.value.code == 2 and str(e.value) == f"--model {path}: no such folder"


class Payload:
    """Stands for code a pickled checkpoint would run when loaded without weights_only."""


HEADS = {"no_head": {}, "no_mlp": {}, "head_3xH": {"score.weight": torch.zeros(3, 128), "score.bias": torch.zeros(3)},
         "head_2xH/2": {"score.weight": torch.zeros(2, 64), "score.bias": torch.zeros(2)}}
MADE_UP = "no saved weight of the model's shape for "
CUT = "config.json has no place for 12 saved weights, the first " \
      "model.layers.2.input_layernorm.weight: is its num_hidden_layers wrong?"
LAYERS = "cannot load it: `num_hidden_layers` (2) must be equal to the number of `layer_types` (3)"


def broken_copy(model_dir, tmp_path, kind: str) -> str:
    """A copy of the saved tiny PRM with one kind of damage."""
    path = tmp_path / kind.replace("/", "")
    shutil.copytree(model_dir, path)
    if kind == "truncated":
        weights = path / "model.safetensors"
        with open(weights, "r+b") as f:
            f.truncate(os.path.getsize(weights) // 2)
    elif kind == "pickled":  # a .bin whose pickle names a class torch.load(weights_only=True) refuses to build
        weights = dict(load_file(str(path / "model.safetensors")), payload=Payload())
        os.remove(path / "model.safetensors")
        torch.save(weights, path / "pytorch_model.bin")
    elif kind in HEADS:  # the head's tensors removed or reshaped (128: the tiny model's width), or a layer's MLP
        state = {k: v for k, v in load_file(str(path / "model.safetensors")).items()
                 if not k.startswith("score." if kind != "no_mlp" else "model.layers.1.mlp.")}
        save_file({**state, **HEADS[kind]}, str(path / "model.safetensors"), metadata={"format": "pt"})
    elif kind == "no_pad_nor_eos":
        config = json.loads((path / "tokenizer_config.json").read_text())
        (path / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items()
                                                                if k not in ("pad_token", "eos_token")}))
    elif kind == "three_labels":
        config = json.loads((path / "config.json").read_text())
        config["id2label"], config["label2id"] = {"0": "a", "1": "b", "2": "c"}, {"a": 0, "b": 1, "c": 2}
        (path / "config.json").write_text(json.dumps(config))
    elif kind in ("one_layer_less", "layer_types_disagree"):  # the weights hold 3 layers
        config = json.loads((path / "config.json").read_text())
        config["num_hidden_layers"] = 2  # and layer_types too with one_layer_less
        config["layer_types"] = config["layer_types"][:2 if kind == "one_layer_less" else 3]
        (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("kind, message", [("truncated", "cannot load it: Error while deserializing header"),
                                           ("pickled", "cannot load it: Weights only load failed"),
                                           ("three_labels", "a PRM needs 2 labels, this checkpoint has 3"),
                                           ("head_3xH", MADE_UP + "score.bias (saved (3,), expected (2,)), "
                                                                  "score.weight (saved (3, 128), expected (2, 128))"),
                                           ("head_2xH/2", MADE_UP + "score.weight (saved (2, 64), expected (2, 128))"),
                                           ("no_mlp", MADE_UP + "model.layers.1.mlp.down_proj.weight, "
                                                                "model.layers.1.mlp.gate_proj.weight, ")])
def test_a_damaged_model_directory_exits_2_with_path_and_cause(model_dir, tmp_path, kind, message):
    from prm.loading import load_trained
    from prm.config import Config
    path = broken_copy(model_dir, tmp_path, kind)
    with pytest.raises(UsageError) as e:
        load_trained(Config(model=path), tokenizer_given=False)
    assert e.value.code == 2 and f"--model {path}: {message}" in str(e.value)


@pytest.mark.parametrize("kind, message", [("no_head", MADE_UP + "score.bias, score.weight: transformers would "
                                                                   "make them up at random"),
                                           ("no_pad_nor_eos",
                                            "the tokenizer has neither a pad nor an EOS token"),
                                           ("one_layer_less", CUT),
                                           ("layer_types_disagree", LAYERS)])
def test_eval_py_and_prm_reward_refuse_a_model_they_would_score_at_random(model_dir, tmp_path, kind, message):
    from prm.scoring.reward import PRMReward
    path = broken_copy(model_dir, tmp_path, kind)
    r = subprocess.run([sys.executable, "eval.py", "--model", path], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2 and f"error: --model {path}: {message}" in r.stderr and "Traceback" not in r.stderr
    with pytest.raises(UsageError, match=message.split(":")[0]):
        PRMReward(path, device="cpu")


def test_a_backbone_with_fewer_layers_in_its_config_than_in_its_weights_is_refused(tmp_path):
    """Another task's head (a causal LM's lm_head) is left out; a layer dropped is refused."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from prm.core.model import PRM, NotAPRM
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    assert isinstance(PRM.from_pretrained(str(tmp_path)), PRM)
    config.num_hidden_layers, config.layer_types = 2, config.layer_types[:2]
    config.save_pretrained(tmp_path)
    with pytest.raises(NotAPRM) as e:
        PRM.from_pretrained(str(tmp_path))
    assert str(e.value) == f"{tmp_path}: {CUT}"


@pytest.mark.parametrize("kind", ["no_head", "head_2xH/2", "three_labels"])
def test_prm_from_pretrained_never_scores_with_made_up_weights(model_dir, tmp_path, kind):
    from prm.core.model import PRM, NotAPRM
    path = broken_copy(model_dir, tmp_path, kind)
    with pytest.raises(NotAPRM) as e:  # the README's Score snippet loads this way, without prm.loading's checks
        PRM.from_pretrained(path)
    said = str(e.value)
    assert said.startswith(f"{path}: ") and ("no saved weight" in said or "2 labels" in said)
    assert isinstance(PRM.from_pretrained(model_dir), PRM)


@pytest.mark.parametrize("text, message", [("{not json", "config.train.json: Expecting property"),
                                           ('{"lr": "abc"}', "config.train.json: 'lr' must be float, got 'abc'"),
                                           ('{"max_length": [1]}', "'max_length' must be int, got [1]"),
                                           ("[1]", "expected a mapping, got list")])
def test_a_garbage_or_wrong_typed_config_train_json_exits_2_naming_file_and_field(model_dir, tmp_path, text, message):
    from prm.errors import UsageError
    from prm.scoring.reward import load_reward_model
    path = tmp_path / "run"
    shutil.copytree(model_dir, path)
    (path / "config.train.json").write_text(text)
    with pytest.raises(UsageError) as e:
        load_reward_model(str(path))  # the PRMReward route; eval.py and --resume read it with the same Config.load
    assert e.value.code == 2 and f"{path / 'config.train.json'}" in str(e.value) and message in str(e.value)


@pytest.mark.parametrize("name, text, cause", [("tokenizer.json", "{garbage", "Expecting property name"),
                                               ("tokenizer.json", "{}", "KeyError: 'added_tokens'"),
                                               ("tokenizer_config.json", "{garbage", "JSONDecodeError"),
                                               ("tokenizer_config.json", "[1]", "AttributeError")])
def test_garbage_tokenizer_files_exit_2_naming_the_directory_and_cause(model_dir, tmp_path, name, text, cause):
    from prm.loading import load_tokenizer
    path = tmp_path / "model"
    shutil.copytree(model_dir, path)
    (path / name).write_text(text)
    with pytest.raises(UsageError) as e:
        load_tokenizer(str(path))
    assert e.value.code == 2 and f"--tokenizer {path}: " in str(e.value) and cause in str(e.value)


def test_every_tokenizer_load_refuses_one_with_neither_pad_nor_eos(model_dir, tmp_path):
    from prm.loading import load_tokenizer
    path = broken_copy(model_dir, tmp_path, "no_pad_nor_eos")
    for flag in ("--tokenizer", "--policy"):  # training, published-PRM scorers and prm.label load through it
        with pytest.raises(UsageError) as e:
            load_tokenizer(path, False, flag)
        assert str(e.value).startswith(f"{flag} {path}: the tokenizer has neither a pad nor an EOS token")


def test_scorer_auto_reads_the_config_of_a_hub_name_too(monkeypatch):
    import prm.scoring.scorers as scorers

    class Hub:
        @staticmethod
        def from_pretrained(name, **kw):
            if name != "Qwen/Qwen2.5-Math-PRM-7B":
                raise OSError(f"{name} is not a local folder nor a hub model")
            return type("Config", (), {"architectures": ["Qwen2ForProcessRewardModel"]})()
    monkeypatch.setattr(scorers, "AutoConfig", Hub)
    assert scorers.detect("Qwen/Qwen2.5-Math-PRM-7B", "auto") == "qwen-prm"
    assert scorers.detect("someone/a-classifier", "auto") == "classifier"
    assert scorers.detect("Qwen/Qwen2.5-Math-PRM-7B", "step-tag") == "step-tag"


def test_training_from_a_backbone_says_once_that_the_head_is_new_and_a_resume_does_not(tmp_path, capsys):
    from transformers import AutoModel

    from conftest import run_train
    from prm.loading import tiny_config
    from prm.readers.synthetic import char_tokenizer
    tokenizer, base = char_tokenizer(), tmp_path / "backbone"
    AutoModel.from_config(tiny_config(tokenizer)).save_pretrained(base)
    tokenizer.save_pretrained(base)
    note = f"--model {base}: a backbone: the PRM head is new"
    run_train(tmp_path / "run", model=str(base), max_steps=2, save_every=1)
    assert capsys.readouterr().out.count(note) == 1
    run_train(tmp_path / "resumed", model=str(base), max_steps=2, resume=str(tmp_path / "run" / "checkpoint-1"))
    assert note not in capsys.readouterr().out


def test_a_backbone_without_a_token_classifier_class_is_refused_before_any_data_loads(tmp_path, monkeypatch):
    """OLMo loads with AutoModel but has no *ForTokenClassification, the form final/ is saved in: refused at
    start-up, not after training, at the first save."""
    from transformers import AutoModel, OlmoConfig

    from conftest import run_train, training
    from prm.readers.synthetic import char_tokenizer
    tokenizer, base = char_tokenizer(), tmp_path / "olmo"
    config = OlmoConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, pad_token_id=tokenizer.pad_token_id)
    AutoModel.from_config(config).save_pretrained(base)
    tokenizer.save_pretrained(base)
    monkeypatch.setattr(training(), "load_splits", lambda *a: pytest.fail("the data was loaded"))
    with pytest.raises(UsageError, match=f"--model {base}: model type 'olmo' has no transformers token classifier"
                       ) as e:
        run_train(tmp_path / "run", model=str(base))
    assert e.value.code == 2 and not os.path.exists(tmp_path / "run")


@pytest.mark.parametrize("head, made_up", [(None, "lm_head.weight"),
                                           (torch.zeros(3, 128), "lm_head.weight (saved (3, 128), expected (")])
def test_an_lm_scorer_refuses_a_model_whose_lm_head_it_would_make_up(model_dir, tmp_path, head, made_up):
    """step-tag (and chat-turns, prm.serve, PRMReward: one loader) on a train.py classifier, which saves no LM
    head, or on one saved with an LM head of another shape: refused, never scored with a random head."""
    from prm.config import Config
    from prm.scoring import ScorerOptions
    from prm.scoring.scorers import load
    path = shutil.copytree(model_dir, tmp_path / "model")
    if head is not None:
        state = load_file(str(path / "model.safetensors"))
        save_file({**state, "lm_head.weight": head}, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UsageError) as e:
        load(Config(model=str(path)), False, ScorerOptions(scorer="step-tag", step_tag="="))
    assert e.value.code == 2 and f"--model {path}: {MADE_UP}{made_up}" in str(e.value)
