"""LoRA runs also write their adapter in peft's format (checkpoint-N/adapter, final/adapter): the files, the key
names peft uses, the same weights as the merged export; with peft installed, peft loads it onto the base model."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from conftest import final_weights, run_train
from prm.loading import build_model
from prm.training.checkpoint import ADAPTER
from prm.config import Config
from prm.core.lora import apply_lora, peft_targets

LORA = dict(lora_r=4, lora_alpha=8.0, lora_dropout=0.1, lora_targets="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,"
                                                                      "down_proj")
# what peft 0.21.2's save_pretrained wrote for the tiny Qwen2 token classifier with these 7 targets, r=4 and
# modules_to_save=["score"]: lora_A (4, in), lora_B (out, 4), the head under its own name
PEFT_KEYS = {f"base_model.model.model.layers.{i}.{block}.{proj}.lora_{x}.weight" for i in range(3)
             for block, projs in (("self_attn", "q_proj k_proj v_proj o_proj"), ("mlp", "gate_proj up_proj down_proj"))
             for proj in projs.split() for x in "AB"} | {"base_model.model.score.weight", "base_model.model.score.bias"}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora")
    run_train(out, max_steps=4, save_every=4, **LORA)
    return out


def test_lora_checkpoint_and_final_hold_a_peft_adapter(lora_run, char_tok):
    adapter = lora_run / "final" / ADAPTER
    with open(adapter / "adapter_config.json") as f:
        config = json.load(f)
    assert {k: config[k] for k in ("peft_type", "task_type", "base_model_name_or_path", "r", "lora_alpha",
                                   "lora_dropout", "modules_to_save", "bias", "fan_in_fan_out", "use_rslora")} == \
        dict(peft_type="LORA", task_type="TOKEN_CLS", base_model_name_or_path="tiny", r=4, lora_alpha=8.0,
             lora_dropout=0.1, modules_to_save=["score"], bias="none", fan_in_fan_out=False, use_rslora=False)
    assert sorted(config["target_modules"]) == sorted(LORA["lora_targets"].split(","))
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    assert set(tensors) == PEFT_KEYS
    saved = load_file(str(lora_run / "checkpoint-4" / ADAPTER / "adapter_model.safetensors"))  # the same step
    assert saved.keys() == tensors.keys() and all(torch.equal(saved[k], tensors[k]) for k in saved)
    assert os.path.isfile(lora_run / "checkpoint-4" / ADAPTER / "adapter_config.json")
    # by hand, W + alpha / r x B A on the untrained base and the head replaced: the merged final/
    base = build_model("tiny", char_tok, seed=Config().seed).backbone.state_dict()
    final = final_weights(lora_run)
    for key, w in base.items():
        a = tensors.get(f"base_model.model.model.{key[:-len('weight')]}lora_A.weight")
        expected = w if a is None else w + 8.0 / 4 * tensors[f"base_model.model.model.{key[:-len('weight')]}"
                                                               f"lora_B.weight"] @ a
        assert (final[f"model.{key}"] - expected).abs().max().item() <= 1e-6, key
    assert all(torch.equal(final[f"score.{k}"], tensors[f"base_model.model.score.{k}"]) for k in ("weight", "bias"))
    # final/ itself stays a plain token classifier: no adapter files beside its config.json
    from transformers import AutoModelForTokenClassification
    hf = AutoModelForTokenClassification.from_pretrained(str(lora_run / "final"))
    assert not os.path.exists(lora_run / "final" / "adapter_config.json")
    assert all(torch.equal(v, final[k]) for k, v in hf.state_dict().items())


def test_peft_targets_are_short_names_only_when_exact(char_tok):
    backbone = build_model("tiny", char_tok, seed=0).backbone
    apply_lora(backbone, 4, 8.0, 0.0, "q_proj,layers.1.mlp.*")  # layers 0 and 2 keep their plain MLP
    assert peft_targets(backbone) == sorted([f"layers.{i}.self_attn.q_proj" for i in range(3)] +
                                            [f"layers.1.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")])


@pytest.mark.parametrize("targets", [LORA["lora_targets"], "q_proj,layers.1.mlp.*"])
def test_peft_loads_the_adapter_onto_the_base_as_the_merged_model(targets, char_tok, tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForTokenClassification
    run_train(tmp_path, max_steps=3, **{**LORA, "lora_targets": targets})
    build_model("tiny", char_tok, seed=Config().seed).save_pretrained(str(tmp_path / "base"))  # what --model tiny is
    base = AutoModelForTokenClassification.from_pretrained(str(tmp_path / "base"))
    adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "final" / ADAPTER)).eval()
    ours = load_file(str(tmp_path / "final" / ADAPTER / "adapter_model.safetensors"))
    assert set(peft.get_peft_model_state_dict(adapted)) == set(ours)  # every tensor found its place, none missing
    merged = AutoModelForTokenClassification.from_pretrained(str(tmp_path / "final")).eval()
    assert not getattr(merged, "_hf_peft_config_loaded", False)  # with peft installed too, final/ is what loads
    ids = torch.randint(0, len(char_tok), (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (adapted(input_ids=ids).logits - merged(input_ids=ids).logits).abs().max().item()
    assert diff <= 1e-5
