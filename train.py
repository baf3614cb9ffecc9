"""Train a process reward model: `python train.py` (offline default) or `torchrun ... train.py --model ...`.
Depends on: prm."""
import json

from prm.config import parse_config

if __name__ == "__main__":
    cfg = parse_config()  # before torch, datasets and transformers load: --help and a bad flag answer in a blink
    from prm.card import launch_command
    from prm.errors import exit_status
    from prm.trainer import train
    with exit_status():  # bad rows (2), a failed write (1): a one-screen message, no traceback
        final = train(cfg, launch_command())
    if final is not None:
        summary = {k: v for k, v in final.items() if k not in ("train_data", "eval_data")}
        print(json.dumps(summary), flush=True)
