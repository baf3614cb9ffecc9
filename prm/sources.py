"""Load train/held-out rows in the stepwise format (prompt, completions, labels[, id]) from any source. Depends on: datasets, prm.synthetic."""
import os
import random

from datasets import Dataset, load_dataset

LOCAL_EXT = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def load_source(spec: str, split: str, cfg) -> Dataset:
    """A local file, a directory of files, or a hub dataset name."""
    if os.path.isdir(spec):
        files = sorted(os.path.join(spec, f) for f in os.listdir(spec) if os.path.splitext(f)[1] in LOCAL_EXT)
        if not files:
            raise SystemExit(f"{spec}: no .jsonl/.json/.parquet files in this directory")
        return load_dataset(LOCAL_EXT[os.path.splitext(files[0])[1]], data_files=files, split="train")
    ext = os.path.splitext(spec)[1]
    if ext in LOCAL_EXT:
        if not os.path.isfile(spec):
            raise SystemExit(f"{spec}: no such file")
        return load_dataset(LOCAL_EXT[ext], data_files=spec, split="train")
    return load_dataset(spec, cfg.dataset_config or None, split=split)


def split_by_prompt(ds: Dataset, fraction: float, seed: int):
    """Seeded held-out share, split by prompt so one problem never sits on both sides."""
    prompts = sorted({str(p) for p in ds["prompt"]})
    random.Random(seed).shuffle(prompts)
    held = set(prompts[: max(1, round(len(prompts) * fraction))])
    is_held = [str(p) in held for p in ds["prompt"]]
    return (ds.select([i for i, h in enumerate(is_held) if not h]),
            ds.select([i for i, h in enumerate(is_held) if h]))


def load_splits(cfg):
    """(train, held-out) datasets with columns prompt, completions, labels and, when the data has one, id."""
    if cfg.dataset == "synthetic":
        from prm.synthetic import train_eval_rows
        train, held = train_eval_rows(cfg.synthetic_size, cfg.seed)
        return Dataset.from_list(train), Dataset.from_list(held)
    train = load_source(cfg.dataset, cfg.train_split, cfg)
    if cfg.eval_dataset:
        return train, load_source(cfg.eval_dataset, cfg.eval_split, cfg)
    if not any(cfg.dataset.endswith(e) for e in LOCAL_EXT) and not os.path.isdir(cfg.dataset):
        try:
            return train, load_source(cfg.dataset, cfg.eval_split, cfg)
        except ValueError:  # the hub dataset has no such split: hold out a share below
            pass
    return split_by_prompt(train, cfg.eval_fraction, cfg.seed)


def load_eval(cfg, whole: str = ""):
    """`whole`: evaluate all of that source; otherwise the held-out set a run used, rebuilt from its config."""
    if whole and whole != "synthetic":
        return load_source(whole, cfg.eval_split, cfg)
    return load_splits(cfg)[1]
