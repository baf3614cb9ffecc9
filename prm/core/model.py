"""PRM: a transformers backbone + a linear 2-way head, saved as an HF token classifier; the loss."""
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel, AutoModelForTokenClassification

SETTINGS = "prm"  # config.json key of the input settings (step_separator, ...)


class NotAPRM(ValueError):
    """A checkpoint that cannot run as saved: not 2 labels, or weights missing."""


class PRM(nn.Module):
    def __init__(self, backbone, head: nn.Linear):
        super().__init__()
        self.backbone, self.head = backbone, head

    @property
    def config(self):
        return self.backbone.config

    def forward(self, input_ids, attention_mask=None, **packed):  # packed: data.pack's extras
        h = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                          **packed).last_hidden_state  # (B, T, H)
        return self.head(h)  # (B, T, 2)

    def save_pretrained(self, path: str, backbone_state: dict = None, head_state: dict = None):
        """A checkpoint AutoModelForTokenClassification loads; *_state: weights to write instead."""
        state = self.backbone.state_dict() if backbone_state is None else backbone_state
        if any(".lora_" in k or k.startswith("lora_") for k in state):  # HF would drop them
            raise ValueError("the backbone has unmerged adapters: pass "
                             "backbone_state=merged_state_dict(backbone)")
        os.makedirs(path, exist_ok=True)
        cfg = self.config
        cfg.num_labels, cfg.id2label = 2, {0: "incorrect", 1: "correct"}
        cfg.label2id = {"incorrect": 0, "correct": 1}
        arch, prefix, head_name = hf_names(cfg)
        cfg.architectures = [arch]
        out = {f"{prefix}.{k}": v for k, v in state.items()}
        head_state = head_state or self.head.state_dict()
        out.update({f"{head_name}.{k}": v for k, v in head_state.items()})
        save_file({k: v.detach().contiguous().cpu() for k, v in out.items()},
                  os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        cfg.save_pretrained(path)
        add_legacy_keys(os.path.join(path, "config.json"))

    @classmethod
    def from_pretrained(cls, name: str, trust_remote_code: bool = False, **kw) -> "PRM":
        """A 2-label token classifier (else NotAPRM), or a backbone with a fresh head."""
        cfg = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
        kw["trust_remote_code"] = trust_remote_code
        if is_classifier(cfg):
            if cfg.num_labels != 2:
                raise NotAPRM(f"{name}: a PRM needs 2 labels, this checkpoint has {cfg.num_labels}")
            hf = saved_weights(name, auto=AutoModelForTokenClassification, **kw)
            return cls(getattr(hf, hf.base_model_prefix), getattr(hf, _head_name(hf)))
        backbone = saved_weights(name, auto=AutoModel, **kw)
        return cls(backbone, new_head(backbone.config))


def saved_weights(name: str, *, auto, **kw):
    """auto.from_pretrained, or NotAPRM naming weights missing or misplaced."""
    model, info = auto.from_pretrained(name, output_loading_info=True,
                                       ignore_mismatched_sizes=True, **kw)
    bad = sorted(info["missing_keys"])
    bad += sorted(f"{k} (saved {tuple(saved)}, expected {tuple(want)})"
                  for k, saved, want in info["mismatched_keys"])
    if bad:
        raise NotAPRM(f"{name}: no saved weight of the model's shape for {', '.join(bad[:8])}"
                      f"{', ...' if len(bad) > 8 else ''}: transformers would make them up at "
                      "random")
    # another task's head (a causal LM's lm_head) is none of the model's modules: left out
    own, prefix = {n for n, _ in model.named_children()}, model.base_model_prefix + "."
    extra = sorted(k for k in info["unexpected_keys"]
                   if own & {k.split(".")[0], k.removeprefix(prefix).split(".")[0]})
    if extra:
        raise NotAPRM(f"{name}: config.json has no place for {len(extra)} saved weights, the first "
                      f"{extra[0]}: is its num_hidden_layers wrong?")
    return model


def is_classifier(config) -> bool:
    archs = getattr(config, "architectures", None) or []
    return any(a.endswith("ForTokenClassification") for a in archs)


def input_settings(config) -> dict:
    """The input settings the model was trained with ({} if not ours)."""
    return dict(getattr(config, SETTINGS, None) or {})


def add_legacy_keys(config_path: str):
    """Adds transformers 4's keys (its rope_theta default is wrong for Qwen2)."""
    with open(config_path) as f:
        d = json.load(f)
    rope = d.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:  # not per-layer-type dicts (Gemma 3)
        d.setdefault("rope_theta", rope["rope_theta"])
        if rope.get("rope_type", "default") != "default":
            d.setdefault("rope_scaling", {**{k: v for k, v in rope.items() if k != "rope_theta"},
                                          "type": rope["rope_type"]})
    if "dtype" in d:
        d.setdefault("torch_dtype", d["dtype"])
    with open(config_path, "w") as f:
        json.dump(d, f, indent=2, sort_keys=True)
        f.write("\n")


def new_head(config) -> nn.Linear:
    """A fresh head drawn as transformers draws a token classifier's (as TRL's is)."""
    head = nn.Linear(config.get_text_config().hidden_size, 2)
    nn.init.normal_(head.weight, std=getattr(config, "initializer_range", 0.02))
    nn.init.zeros_(head.bias)
    return head


def step_loss(logits, labels, n_labeled):
    """(loss, ce_sum, n_correct): cross-entropy against [1-p, p] summed over labeled steps, over
    n_labeled: those of the WHOLE optimizer step (all micro-batches and ranks)."""
    mask = labels != -100  # (B, T); labels soft in [0, 1]
    logp = F.log_softmax(logits.float(), dim=-1)  # (B, T, 2): no data-dependent shape, no host sync
    p = torch.where(mask, labels, 0.0)  # (B, T)
    ce = -(p * logp[..., 1] + (1 - p) * logp[..., 0])  # (B, T)
    ce_sum = torch.where(mask, ce, 0.0).sum()
    n_correct = (((logp[..., 1] >= logp[..., 0]) == (p >= 0.5)) & mask).sum()
    n = n_labeled.clamp(min=1) if torch.is_tensor(n_labeled) else max(n_labeled, 1)
    return ce_sum / n, ce_sum.detach(), n_correct


def enable_activation_checkpointing(backbone):
    """Non-reentrant: works under DDP and with inputs that need no grad."""
    kw = {"use_reentrant": False}
    if hasattr(backbone, "activation_checkpointing_enable"):  # transformers 5
        backbone.activation_checkpointing_enable(kw)
    else:
        backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)


def _head_name(hf) -> str:
    """The HF token classifier's output layer's name (`score`, `classifier`)."""
    for name, module in hf.named_children():
        if isinstance(module, nn.Linear) and module.out_features == hf.config.num_labels:
            return name
    raise ValueError(f"{type(hf).__name__} has no linear output layer")


def hf_names(config):
    """(HF token classifier class, backbone key prefix, head key prefix) of this config."""
    with torch.device("meta"):
        hf = AutoModelForTokenClassification.from_config(config)
    return type(hf).__name__, hf.base_model_prefix, _head_name(hf)


def load_weights(model: PRM, path: str):
    """save_pretrained's weights into an existing PRM."""
    state = load_file(os.path.join(path, "model.safetensors"))
    _, prefix, head_name = hf_names(model.config)
    for module, name in ((model.backbone, prefix + "."), (model.head, head_name + ".")):
        module.load_state_dict({k.removeprefix(name): v for k, v in state.items()
                                if k.startswith(name)})
