"""Model directories (final/, checkpoints) as transformers and peft read them."""
import json
import os

from safetensors.torch import load_file, save_file

from prm.core.lora import has_lora, merged_state_dict, peft_targets, trainable_state_dict
from prm.core.model import hf_names
from prm.errors import UsageError
from prm.files import write_lines

TRAINABLE = "trainable.safetensors"  # LoRA checkpoints: adapters + head only
# peft's adapter in its own folder: beside config.json, transformers would apply it twice
ADAPTER = "adapter"


def _save(tensors: dict, folder: str, name: str):
    os.makedirs(folder, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    save_file(tensors, os.path.join(folder, name), metadata={"format": "pt"})


def write_model_dir(path: str, model, tokenizer, cfg, trainable_only: bool = False,
                    state: dict = None):
    """Weights (LoRA merged; trainable_only: adapters and head), adapter, tokenizer and config."""
    if trainable_only:
        _save(trainable_state_dict(model), path, TRAINABLE)
    else:
        part = lambda prefix: None if state is None else {
            k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        backbone = merged_state_dict(model.backbone, part("backbone."))
        model.save_pretrained(path, backbone, part("head."))
    if has_lora(model):
        write_adapter(os.path.join(path, ADAPTER), model, cfg, state)
    tokenizer.save_pretrained(path)
    cfg.save(path)


def write_adapter(path: str, model, cfg, state: dict = None):
    """The adapters and head as peft writes them: our lora_A, lora_B, scale are peft's."""
    _, prefix, head_name = hf_names(model.config)
    tensors = {}
    for key, value in (trainable_state_dict(model) if state is None else state).items():
        if key.startswith("head."):
            tensors[f"base_model.model.{head_name}.{key.removeprefix('head.')}"] = value
        elif key.endswith((".lora_A", ".lora_B")):
            tensors[f"base_model.model.{prefix}.{key.removeprefix('backbone.')}.weight"] = value
    _save(tensors, path, "adapter_model.safetensors")
    # the fields peft leaves out take its defaults
    config = {"peft_type": "LORA", "task_type": "TOKEN_CLS", "base_model_name_or_path": cfg.model,
              "r": cfg.lora_r, "lora_alpha": cfg.lora_alpha, "lora_dropout": cfg.lora_dropout,
              "target_modules": peft_targets(model.backbone), "modules_to_save": [head_name],
              "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
              "init_lora_weights": True, "inference_mode": True}
    write_lines(os.path.join(path, "adapter_config.json"), [json.dumps(config, indent=2)])


def load_trainable(model, path: str):
    """Adapters + head into a model of the same --model and LoRA flags."""
    state, expected = load_file(path), set(trainable_state_dict(model))
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise UsageError(f"{path} does not fit this model (same --model and --lora-* flags as the "
                         f"run?): missing {missing[:3]}, unexpected {extra[:3]}")
    model.load_state_dict(state, strict=False)
