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
