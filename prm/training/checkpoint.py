"""Training checkpoints (atomic, checksummed, exact resume), the final export, finding the newest good
checkpoint, and the lock that keeps two runs out of one output directory. Depends on: torch, safetensors,
prm.core.model, prm.core.lora, prm.core.runtime, prm.training.sharding, prm.errors."""
import contextlib
import fcntl
import hashlib
import json
import os
import random
import re
import shutil
import socket
import stat
import sys

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.api import CheckpointException

from prm.errors import UsageError, WriteFailed, check
from prm.core.lora import has_lora, merged_state_dict, peft_targets, trainable_state_dict
from prm.core.model import hf_names, load_weights
from prm.core.runtime import barrier
from prm.training.sharding import SHARDS, load_shards, save_shards

MARKER = "complete.json"  # written last, with every file's checksum: without it, a crashed save, not resumed
TRAINABLE = "trainable.safetensors"  # LoRA checkpoints: adapters + head only
# LoRA runs: the adapter in peft's format, in a folder of its own: beside config.json, transformers (with peft
# installed) would load the merged weights and then add the adapter on top of them, applying it twice
ADAPTER = "adapter"
LOCK = ".lock"  # pid@host of the run that is using an output directory
NOT_REGULAR = "not a regular file"  # file_digests' entry for a symlink, FIFO or device


def write_model_dir(path: str, model, tokenizer, cfg, trainable_only: bool = False, state: dict = None):
    """What eval.py and transformers read: weights (LoRA folded in, or with trainable_only the adapters and
    head alone), a LoRA run's adapter in PEFT's format (write_adapter), the tokenizer and the run's config.
    state: the whole model's weights gathered from shards (Parallel.full_state); default: the model's."""
    if trainable_only:  # the frozen base is rebuilt from --model on resume: store only what trains
        os.makedirs(path, exist_ok=True)
        save_file({k: v.contiguous().cpu() for k, v in trainable_state_dict(model).items()},
                  os.path.join(path, TRAINABLE), metadata={"format": "pt"})
    else:
        part = lambda prefix: None if state is None else {k[len(prefix):]: v for k, v in state.items()
                                                          if k.startswith(prefix)}
        model.save_pretrained(path, merged_state_dict(model.backbone, part("backbone.")), part("head."))
    if has_lora(model):
        write_adapter(os.path.join(path, ADAPTER), model, cfg, state)
    tokenizer.save_pretrained(path)
    cfg.save(path)


def write_adapter(path: str, model, cfg, state: dict = None):
    """The adapters and head as peft's save_pretrained writes them, for PeftModel.from_pretrained(
    AutoModelForTokenClassification.from_pretrained(--model), path); peft is not needed. Our lora_A (r, in),
    lora_B (out, r) and scale alpha / r are peft's (use_rslora false), so only names change:
    backbone.<layer>.lora_A -> base_model.model.<prefix>.<layer>.lora_A.weight, and head.weight (trains whole:
    modules_to_save) -> base_model.model.<head name>.weight. state: as in write_model_dir."""
    _, prefix, head_name = hf_names(model.config)
    tensors = {}
    for key, value in (trainable_state_dict(model) if state is None else state).items():
        if key.startswith("head."):
            tensors[f"base_model.model.{head_name}.{key[len('head.'):]}"] = value
        elif key.endswith((".lora_A", ".lora_B")):
            tensors[f"base_model.model.{prefix}.{key[len('backbone.'):]}.weight"] = value
    os.makedirs(path, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()},
              os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "TOKEN_CLS", "base_model_name_or_path": cfg.model,
              "r": cfg.lora_r, "lora_alpha": cfg.lora_alpha, "lora_dropout": cfg.lora_dropout,
              "target_modules": peft_targets(model.backbone), "modules_to_save": [head_name], "bias": "none",
              "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
              "inference_mode": True}  # the fields peft leaves out take its defaults
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)


# what a failed write raises: OSError from open/write/rename, RuntimeError from torch.save ("file write
# failed"), SafetensorError from safetensors' save_file ("IoError(... StorageFull ...)"), CheckpointException
# from dcp.save under --fsdp (a BaseException, holding each failed rank's error)
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError, CheckpointException)


@contextlib.contextmanager
def reported(path: str):
    """A write failure inside the block ends the run with WriteFailed: one line naming `path` and the cause
    (exit status 1: the machine failed, not the user's input)."""
    try:
        yield
    except WRITE_ERRORS as e:
        error = e
        if isinstance(e, CheckpointException) and e.failures:  # its own text is a traceback per rank
            error = next(iter(e.failures.values()))[0]
        lines = str(error).strip().splitlines()
        cause = (error.strerror if isinstance(error, OSError) else None) or \
            (lines[0] if lines else type(error).__name__)
        if not isinstance(error, OSError):  # torch.save's "unexpected pos 320 vs 214" never says "disk full"
            cause += f" ({_free_mib(path)} MiB free there)"
        raise WriteFailed(f"could not write {path}: {cause}", cause=cause) from e


def _free_mib(path: str) -> str:
    """Free space on the disk of `path` (or of its nearest existing parent), in MiB; '?' when unknown."""
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        return f"{shutil.disk_usage(path or '.').free / 2 ** 20:.1f}"
    except OSError:
        return "?"


@contextlib.contextmanager
def written_in_place(path: str, fresh: bool = True):
    """Yields a temporary directory that replaces `path` once the block succeeds: a crash or a full disk never
    leaves a half-written `path`, and a failed write (WriteFailed) keeps the previous one and no temporary
    directory. fresh=False keeps what is already in the temporary directory (the shards every rank wrote)."""
    tmp, old = path + ".tmp", path + ".old"
    if fresh:
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        with reported(path):
            yield tmp
            if os.path.isdir(path):  # set aside only now that the new one is complete
                shutil.rmtree(old, ignore_errors=True)
                os.replace(path, old)
            os.replace(tmp, path)
    except BaseException:  # whatever stopped the write (an interrupt too): no half-written directory stays
        shutil.rmtree(tmp, ignore_errors=True)
        if os.path.isdir(old) and not os.path.isdir(path):  # failed between the renames: put the old one back
            os.replace(old, path)
        raise
    shutil.rmtree(old, ignore_errors=True)


class AppendFile:
    """A text file opened for appending (metrics.jsonl) whose failed writes end the run with WriteFailed."""

    def __init__(self, path: str):
        self.path = path
        with reported(path):
            self.file = open(path, "a")

    def write(self, text: str):
        """Writes and flushes: what was written is on disk even if the run dies next."""
        with reported(self.path):
            self.file.write(text)
            self.file.flush()

    def close(self):
        with reported(self.path):
            self.file.close()


def file_digests(path: str) -> dict:
    """sha256 of every file under a directory, by relative path; a symlink, FIFO or device gets NOT_REGULAR
    instead (reading /dev/zero or a FIFO would never end), so a checkpoint holding one fails its checksums."""
    out = {}
    for root, _, names in os.walk(path):
        for full in (os.path.join(root, name) for name in names):
            digest = NOT_REGULAR
            if stat.S_ISREG(os.lstat(full).st_mode):  # lstat: a symlink is not followed
                h = hashlib.sha256()
                with open(full, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        h.update(block)
                digest = h.hexdigest()
            out[os.path.relpath(full, path)] = digest
    return out


def checkpoint_dir(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, f"checkpoint-{step}")


def prune(output_dir: str, keep_last: int):
    """Removes the complete checkpoints older than the newest keep_last (0: keeps all): after every save, and
    once final/ is written, since a kill between a save's rename and its pruning leaves one too many."""
    if keep_last > 0:
        for old in complete_checkpoints(output_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)


ABANDONED = "abandoned-"  # prefix of the checkpoints a resume from an older step leaves behind


def set_aside_after(output_dir: str, step: int):
    """After a resume from `step`, the checkpoint-<n> directories with n > step belong to the abandoned
    timeline (its metrics.jsonl records are dropped too): renamed to abandoned-checkpoint-<n>, which prune and
    resolve_resume ignore, so the new run's checkpoints are the ones kept and resumed. Rank 0 only."""
    newer = []
    for name in os.listdir(output_dir) if os.path.isdir(output_dir) else []:
        m = re.fullmatch(r"checkpoint-(\d+)", name)
        if m and int(m.group(1)) > step:
            newer.append((int(m.group(1)), name))
    moved = []
    for _, name in sorted(newer):
        target, n = ABANDONED + name, 1
        while os.path.exists(os.path.join(output_dir, target)):  # set aside by an earlier resume already
            n += 1
            target = f"{ABANDONED}{name}.{n}"
        with reported(os.path.join(output_dir, target)):
            os.replace(os.path.join(output_dir, name), os.path.join(output_dir, target))
        moved.append(f"{name} -> {target}")
    if moved:
        print(f"warning: resumed at step {step}, so the newer checkpoints are set aside in {output_dir}: "
              f"{', '.join(moved)}", file=sys.stderr, flush=True)


def write_card(path: str, card: str):
    """The model card, <path>/README.md, written to a temporary name and renamed: never half a file."""
    tmp = os.path.join(path, "README.md.tmp")
    try:
        with reported(tmp):
            with open(tmp, "w") as f:
                f.write(card)
            os.replace(tmp, os.path.join(path, "README.md"))
    except WriteFailed:
        with contextlib.suppress(OSError):  # half a card: gone, so the folder holds only what is whole
            os.remove(tmp)
        raise


def complete_checkpoints(output_dir: str) -> list:
    """checkpoint-<step> directories holding the completion marker, oldest first."""
    found = []
    for name in os.listdir(output_dir) if os.path.isdir(output_dir) else []:
        m = re.fullmatch(r"checkpoint-(\d+)", name)
        if m and os.path.isfile(os.path.join(output_dir, name, MARKER)):
            found.append((int(m.group(1)), os.path.join(output_dir, name)))
    return [path for _, path in sorted(found)]


def read_marker(path: str) -> dict:
    """A complete checkpoint's marker: step, world_size, data (content digests), sha256 (of every file)."""
    with open(os.path.join(path, MARKER)) as f:
        return json.load(f)


def damaged_files(path: str) -> list:
    """Files of a complete checkpoint whose checksum differs from its marker's (missing ones included), then
    its symlinks, FIFOs and devices."""
    expected = read_marker(path).get("sha256", {})  # checkpoints written before checksums: nothing to compare
    found = file_digests(path)
    strange = {name for name, digest in found.items() if digest == NOT_REGULAR}  # listed in the marker or not
    return sorted({name for name, digest in expected.items() if found.get(name) != digest} - strange) + \
        [f"{name} ({NOT_REGULAR})" for name in sorted(strange)]


def resolve_resume(resume: str, output_dir: str):
    """The checkpoint to resume: `resume` itself, or with 'auto' the newest complete one whose files pass
    their checksums (a damaged one is skipped with a warning); None when there is none."""
    if resume != "auto":
        if not os.path.isfile(os.path.join(resume, MARKER)):
            check([f"--resume {resume}: not a complete checkpoint (no {MARKER})"])
        if damaged := damaged_files(resume):
            check([f"--resume {resume}: damaged checkpoint (checksum mismatch): {', '.join(damaged)}"])
        return resume
    for path in reversed(complete_checkpoints(output_dir)):
        if not (damaged := damaged_files(path)):
            return path
        print(f"warning: skipping damaged checkpoint {path} (checksum mismatch: {', '.join(damaged)})",
              file=sys.stderr, flush=True)
    return None


@contextlib.contextmanager
def run_lock(output_dir: str):
    """Holds <output_dir>/.lock for the life of a run, so a second trainer on the same directory stops at once
    (exit status 2). The file names its owner (pid@host) and is held with flock: the kernel lets exactly one
    process hold it, and drops the hold when that process dies, so two runs that take over one stale lock at
    once cannot both proceed. A lock of this host whose flock is free is stale and taken over, with a warning;
    one of another host is not (_alive). A directory made here and left empty (the run failed before writing
    anything, e.g. bad data) goes again."""
    made = not os.path.isdir(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, LOCK)
    fd = _hold(path, output_dir)
    try:
        yield
    finally:
        os.remove(path)  # before the hold ends: a process that opened the file meanwhile sees it gone (_hold)
        os.close(fd)
        if made:
            with contextlib.suppress(OSError):  # rmdir removes an empty directory only: one with files stays
                os.rmdir(output_dir)


def _hold(path: str, output_dir: str) -> int:
    """An open descriptor of `path` holding its flock, the file naming this process; exit status 2 if another
    run holds it."""
    busy = lambda owner: check([f"{output_dir} is in use by another run ({owner or 'starting'}); if none "
                                f"is, delete {path}"])
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.read(fd, 256).decode(errors="replace").strip()
            os.close(fd)
            busy(owner)
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        os.close(fd)  # the holder removed the file as we opened it: that hold is on a file nobody else sees
    owner = os.read(fd, 256).decode(errors="replace").strip()
    if owner and _alive(owner):
        os.close(fd)
        busy(owner)
    if owner:
        print(f"warning: taking over the stale lock of {owner} in {output_dir}", file=sys.stderr, flush=True)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}@{socket.gethostname()}".encode(), 0)
    return fd


def _alive(owner: str) -> bool:
    """Whether the pid@host that wrote a lock whose flock this process now holds may still run. A process of
    another host may (flock need not reach across hosts, e.g. on NFS), and so may an owner not of that form.
    One of this host cannot: it would hold the flock still (the kernel drops a hold only when its process
    ends). Its pid proves nothing: it may now be another process's, or this very one's (a restarted
    container reuses the same small pids)."""
    pid, _, host = owner.partition("@")
    return host != socket.gethostname() or not pid.isdigit()


def load_trainable(model, path: str):
    """Adapters + head into a model built with the same --model and LoRA flags; any mismatch is an error."""
    state, expected = load_file(path), set(trainable_state_dict(model))
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise UsageError(f"{path} does not fit this model (same --model and --lora-* flags as the run?): "
                         f"missing {missing[:3]}, unexpected {extra[:3]}")
    model.load_state_dict(state, strict=False)


def rng_state() -> dict:
    """Every generator the training draws from (data order, dropout), as a checkpoint stores them."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict):
    """Restores what rng_state returned; a checkpoint written on a GPU loads on a CPU-only machine too."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def load_checkpoint(path: str, model, optimizer, scheduler, scaler) -> int:
    """Restores everything Checkpointer.write wrote; returns the optimizer step to continue from. A sharded
    checkpoint is read by every rank together (a collective), into a model sharded the same way."""
    state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=True)
    if os.path.isdir(os.path.join(path, SHARDS)):
        load_shards(path, model, optimizer, trainable_only=has_lora(model))
    elif os.path.isfile(os.path.join(path, TRAINABLE)):
        load_trainable(model, os.path.join(path, TRAINABLE))
    else:
        load_weights(model, path)
    if "optimizer" in state:
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    set_rng_state(state["rng"])
    return read_marker(path)["step"]


class Checkpointer:
    """The trainer's checkpoints: checkpoint-<step>/ when --save-every says so or the run stops early, and
    final/ at the end; `before_save` first (the divergence check: it raises rather than save non-finite
    weights). parallel: prm.training.sharding.Parallel, the model as the loop runs it."""

    def __init__(self, cfg, rt, parallel, *, every: int, optimizer, scheduler, scaler, tokenizer, before_save,
                 digests: dict):
        self.cfg, self.rt, self.parallel, self.digests = cfg, rt, parallel, digests
        self.before_save, self.interval = before_save, every  # every: steps between saves, 0: a stop's only
        self.optimizer, self.scheduler, self.scaler, self.tokenizer = optimizer, scheduler, scaler, tokenizer

    def save(self, step: int, *, stopping: bool = False):
        if not (stopping or (self.interval and step % self.interval == 0)):
            return
        self.before_save()
        barrier(self.rt)
        if self.cfg.fsdp:  # every rank writes its shards into the temporary directory rank 0 then completes
            tmp = checkpoint_dir(self.cfg.output_dir, step) + ".tmp"
            if self.rt.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            barrier(self.rt)
            model = self.parallel.model
            try:
                with reported(checkpoint_dir(self.cfg.output_dir, step)):
                    save_shards(tmp, model, self.optimizer, trainable_only=has_lora(model))
            except WriteFailed:  # every rank gets dcp's error: no half-written shards stay
                if self.rt.is_main:
                    shutil.rmtree(tmp, ignore_errors=True)
                raise
            barrier(self.rt)
        if self.rt.is_main:
            self.write(step)
        barrier(self.rt)

    def write(self, step: int):
        """Rank 0's part of checkpoint-<step>: everything resume needs (weights, optimizer, scheduler, scaler,
        RNG) and what eval.py reads, assembled in a temporary directory and renamed into place. The marker,
        written last, holds every file's checksum and the data's content digests, which a resume must match.
        Under --fsdp every rank wrote the weights and optimizer state into <tmp>/shards first."""
        cfg, model = self.cfg, self.parallel.model
        with written_in_place(checkpoint_dir(cfg.output_dir, step), fresh=not cfg.fsdp) as tmp:
            state = {"scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                     "rng": rng_state()}
            if cfg.fsdp:
                self.tokenizer.save_pretrained(tmp)
                cfg.save(tmp)
            else:
                write_model_dir(tmp, model, self.tokenizer, cfg, trainable_only=has_lora(model))
                state["optimizer"] = self.optimizer.state_dict()
            torch.save(state, os.path.join(tmp, "trainer_state.pt"))
            marker = {"step": step, "world_size": self.rt.world_size, "data": self.digests or {},
                      "sha256": file_digests(tmp)}
            with open(os.path.join(tmp, MARKER), "w") as f:
                json.dump(marker, f)
        prune(cfg.output_dir, cfg.keep_last)

    def save_final(self, step: int) -> str:
        """final/, written atomically: a plain HF token classifier (adapters merged; a LoRA run's adapter in
        final/adapter too), tokenizer, config. Returns its path on rank 0, None elsewhere. If final/ cannot be
        written, the weights trained are not lost with it (kept_instead)."""
        self.before_save()
        barrier(self.rt)
        state = self.parallel.full_state()  # a collective: every rank sends its shards
        path = os.path.join(self.cfg.output_dir, "final")
        if self.rt.is_main:
            try:
                with written_in_place(path) as tmp:
                    write_model_dir(tmp, self.parallel.model, self.tokenizer, self.cfg, state=state)
            except WriteFailed as e:
                raise WriteFailed(f"{e}; {self.kept_instead(step)}") from e.__cause__
            prune(self.cfg.output_dir, self.cfg.keep_last)  # a resumed run may save no checkpoint to prune
        barrier(self.rt)
        return path if self.rt.is_main else None

    def kept_instead(self, step: int) -> str:
        """Where the weights of `step` are when final/ could not be written: in a complete checkpoint, written
        now if need be (not under --fsdp: rank 0 alone cannot write a sharded one), or lost."""
        ckpt = checkpoint_dir(self.cfg.output_dir, step)
        if not os.path.isfile(os.path.join(ckpt, MARKER)):
            if self.cfg.fsdp:
                return f"the weights of step {step} are lost: no checkpoint holds them"
            try:
                self.write(step)
            except WriteFailed as e:
                return f"{ckpt} could not be written either ({e.cause}): the weights of step {step} are lost"
        return (f"the weights of step {step} are kept in {ckpt}: free space, then export final/ with "
                "--resume auto")
