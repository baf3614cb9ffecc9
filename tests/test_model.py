"""Loss, metrics and model behaviour on tiny random backbones."""
import math

import pytest
import torch

from prm.core.data import collate, tokenize_example
from prm.core.metrics import step_metrics
from prm.core.lora import apply_lora
from prm.loading import build_model
from prm.core.model import enable_activation_checkpointing, step_loss
from prm.readers.synthetic import make_rows


def test_loss_ignores_unlabeled_positions_and_counts_globally():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 2)
    labels = torch.full((2, 5), -100.0)
    labels[0, 2], labels[1, 4] = 1.0, 0.0
    loss, ce_sum, n_correct = step_loss(logits, labels, 2)
    other = logits.clone()
    other[labels == -100] = 50.0  # garbage where nothing is labeled
    assert torch.allclose(step_loss(other, labels, 2)[0], loss)
    expected = -(torch.log_softmax(logits[0, 2], -1)[1] + torch.log_softmax(logits[1, 4], -1)[0])
    assert torch.allclose(ce_sum, expected)
    assert torch.allclose(step_loss(logits, labels, 8)[0], expected / 8)  # divided by the GLOBAL count


def test_soft_label_loss_is_cross_entropy_against_distribution():
    logits = torch.tensor([[[0.3, -0.2]]])
    loss, _, _ = step_loss(logits, torch.tensor([[0.25]]), 1)
    logp = torch.log_softmax(logits[0, 0], -1)
    assert torch.allclose(loss, -(0.25 * logp[1] + 0.75 * logp[0]))


def test_all_unlabeled_batch_gives_zero_loss_not_nan():
    logits = torch.randn(2, 3, 2, requires_grad=True)
    loss, ce_sum, n_correct = step_loss(logits, torch.full((2, 3), -100.0), 0)
    loss.backward()
    assert loss.item() == 0.0 and not math.isnan(loss.item()) and n_correct.item() == 0
    assert torch.isfinite(logits.grad).all()


def test_step_metrics_hand_computed():
    probs = [0.9, 0.2, 0.6, 0.4, 0.7]
    labels = [1, 0, 0, 1, 1.0]
    m = step_metrics(probs, labels)  # predicted correct: 1,0,1,0,1 -> right on items 0,1,4
    assert m["step_accuracy"] == pytest.approx(3 / 5) and m["n_steps"] == 5
    assert m["positive_rate"] == pytest.approx(3 / 5)
    assert m["precision_0"] == pytest.approx(1 / 2) and m["recall_0"] == pytest.approx(1 / 2)
    assert m["precision_1"] == pytest.approx(2 / 3) and m["recall_1"] == pytest.approx(2 / 3)
    # AUROC: positives {0.9, 0.4, 0.7} vs negatives {0.2, 0.6}: 5 of 6 pairs ranked right (0.4 < 0.6)
    assert m["auroc"] == pytest.approx(5 / 6)


def _batch(tok, n=8, seed=1):
    return collate([tokenize_example(r, tok) for r in make_rows(n, seed)], tok.pad_token_id)


def test_overfits_one_small_batch(char_tok):
    model = build_model("tiny", char_tok, seed=0)
    b = _batch(char_tok)
    n = (b["labels"] != -100).sum()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(150):
        loss, _, n_correct = step_loss(model(b["input_ids"], b["attention_mask"]), b["labels"], n)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1 and n_correct.item() == n.item()


@pytest.mark.parametrize("lora", [False, True])
def test_gradient_checkpointing_gives_same_gradients(char_tok, lora):
    b = _batch(char_tok, 4)
    grads, saved = [], []
    for gc in (False, True):
        model = build_model("tiny", char_tok, seed=0)
        if lora:  # frozen base weights, trainable adapters: checkpointing must still recompute and save memory
            apply_lora(model.backbone, 4, 8.0, 0.0, "q_proj,v_proj,up_proj")
            torch.manual_seed(1)
            for name, p in model.named_parameters():
                if "lora_B" in name:  # B = 0 would give the adapters' A no gradient to compare
                    torch.nn.init.normal_(p, std=0.02)
        if gc:
            enable_activation_checkpointing(model.backbone)
        model.train()
        nbytes = [0]

        def pack(t):  # count what autograd keeps for backward: checkpointing must shrink it
            nbytes[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = model(b["input_ids"], b["attention_mask"])
        loss, _, _ = step_loss(logits, b["labels"], 10)
        loss.backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad})
        saved.append(nbytes[0])
    assert saved[1] < saved[0] / 4
    assert max((grads[0][k] - grads[1][k]).abs().max().item() for k in grads[0]) < 1e-6


def test_padding_does_not_change_scores(char_tok):
    """Right padding with a causal model: a row's logits are the same alone or next to a longer row."""
    model = build_model("tiny", char_tok, seed=0).eval()
    rows = [tokenize_example(r, char_tok) for r in make_rows(2, 5)]
    alone = collate(rows[:1], char_tok.pad_token_id)
    padded = collate([rows[0], {**rows[1], "input_ids": rows[1]["input_ids"] * 3, "labels": rows[1]["labels"] * 3}],
                     char_tok.pad_token_id)
    with torch.no_grad():
        a = model(alone["input_ids"], alone["attention_mask"])[0]
        p = model(padded["input_ids"], padded["attention_mask"])[0, : a.shape[0]]
    assert torch.allclose(a, p, atol=1e-5)


def test_a_new_head_on_a_pretrained_backbone_is_drawn_as_transformers_draws_one(tmp_path, char_tok):
    """A fresh head on a saved backbone is drawn as AutoModelForTokenClassification's (so TRL's
    PRMTrainer's): weight normal, std initializer_range, bias 0; it and the backbone learn at once."""
    from transformers import AutoModel
    from prm.core.model import PRM
    build_model("tiny", char_tok, seed=0).backbone.save_pretrained(tmp_path)
    AutoModel.from_pretrained(tmp_path)  # a plain backbone directory, as a hub model is
    torch.manual_seed(0)
    model = PRM.from_pretrained(str(tmp_path))
    std = model.config.initializer_range  # 256 draws: their std within 20% of it
    assert torch.count_nonzero(model.head.bias) == 0
    assert abs(model.head.weight.std() / std - 1) < 0.2
    row = tokenize_example(make_rows(1, seed=0)[0], char_tok, max_length=256)
    batch = collate([row], char_tok.pad_token_id)
    logits = model(batch["input_ids"], batch["attention_mask"])  # (1, T, 2)
    step_loss(logits, batch["labels"], int((batch["labels"] != -100).sum()))[0].backward()
    assert model.head.weight.grad.abs().sum() > 0
    assert model.backbone.norm.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("disable", [True, False])
def test_the_backbone_trains_without_dropout_by_default_as_in_trl(tmp_path, char_tok, disable):
    """TRL's disable_dropout (default true) zeroes every nn.Dropout of a GPT-2-style backbone (dropout 0.1); false
    keeps the model's. --lora-dropout is the adapters' own either way."""
    from transformers import GPT2Config, GPT2Model
    from prm.loading import model_for
    from prm.config import Config
    from prm.core.lora import LoRALinear
    gpt2 = GPT2Config(vocab_size=len(char_tok), n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    GPT2Model(gpt2).save_pretrained(tmp_path)
    model = model_for(Config(model=str(tmp_path), disable_dropout=disable).resolve(), char_tok).train()
    ps = {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)}
    assert len(ps) == 1 and ps == {0.0 if disable else 0.1}
    x = torch.tensor([[10, 20, 30, 40]])
    runs = [torch.manual_seed(seed) and model.backbone(x).last_hidden_state for seed in (0, 1)]
    assert torch.equal(*runs) == disable  # no dropout: train-mode forwards repeat exactly
    lora = model_for(Config(lora_r=4, lora_dropout=0.1, disable_dropout=disable).resolve(), char_tok)
    assert {m.dropout.p for m in lora.modules() if isinstance(m, LoRALinear)} == {0.1}
