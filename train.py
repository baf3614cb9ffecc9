"""Train a process reward model: `python train.py` or `torchrun ... train.py --model ...`."""
import json

from prm.cli import parse_config
from prm.errors import exit_status

if __name__ == "__main__":
    with exit_status():  # one line and exit status 2 (bad input), 1 (failed write), 3 (divergence)
        cfg = parse_config()  # before torch loads: --help and a bad flag answer at once
        from prm.training.card import launch_command
        from prm.training.trainer import train_resolved
        results = train_resolved(cfg, launch_command())
    if results is not None:
        summary = {k: v for k, v in results.items() if k not in ("train_data", "eval_data")}
        print(json.dumps(summary), flush=True)
