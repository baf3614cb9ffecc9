"""One run per output directory: a directory that already holds a run is refused at start-up unless that run
is continued (--resume) or replaced (--overwrite), so no run ever appends to another's records. Depends on:
prm.training.checkpoint, prm.errors."""
import os
import shutil

from prm.training.checkpoint import resolve_resume
from prm.errors import check

RUN_FILES = ("metrics.jsonl", "final")  # with (abandoned-)checkpoint-*: what makes a directory hold a run
ALSO_WRITTEN = ("config.train.json", "tensorboard")  # a run's too; --overwrite removes them with the rest


def run_files(output_dir: str) -> list:
    """The names in output_dir that belong to a run, sorted ([] for a missing or empty directory)."""
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    return sorted(n for n in names
                  if n in RUN_FILES or n.startswith(("checkpoint-", "abandoned-checkpoint-")))


def prepare_output_dir(cfg):
    """Called once at start-up, by one process (rank 0), before any data loads. A directory holding a run is
    refused (exit status 2, every file untouched) unless --resume continues a checkpoint of that same run or
    --overwrite replaces it; with --overwrite, it deletes what a run writes there, and only that (the
    directory may hold other files). Returns the checkpoint to resume (None: a fresh start), checksummed."""
    out, found = cfg.output_dir, run_files(cfg.output_dir)
    if cfg.overwrite and cfg.resume:
        check(["--overwrite and --resume exclude each other: replace the run, or continue it"])
    ckpt = resolve_resume(cfg.resume, out) if cfg.resume else None
    if not found:
        return ckpt
    shown = [n + "/" if os.path.isdir(os.path.join(out, n)) else n for n in found]
    listing = f"{out} already holds a run ({', '.join(shown)})"
    if cfg.resume:
        if ckpt and os.path.dirname(os.path.abspath(ckpt)) == os.path.abspath(out):
            return ckpt  # continuing this very run: its records go on where the checkpoint left them
        check([f"{listing}, and --resume {cfg.resume} "
               + ("finds no complete checkpoint in it to continue from" if cfg.resume == "auto"
                  else "is a checkpoint of another directory")
               + "; pass --overwrite (without --resume) to replace it, or choose another --output-dir"])
    if not cfg.overwrite:
        check([f"{listing}; pass --resume auto to continue it, --overwrite to replace it, or choose another "
               "--output-dir"])
    for name in found + [n for n in ALSO_WRITTEN if os.path.exists(os.path.join(out, n))]:
        path = os.path.join(out, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
