"""Step-for-step parity with the trainer prm replaces, TRL 1.13.0's PRMTrainer: from the same
token-classification weights, on the same 11 rows as one batch (so data order cannot matter), with TRL
configured as prm trains, every optimizer step's loss agrees. Three rows have steps holding the separator or
their own leading/trailing whitespace: each step stays whole and verbatim. Runs in a virtual environment with
`pip install trl==1.13.0 pytest pyyaml`; skips where trl is not importable or ../shared/tokenizers/qwen2
is absent."""
import json
import os

import pytest
import torch

from conftest import ROOT, SHARED

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
pytest.importorskip("trl", reason="trl is not installed (the parity test runs in a venv with trl==1.13.0)")
QWEN2 = os.path.join(SHARED, "tokenizers", "qwen2")
pytestmark = pytest.mark.skipif(not os.path.isdir(QWEN2), reason="../shared/tokenizers/qwen2 is absent")
STEPS, LR = 12, 1e-3
INNER = [  # "\n" (the separator) inside steps; spaces and blank lines around them
    {"prompt": "Solve 2+3*4.", "completions": ["3*4 = 12.\nThen add 2.", "  2+12 = 14.\n\n",
                                               " The answer is 14. "], "labels": [True, True, True]},
    {"prompt": "Is 91 prime?", "completions": ["91 = 7*13.\n", "\nSo 91 is prime."], "labels": [True, False]},
    {"prompt": "Sort 3,1,2.", "completions": ["Compare:\n3 > 1\n1 < 2", "1, 2, 3 "],
     "labels": [False, True]}]
ROWS = 8 + len(INNER)  # the fixture's first 8 rows, then INNER: one batch


def write_inputs(tmp_path) -> tuple:
    """(model directory: a tiny random Qwen2ForTokenClassification and the Qwen2 tokenizer; the rows)."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForTokenClassification
    tok = AutoTokenizer.from_pretrained(QWEN2)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, num_labels=2, classifier_dropout=0.0,
                      attention_dropout=0.0, pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model_dir, data = str(tmp_path / "model"), str(tmp_path / "rows.jsonl")
    Qwen2ForTokenClassification(cfg).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    with open(os.path.join(ROOT, "tests", "fixtures", "stepwise_train.jsonl")) as f:
        rows = f.readlines()[:ROWS - len(INNER)]
    with open(data, "w") as f:
        f.writelines(rows + [json.dumps(r) + "\n" for r in INNER])
    return model_dir, data


def trl_losses(model_dir: str, data: str, out: str, warmup: int) -> list:
    """Each optimizer step's loss as PRMTrainer computes it, unrounded (its log keeps 4 digits)."""
    from datasets import load_dataset
    from transformers import AutoModelForTokenClassification, AutoTokenizer
    from trl.experimental.prm import PRMConfig, PRMTrainer
    losses = []

    class Recording(PRMTrainer):
        def compute_loss(self, model, inputs, *args, **kw):
            loss = super().compute_loss(model, inputs, *args, **kw)
            losses.append(loss.item())
            return loss

    args = PRMConfig(output_dir=out, max_steps=STEPS, per_device_train_batch_size=ROWS,
                     gradient_accumulation_steps=1, learning_rate=LR, weight_decay=0.0, adam_beta2=0.95,
                     lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1},
                     warmup_steps=warmup, max_grad_norm=1.0, bf16=False, fp16=False, gradient_checkpointing=False,
                     seed=0, use_cpu=True, report_to="none", save_strategy="no", logging_steps=1,
                     dataloader_num_workers=0, disable_tqdm=True)
    model = AutoModelForTokenClassification.from_pretrained(model_dir, dtype=torch.float32)
    trainer = Recording(model=model, args=args, processing_class=AutoTokenizer.from_pretrained(model_dir),
                        train_dataset=load_dataset("json", data_files=data, split="train"))
    trainer.train()
    return losses


def prm_losses(model_dir: str, data: str, out: str, warmup: int) -> list:
    """Each optimizer step's loss from prm's metrics.jsonl (a record every step)."""
    from prm.config import Config
    from conftest import train
    train(Config(model=model_dir, dataset=data, eval_dataset=data, output_dir=out, max_steps=STEPS,
                 batch_size=ROWS, grad_accum=1, lr=LR, weight_decay=0.0, warmup_steps=warmup, max_grad_norm=1.0,
                 dtype="fp32", packing=False, seed=0, log_every=1))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r["loss"] for r in map(json.loads, f) if "loss" in r]


@pytest.mark.parametrize("warmup", [0, 3])  # with warmup: HF's linear ramp from 0, step for step
def test_losses_equal_trl_prm_trainer(tmp_path, warmup):
    model_dir, data = write_inputs(tmp_path)
    theirs = trl_losses(model_dir, data, str(tmp_path / "trl"), warmup)
    ours = prm_losses(model_dir, data, str(tmp_path / "prm"), warmup)
    assert len(ours) == len(theirs) == STEPS
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs))
    print(f"\nTRL PRMTrainer parity over {STEPS} steps, warmup {warmup}: losses {theirs[0]:.6f} -> "
          f"{theirs[-1]:.6f}, worst relative difference {worst:.2g}")
    assert worst < 1e-5, list(zip(ours, theirs))
