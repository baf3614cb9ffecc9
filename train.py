"""Train a process reward model: `python train.py` (offline default) or `torchrun ... train.py --model ...`.
Depends on: prm."""
import json

from prm.cli import parse_config
from prm.errors import exit_status

if __name__ == "__main__":
    with exit_status():  # bad flags or rows: one line and exit status 2; a failed write: 1; divergence: 3
        cfg = parse_config()  # before torch and transformers load: --help and a bad flag answer at once
        from prm.training.card import launch_command
        from prm.training.trainer import train_resolved
        results = train_resolved(cfg, launch_command())
    if results is not None:
        summary = {k: v for k, v in results.items() if k not in ("train_data", "eval_data")}
        print(json.dumps(summary), flush=True)
