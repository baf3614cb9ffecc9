"""metrics.jsonl's records and the config sent to TensorBoard or W&B."""
import dataclasses
import importlib
import os
import textwrap

from prm.errors import check


def require(report_to: str):
    """The tracker's module (None for 'none')."""
    if report_to == "none":
        return None
    name = "torch.utils.tensorboard" if report_to == "tensorboard" else "wandb"
    try:
        return importlib.import_module(name)
    except ImportError:
        check([f"--report-to {report_to} needs the {report_to} package: pip install {report_to}"])


def scalars(record: dict) -> dict:
    """A metrics.jsonl record -> {tag: number}: train/loss, eval/auroc, ..."""
    if "final" in record:
        items = {f"final/{k}": v for k, v in record["final"].items()}
    else:
        items = {(f"eval/{k.removeprefix('eval_')}" if k.startswith("eval_") else f"train/{k}"): v
                 for k, v in record.items() if k != "step"}
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    return {k: float(v) for k, v in items.items() if number(v)}


class Tracker:
    """TensorBoard (<output-dir>/tensorboard/<run name>) or W&B ($WANDB_PROJECT)."""

    def __init__(self, cfg, resumed_at: int = 0):
        self.kind, module = cfg.report_to, require(cfg.report_to)
        name = cfg.run_name or os.path.basename(os.path.abspath(cfg.output_dir))
        if self.kind == "tensorboard":
            log_dir = os.path.join(cfg.output_dir, "tensorboard", name)
            purge = resumed_at + 1 if resumed_at else None  # resumed: later events go
            self.writer = module.SummaryWriter(log_dir=log_dir, purge_step=purge)
            # indented: verbatim in TensorBoard's markdown
            self.writer.add_text("config", textwrap.indent(cfg.to_json(), "    "))
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
