"""A run's output directory, checkpoints and resume: the Checkpointer, and run_lock, which keeps a
second run out of the directory."""
import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import stat
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

from prm.core.lora import has_lora
from prm.core.model import load_weights
from prm.core.runtime import barrier, decided_by_main, gather_objects
from prm.errors import UsageError, WriteFailed, check, overwrites
from prm.files import locked, staged_folder, write_lines, writing
from prm.readers.sources import data_digest
from prm.training.export import TRAINABLE, load_trainable, write_model_dir
from prm.training.sharding import SHARDS, load_shards, save_shards

# written last, with every file's checksum: a checkpoint without it is a crashed save, never resumed
MARKER = "complete.json"
NOT_REGULAR = "not a regular file"
# set aside by a resume from an older step
ABANDONED = "abandoned-"
# with (abandoned-)checkpoint-*, what makes a directory hold a run
RUN_FILES = ("metrics.jsonl", "final")
# also removed by --overwrite
ALSO_WRITTEN = ("config.train.json", "tensorboard")
LOCK = ".lock"


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


def files_under(path: str) -> list:
    """The sorted relative paths of the files under a directory."""
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
    """Files whose checksum differs from the marker's (missing ones included), then the not
    regular ones."""
    expected, found = read_marker(path).get("sha256", {}), file_digests(path)
    strange = {name for name, digest in found.items() if digest == NOT_REGULAR}
    differ = {name for name, digest in expected.items() if found.get(name) != digest}
    return sorted(differ - strange) + [f"{name} ({NOT_REGULAR})" for name in sorted(strange)]


def resolve_resume(resume: str, output_dir: str):
    """`resume` itself, or with 'auto' the newest complete undamaged checkpoint (None: none)."""
    if resume != "auto":
        if not os.path.isfile(os.path.join(resume, MARKER)):
            check([f"--resume {resume}: not a complete checkpoint (no {MARKER})"])
        if damaged := ", ".join(damaged_files(resume)):
            check([f"--resume {resume}: damaged checkpoint (checksum mismatch): {damaged}"])
        return resume
    for path in reversed(complete_checkpoints(output_dir)):
        if not (damaged := ", ".join(damaged_files(path))):
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
    """Renames checkpoint-<n> with n > step to abandoned-checkpoint-<n>(.2, .3, ...), which prune
    and resume ignore."""
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
    """Holds <output_dir>/.lock for the run: a second run there is a UsageError. A directory made
    here and left empty is removed."""
    made = not os.path.isdir(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    try:
        with locked(output_dir, os.path.join(output_dir, LOCK)):
            yield
    finally:
        if made:
            with contextlib.suppress(OSError):
                os.rmdir(output_dir)


def rng_state() -> dict:
    """Every generator the training draws from (data order, dropout)."""
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


class Checkpointer:
    """Resume and checkpoints. At start-up rank 0 picks the checkpoint to resume (resume_from,
    None: a fresh start) and hashes the data files (digests: {"train", "eval"}, '' for hub or
    synthetic data)."""

    def __init__(self, cfg, rt):
        self.cfg, self.rt = cfg, rt
        self.resume_from, self.digests = decided_by_main(rt, self.decide)

    def decide(self) -> tuple:
        """(the checkpoint to resume, the data digests). The settings defining the model, the data
        and its order, and the data files' contents must equal the checkpoint's, else UsageError."""
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

    def load(self, *, parallel, optimizer, scheduler, scaler, tokenizer, plan) -> int:
        """The step to continue from (0: a fresh start); on a resume, restores the trainer's state
        in place and sets aside what was written past the checkpoint."""
        self.parallel, self.optimizer = parallel, optimizer
        self.scheduler, self.scaler = scheduler, scaler
        self.tokenizer, self.interval = tokenizer, self.cfg.every("save", plan.steps_per_epoch)
        path, model = self.resume_from, parallel.model
        if not path:
            return 0
        step = read_marker(path)["step"]
        if step > plan.total:
            raise UsageError(f"--resume {path}: the checkpoint is at step {step}, past this run's "
                             f"last step {plan.total} (--max-steps, --epochs): nothing to continue")
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
        if self.rt.is_main:
            print(f"resumed from {path} at step {step}")
            set_aside_after(self.cfg.output_dir, step)
            keep_records_until(os.path.join(self.cfg.output_dir, "metrics.jsonl"), step)
        return step

    def due(self, step: int) -> bool:
        """Whether --save-every (or --save-strategy epoch) falls on `step`."""
        return bool(self.interval) and step % self.interval == 0

    def save(self, step: int):
        """checkpoint-<step>/, every rank together: under --fsdp each writes its shards, then
        checksums a share of them (faster than rank 0 alone)."""
        barrier(self.rt)
        shards = {}
        if self.cfg.fsdp:
            path = checkpoint_dir(self.cfg.output_dir, step)
            tmp = path + ".tmp"
            if self.rt.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            barrier(self.rt)
            model = self.parallel.model
            try:
                with writing(path):
                    save_shards(tmp, model, self.optimizer, trainable_only=has_lora(model))
            except WriteFailed:
                if self.rt.is_main:
                    shutil.rmtree(tmp, ignore_errors=True)
                raise
            barrier(self.rt)
            share = file_digests(tmp, files_under(tmp)[self.rt.rank::self.rt.world_size])
            shards = {k: v for part in gather_objects(share, self.rt) for k, v in part.items()}
        if self.rt.is_main:
            self.write(step, shards)
        barrier(self.rt)

    def write(self, step: int, shards: dict = None):
        """Rank 0's part of checkpoint-<step>; the marker, last, holds every file's checksum
        (shards: those of the files the ranks wrote)."""
        cfg, model, shards = self.cfg, self.parallel.model, shards or {}
        with staged_folder(checkpoint_dir(cfg.output_dir, step), fresh=not cfg.fsdp) as tmp:
            state = {"scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                     "rng": rng_state()}
            if cfg.fsdp:
                self.tokenizer.save_pretrained(tmp)
                cfg.save(tmp)
            else:
                write_model_dir(tmp, model, self.tokenizer, cfg, trainable_only=has_lora(model))
                state["optimizer"] = self.optimizer.state_dict()
            torch.save(state, os.path.join(tmp, "trainer_state.pt"))
            mine = file_digests(tmp, [n for n in files_under(tmp) if n not in shards])
            marker = {"step": step, "world_size": self.rt.world_size, "data": self.digests or {},
                      "sha256": {**shards, **mine}}
            write_lines(os.path.join(tmp, MARKER), [json.dumps(marker)])
        prune(cfg.output_dir, cfg.keep_last)

    def save_final(self, step: int) -> str:
        """final/ (a plain HF token classifier, adapters merged); its path on rank 0, else None."""
        barrier(self.rt)
        state = self.parallel.full_state()
        path = os.path.join(self.cfg.output_dir, "final")
        if self.rt.is_main:
            try:
                with staged_folder(path) as tmp:
                    write_model_dir(tmp, self.parallel.model, self.tokenizer, self.cfg, state=state)
            except WriteFailed as e:
                raise WriteFailed(f"{e}; {self.kept_instead(step)}") from e.__cause__
            prune(self.cfg.output_dir, self.cfg.keep_last)
        barrier(self.rt)
        return path if self.rt.is_main else None

    def kept_instead(self, step: int) -> str:
        """Where the weights of `step` are when final/ failed (writing a checkpoint if need be)."""
        ckpt = checkpoint_dir(self.cfg.output_dir, step)
        if not os.path.isfile(os.path.join(ckpt, MARKER)):
            if self.cfg.fsdp:
                return f"the weights of step {step} are lost: no checkpoint holds them"
            try:
                self.write(step)
            except WriteFailed as e:
                return (f"{ckpt} could not be written either ({e.cause}): the weights of step "
                        f"{step} are lost")
        return (f"the weights of step {step} are kept in {ckpt}: free space, then export final/ "
                "with --resume auto")
