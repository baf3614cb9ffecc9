"""Training checkpoints (atomic, exact resume), the final export, and finding the newest complete checkpoint.
Depends on: torch, safetensors, prm.model, prm.lora."""
import json
import os
import random
import re
import shutil

import torch
from safetensors.torch import load_file, save_file

from prm.lora import has_lora, merged_state_dict, trainable_state_dict
from prm.model import load_weights

MARKER = "complete.json"  # written last: a directory without it is a crashed save and is never resumed
TRAINABLE = "trainable.safetensors"  # LoRA checkpoints: adapters + head only


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict):
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_model_dir(path: str, model, tokenizer, cfg, trainable_only: bool = False):
    """What eval.py and transformers read: weights (LoRA folded in, or with trainable_only the adapters and head
    alone), the tokenizer and the run's config."""
    if trainable_only:  # the frozen base is rebuilt from --model on resume: store only what trains
        os.makedirs(path, exist_ok=True)
        save_file({k: v.contiguous().cpu() for k, v in trainable_state_dict(model).items()},
                  os.path.join(path, TRAINABLE), metadata={"format": "pt"})
    else:
        model.save_pretrained(path, merged_state_dict(model.backbone))
    tokenizer.save_pretrained(path)
    cfg.save(path)


def save_checkpoint(output_dir: str, step: int, *, model, optimizer, scheduler, scaler, tokenizer, cfg) -> str:
    """Writes into a temporary directory, then renames it into place: a crash never leaves a whole-looking one.

    Holds everything resume needs (weights, optimizer, scheduler, scaler, RNG) and what eval.py reads."""
    final = os.path.join(output_dir, f"checkpoint-{step}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    write_model_dir(tmp, model, tokenizer, cfg, trainable_only=has_lora(model))
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict(), "rng": rng_state()}, os.path.join(tmp, "trainer_state.pt"))
    with open(os.path.join(tmp, MARKER), "w") as f:
        json.dump({"step": step}, f)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    if cfg.keep_last > 0:
        for old in complete_checkpoints(output_dir)[:-cfg.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def save_final(output_dir: str, *, model, tokenizer, cfg, card: str) -> str:
    """<output_dir>/final: a plain HF token classifier (adapters merged), its tokenizer, config and model card."""
    path = os.path.join(output_dir, "final")
    write_model_dir(path, model, tokenizer, cfg)
    with open(os.path.join(path, "README.md"), "w") as f:
        f.write(card)
    return path


def complete_checkpoints(output_dir: str) -> list:
    """checkpoint-<step> directories holding the completion marker, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        m = re.fullmatch(r"checkpoint-(\d+)", name)
        if m and os.path.isfile(os.path.join(output_dir, name, MARKER)):
            found.append((int(m.group(1)), os.path.join(output_dir, name)))
    return [path for _, path in sorted(found)]


def resolve_resume(resume: str, output_dir: str):
    if resume != "auto":
        if not os.path.isfile(os.path.join(resume, MARKER)):
            raise SystemExit(f"--resume {resume}: not a complete checkpoint (no {MARKER})")
        return resume
    found = complete_checkpoints(output_dir)
    return found[-1] if found else None


def load_trainable(model, path: str):
    """Adapters + head into a model built with the same --model and LoRA flags; any mismatch is an error."""
    state, expected = load_file(path), set(trainable_state_dict(model))
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise SystemExit(f"{path} does not fit this model (same --model and --lora-* flags as the run?): "
                         f"missing {missing[:3]}, unexpected {extra[:3]}")
    model.load_state_dict(state, strict=False)


def load_checkpoint(path: str, model, optimizer, scheduler, scaler) -> int:
    """Restores everything save_checkpoint wrote; returns the optimizer step to continue from."""
    if os.path.isfile(os.path.join(path, TRAINABLE)):
        load_trainable(model, os.path.join(path, TRAINABLE))
    else:
        load_weights(model, path)
    state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    set_rng_state(state["rng"])
    with open(os.path.join(path, MARKER)) as f:
        return json.load(f)["step"]
