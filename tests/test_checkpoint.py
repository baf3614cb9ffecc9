"""Exact resume, crash-safe checkpoints, SIGTERM, Hugging Face export round trip, and the scoring API."""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, final_weights, read_metrics, run_train
from prm.training.checkpoint import MARKER, resolve_resume


def losses(out):
    return {r["step"]: r["loss"] for r in read_metrics(out) if "loss" in r}


def test_resume_is_bit_identical(tmp_path):
    run_train(tmp_path / "full", max_steps=6, save_every=3, keep_last=0, dtype="bf16")
    assert os.path.isfile(tmp_path / "full" / "checkpoint-3" / MARKER)
    run_train(tmp_path / "resumed", max_steps=6, dtype="bf16", resume=str(tmp_path / "full" / "checkpoint-3"))
    full, resumed = losses(tmp_path / "full"), losses(tmp_path / "resumed")
    assert sorted(resumed) == [4, 5, 6]
    assert all(full[s] == resumed[s] for s in resumed)
    a, b = final_weights(tmp_path / "full"), final_weights(tmp_path / "resumed")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_keep_last_prunes_old_checkpoints(tmp_path):
    run_train(tmp_path, max_steps=6, save_every=2, keep_last=2)
    assert sorted(d for d in os.listdir(tmp_path) if d.startswith("checkpoint")) == ["checkpoint-4", "checkpoint-6"]


def test_half_written_checkpoint_is_ignored(tmp_path):
    run_train(tmp_path, max_steps=3, save_every=3)
    broken = tmp_path / "checkpoint-5"  # a crash between files: weights written, marker never
    broken.mkdir()
    shutil.copy(tmp_path / "checkpoint-3" / "model.safetensors", broken)
    (tmp_path / "checkpoint-6.tmp").mkdir()
    assert resolve_resume("auto", str(tmp_path)) == str(tmp_path / "checkpoint-3")
    run_train(tmp_path, max_steps=4, resume="auto")
    assert [r["step"] for r in read_metrics(tmp_path) if "loss" in r][-1] == 4


def test_sigterm_saves_a_resumable_checkpoint(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "train.py", "--synthetic-size", "200", "--max-steps", "100000", "--log-every", "1",
           "--output-dir", str(tmp_path), "--batch-size", "4"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 240
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.time() < deadline:
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 128 + signal.SIGTERM, out[-2000:]
    assert "stopped by SIGTERM" in out
    ckpt = resolve_resume("auto", str(tmp_path))
    assert ckpt is not None
    stopped = int(os.path.basename(ckpt).split("-")[1])
    run_train(tmp_path, synthetic_size=200, batch_size=4, dtype="auto", max_steps=stopped + 1, resume="auto")
    assert [r["step"] for r in read_metrics(tmp_path) if "loss" in r][-1] == stopped + 1


def test_a_stop_between_log_steps_records_the_steps_since_the_last_log_line(tmp_path, monkeypatch):
    """--log-every 3, SIGTERM while step 5 trains: the record of steps 4-5 is written before the checkpoint at 5,
    so the resume keeps it and starts its own window at 6: every step is in exactly one record."""
    from prm.training import trainer
    from prm.errors import Stopped
    real, signalled = trainer.Trainer.train_step, []

    def step_then_signal(self, batch):
        if self.step == 4 and not signalled:  # self.step: the steps done before this one
            signalled.append(signal.raise_signal(signal.SIGTERM))
        return real(self, batch)
    monkeypatch.setattr(trainer.Trainer, "train_step", step_then_signal)
    with pytest.raises(Stopped):
        run_train(tmp_path, max_steps=7, log_every=3)
    run_train(tmp_path, max_steps=7, log_every=3, resume="auto")
    records = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert [(r["step"], r.get("since_resume", False)) for r in records] == [(3, False), (5, False), (6, True),
                                                                            (7, False)]


def _tiny(family, vocab):
    from transformers import LlamaConfig, Qwen2Config
    cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[family]
    return cls(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_export_loads_as_hf_token_classifier_with_same_logits(tmp_path, family):
    from transformers import AutoModel, AutoModelForTokenClassification
    from prm.core.model import PRM, new_head
    torch.manual_seed(0)
    cfg = _tiny(family, 100)
    ours = PRM(AutoModel.from_config(cfg), new_head(cfg)).eval()
    with torch.no_grad():
        ours.head.bias.fill_(0.3)  # a non-zero bias must survive the trip too
    ours.save_pretrained(tmp_path)
    hf = AutoModelForTokenClassification.from_pretrained(tmp_path).eval()
    assert hf.config.num_labels == 2 and hf.config.id2label == {0: "incorrect", 1: "correct"}
    assert hf.config.architectures[0].endswith("ForTokenClassification")
    ids = torch.randint(1, 100, (2, 9))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ref = ours(ids, mask)
        assert (hf(input_ids=ids, attention_mask=mask).logits - ref).abs().max() <= 1e-5
        back = PRM.from_pretrained(str(tmp_path)).eval()  # and our wrapper loads it back
        assert (back(ids, mask) - ref).abs().max() <= 1e-5


def test_wrapper_loads_a_foreign_hf_token_classifier(tmp_path):
    """E.g. a checkpoint written by TRL's PRMTrainer: a plain XxxForTokenClassification with 2 labels."""
    from transformers import Qwen2ForTokenClassification
    from prm.core.model import PRM
    torch.manual_seed(1)
    cfg = _tiny("qwen2", 100)
    cfg.num_labels = 2
    theirs = Qwen2ForTokenClassification(cfg).eval()
    theirs.save_pretrained(tmp_path)
    ids = torch.randint(1, 100, (1, 7))
    with torch.no_grad():
        assert torch.allclose(PRM.from_pretrained(str(tmp_path)).eval()(ids), theirs(input_ids=ids).logits, atol=1e-6)


def test_scoring_api_equals_evaluation_probabilities(char_tok):
    from prm.training.build import build_model
    from prm.core.data import pad_token_id, tokenize_example
    from prm.core.evaluate import predict, score, score_batch
    from prm.readers.synthetic import make_rows
    model = build_model("tiny", char_tok, seed=0)
    rows = make_rows(5, 3)
    tokenized = [tokenize_example(r, char_tok, is_eval=True) for r in rows]
    seen = predict(model, tokenized, batch_size=2, pad_id=pad_token_id(char_tok), progress=False)
    scored = score_batch(model, char_tok, [(r["prompt"], r["completions"]) for r in rows])
    for probs, mine, row in zip(seen, scored, rows):
        assert len(mine) == len(row["completions"])
        assert mine == pytest.approx(probs, abs=1e-6)
    assert score(model, char_tok, rows[0]["prompt"], rows[0]["completions"]) == pytest.approx(scored[0], abs=1e-6)


def test_resume_from_an_older_checkpoint_sets_the_newer_ones_aside(tmp_path, capsys):
    run_train(tmp_path, max_steps=4, save_every=1, keep_last=0)  # checkpoints 1, 2, 3, 4
    run_train(tmp_path, max_steps=3, save_every=1, keep_last=1, resume=str(tmp_path / "checkpoint-1"))
    assert "set aside" in capsys.readouterr().err
    names = sorted(d for d in os.listdir(tmp_path) if "checkpoint" in d)
    # the new run's checkpoint-3 is kept (not the old timeline's checkpoint-4), and nothing is deleted
    assert names == ["abandoned-checkpoint-2", "abandoned-checkpoint-3", "abandoned-checkpoint-4", "checkpoint-3"]
    assert resolve_resume("auto", str(tmp_path)) == str(tmp_path / "checkpoint-3")
    assert [r["step"] for r in read_metrics(tmp_path) if "loss" in r] == [1, 2, 3]


def test_rng_state_round_trip():
    import random
    from prm.training.checkpoint import rng_state, set_rng_state
    state = rng_state()
    drawn = (random.random(), torch.rand(3))
    set_rng_state(state)
    again = (random.random(), torch.rand(3))
    assert drawn[0] == again[0] and torch.equal(drawn[1], again[1])
