"""A model directory never allows its own code: PRMReward, prm.serve, eval.py and train.py load a hostile directory
(config.train.json saying trust_remote_code, auto_maps naming a file beside the weights) without running that file,
even were transformers to ask (the answer would be yes); the user's own --trust-remote-code does run it.
Depends on: pytest, transformers, prm."""
import json
import shutil
import socketserver

import pytest

import eval as eval_cli
from prm import serve
from prm.cli import parse_config
from prm.config import Config
from prm.scoring.reward import PRMReward
from conftest import train

# importing it leaves a mark outside the directory, then fails: nothing after the import matters to these tests
EVIL = "open({marker!r}, 'w').write('ran')\nraise RuntimeError('the model directory\\'s own code ran')\n"


def edit(path, **changes):
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, **changes}))


@pytest.fixture
def hostile(model_dir, tmp_path, monkeypatch):
    """(directory, marker): model_dir's files plus everything that asks transformers to import evil.py."""
    path, marker = tmp_path / "hostile", tmp_path / "ran"
    shutil.copytree(model_dir, path)
    Config(trust_remote_code=True, synthetic_size=64, max_steps=1, batch_size=4).save(str(path))
    (path / "evil.py").write_text(EVIL.format(marker=str(marker)))
    edit(path / "config.json", auto_map={"AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel",
                                         "AutoModelForTokenClassification": "evil.EvilModel"})
    # a class of its own: the tokenizer goes through AutoTokenizer, not the generic tokenizer.json loader
    edit(path / "tokenizer_config.json", tokenizer_class="EvilTokenizer",
         auto_map={"AutoTokenizer": ["evil.EvilTokenizer", None]})
    monkeypatch.setattr("builtins.input", lambda *a: "y")  # transformers prompts when not told: say yes
    monkeypatch.setattr(socketserver.BaseServer, "serve_forever", lambda self, poll_interval=0.5: None)
    return str(path), marker


def test_the_reward_and_the_server_load_it_without_its_code(hostile):
    path, marker = hostile
    reward = PRMReward(path, device="cpu")
    assert 0 < reward(["count from 1:"], ["1+1=2\n"])[0] < 1  # the stock classes, weights loaded and working
    serve.main(["--model", path, "--port", "0", "--device", "cpu"])  # loads, binds, returns (serve_forever stubbed)
    assert not marker.exists()


def test_eval_and_train_load_it_without_its_code(hostile, tmp_path):
    path, marker = hostile
    eval_cli.main(["--model", path, "--dtype", "fp32"])  # the run's own config and held-out set
    assert not marker.exists()
    # train.py --config <the directory's config.train.json> --model <the directory>: both files say "trust"
    cfg = parse_config(["--config", f"{path}/config.train.json", "--model", path, "--dtype", "fp32",
                        "--output-dir", str(tmp_path / "run")])
    assert cfg.trust_remote_code is False
    train(cfg)
    assert not marker.exists()


def test_the_users_own_flag_does_run_it(hostile):
    path, marker = hostile
    with pytest.raises(RuntimeError, match="own code ran"):  # proves the directory is hostile: the tests above can fail
        serve.main(["--model", path, "--port", "0", "--device", "cpu", "--trust-remote-code"])
    assert marker.exists()
    with pytest.raises(ValueError, match="expected True or False"):
        PRMReward(path, trust_remote_code="false")
