"""Shared test helpers: offline tokenizers and a small in-process training run."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(ROOT), "shared")
sys.path.insert(0, ROOT)


@pytest.fixture(scope="session")
def char_tok():
    from prm.synthetic import char_tokenizer
    return char_tokenizer()


@pytest.fixture(scope="session")
def char_tok_no_bos():
    from prm.synthetic import char_tokenizer
    tok = char_tokenizer()
    tok.bos_token = None
    return tok


@pytest.fixture(scope="session")
def qwen2_tok():
    path = os.path.join(SHARED, "tokenizers", "qwen2")
    if not os.path.isdir(path):
        pytest.skip("../shared/tokenizers/qwen2 is absent")
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def small_config(tmp_path, **overrides):
    from prm.config import Config
    base = dict(output_dir=str(tmp_path), synthetic_size=64, max_steps=4, batch_size=4, log_every=1, dtype="fp32",
                eval_batch_size=16, lr=1e-3)
    return Config(**{**base, **overrides})


def run_train(tmp_path, **overrides):
    from prm.trainer import train
    return train(small_config(tmp_path, **overrides))


def read_metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def final_weights(out_dir):
    from safetensors.torch import load_file
    return load_file(os.path.join(out_dir, "final", "model.safetensors"))


def max_weight_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A saved tiny PRM (random weights, seed 0) with its character tokenizer: what eval.py reads."""
    from prm.build import build_model
    from prm.synthetic import char_tokenizer
    path = str(tmp_path_factory.mktemp("model"))
    tokenizer = char_tokenizer()
    build_model("tiny", tokenizer, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
