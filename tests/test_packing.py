"""Padding-free packed batches (--packing, the default) against padded ones (--no-packing): same logits, losses,
weights and evaluation; and the CUDA kernel's argument handling, checked on CPU with a reference kernel.

2 ranks with packing equal 1 process with packing in test_distributed.py, and resume with packing is bit-exact in
test_checkpoint.py: both run the default, packed (test_default_packs_the_tiny_preset pins that)."""
import copy
import inspect
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import PACKING_ROWS as ROWS, packing_rows as rows
from conftest import ROOT, assert_same_run, reference_kernel, run_train


def tiny_model(tokenizer, packing: bool, lora: bool = False, checkpointing: bool = False):
    from prm.loading import model_for
    from prm.config import Config
    from prm.core.model import enable_activation_checkpointing
    model = model_for(Config(lora_r=4 if lora else 0, lora_alpha=8.0, packing=packing), tokenizer)
    if checkpointing:
        enable_activation_checkpointing(model.backbone)
    return model


def test_pack_layout():
    from prm.core.data import IGNORE, pack
    rs = [{"input_ids": [5, 6, 7], "labels": [IGNORE, IGNORE, 1]}, {"input_ids": [8, 9], "labels": [IGNORE, 0.25]}]
    p = pack(rs, pad_id=0)
    assert p["input_ids"].tolist() == [[5, 6, 7, 8, 9]] and p["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert p["labels"].tolist() == [[IGNORE, IGNORE, 1.0, IGNORE, 0.25]]
    assert p["cu_seq_lens_q"].dtype == torch.int32 and p["cu_seq_lens_q"].tolist() == [0, 3, 5]
    assert p["max_length_q"] == p["max_length_k"] == 3
    b = pack(rs, pad_id=0, pack_to=4)
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert b["labels"][0, 5:].eq(IGNORE).all() and b["cu_seq_lens_q"].tolist() == [0, 3, 5, 8]
    assert b["max_length_q"] == 8
    exact = pack(rs + [{"input_ids": [1, 2, 3], "labels": [IGNORE] * 3}], pad_id=0, pack_to=4)
    assert exact["cu_seq_lens_q"].tolist() == [0, 3, 5, 8, 8]  # the tail slot stays, empty: same shapes every batch
    other = pack([{"input_ids": [1], "labels": [1]}, {"input_ids": [2, 3, 4, 5], "labels": [IGNORE] * 4}], 0, 64)
    again = pack([{"input_ids": [6] * 30, "labels": [0] * 30}, {"input_ids": [7] * 9, "labels": [1] * 9}], 0, 64)
    for k, v in other.items():  # what --compile specializes on: tensor shapes and the int max_length
        assert (v.shape == again[k].shape) if torch.is_tensor(v) else (v == again[k] == 64), k


@pytest.mark.parametrize("pack_to", [0, 16])
def test_packed_logits_equal_padded(char_tok, pack_to):
    from prm.core.data import collate, pack
    rs = rows(char_tok)
    padded_model, packed_model = tiny_model(char_tok, False), tiny_model(char_tok, True)
    padded_model.load_state_dict(packed_model.state_dict())
    c = collate(rs, 0)
    ref = padded_model(c["input_ids"], c["attention_mask"])  # (B, T, 2)
    p = pack(rs, 0, pack_to)
    out = packed_model(**{k: v for k, v in p.items() if k != "labels"})  # (1, N, 2)
    cu = p["cu_seq_lens_q"].tolist()
    for i, r in enumerate(rs):
        n = len(r["input_ids"])
        assert cu[i + 1] - cu[i] == n
        assert (out[0, cu[i]:cu[i + 1]] - ref[i, :n]).abs().max().item() <= 1e-5
    assert torch.equal(p["labels"][0, :cu[len(rs)]], torch.cat([c["labels"][i, :len(r["input_ids"])]
                                                                 for i, r in enumerate(rs)]))


@pytest.mark.parametrize("lora,checkpointing,precision", [(False, False, "fp32"), (False, True, "fp32"),
                                                          (True, False, "fp32"), (False, False, "bf16")])
def test_packed_training_equals_padded(tmp_path, lora, checkpointing, precision):
    # mixed widths (padding to remove); the tolerance is conftest's SAME_RUN for the precision pinned here
    extra = {"group_by_length": False, "dtype": precision, "max_steps": 5, "gradient_checkpointing": checkpointing,
             **({"lora_r": 4} if lora else {})}
    padded = run_train(tmp_path / "padded", packing=False, **extra)
    packed = run_train(tmp_path / "packed", packing=True, **extra)
    assert_same_run(tmp_path / "padded", tmp_path / "packed", lr=1e-3, steps=5, precision=precision)
    assert packed["padding_efficiency"] == 1.0 > padded["padding_efficiency"]


def test_default_packs_the_tiny_preset(tmp_path):
    from prm.config import Config
    from prm.core.varlen import is_packed
    assert Config().packing
    run_train(tmp_path, max_steps=1)
    assert json.loads((tmp_path / "config.train.json").read_text())["packing"] is True
    assert "prm_packed" not in (tmp_path / "final" / "config.json").read_text()  # a stock, portable config
    from prm.loading import build_model, set_packing
    from prm.readers.synthetic import char_tokenizer
    assert is_packed(set_packing(build_model("tiny", char_tokenizer(), 0), True))


def test_encoders_and_attention_dropout_are_not_packed(char_tok):
    from transformers import AutoModel, BertConfig, GPT2Config
    from prm.core.varlen import supports_packing
    bert = AutoModel.from_config(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                            intermediate_size=64))
    assert not supports_packing(bert)  # bidirectional: packed attention is causal only
    gpt2 = AutoModel.from_config(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2))
    assert not supports_packing(gpt2)  # attention dropout 0.1 by default
    gpt2.config.attn_pdrop = 0.0
    assert supports_packing(gpt2)
    assert supports_packing(tiny_model(char_tok, False).backbone)


# eval.py's probabilities, packed against padded, on the same weights (no training to amplify a difference): fp32
# rounds each logit to ~1e-7 relative (measured 3e-8). bf16 autocast rounds every matmul output to 8 bits (u = 2^-8)
# and the two layouts round differently; P = sigmoid(logit gap) moves by at most a quarter of the gap's change, which
# stays within a few u of the tiny model's gaps (|gap| < 1): bound u (measured 4.9e-4; 8.9e-4 on an AVX512-BF16 CPU).
# Examples that see each other in the packed row move P by 6.0e-2 (fp32) and 6.1e-2 (bf16).
@pytest.mark.parametrize("precision,tol", [("fp32", 1e-5), ("bf16", 2 ** -8)])
def test_eval_packed_equals_padded(tmp_path, model_dir, precision, tol):
    env = {**os.environ, "PYTHONPATH": ROOT}
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "completions": c, "labels": [y >= 0.5 for y in ls]}) + "\n"
                            for p, c, ls in zip(ROWS["prompt"], ROWS["completions"], ROWS["labels"])))
    probs = {}
    for flag in ("--packing", "--no-packing"):
        out = tmp_path / f"{flag}.jsonl"
        ev = subprocess.run([sys.executable, "eval.py", "--model", model_dir, "--dataset", str(data), flag,
                             "--predictions", str(out), "--eval-batch-size", "3", "--dtype", precision], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=300)
        assert ev.returncode == 0, ev.stderr[-3000:]
        probs[flag] = [p for line in out.read_text().splitlines() for p in json.loads(line)["step_probs"]]
    assert len(probs["--packing"]) == 10
    worst = max(abs(a - b) for a, b in zip(probs["--packing"], probs["--no-packing"]))
    print(f"{precision}: packed and padded P(correct) differ by at most {worst:.2e}")
    assert worst <= tol


@pytest.mark.parametrize("signature", ["2.10", "2.13"])
def test_kernel_branch_arguments(char_tok, monkeypatch, signature):
    """The CUDA branch on CPU: causal flag for the signature, grouped-query heads (tiny preset: 4 query, 2 K/V),
    int32 cumulative lengths, and the autocast dtype for the fp32 queries RoPE hands over under autocast."""
    from prm.core import varlen
    from prm.core.data import collate, pack
    calls = []
    monkeypatch.setattr(varlen, "varlen_attn", reference_kernel(signature, calls))
    monkeypatch.setattr(varlen, "KERNEL_DEVICE", "cpu")
    rs = rows(char_tok)
    padded_model, packed_model = tiny_model(char_tok, False), tiny_model(char_tok, True)
    padded_model.load_state_dict(packed_model.state_dict())
    c, p = collate(rs, 0), pack(rs, 0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = padded_model(c["input_ids"], c["attention_mask"]).float()  # (B, T, 2)
        out = packed_model(**{k: v for k, v in p.items() if k != "labels"}).float()  # (1, N, 2)
    assert calls and all(x["dtype"] == torch.bfloat16 for x in calls)
    assert all(x["heads"] == ((4, 4) if signature == "2.10" else (4, 2)) for x in calls)
    cu = p["cu_seq_lens_q"].tolist()
    worst = max((out[0, cu[i]:cu[i + 1]] - ref[i, :cu[i + 1] - cu[i]]).abs().max().item() for i in range(len(rs)))
    assert worst <= 0.05  # bf16 both ways; fp32 exactness is test_packed_logits_equal_padded's
    kw, repeat = varlen.kernel_options(reference_kernel(signature, []), 4, 2)
    assert (kw, repeat) == (({"is_causal": True}, True) if signature == "2.10"
                            else ({"window_size": (-1, 0), "enable_gqa": True}, False))


def test_installed_kernel_signature_is_understood():
    from prm.core import varlen
    if varlen.varlen_attn is None:
        pytest.skip("torch < 2.10 has no varlen_attn")
    params = inspect.signature(varlen.varlen_attn).parameters
    kw, _ = varlen.kernel_options(varlen.varlen_attn, 4, 2)
    assert set(kw) <= set(params)


def windowed_kernel(calls: list):
    """torch 2.13's varlen_attn signature with its (left, right) window: left keys before the query, its own
    not counted, as flash attention counts them; per-example SDPA under that band."""
    def kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
               window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
        left, right = window_size
        calls.append(window_size)
        assert right == 0 and left >= -1
        out, bounds = torch.empty_like(query), cu_seq_q.tolist()
        for s, e in zip(bounds, bounds[1:]):
            i = torch.arange(e - s)
            band = (i[:, None] >= i[None, :]) & ((left < 0) | (i[:, None] - i[None, :] <= left))
            out[s:e] = F.scaled_dot_product_attention(*(x[s:e].transpose(0, 1) for x in (query, key, value)),
                                                      attn_mask=band, scale=scale,
                                                      enable_gqa=enable_gqa).transpose(0, 1)
        return out
    return kernel


@pytest.mark.parametrize("path", ["fallback", "kernel 2.13", "kernel 2.10"])
def test_a_sliding_window_model_packs_examples_longer_than_its_window(char_tok, monkeypatch, path):
    """Mistral-style sliding-window attention (window 8) over examples of up to 38 tokens, one --pack-to row:
    packed logits equal padded ones in fp32 on every path (the 2.10 kernel has no window: the fallback runs)."""
    from transformers import AutoModel, MistralConfig

    from prm.core import varlen
    from prm.core.data import collate, pack
    calls = []
    if path != "fallback":
        kernel = windowed_kernel(calls) if path == "kernel 2.13" else reference_kernel("2.10", calls)
        monkeypatch.setattr(varlen, "varlen_attn", kernel)
        monkeypatch.setattr(varlen, "KERNEL_DEVICE", "cpu")
    cfg = MistralConfig(vocab_size=len(char_tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                        pad_token_id=char_tok.pad_token_id)
    torch.manual_seed(0)
    padded = AutoModel.from_config(cfg, attn_implementation="sdpa").eval()
    packed = copy.deepcopy(padded)  # its own config: the attention implementation is a config field
    varlen.use_packed_attention(packed)
    assert varlen.supports_packing(padded)
    rs = rows(char_tok)
    c, p = collate(rs, 0), pack(rs, 0, pack_to=64)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=path != "fallback"):
        ref = padded(input_ids=c["input_ids"], attention_mask=c["attention_mask"]).last_hidden_state.float()
        out = packed(input_ids=p["input_ids"], position_ids=p["position_ids"],
                     **{k: v for k, v in p.items() if k.startswith(("cu_seq", "max_length"))}).last_hidden_state
    cu = p["cu_seq_lens_q"].tolist()
    assert max(e - s for s, e in zip(cu, cu[1:])) > 8  # some example is longer than the window
    worst = max((out[0, cu[i]:cu[i + 1]].float() - ref[i, :cu[i + 1] - cu[i]]).abs().max().item()
                for i in range(len(rs)))
    assert worst <= (1e-5 if path == "fallback" else 0.05)  # bf16 both ways on the kernel paths
    assert calls == ([(7, 0)] * 2 if path == "kernel 2.13" else [])  # window 8: 7 keys before the query's own


def test_soft_capped_attention_and_attention_sinks_are_not_packed():
    """Gemma 2's logit soft-capping changes the softmax, which the packed kernels lack: such models pad."""
    from transformers import AutoModel, Gemma2Config

    from prm.core.varlen import supports_packing
    cfg = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    assert not supports_packing(AutoModel.from_config(cfg))
    cfg.attn_logit_softcapping = None
    assert supports_packing(AutoModel.from_config(cfg))
