"""Shared test helpers: offline tokenizers and a small in-process training run."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(ROOT), "shared")
sys.path.insert(0, ROOT)


def pytest_addoption(parser):
    parser.addoption("--cpu-bf16", choices=["probe", "yes", "no"], default="probe",
                     help="what prm.core.runtime.cpu_has_bf16 answers (so --dtype auto), here and in the runs the tests "
                          "launch: run the suite as a bf16-native CPU (yes) or an AVX2-only one (no) sees it")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA (skipped without it); run by python -m prm.bench --gpu-check")
    answer = config.getoption("--cpu-bf16")
    if answer != "probe":  # an environment variable, so that train.py / eval.py subprocesses see it too
        os.environ["PRM_CPU_BF16"] = "1" if answer == "yes" else "0"


@pytest.fixture(scope="session")
def char_tok():
    from prm.readers.synthetic import char_tokenizer
    return char_tokenizer()


@pytest.fixture(scope="session")
def char_tok_no_bos():
    from prm.readers.synthetic import char_tokenizer
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
    # 63 synthetic rows: 58 train (not a multiple of the batch) + 5 held out (25 steps)
    base = dict(output_dir=str(tmp_path), synthetic_size=63, max_steps=4, batch_size=4, log_every=1, dtype="fp32",
                eval_batch_size=16, lr=1e-3)
    return Config(**{**base, **overrides})


def training():
    """train.py, the training program (a script beside the package; ROOT is on sys.path): the one
    place tests import it. Tests patch its seams there: train_step, evaluate, BatchPlan."""
    import train as program
    return program


def train(cfg):
    """The training loop in-process on a Config: the one place tests start training from."""
    return training().train(cfg)


def run_train(tmp_path, **overrides):
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


def losses(out_dir) -> list:
    return [r["loss"] for r in read_metrics(out_dir) if "loss" in r]


# How far apart two runs of one computation may end when only the summation order differs (2 ranks against 1:
# gloo's all-reduce against one process's sum; packed against padded reductions; another CPU's kernels).
# AdamW moves a weight by about lr per step (the gradient over its running RMS), so lr x steps bounds any movement,
# and a weight whose gradient is ~0 may move that far either way on rounding noise alone: no bound on the largest
# difference holds on every CPU (fp32 at lr 1e-3: 1.0e-5 here, 2.4e-5 on an AVX512-BF16 CPU). So we bound the SHARE
# of weights whose two copies differ by more than `moved` x lr x steps, and the relative loss difference:
# - fp32: gradients agree to ~1e-6 relative, so nearly every weight agrees to ~1e-6 of its movement; 1e-4 of them may
#   differ by over 1% (measured: none of 0.75M). Losses are fp32 sums: a few ulps apart (<= 7e-7 measured), bound 1e-5.
# - bf16 autocast rounds every matmul output to 8 bits (u = 2^-8): gradients agree to ~1e-2 only; 1% of the weights
#   may differ by over 10% (measured: 0.17% packed against padded, 0.007% 2 ranks against 1), losses by 2u (<= 1.3e-3).
# Breaking what these tests guard lands far outside (fp32, 5 steps at lr 1e-3): each rank or
# micro-batch dividing by its own label count moves 43-54% of the weights by over 1% (losses
# 0.9-1.7e-2 apart) where batches are not grouped by length (grouped, each holds as many labels and
# the bug is invisible: 1e-7); packed examples that see each other, 86% (6e-2).
SAME_RUN = {"fp32": dict(moved=1e-2, share=1e-4, loss_rtol=1e-5), "bf16": dict(moved=0.1, share=1e-2, loss_rtol=2 ** -7)}


def weight_share_apart(wa: dict, wb: dict, *, lr: float, steps: int, precision: str = "fp32") -> float:
    """The share of weights (two state dicts) apart by more than SAME_RUN's `moved` x lr x steps."""
    assert wa.keys() == wb.keys()
    limit = SAME_RUN[precision]["moved"] * lr * steps
    over = sum(int(((wa[k].float() - wb[k].float()).abs() > limit).sum()) for k in wa)
    return over / sum(v.numel() for v in wa.values())


def assert_same_weights(wa: dict, wb: dict, *, lr: float, steps: int, precision: str = "fp32"):
    share = weight_share_apart(wa, wb, lr=lr, steps=steps, precision=precision)
    print(f"{precision}: weights apart by over {SAME_RUN[precision]['moved']} x lr x steps: {share:.2e} of them")
    assert share <= SAME_RUN[precision]["share"]


def assert_same_run(a, b, *, lr: float, steps: int, precision: str = "fp32"):
    """Runs a and b (output directories) logged the same losses and ended with the same weights, within SAME_RUN."""
    la, lb = losses(a), losses(b)
    assert len(la) == len(lb) == steps
    worst = max(abs(x - y) / abs(x) for x, y in zip(la, lb))
    print(f"{precision}: max relative loss difference {worst:.2e}")
    assert worst <= SAME_RUN[precision]["loss_rtol"]
    assert_same_weights(final_weights(a), final_weights(b), lr=lr, steps=steps, precision=precision)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A saved tiny PRM (random weights, seed 0) with its character tokenizer: what eval.py reads."""
    from prm.loading import build_model
    from prm.readers.synthetic import char_tokenizer
    path = str(tmp_path_factory.mktemp("model"))
    tokenizer = char_tokenizer()
    build_model("tiny", tokenizer, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
