"""Optional experiment trackers: the records of metrics.jsonl, and the config once, sent to TensorBoard or
Weights & Biases from rank 0. A tracker's package, named as its --report-to value, is imported only when asked
for. Depends on: prm.errors (and tensorboard or wandb when asked for)."""
import dataclasses
import os

from prm.errors import check


def require(report_to: str):
    """The tracker's module (None for 'none'); a missing package stops start-up with one line and exit status
    2. Called on every rank, so under torchrun all ranks stop together, not only the one that would log."""
    if report_to == "none":
        return None
    try:
        if report_to == "tensorboard":
            import torch.utils.tensorboard as module  # needs the tensorboard package (ImportError without it)
        else:
            import wandb as module
    except ImportError:
        check([f"--report-to {report_to} needs the {report_to} package: pip install {report_to}"])
    return module


def scalars(record: dict) -> dict:
    """A metrics.jsonl record -> {tag: number}: train/loss, eval/step_accuracy, final/auroc, ... (None, text
    and nested reports skipped)."""
    if "final" in record:
        items = {f"final/{k}": v for k, v in record["final"].items()}
    else:
        items = {(f"eval/{k[len('eval_'):]}" if k.startswith("eval_") else f"train/{k}"): v
                 for k, v in record.items() if k != "step"}
    return {k: float(v) for k, v in items.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class Tracker:
    """Rank 0's link to TensorBoard (event files in <output-dir>/tensorboard/<run name>) or W&B (project from
    $WANDB_PROJECT, else 'prm'): log() takes each metrics.jsonl record as it is written. resumed_at: the
    checkpoint's step a resumed run continues from (0: a fresh run)."""

    def __init__(self, cfg, resumed_at: int = 0):
        self.kind, module = cfg.report_to, require(cfg.report_to)
        name = cfg.run_name or os.path.basename(os.path.abspath(cfg.output_dir))
        if self.kind == "tensorboard":
            # resumed: the events a stopped run wrote past its checkpoint are purged (as in metrics.jsonl)
            self.writer = module.SummaryWriter(log_dir=os.path.join(cfg.output_dir, "tensorboard", name),
                                               purge_step=resumed_at + 1 if resumed_at else None)
            # indented: TensorBoard renders text as markdown, and an indented block stays verbatim
            self.writer.add_text("config", "\n".join("    " + line for line in cfg.to_json().splitlines()))
        else:
            self.run = module.init(project=os.environ.get("WANDB_PROJECT", "prm"), name=name,
                                   config=dataclasses.asdict(cfg), dir=cfg.output_dir)

    def log(self, record: dict):
        values = scalars(record)
        if self.kind == "tensorboard":
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, record["step"])
            self.writer.flush()  # a crash keeps the curve up to here
        else:
            self.run.log(values, step=record["step"])

    def close(self):
        if self.kind == "tensorboard":
            self.writer.close()
        else:
            self.run.finish()
