"""Checkpoints, resume, and the model folders of a run (--fsdp: dcp shards, one per rank)."""
import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import stat
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_state_dict, set_model_state_dict, set_state_dict)

from prm.core.lora import has_lora, merged_state_dict, peft_targets, trainable_state_dict
from prm.core.model import hf_names, load_weights
from prm.core.runtime import barrier, decided_by_main, gather_objects
from prm.errors import UsageError, WriteFailed, check, overwrites
from prm.files import locked, staged_folder, write_lines, writing
from prm.readers.sources import data_digest

MARKER = "complete.json"  # written last, with every file's sha256: missing after a crash
NOT_REGULAR = "not a regular file"
ABANDONED = "abandoned-"
TRAINABLE = "trainable.safetensors"  # LoRA checkpoints: adapters + head only
ADAPTER = "adapter"  # its own folder: beside config.json, transformers would apply it twice
SHARDS = "shards"


@dataclass
class State:
    model: torch.nn.Module  # the plain PRM (sharded in place under --fsdp)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    tokenizer: object


def numbered(out: str) -> list:  # (step, name) of the checkpoint-<step>s, by step
    names = os.listdir(out) if os.path.isdir(out) else []
    return sorted((int(n.split("-")[1]), n) for n in names if re.fullmatch(r"checkpoint-\d+", n))


def complete_checkpoints(out: str) -> list:  # oldest first
    return [os.path.join(out, name) for _, name in numbered(out)
            if os.path.isfile(os.path.join(out, name, MARKER))]


def read_marker(path: str) -> dict:
    with open(os.path.join(path, MARKER)) as f:
        return json.load(f)


def files_under(path: str) -> list:  # relative paths
    return sorted(os.path.relpath(os.path.join(root, name), path)
                  for root, _, names in os.walk(path) for name in names)


def file_digests(path: str, names: list = None) -> dict:
    """{name: sha256 or NOT_REGULAR} of `names` (default: all) under `path`."""
    def digest(name):
        full = os.path.join(path, name)
        if not stat.S_ISREG(os.lstat(full).st_mode):
            return NOT_REGULAR
        h = hashlib.sha256()  # not hashlib.file_digest: Python 3.11+
        with open(full, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        return h.hexdigest()
    names = files_under(path) if names is None else names
    with ThreadPoolExecutor(8) as pool:  # hashlib and reads let go of the GIL
        return dict(zip(names, pool.map(digest, names)))


def resolve_resume(resume: str, out: str):
    """`resume`, or for 'auto' the newest undamaged checkpoint (or None)."""
    auto = resume == "auto"
    if not auto and not os.path.isfile(os.path.join(resume, MARKER)):
        check([f"--resume {resume}: not a complete checkpoint (no {MARKER})"])
    for path in reversed(complete_checkpoints(out)) if auto else [resume]:
        expected, found = read_marker(path)["sha256"], file_digests(path)
        strange = sorted(n for n, sha in found.items() if sha == NOT_REGULAR)
        differ = sorted({n for n, sha in expected.items() if found.get(n) != sha} - {*strange})
        damaged = ", ".join(differ + [f"{n} ({NOT_REGULAR})" for n in strange])
        if not damaged:
            return path
        if not auto:
            check([f"--resume {resume}: damaged checkpoint (checksum mismatch): {damaged}"])
        print(f"warning: skipping damaged checkpoint {path} (checksum mismatch: {damaged})",
              file=sys.stderr, flush=True)
    return None


def prepare_output_dir(cfg):
    """The checkpoint to resume (None: fresh); a run's folder needs --resume or --overwrite."""
    out = cfg.output_dir
    names = os.listdir(out) if os.path.isdir(out) else []
    found = sorted(n for n in names if n in ("metrics.jsonl", "final")
                   or n.startswith(("checkpoint-", ABANDONED + "checkpoint-")))  # a run's files
    if cfg.overwrite and cfg.resume:
        check(["--overwrite and --resume exclude each other"])
    # what --overwrite deletes, else what the run replaces at its end
    doomed = [os.path.join(out, n) for n in (
        found + ["config.train.json", "tensorboard"] if cfg.overwrite else ["final"])]
    check(overwrites([("--output-dir", p) for p in doomed], [
        ("--model", cfg.model), ("--dataset", cfg.dataset), ("--eval-dataset", cfg.eval_dataset)]))
    ckpt = resolve_resume(cfg.resume, out) if cfg.resume else None
    if not found:
        return ckpt
    shown = [n + "/" if os.path.isdir(os.path.join(out, n)) else n for n in found]
    listing = f"{out} already holds a run ({', '.join(shown)})"
    if cfg.resume:
        if ckpt and os.path.dirname(os.path.abspath(ckpt)) == os.path.abspath(out):
            return ckpt
        why = ("auto finds no complete checkpoint in it" if cfg.resume == "auto"
               else f"{cfg.resume} is a checkpoint of another directory")
        listing += f", and --resume {why}"
    if not cfg.overwrite:
        resume = "" if cfg.resume else "--resume auto to continue it, "
        check([f"{listing}; pass {resume}--overwrite to replace it, or another --output-dir"])
    links = [p for p in doomed if os.path.islink(p) and os.path.isdir(p)]  # rmtree refuses them
    check([f"--overwrite: {p} is a link to a folder; remove it yourself" for p in links[:1]])
    for path in filter(os.path.lexists, doomed):
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def set_aside_after(out: str, step: int):
    """checkpoint-<n>, n > step -> abandoned-checkpoint-<n>(.2, ...): resume skips them."""
    moved = []
    for name in [name for done, name in numbered(out) if done > step]:
        target, n = ABANDONED + name, 1
        while os.path.exists(os.path.join(out, target)):
            n += 1
            target = f"{ABANDONED}{name}.{n}"
        with writing(os.path.join(out, target)):
            os.replace(os.path.join(out, name), os.path.join(out, target))
        moved.append(f"{name} -> {target}")
    if moved:
        print(f"warning: resumed at step {step}: newer checkpoints set aside in {out}: "
              f"{', '.join(moved)}", file=sys.stderr, flush=True)


def keep_records_until(path: str, step: int):
    """Drops the records past `step`, and final ones."""
    if not os.path.isfile(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            with contextlib.suppress(json.JSONDecodeError):  # a line cut short by a crash
                rec = json.loads(line)
                if rec.get("step", 0) <= step and "final" not in rec:
                    kept.append(line.rstrip("\n"))
    write_lines(path, kept)


@contextlib.contextmanager
def run_lock(out: str):
    """Holds out/.lock; removes `out` if made here and empty."""
    made = not os.path.isdir(out)
    os.makedirs(out, exist_ok=True)
    try:
        with locked(out, os.path.join(out, ".lock")):
            yield
    finally:
        if made:
            with contextlib.suppress(OSError):
                os.rmdir(out)


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


def _options(trainable_only: bool) -> StateDictOptions:  # LoRA: the base is --model's
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)


def load_whole(path: str, model, trainable_only: bool):
    """A sharded checkpoint into an unsharded model."""
    weights = get_model_state_dict(model, options=_options(trainable_only))
    with warnings.catch_warnings():  # no_dist reads in one process, as asked
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load({"model": weights}, checkpoint_id=os.path.join(path, SHARDS), no_dist=True)
    set_model_state_dict(model, weights, options=_options(trainable_only))


def _save(tensors: dict, path: str):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    save_file(tensors, path, metadata={"format": "pt"})


def write_model_dir(path: str, model, tokenizer, cfg, trainable_only: bool = False,
                    state: dict = None):
    """Weights (LoRA merged, or trainable_only), peft's adapter/, tokenizer, config; state: a
    sharded model's whole weights."""
    if trainable_only:
        _save(trainable_state_dict(model), os.path.join(path, TRAINABLE))
    else:
        def part(prefix):  # None: the module's own
            return state and {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        backbone = merged_state_dict(model.backbone, part("backbone."))
        model.save_pretrained(path, backbone, part("head."))
    if has_lora(model):  # our lora_A, lora_B, scale are peft's
        _, prefix, head_name = hf_names(model.config)
        tensors = {}
        for key, value in (trainable_state_dict(model) if state is None else state).items():
            if key.startswith("head."):
                tensors[f"base_model.model.{head_name}.{key.removeprefix('head.')}"] = value
            elif key.endswith((".lora_A", ".lora_B")):
                name = key.removeprefix("backbone.")
                tensors[f"base_model.model.{prefix}.{name}.weight"] = value
        adapter = os.path.join(path, ADAPTER)
        _save(tensors, os.path.join(adapter, "adapter_model.safetensors"))
        # the fields left out take peft's defaults
        config = dict(peft_type="LORA", task_type="TOKEN_CLS", base_model_name_or_path=cfg.model,
                      r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=peft_targets(model.backbone), modules_to_save=[head_name],
                      bias="none", fan_in_fan_out=False, use_rslora=False)
        write_lines(os.path.join(adapter, "adapter_config.json"), [json.dumps(config, indent=2)])
    tokenizer.save_pretrained(path)
    cfg.save(path)


def load_trainable(model, path: str):
    state, expected = load_file(path), set(trainable_state_dict(model))
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise UsageError(f"{path} does not fit this model (--model, --lora-*?): missing "
                         f"{missing[:3]}, unexpected {extra[:3]}")
    model.load_state_dict(state, strict=False)


class Checkpointer:
    """Rank 0 picks resume_from (None: fresh) and hashes the data (digests; '': not a file)."""

    def __init__(self, cfg, rt):
        self.cfg, self.rt = cfg, rt
        self.resume_from, self.digests = decided_by_main(rt, self.decide)

    def decide(self) -> tuple:
        """Refuses a checkpoint of another model or data."""
        cfg = self.cfg
        path = prepare_output_dir(cfg)
        specs = {"train": cfg.dataset, "eval": cfg.eval_dataset}
        digests = {split: data_digest(spec) for split, spec in specs.items()}
        if not path:
            return None, digests
        marker = read_marker(path)
        bad, changed = cfg.resume_conflicts(
            type(cfg).load(path), marker["world_size"], self.rt.world_size)
        for split, spec in specs.items():
            saved = marker["data"].get(split)
            if saved and digests[split] and saved != digests[split]:
                bad.append(f"{spec} changed since the checkpoint")
        if bad:
            check([f"--resume {path}: the checkpoint does not fit this model and data: "
                   f"{'; '.join(bad)}"])
        if changed:
            print(f"resuming with changed settings: {'; '.join(changed)}")
        return path, digests

    def load(self, state: State, last_step: int) -> int:
        """The step to continue from (0: fresh); restores `state` in place."""
        path, model, optimizer = self.resume_from, state.model, state.optimizer
        if not path:
            return 0
        step = read_marker(path)["step"]
        if step > last_step:
            raise UsageError(f"--resume {path}: the checkpoint is at step {step}, past this run's "
                             f"last step {last_step} (--max-steps, --epochs)")
        saved = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=True)
        if os.path.isdir(os.path.join(path, SHARDS)):  # resharded to this world size
            options = _options(has_lora(model))
            weights, optim = get_state_dict(model, optimizer, options=options)
            dcp.load({"model": weights, "optimizer": optim},  # in place
                     checkpoint_id=os.path.join(path, SHARDS))
            set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict=optim,
                           options=options)
        elif os.path.isfile(os.path.join(path, TRAINABLE)):
            load_trainable(model, os.path.join(path, TRAINABLE))
        else:
            load_weights(model, path)
        if "optimizer" in saved:
            optimizer.load_state_dict(saved["optimizer"])
        state.scheduler.load_state_dict(saved["scheduler"])
        state.scaler.load_state_dict(saved["scaler"])
        set_rng_state(saved["rng"])
        if self.rt.is_main:
            print(f"resumed from {path} at step {step}")
            set_aside_after(self.cfg.output_dir, step)
            keep_records_until(os.path.join(self.cfg.output_dir, "metrics.jsonl"), step)
        return step

    def save(self, step: int, state: State):
        """checkpoint-<step>/, by all ranks (--fsdp: each writes and hashes shards)."""
        rt, ckpt = self.rt, os.path.join(self.cfg.output_dir, f"checkpoint-{step}")
        barrier(rt)
        with staged_folder(ckpt) if rt.is_main else writing(ckpt):  # rank 0 stages ckpt.tmp
            tmp, shards = ckpt + ".tmp", {}
            if self.cfg.fsdp:
                barrier(rt)  # ckpt.tmp is empty
                weights, optim = get_state_dict(
                    state.model, state.optimizer, options=_options(has_lora(state.model)))
                dcp.save({"model": weights, "optimizer": optim},
                         checkpoint_id=os.path.join(tmp, SHARDS))
                barrier(rt)
                share = file_digests(tmp, files_under(tmp)[rt.rank::rt.world_size])
                shards = {k: v for part in gather_objects(share, rt) for k, v in part.items()}
            if rt.is_main:
                self.write(tmp, step, state, shards)
        if rt.is_main:
            self.prune()
        barrier(rt)

    def write(self, tmp: str, step: int, state: State, shards: dict):
        """Rank 0's part of checkpoint-<step>, into its staged folder."""
        cfg = self.cfg
        saved = {"scheduler": state.scheduler.state_dict(), "scaler": state.scaler.state_dict(),
                 "rng": rng_state()}
        if cfg.fsdp:
            state.tokenizer.save_pretrained(tmp)
            cfg.save(tmp)
        else:
            write_model_dir(tmp, state.model, state.tokenizer, cfg,
                            trainable_only=has_lora(state.model))
            saved["optimizer"] = state.optimizer.state_dict()
        torch.save(saved, os.path.join(tmp, "trainer_state.pt"))
        mine = file_digests(tmp, [n for n in files_under(tmp) if n not in shards])
        marker = {"step": step, "world_size": self.rt.world_size, "data": self.digests,
                  "sha256": {**shards, **mine}}
        write_lines(os.path.join(tmp, MARKER), [json.dumps(marker)])

    def prune(self):  # --keep-last 0: keeps all
        if self.cfg.keep_last > 0:
            for old in complete_checkpoints(self.cfg.output_dir)[:-self.cfg.keep_last]:
                shutil.rmtree(old, ignore_errors=True)

    def save_final(self, step: int, state: State) -> str:
        """final/ (adapters merged): its path on rank 0, else None."""
        barrier(self.rt)
        whole = None
        if self.cfg.fsdp:  # all ranks gather the whole weights on rank 0's CPU
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            whole = get_model_state_dict(state.model, options=options)
        path = os.path.join(self.cfg.output_dir, "final")
        if self.rt.is_main:
            try:
                with staged_folder(path) as tmp:
                    write_model_dir(tmp, state.model, state.tokenizer, self.cfg, state=whole)
            except WriteFailed as e:
                raise WriteFailed(f"{e}; {self.kept_instead(step, state)}") from e.__cause__
            self.prune()
        barrier(self.rt)
        return path if self.rt.is_main else None

    def kept_instead(self, step: int, state: State) -> str:
        """Where final/'s weights are kept (writing a checkpoint if need be)."""
        ckpt = os.path.join(self.cfg.output_dir, f"checkpoint-{step}")
        lost = f"the weights of step {step} are lost"
        if not os.path.isfile(os.path.join(ckpt, MARKER)):
            if self.cfg.fsdp:
                return f"{lost}: no checkpoint holds them"
            try:
                with staged_folder(ckpt) as tmp:
                    self.write(tmp, step, state, {})
            except WriteFailed as e:
                return f"{ckpt} could not be written either ({e.cause}): {lost}"
            self.prune()
        return f"the weights of step {step} are kept in {ckpt}: free space, then --resume auto"
