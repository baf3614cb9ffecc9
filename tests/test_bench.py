"""prm.bench: one tiny in-process run returns every documented key; the FLOPs formula and a child's flags."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from prm import bench
from prm.bench import BF16_PEAK_TFLOPS, ONCE, flops_per_token, parser, run_once
from prm.config import Config


def test_run_once_reports_every_key(tmp_path):
    a = parser().parse_args(["--steps", "2", "--batch-size", "4", "--max-length", "64", "--dtype", "fp32",
                             "--synthetic-size", "120", "--output-dir", str(tmp_path)])
    cfg = Config(**{k: v for k, v in vars(a).items() if k in Config.__dataclass_fields__})
    out = run_once(cfg)
    for k in ("tokens_per_second", "padding_efficiency", "peak_memory_mb", "static_memory_mb",
              "activation_memory_mb", "mfu", "flops_per_token", "tokenize_rows_per_second"):
        assert k in out
    assert out["steps"] == 2 and out["tokens_per_second"] > 0
    assert 0 < out["padding_efficiency"] <= 1
    assert out["peak_memory_mb"] >= out["static_memory_mb"] > 0
    assert out["memory_kind"] == "cpu_max_rss" and out["mfu"] is None  # the CPU test machine
    assert out["attention"] == "sdpa per example (packed, exact fallback)" and out["host_syncs_per_step"] is None


def test_flops_per_token_formula():
    import torch
    from transformers import AutoModel, Qwen2Config
    c = Qwen2Config(vocab_size=1000, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)
    fpt, n, everything = flops_per_token(c, [10, 30])
    with torch.device("meta"):
        total = sum(p.numel() for p in AutoModel.from_config(c).parameters())
    assert n == total - 1000 * 64 + 2 * 64 + 2 and everything == total + 2 * 64 + 2  # embedding out, 2-way head in
    assert fpt == 6 * n + 12 * 2 * 64 * (100 + 900) / 40


def test_lora_counts_4_flops_per_frozen_weight():
    from transformers import Qwen2Config
    c = Qwen2Config(vocab_size=1000, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)
    full, n, _ = flops_per_token(c, [10, 30])
    lora, *_ = flops_per_token(c, [10, 30], lora_trainable=500 + 130)  # 500 adapter weights + the 130-weight head
    assert full - lora == 2 * (n - 130) - 6 * 500


@pytest.mark.parametrize("name,peak", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                       ("NVIDIA H100 NVL", 835.0), ("NVIDIA H200", 989.0), ("NVIDIA H200 NVL", 835.0)])
def test_device_peak_by_exact_name(monkeypatch, name, peak):
    import torch
    from prm.bench import _device_peak
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert _device_peak(None, 0.0) == peak * 1e12 and "H100 PCIe" in BF16_PEAK_TFLOPS


def test_variants_side_by_side(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, "-m", "prm.bench", "--variants", "padded,packed", "--steps", "3",
                        "--batch-size", "8", "--synthetic-size", "200", "--dtype", "fp32", "--no-group-by-length"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    padded, packed = out["variants"]["padded"], out["variants"]["packed"]
    assert padded["attention"] == "sdpa (padded, with a mask)" and not padded["packing"]
    assert packed["packing"] and packed["padding_efficiency"] == 1.0 > padded["padding_efficiency"]
    assert out["tokens_per_second_vs_padded"]["padded"] == 1.0 and out["tokens_per_second_vs_padded"]["packed"] > 0


def test_a_child_runs_once_without_the_peer_or_variants():
    argv = ["--model", "m", "--repeats", "3", "--peer-python=/x/py", "--peer-script", "s.py", "--steps", "5",
            "--variants", "padded,packed"]
    a = parser().parse_args(argv + ONCE + ["--repeats", "2"])  # a variant's child repeats
    assert (a.repeats, a.variants, a.peer_python, a.peer_script, a.max_steps, a.model) == (2, "", "", "", 5, "m")


def test_a_childs_flags_win_over_underscore_spellings(monkeypatch):
    seen = []
    monkeypatch.setattr(bench, "_run", lambda cmd: seen.append(cmd[3:]) or "{}")
    bench._child(["--peer_python", "/x/py", "--peer_script=s.py", "--max_length", "8"], "--repeats", "2")
    a = parser().parse_args(seen[0])
    assert (a.repeats, a.peer_python, a.peer_script, a.max_length) == (2, "", "", 8)


def test_flops_by_hand_for_one_layer():
    """Each weight counted by hand (Qwen2: q/k/v with biases, o and the MLP without, two norms per layer and a final
    one; the 2-way head): 6 FLOPs per weight per token, 4 per frozen one under LoRA. Attention: 12 x width per pair
    of positions an example attends over, so packed examples of 3 and 5 tokens cost (9 + 25) / 8 per token, not the
    8-token row's 64 / 8."""
    from transformers import Qwen2Config
    d, inner, heads, kv, hd = 64, 128, 4, 2, 16
    c = Qwen2Config(vocab_size=100, hidden_size=d, intermediate_size=inner, num_hidden_layers=1,
                    num_attention_heads=heads, num_key_value_heads=kv)
    attn = (d * heads * hd + heads * hd) + 2 * (d * kv * hd + kv * hd) + heads * hd * d  # q, k, v (+ biases), o
    n = attn + 3 * d * inner + 2 * d + d + (2 * d + 2)  # MLP (gate, up, down), 2 layer norms + final, head
    fpt, counted, _ = flops_per_token(c, [3, 5])
    assert counted == n == 37314
    assert fpt == 6 * n + 12 * 1 * heads * hd * (9 + 25) / 8
    lora, *_ = flops_per_token(c, [3, 5], lora_trainable=1000 + 130)  # 1000 adapter weights and the head
    assert lora == 4 * (n - 130) + 6 * 1130 + 12 * heads * hd * (9 + 25) / 8


def test_the_batch_plan_the_benchmark_counts_reshuffles_each_epoch_as_the_trainer_does():
    from conftest import training
    BatchPlan = training().BatchPlan
    from prm.core.data import global_batches
    cfg = Config(batch_size=2, grad_accum=2, seed=3, group_by_length=True)
    lengths = [10 * (i + 1) for i in range(10)]  # 10 rows, global batch 4: 3 steps per epoch
    plan = BatchPlan(cfg, lengths, [1] * 10, world_size=1)
    got = [plan.batch(step)[1] for step in range(5)]
    first, second = global_batches(lengths, 4, 3, 0, True), global_batches(lengths, 4, 3, 1, True)
    assert got == first + second[:2] and all(len(b) == 4 for b in got)  # epoch 1 reshuffled, as the trainer does


def test_gpu_check_dry_run_on_cpu():
    """--gpu-check builds its config, tokenizer and data, then stops with exit 2 on a machine without CUDA; --dry-run
    runs the whole check on the CPU at a tiny shape: the gpu-marked tests (skipped here, with their reason), then the
    variants, one JSON object."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: --gpu-check would run for real")
    env = {**os.environ, "PYTHONPATH": ROOT}
    bare = subprocess.run([sys.executable, "-m", "prm.bench", "--gpu-check"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert bare.returncode == 2 and "needs CUDA" in bare.stderr and "rows" in bare.stderr, bare.stderr[-3000:]
    r = subprocess.run([sys.executable, "-m", "prm.bench", "--gpu-check", "--dry-run"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["tests"]["returncode"] == 0 and "skipped" in out["tests"]["summary"]
    assert any("needs CUDA" in s for s in out["tests"]["skipped"])
    assert set(out["variants"]) == {"padded", "packed"} and out["device"].startswith("cpu")
    assert out["variants"]["packed"]["attention"] == "sdpa per example (packed, exact fallback)"
    assert all(v["steady_tokens_per_second"] > 0 for v in out["variants"].values())
