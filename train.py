"""Train a process reward model: `python train.py` (offline default) or `torchrun ... train.py --model ...`.
Depends on: prm."""
import json

from prm.config import parse_config
from prm.errors import exit_status

if __name__ == "__main__":
    with exit_status():  # a bad flag, file or setting: one line on stderr and exit status 2
        cfg = parse_config()  # before torch, datasets and transformers load: --help answers in a blink
    from prm.card import launch_command
    from prm.sources import exit_on_data_error
    from prm.trainer import train
    with exit_status(), exit_on_data_error():  # bad rows: exit status 2, a one-screen message, no traceback
        final = train(cfg, launch_command())
    if final is not None:
        summary = {k: v for k, v in final.items() if k not in ("train_data", "eval_data")}
        print(json.dumps(summary), flush=True)
