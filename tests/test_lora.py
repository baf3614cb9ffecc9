"""LoRA: only adapters and head train, the merged export equals the unmerged model, resume and checkpointing work."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from conftest import final_weights, read_metrics, run_train, step_accuracy_by_hand, training
from prm.training.checkpoint import TRAINABLE
from prm.core.data import collate, tokenize_example
from prm.core.lora import LoRALinear, apply_lora, count_parameters, merge, merged_state_dict
from prm.loading import build_model, model_for
from prm.config import Config
from prm.errors import UsageError
from prm.core.model import PRM, step_loss
from prm.readers.synthetic import train_eval_rows

LORA = dict(lora_r=4, lora_alpha=8.0, lora_targets="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")


def tiny_lora(char_tok, **kw):
    model = build_model("tiny", char_tok, seed=0)
    names = apply_lora(model.backbone, kw.get("r", 4), kw.get("alpha", 8.0), kw.get("dropout", 0.0),
                       kw.get("targets", LORA["lora_targets"]))
    return model, names


def batch(char_tok, n=8):
    rows = [tokenize_example(r, char_tok) for r in train_eval_rows(40, seed=1)[0][:n]]
    return collate(rows, char_tok.pad_token_id)


def test_targets_cover_attention_and_mlp_and_freeze_the_rest(char_tok):
    model, names = tiny_lora(char_tok)
    assert len(names) == 3 * 7  # 3 layers x (q, k, v, o, gate, up, down)
    assert all(isinstance(model.backbone.get_submodule(n), LoRALinear) for n in names)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"backbone.{n}.lora_{x}" for n in names for x in "AB"} | {"head.weight", "head.bias"}
    n_train, n_total = count_parameters(model)
    assert 0 < n_train < n_total
    _, only_q = tiny_lora(char_tok, targets="layers.0.*.q_proj")  # a glob on the full name
    assert only_q == ["layers.0.self_attn.q_proj"]


def test_targets_that_match_nothing_are_an_error(char_tok):
    model = build_model("tiny", char_tok, seed=0)
    with pytest.raises(ValueError, match="matches no nn.Linear layer.*q_proj"):
        apply_lora(model.backbone, 4, 8.0, 0.0, "c_attn")
    with pytest.raises(UsageError, match="--lora-targets 'c_attn' matches no nn.Linear layer.*q_proj") as e:
        model_for(Config(lora_r=4, lora_targets="c_attn").resolve(), char_tok)
    assert e.value.code == 2


def test_fresh_adapters_leave_the_model_unchanged(char_tok):
    b = batch(char_tok)
    base = build_model("tiny", char_tok, seed=0).eval()
    model, _ = tiny_lora(char_tok)
    with torch.no_grad():
        assert torch.equal(base(b["input_ids"], b["attention_mask"]), model.eval()(b["input_ids"], b["attention_mask"]))


def test_only_adapters_and_head_change(char_tok):
    model, _ = tiny_lora(char_tok)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    from prm.config import Config
    opt = training().make_optimizer(model, Config(weight_decay=0.1, lr=1e-2), torch.device("cpu"))
    b = batch(char_tok)
    for _ in range(3):
        logits = model(b["input_ids"], b["attention_mask"])  # (B, T, 2)
        loss, _, _ = step_loss(logits, b["labels"], int((b["labels"] != -100).sum()))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert changed == trainable  # every adapter and the head moved; every frozen tensor is bit-identical
    state_params = {id(p) for p in opt.state}
    assert state_params == {id(p) for p in model.parameters() if p.requires_grad}  # no Adam state for frozen ones


def test_merged_export_equals_unmerged_logits(char_tok, tmp_path):
    from transformers import AutoModelForTokenClassification
    model, _ = tiny_lora(char_tok)
    torch.manual_seed(3)
    with torch.no_grad():  # trained-looking adapters: B != 0, so merging really changes the weights
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.normal_(std=0.05)
    b = batch(char_tok)
    model.eval()
    with torch.no_grad():
        unmerged = model(b["input_ids"], b["attention_mask"])  # (B, T, 2)
        model.save_pretrained(str(tmp_path), merged_state_dict(model.backbone))
        hf = AutoModelForTokenClassification.from_pretrained(str(tmp_path)).eval()
        merged = hf(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits  # (B, T, 2)
        ours = PRM.from_pretrained(str(tmp_path)).eval()(b["input_ids"], b["attention_mask"])
    mask = b["attention_mask"].bool()
    assert not any("lora" in k for k in load_file(str(tmp_path / "model.safetensors")))
    assert (merged - unmerged)[mask].abs().max().item() <= 1e-4
    assert (ours - unmerged)[mask].abs().max().item() <= 1e-4
    base = build_model("tiny", char_tok, seed=0).eval()
    with torch.no_grad():
        assert (base(b["input_ids"], b["attention_mask"]) - unmerged)[mask].abs().max().item() > 1e-3


def test_lora_run_checkpoints_only_what_trains_and_exports_merged(char_tok, tmp_path):
    run_train(tmp_path, max_steps=4, save_every=4, **LORA)
    saved = load_file(str(tmp_path / "checkpoint-4" / TRAINABLE))
    assert not os.path.exists(tmp_path / "checkpoint-4" / "model.safetensors")
    assert set(saved) == {k for k in saved if ".lora_" in k} | {"head.weight", "head.bias"}
    assert len(saved) == 2 + 2 * 21
    # final/ is merged: W_final = W_base + scale * B A for adapted layers, untouched tensors are the base's exactly
    base_model = build_model("tiny", char_tok, seed=0)
    final = final_weights(tmp_path)
    for key, w in base_model.backbone.state_dict().items():
        out = final[f"model.{key}"]
        layer = key[:-len(".weight")]
        if f"backbone.{layer}.lora_A" in saved:  # merge the untrained W with the saved adapters: bit-equal
            lora = LoRALinear(base_model.backbone.get_submodule(layer), 4, 8.0, 0.0)
            lora.lora_A.data, lora.lora_B.data = saved[f"backbone.{layer}.lora_A"], saved[f"backbone.{layer}.lora_B"]
            merged = merge(lora.weight, lora.lora_A, lora.lora_B, lora.scale)
            assert torch.equal(out, merged) and not torch.equal(out, w), key
        else:
            assert torch.equal(out, w), key
    assert torch.equal(final["score.weight"], saved["head.weight"])


def test_lora_resume_is_exact(tmp_path):
    run_train(tmp_path / "full", max_steps=6, save_every=3, keep_last=0, dtype="bf16", **LORA)
    run_train(tmp_path / "resumed", max_steps=6, dtype="bf16", resume=str(tmp_path / "full" / "checkpoint-3"), **LORA)
    losses = lambda out: {r["step"]: r["loss"] for r in read_metrics(out) if "loss" in r}
    full, resumed = losses(tmp_path / "full"), losses(tmp_path / "resumed")
    assert sorted(resumed) == [4, 5, 6] and all(full[s] == resumed[s] for s in resumed)
    a, b = final_weights(tmp_path / "full"), final_weights(tmp_path / "resumed")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_with_other_lora_flags_is_refused(tmp_path):
    run_train(tmp_path, max_steps=2, save_every=2, **LORA)
    with pytest.raises(UsageError, match="does not fit this model"):
        run_train(tmp_path, max_steps=4, resume="auto", **{**LORA, "lora_targets": "q_proj"})


def test_lora_with_gradient_checkpointing_and_bf16(tmp_path):
    run_train(tmp_path / "plain", max_steps=3, **LORA)
    run_train(tmp_path / "gc", max_steps=3, gradient_checkpointing=True, **LORA)
    plain = [r["loss"] for r in read_metrics(tmp_path / "plain") if "loss" in r]
    gc = [r["loss"] for r in read_metrics(tmp_path / "gc") if "loss" in r]
    assert plain == pytest.approx(gc, rel=1e-6)
    final = run_train(tmp_path / "bf16", max_steps=2, save_every=2, dtype="bf16", lora_dropout=0.1,
                      **LORA)
    # the checkpoint holds the weights the run evaluated (final/ has the adapters merged)
    checkpoint = tmp_path / "bf16" / "checkpoint-2"
    assert final["step_accuracy"] == step_accuracy_by_hand(checkpoint, tmp_path / "p.jsonl")


def test_eval_py_reads_lora_and_full_checkpoints_like_final(tmp_path):
    import eval as eval_cli
    for name, extra in (("lora", LORA), ("full", {})):
        out = tmp_path / name
        run_train(out, max_steps=4, save_every=4, **extra)
        preds = {}
        for d in ("checkpoint-4", "final"):
            eval_cli.main(["--model", str(out / d), "--dtype", "fp32", "--predictions", str(out / f"{d}.jsonl")])
            preds[d] = [json.loads(line)["step_probs"] for line in open(out / f"{d}.jsonl")]
        assert len(preds["final"]) > 0
        for a, b in zip(preds["checkpoint-4"], preds["final"]):
            assert a == pytest.approx(b, abs=1e-5)


def test_a_bf16_frozen_base_halves_its_memory_trains_and_scores_without_bf16_autocast(char_tok, tmp_path):
    from prm.loading import model_for
    from prm.config import Config
    cfg = Config(lora_r=4, lora_base_dtype="bf16", dtype="bf16").resolve()
    model = model_for(cfg, char_tok)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)  # adapters and head: fp32
    fp32 = model_for(Config(lora_r=4).resolve(), char_tok)
    nbytes = lambda m: sum(p.numel() * p.element_size() for p in m.parameters() if not p.requires_grad)
    assert nbytes(model) * 2 == nbytes(fp32)
    final = run_train(tmp_path, max_steps=3, save_every=3, dtype="bf16", lora_base_dtype="bf16", **LORA)
    losses = [r["loss"] for r in read_metrics(tmp_path) if "loss" in r]
    assert len(losses) == 3 and all(0 < x < 10 for x in losses)
    by_hand = step_accuracy_by_hand(tmp_path / "checkpoint-3", tmp_path / "p.jsonl")
    assert final["step_accuracy"] == by_hand
    # scored in fp32 (eval.py --dtype fp32, PRMReward): the LoRA checkpoint's bf16 base and the merged final/
    import eval as eval_cli
    from prm.scoring.reward import PRMReward
    preds, rewards = {}, {}
    for d in ("checkpoint-3", "final"):
        out = str(tmp_path / f"{d}.jsonl")
        eval_cli.main(["--model", str(tmp_path / d), "--dtype", "fp32", "--predictions", out])
        preds[d] = [p for line in open(out) for p in json.loads(line)["step_probs"]]
        reward = PRMReward(str(tmp_path / d), device="cpu", dtype="fp32")
        rewards[d] = reward(["count from 1:"], ["1+1=2\n2+2=4\n"])
    # the same model up to final/'s merged weights, rounded to bf16 (5e-4 apart measured)
    assert len(preds["final"]) > 0 and preds["checkpoint-3"] == pytest.approx(preds["final"], abs=5e-3)
    assert rewards["checkpoint-3"] == pytest.approx(rewards["final"], abs=5e-3)
    with pytest.raises(ValueError, match="lora-base-dtype"):
        run_train(tmp_path / "fp32", max_steps=1, dtype="fp32", lora_base_dtype="bf16", **LORA)
