"""The hand-written loop: accumulation equivalence, bf16 on CPU, the default pipeline end to end, divergence (exit 3,
nothing non-finite saved) and signals."""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import (ROOT, assert_same_run, final_weights, max_weight_diff, read_metrics,
                      run_train, step_accuracy_by_hand)
from prm.errors import PRMError


def test_grad_accumulation_matches_one_big_batch(tmp_path):
    # batches not grouped by length: micro-batches hold different label counts, so dividing each
    # by its own count instead of the whole step's shows (grouped, the counts are equal)
    run_train(tmp_path / "big", batch_size=8, grad_accum=1, group_by_length=False)
    run_train(tmp_path / "acc", batch_size=4, grad_accum=2, group_by_length=False)
    assert_same_run(tmp_path / "big", tmp_path / "acc", lr=1e-3, steps=4)  # fp32 (small_config): one sum split in 2


def test_bf16_autocast_steps_on_cpu_follow_the_fp32_steps(tmp_path):
    """From the same weights and batches, bf16 autocast only rounds (conftest's bf16 bounds;
    measured: losses 3.5e-3 relative apart, 0.34% of the weights over 10% of lr x steps apart)."""
    final = run_train(tmp_path / "bf16", dtype="bf16", max_steps=4)
    run_train(tmp_path / "fp32", dtype="fp32", max_steps=4)
    assert_same_run(tmp_path / "fp32", tmp_path / "bf16", lr=1e-3, steps=4, precision="bf16")
    by_hand = step_accuracy_by_hand(tmp_path / "bf16" / "final", tmp_path / "p.jsonl")
    assert final["step_accuracy"] == by_hand


def mlp_calls(monkeypatch) -> list:
    """Records each call of the tiny model's MLP (transformers' Qwen2MLP), in order: `grad`, the
    grad mode on entry, and `dtype`, its output's, once it returns (a recomputation in the backward
    may stop before it returns: it stops once it has what the backward needs)."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP
    calls, forward = [], Qwen2MLP.forward

    def recorded(self, x):
        call = {"grad": torch.is_grad_enabled()}
        calls.append(call)
        out = forward(self, x)
        call["dtype"] = out.dtype
        return out
    monkeypatch.setattr(Qwen2MLP, "forward", recorded)
    return calls


def test_gradient_checkpointing_recomputes_every_layer_in_the_backward_and_changes_no_loss(
        tmp_path, monkeypatch):
    calls = mlp_calls(monkeypatch)
    runs = {}
    for name, on in (("plain", False), ("gc", True)):
        calls.clear()
        run_train(tmp_path / name, max_steps=2, gradient_checkpointing=on)
        runs[name] = sum(c["grad"] for c in calls)  # training's calls: evaluation runs without grad
    with open(tmp_path / "gc" / "final" / "config.json") as f:
        layers = json.load(f)["num_hidden_layers"]
    assert runs["plain"] == 2 * layers  # 2 steps of one micro-batch (small_config)
    assert runs["gc"] == 2 * runs["plain"]  # each layer runs again in the backward
    assert_same_run(tmp_path / "plain", tmp_path / "gc", lr=1e-3, steps=2)  # fp32: the same sums


def applied_gradient(before: dict, after: dict) -> dict:
    """The gradient one AdamW step from zero moments applied, with lr = eps = 1 and no weight
    decay: it moves each weight by u = -g / (|g| + 1), so g = -u / (1 - |u|)."""
    moved = {k: after[k].double() - before[k].double() for k in before}
    return {k: -u / (1 - u.abs()) for k, u in moved.items()}


def test_the_update_applies_the_gradient_clipped_to_max_grad_norm(tmp_path, model_dir):
    from safetensors.torch import load_file
    before = load_file(os.path.join(model_dir, "model.safetensors"))  # the tiny PRM of seed 0
    one_step = dict(max_steps=1, lr=1.0, adam_epsilon=1.0, weight_decay=0.0,
                    lr_scheduler_type="constant")
    run_train(tmp_path / "clipped", max_grad_norm=0.5, **one_step)
    run_train(tmp_path / "free", max_grad_norm=0, **one_step)  # 0: no clipping
    clipped = applied_gradient(before, final_weights(tmp_path / "clipped"))
    free = applied_gradient(before, final_weights(tmp_path / "free"))
    norm = read_metrics(tmp_path / "clipped")[0]["norm"]  # before clipping
    assert norm > 10 * 0.5  # the clip bites
    free_norm = sum((g ** 2).sum() for g in free.values()).sqrt().item()
    assert free_norm == pytest.approx(norm, rel=1e-5)
    # the recovered gradients carry the fp32 rounding of the weights (half an ulp, 6e-8 at |w| ~ 1)
    # over (1 - |u|)^2: measured 6e-8 apart, against 0.04 for the largest clipped component
    assert max((clipped[k] - free[k] * 0.5 / norm).abs().max().item() for k in free) <= 1e-6


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_forward_runs_in_the_dtype_asked(tmp_path, monkeypatch, dtype):
    expected = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    calls = mlp_calls(monkeypatch)
    run_train(tmp_path, max_steps=1, dtype=dtype)
    assert {c["dtype"] for c in calls if c["grad"]} == {expected}  # training
    assert {c["dtype"] for c in calls if not c["grad"]} == {expected}  # the held-out evaluation


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_eval_py_reproduces_the_trainers_held_out_metrics(tmp_path, precision):
    """The same weights, batches and kernels in both: equal figures, in either precision (no tolerance needed)."""
    import eval as eval_cli
    final = run_train(tmp_path, dtype=precision, max_steps=3)
    again = eval_cli.main(["--model", str(tmp_path / "final")])  # the run's held-out set, batch size and dtype
    for key in ("step_accuracy", "auroc", "f1_0", "n_steps", "n_examples"):
        assert again[key] == final[key], key


def test_seeded_runs_are_deterministic(tmp_path):
    run_train(tmp_path / "a", max_steps=3, gradient_checkpointing=True)
    run_train(tmp_path / "b", max_steps=3, gradient_checkpointing=True)
    assert max_weight_diff(final_weights(tmp_path / "a"), final_weights(tmp_path / "b")) == 0.0


def test_default_pipeline_end_to_end_and_eval_agrees(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": ROOT}
    train = subprocess.run([sys.executable, "train.py", "--max-steps", "6", "--synthetic-size", "200",
                            "--output-dir", str(out), "--log-every", "2"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300)
    assert train.returncode == 0, train.stderr[-3000:]
    final = json.loads(train.stdout.strip().splitlines()[-1])
    for key in ("step_accuracy", "positive_rate", "n_steps", "train_tokens_per_second"):
        assert key in final
    assert os.path.isfile(out / "final" / "model.safetensors") and os.path.isfile(out / "final" / "tokenizer.json")
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == [2, 4, 6]
    card = (out / "final" / "README.md").read_text()
    assert f"python train.py --max-steps 6 --synthetic-size 200 --output-dir {out} --log-every 2" in card
    assert f"| step_accuracy | {final['step_accuracy']:.4f} |" in card and "arXiv:2305.20050" in card
    ev = subprocess.run([sys.executable, "eval.py", "--model", str(out / "final")], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
    assert ev.returncode == 0, ev.stderr[-3000:]
    again = json.loads(ev.stdout.strip().splitlines()[-1])
    assert again["step_accuracy"] == final["step_accuracy"] and again["n_steps"] == final["n_steps"]


def test_auto_dtype_takes_bf16_only_where_the_cpu_runs_it_natively(monkeypatch):
    import torch
    from prm.core.runtime import autocast_dtype
    cpu = torch.device("cpu")
    monkeypatch.delenv("PRM_CPU_BF16", raising=False)  # the probes' answer, not the suite's --cpu-bf16 choice
    for amx, avx512_bf16, expected in ((False, False, None), (True, False, torch.bfloat16),
                                       (False, True, torch.bfloat16)):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v, raising=False)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v, raising=False)
        assert autocast_dtype(None, cpu) == expected  # emulated bf16 (AVX2 only) is far slower than fp32
    assert autocast_dtype("bf16", cpu) == torch.bfloat16 and autocast_dtype("fp32", cpu) is None
    for forced, expected in (("1", torch.bfloat16), ("0", None)):  # PRM_CPU_BF16 overrides the probes (last: AVX512)
        monkeypatch.setenv("PRM_CPU_BF16", forced)
        assert autocast_dtype(None, cpu) == expected


def strict_records(out_dir):
    """metrics.jsonl parsed strictly: a bare NaN or Infinity fails."""
    def refuse(name):
        raise ValueError(f"non-strict JSON constant {name}")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line, parse_constant=refuse) for line in f]


def test_divergence_stops_with_status_3_and_saves_no_non_finite_weights(tmp_path, capsys):
    with pytest.raises(PRMError) as e:
        # 1e10: packed attention stays finite at the 1e3 that made the padded (masked) path overflow
        run_train(tmp_path, synthetic_size=400, batch_size=32, lr=1e10, max_steps=20, save_every=1, keep_last=1,
                  log_every=10)
    assert e.value.code == 3
    err = str(e.value)
    assert "not finite at step" in err and "Lower --lr (now 1e+10)" in err
    bad = int(err.split("not finite at step ")[1].split()[0])
    saved = [d for d in os.listdir(tmp_path) if d.startswith("checkpoint-")]
    assert all(int(d.split("-")[1]) < bad for d in saved)  # nothing saved from the first non-finite step on
    for d in saved:
        assert all(torch.isfinite(t).all() for t in load_file(str(tmp_path / d / "model.safetensors")).values())
    assert not os.path.exists(tmp_path / "final")
    strict_records(tmp_path)  # the NaN loss was written as null


def test_signals_keep_their_usual_effect_during_the_final_evaluation(tmp_path, monkeypatch):
    from conftest import training
    from prm.core.runtime import Runtime
    trainer, seen = training(), []
    real = trainer.evaluate
    monkeypatch.setattr(trainer, "evaluate", lambda run: seen.append(signal.getsignal(signal.SIGTERM)) or real(run))
    run_train(tmp_path, max_steps=2)
    assert seen == [signal.SIG_DFL]  # the trainer's flag-only handler is gone: SIGTERM stops the process at once
    preemption = trainer.Preemption(Runtime())
    preemption.signum = signal.SIGTERM  # a second signal in the loop stops at once
    with pytest.raises(PRMError) as e:
        preemption.on_signal(signal.SIGTERM, None)
    assert e.value.code == 128 + signal.SIGTERM
