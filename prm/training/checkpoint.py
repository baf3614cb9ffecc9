"""A run's output directory, checkpoints and resume, and model directories as transformers and
peft read them (final/, a checkpoint's weights). Handed what it saves and restores (State); a
sharded (--fsdp) model is saved with torch.distributed.checkpoint (dcp), every rank its shard."""
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

# written last, with every file's checksum: a checkpoint without it is a crashed save, never resumed
MARKER = "complete.json"
NOT_REGULAR = "not a regular file"
ABANDONED = "abandoned-"  # set aside by a resume from an older step
# with (abandoned-)checkpoint-*, what makes a directory hold a run
RUN_FILES = ("metrics.jsonl", "final")
ALSO_WRITTEN = ("config.train.json", "tensorboard")  # also removed by --overwrite
LOCK = ".lock"
TRAINABLE = "trainable.safetensors"  # LoRA checkpoints: adapters + head only
# peft's adapter in its own folder: beside config.json, transformers would apply it twice
ADAPTER = "adapter"
SHARDS = "shards"  # the dcp folder of an --fsdp checkpoint


@dataclass
class State:  # what a checkpoint holds besides the random generators
    model: torch.nn.Module  # the plain PRM (sharded in place under --fsdp)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    tokenizer: object


# ---- the directory
def checkpoint_dir(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, f"checkpoint-{step}")


def numbered(output_dir: str) -> list:
    """(step, name) of the checkpoint-<step> directories in output_dir, by step."""
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    return sorted((int(n.split("-")[1]), n) for n in names if re.fullmatch(r"checkpoint-\d+", n))


def complete_checkpoints(output_dir: str) -> list:
    """checkpoint-<step> directories holding the marker, oldest first."""
    return [os.path.join(output_dir, name) for _, name in numbered(output_dir)
            if os.path.isfile(os.path.join(output_dir, name, MARKER))]


def read_marker(path: str) -> dict:
    """A complete checkpoint's marker: step, world_size, data (content digests), sha256."""
    with open(os.path.join(path, MARKER)) as f:
        return json.load(f)


def files_under(path: str) -> list:  # relative paths
    return sorted(os.path.relpath(os.path.join(root, name), path)
                  for root, _, names in os.walk(path) for name in names)


def file_digests(path: str, names: list = None) -> dict:
    """sha256 of the files `names` under a directory (default: all) by relative path;
    NOT_REGULAR for a symlink, FIFO or device."""
    def digest(name):
        full = os.path.join(path, name)
        if not stat.S_ISREG(os.lstat(full).st_mode):
            return NOT_REGULAR
        h = hashlib.sha256()
        with open(full, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        return h.hexdigest()
    names = files_under(path) if names is None else names
    # hashlib and reads let go of the GIL: the files are hashed in parallel
    with ThreadPoolExecutor(8) as pool:
        return dict(zip(names, pool.map(digest, names)))


def damaged_files(path: str) -> list:
    """Files whose checksum differs from the marker's (or missing), then the not regular ones."""
    expected, found = read_marker(path).get("sha256", {}), file_digests(path)
    strange = {name for name, digest in found.items() if digest == NOT_REGULAR}
    differ = {name for name, digest in expected.items() if found.get(name) != digest}
    return sorted(differ - strange) + [f"{name} ({NOT_REGULAR})" for name in sorted(strange)]


def resolve_resume(resume: str, output_dir: str):
    """`resume` itself, or with 'auto' the newest complete undamaged checkpoint (None: none)."""
    if resume != "auto":
        if not os.path.isfile(os.path.join(resume, MARKER)):
            check([f"--resume {resume}: not a complete checkpoint (no {MARKER})"])
        damaged = ", ".join(damaged_files(resume))
        if damaged:
            check([f"--resume {resume}: damaged checkpoint (checksum mismatch): {damaged}"])
        return resume
    for path in reversed(complete_checkpoints(output_dir)):
        damaged = ", ".join(damaged_files(path))
        if not damaged:
            return path
        print(f"warning: skipping damaged checkpoint {path} (checksum mismatch: {damaged})",
              file=sys.stderr, flush=True)
    return None


def prepare_output_dir(cfg):
    """The checkpoint to resume (None: a fresh start). A directory holding a run is refused unless
    --resume continues it or --overwrite replaces it (deleting only the run's files)."""
    out = cfg.output_dir
    names = os.listdir(out) if os.path.isdir(out) else []
    starts = ("checkpoint-", ABANDONED + "checkpoint-")
    found = sorted(n for n in names if n in RUN_FILES or n.startswith(starts))
    if cfg.overwrite and cfg.resume:
        check(["--overwrite and --resume exclude each other: replace the run, or continue it"])
    # what --overwrite deletes, else what the run replaces at its end
    doomed = [os.path.join(out, n)
              for n in (found + list(ALSO_WRITTEN) if cfg.overwrite else ["final"])]
    read = [("--" + k.replace("_", "-"), getattr(cfg, k))
            for k in ("model", "dataset", "eval_dataset")]
    check(overwrites([("--output-dir", p) for p in doomed], read))
    ckpt = resolve_resume(cfg.resume, out) if cfg.resume else None
    if not found:
        return ckpt
    shown = [n + "/" if os.path.isdir(os.path.join(out, n)) else n for n in found]
    listing = f"{out} already holds a run ({', '.join(shown)})"
    if cfg.resume:
        if ckpt and os.path.dirname(os.path.abspath(ckpt)) == os.path.abspath(out):
            return ckpt
        why = ("finds no complete checkpoint in it to continue from" if cfg.resume == "auto"
               else "is a checkpoint of another directory")
        check([f"{listing}, and --resume {cfg.resume} {why}; pass --overwrite (without --resume) "
               "to replace it, or choose another --output-dir"])
    if not cfg.overwrite:
        check([f"{listing}; pass --resume auto to continue it, --overwrite to replace it, or "
               "choose another --output-dir"])
    links = [p for p in doomed if os.path.islink(p) and os.path.isdir(p)]  # rmtree refuses them
    check([f"--overwrite: {p} is a symbolic link to a folder: remove it yourself (nothing deleted)"
           for p in links[:1]])
    for path in (p for p in doomed if os.path.lexists(p)):
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def set_aside_after(output_dir: str, step: int):
    """checkpoint-<n> with n > step -> abandoned-checkpoint-<n>(.2, ...), which resume skips."""
    moved = []
    for name in [name for done, name in numbered(output_dir) if done > step]:
        target, n = ABANDONED + name, 1
        while os.path.exists(os.path.join(output_dir, target)):
            n += 1
            target = f"{ABANDONED}{name}.{n}"
        with writing(os.path.join(output_dir, target)):
            os.replace(os.path.join(output_dir, name), os.path.join(output_dir, target))
        moved.append(f"{name} -> {target}")
    if moved:
        print(f"warning: resumed at step {step}, so the newer checkpoints are set aside in "
              f"{output_dir}: {', '.join(moved)}", file=sys.stderr, flush=True)


def keep_records_until(path: str, step: int):
    """Drops the records past `step` (and final ones) from metrics.jsonl: each step appears once."""
    if not os.path.isfile(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # cut short by a crash
                continue
            if rec.get("step", 0) <= step and "final" not in rec:
                kept.append(line.rstrip("\n"))
    write_lines(path, kept)


def prune(output_dir: str, keep_last: int):
    """Removes the complete checkpoints older than the newest keep_last (0: keeps all)."""
    if keep_last > 0:
        for old in complete_checkpoints(output_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def run_lock(output_dir: str):
    """Holds <output_dir>/.lock: a second run there is a UsageError; removes the folder if made
    here and left empty."""
    made = not os.path.isdir(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    try:
        with locked(output_dir, os.path.join(output_dir, LOCK)):
            yield
    finally:
        if made:
            with contextlib.suppress(OSError):
                os.rmdir(output_dir)


def rng_state() -> dict:  # every generator the training draws from (data order, dropout)
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict):
    """Restores what rng_state returned (a GPU's state loads on a CPU-only machine too)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- sharded weights
def _options(trainable_only: bool, **kw) -> StateDictOptions:  # LoRA: the base is --model's
    # strict matters only when a state dict is set
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only, **kw)


def save_shards(path: str, model, optimizer):
    """Every rank writes its shard of weights and optimizer state."""
    weights, optim = get_state_dict(model, optimizer, options=_options(has_lora(model)))
    dcp.save({"model": weights, "optimizer": optim}, checkpoint_id=os.path.join(path, SHARDS))


def load_shards(path: str, model, optimizer):
    """The inverse of save_shards, resharded to this world size."""
    weights, optim = get_state_dict(model, optimizer, options=_options(has_lora(model)))
    state = {"model": weights, "optimizer": optim}
    dcp.load(state, checkpoint_id=os.path.join(path, SHARDS))  # in place
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"], options=_options(has_lora(model)))


def load_whole(path: str, model, trainable_only: bool):
    """A sharded checkpoint's weights into an unsharded model."""
    weights = get_model_state_dict(model, options=_options(trainable_only))
    # dcp warns that no_dist reads in one process, as asked
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load({"model": weights}, checkpoint_id=os.path.join(path, SHARDS), no_dist=True)
    set_model_state_dict(model, weights, options=_options(trainable_only))


# ---- model directories
def _save(tensors: dict, folder: str, name: str):
    os.makedirs(folder, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    save_file(tensors, os.path.join(folder, name), metadata={"format": "pt"})


def write_model_dir(path: str, model, tokenizer, cfg, trainable_only: bool = False,
                    state: dict = None):
    """Weights (LoRA merged; trainable_only: adapters and head), adapter, tokenizer and config.
    state: the whole weights (a sharded model's, gathered), else the model's own."""
    if trainable_only:
        _save(trainable_state_dict(model), path, TRAINABLE)
    else:
        def part(prefix):
            if state is None:
                return None
            return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
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


# ---- checkpoints
class Checkpointer:
    """Resume and checkpoints. Rank 0 picks the checkpoint to resume (resume_from; None: fresh)
    and hashes the data files (digests: {"train", "eval"}; '' for hub or synthetic data)."""

    def __init__(self, cfg, rt):
        self.cfg, self.rt = cfg, rt
        self.resume_from, self.digests = decided_by_main(rt, self.decide)

    def decide(self) -> tuple:
        """(the checkpoint to resume, the data digests); UsageError if the settings defining the
        model, the data and its order, or the data files' contents differ from the checkpoint's."""
        cfg = self.cfg
        path = prepare_output_dir(cfg)
        digests = {"train": data_digest(cfg.dataset), "eval": data_digest(cfg.eval_dataset)}
        if not path:
            return None, digests
        marker = read_marker(path)
        bad, changed = cfg.resume_conflicts(type(cfg).load(path), marker.get("world_size", 1),
                                            self.rt.world_size)
        for split, spec in (("train", cfg.dataset), ("eval", cfg.eval_dataset)):
            saved = marker.get("data", {}).get(split)
            if saved and digests[split] and saved != digests[split]:
                bad.append(f"{spec} changed since the checkpoint (its contents differ)")
        if bad:
            check([f"--resume {path}: the checkpoint does not fit this model and data; these "
                   f"settings differ: {'; '.join(bad)}. Use the checkpoint's, or start a new run"])
        if changed:
            print(f"resuming with changed settings: {'; '.join(changed)}")
        return path, digests

    def load(self, state: State, last_step: int) -> int:
        """The step to continue from (0: fresh); a resume restores `state` in place."""
        path, model = self.resume_from, state.model
        if not path:
            return 0
        step = read_marker(path)["step"]
        if step > last_step:
            raise UsageError(f"--resume {path}: the checkpoint is at step {step}, past this run's "
                             f"last step {last_step} (--max-steps, --epochs): nothing to continue")
        saved = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=True)
        if os.path.isdir(os.path.join(path, SHARDS)):
            load_shards(path, model, state.optimizer)
        elif os.path.isfile(os.path.join(path, TRAINABLE)):
            load_trainable(model, os.path.join(path, TRAINABLE))
        else:
            load_weights(model, path)
        if "optimizer" in saved:
            state.optimizer.load_state_dict(saved["optimizer"])
        state.scheduler.load_state_dict(saved["scheduler"])
        state.scaler.load_state_dict(saved["scaler"])
        set_rng_state(saved["rng"])
        if self.rt.is_main:
            print(f"resumed from {path} at step {step}")
            set_aside_after(self.cfg.output_dir, step)
            keep_records_until(os.path.join(self.cfg.output_dir, "metrics.jsonl"), step)
        return step

    def save(self, step: int, state: State):
        """checkpoint-<step>/, every rank together: under --fsdp each writes its shards, then
        checksums a share of them (faster than rank 0 alone)."""
        rt = self.rt
        barrier(rt)
        shards = {}
        if self.cfg.fsdp:
            tmp = checkpoint_dir(self.cfg.output_dir, step) + ".tmp"
            if rt.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            barrier(rt)
            try:
                with writing(tmp.removesuffix(".tmp")):
                    save_shards(tmp, state.model, state.optimizer)
            except WriteFailed:
                if rt.is_main:
                    shutil.rmtree(tmp, ignore_errors=True)
                raise
            barrier(rt)
            share = file_digests(tmp, files_under(tmp)[rt.rank::rt.world_size])
            shards = {k: v for part in gather_objects(share, rt) for k, v in part.items()}
        if rt.is_main:
            self.write(step, state, shards)
        barrier(rt)

    def write(self, step: int, state: State, shards: dict = None):
        """Rank 0's part of checkpoint-<step>; the marker, last, holds every file's checksum."""
        cfg, shards = self.cfg, shards or {}
        with staged_folder(checkpoint_dir(cfg.output_dir, step), fresh=not cfg.fsdp) as tmp:
            saved = {"scheduler": state.scheduler.state_dict(),
                     "scaler": state.scaler.state_dict(), "rng": rng_state()}
            if cfg.fsdp:
                state.tokenizer.save_pretrained(tmp)
                cfg.save(tmp)
            else:
                write_model_dir(tmp, state.model, state.tokenizer, cfg,
                                trainable_only=has_lora(state.model))
                saved["optimizer"] = state.optimizer.state_dict()
            torch.save(saved, os.path.join(tmp, "trainer_state.pt"))
            mine = file_digests(tmp, [n for n in files_under(tmp) if n not in shards])
            marker = {"step": step, "world_size": self.rt.world_size, "data": self.digests or {},
                      "sha256": {**shards, **mine}}
            write_lines(os.path.join(tmp, MARKER), [json.dumps(marker)])
        prune(cfg.output_dir, cfg.keep_last)

    def save_final(self, step: int, state: State) -> str:
        """final/ (a plain HF token classifier, adapters merged); its path on rank 0, else None."""
        barrier(self.rt)
        whole = None
        if self.cfg.fsdp:  # every rank takes part in gathering the whole weights on rank 0's CPU
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            whole = get_model_state_dict(state.model, options=options)
        path = os.path.join(self.cfg.output_dir, "final")
        if self.rt.is_main:
            try:
                with staged_folder(path) as tmp:
                    write_model_dir(tmp, state.model, state.tokenizer, self.cfg, state=whole)
            except WriteFailed as e:
                raise WriteFailed(f"{e}; {self.kept_instead(step, state)}") from e.__cause__
            prune(self.cfg.output_dir, self.cfg.keep_last)
        barrier(self.rt)
        return path if self.rt.is_main else None

    def kept_instead(self, step: int, state: State) -> str:
        """Where the weights of `step` are when final/ failed (writing a checkpoint if need be)."""
        ckpt = checkpoint_dir(self.cfg.output_dir, step)
        if not os.path.isfile(os.path.join(ckpt, MARKER)):
            if self.cfg.fsdp:
                return f"the weights of step {step} are lost: no checkpoint holds them"
            try:
                self.write(step, state)
            except WriteFailed as e:
                return (f"{ckpt} could not be written either ({e.cause}): the weights of step "
                        f"{step} are lost")
        return (f"the weights of step {step} are kept in {ckpt}: free space, then export final/ "
                "with --resume auto")
