"""prm.bench: one tiny in-process run returns every documented key; the FLOPs formula and the flag stripping."""
from prm.bench import _strip_bench_flags, flops_per_token, parser, run_once
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


def test_flops_per_token_formula():
    import torch
    from transformers import AutoModel, Qwen2Config
    c = Qwen2Config(vocab_size=1000, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)
    fpt, n = flops_per_token(c, [10, 30])
    with torch.device("meta"):
        total = sum(p.numel() for p in AutoModel.from_config(c).parameters())
    assert n == total - 1000 * 64 + 2 * 64 + 2  # embedding out, 2-way head in
    assert fpt == 6 * n + 12 * 2 * 64 * (100 + 900) / 40


def test_strip_bench_flags():
    argv = ["--model", "m", "--repeats", "3", "--peer-python=/x/py", "--peer-script", "s.py", "--steps", "5"]
    assert _strip_bench_flags(argv) == ["--model", "m", "--steps", "5"]
