"""Hostile model directories: each is refused with exit status 2 and one line naming the path and the cause."""
import json
import os
import shutil

import pytest

from prm.build import build_model


def test_a_sharded_index_naming_weights_outside_the_directory_is_refused(model_dir, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    os.replace(model / "model.safetensors", tmp_path / "outside.safetensors")
    from safetensors.torch import load_file
    keys = list(load_file(str(tmp_path / "outside.safetensors")))
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: "../outside.safetensors" for k in keys}}))
    with pytest.raises(SystemExit) as e:
        build_model(str(model), None, seed=0)
    assert e.value.code == 2 and "weight_map names '../outside.safetensors', not a file inside" in str(e.value)


class Payload:
    """Stands for code a pickled checkpoint would run when loaded without weights_only."""


def broken_copy(model_dir, tmp_path, kind: str) -> str:
    """A copy of the saved tiny PRM with one kind of damage."""
    path = tmp_path / kind
    shutil.copytree(model_dir, path)
    if kind == "truncated":
        weights = path / "model.safetensors"
        with open(weights, "r+b") as f:
            f.truncate(os.path.getsize(weights) // 2)
    elif kind == "pickled":  # a .bin whose pickle names a class torch.load(weights_only=True) refuses to build
        import torch
        from safetensors.torch import load_file
        weights = dict(load_file(str(path / "model.safetensors")), payload=Payload())
        os.remove(path / "model.safetensors")
        torch.save(weights, path / "pytorch_model.bin")
    elif kind == "three_labels":
        config = json.loads((path / "config.json").read_text())
        config["id2label"], config["label2id"] = {"0": "a", "1": "b", "2": "c"}, {"a": 0, "b": 1, "c": 2}
        (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("kind, message", [("truncated", "cannot load it: Error while deserializing header"),
                                           ("pickled", "cannot load it: Weights only load failed"),
                                           ("three_labels", "a PRM needs 2 labels, this checkpoint has 3")])
def test_a_damaged_model_directory_exits_2_with_path_and_cause(model_dir, tmp_path, kind, message):
    from prm.build import load_trained
    from prm.config import Config
    path = broken_copy(model_dir, tmp_path, kind)
    with pytest.raises(SystemExit) as e:
        load_trained(Config(model=path), tokenizer_given=False)
    assert e.value.code == 2 and f"--model {path}: {message}" in str(e.value)


@pytest.mark.parametrize("text, message", [("{not json", "config.train.json: cannot read it: Expecting property"),
                                           ('{"lr": "abc"}', "config.train.json: 'lr' must be float, got str 'abc'"),
                                           ('{"max_length": [1]}', "'max_length' must be int, got list [1]"),
                                           ("[1]", "expected a JSON object of settings, got list")])
def test_a_garbage_or_wrong_typed_config_train_json_exits_2_naming_file_and_field(model_dir, tmp_path, text, message):
    from prm.errors import UsageError
    from prm.reward import load_reward_model
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
    from prm.build import load_tokenizer
    path = tmp_path / "model"
    shutil.copytree(model_dir, path)
    (path / name).write_text(text)
    with pytest.raises(SystemExit) as e:
        load_tokenizer(str(path))
    assert e.value.code == 2 and f"--tokenizer {path}: " in str(e.value) and cause in str(e.value)
