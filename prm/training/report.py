"""The model card (final/README.md) and the TensorBoard or W&B tracker."""
import dataclasses
import importlib
import os
import shlex
import sys
import textwrap
from importlib.metadata import version

import yaml
from huggingface_hub import ModelCard, ModelCardData, try_to_load_from_cache

from prm.errors import check
from prm.readers.sources import is_local

# the snippet tokenizes as prm.core.data does
TEMPLATE = '''---
{{ card_data }}
---

# Process reward model

Trained by `prm` from {{ "a random tiny Qwen2" if tiny else "`%s`" % cfg.model }} on \
`{{ cfg.dataset }}` by {% if cfg.lora_r %}LoRA (rank {{ cfg.lora_r }}, alpha \
{{ g(cfg.lora_alpha) }}), merged{% else %}full fine-tuning{% endif %} (settings: \
`config.train.json`). An `AutoModelForTokenClassification`, class 1 = `correct`. Step separator: \
`{{ sep }}`; a step is scored at the LAST token of its separator, each piece tokenized alone:

```python
import torch
from transformers import AutoModelForTokenClassification, AutoTokenizer

MODEL = "."  # this folder, or its hub id
tok = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForTokenClassification.from_pretrained(MODEL).eval()
sep = model.config.prm["step_separator"]


def score(prompt, steps):
    piece = lambda text: tok(text, add_special_tokens=False)["input_ids"]
    ids = ([tok.bos_token_id] if tok.bos_token_id is not None else []) + piece(prompt)
    ends = []
    for step in steps:
        ids += piece(step) + piece(sep)
        ends.append(len(ids) - 1)
    with torch.no_grad():
        probs = model(torch.tensor([ids])).logits.float().softmax(-1)[0, :, 1]
    return probs[ends].tolist()
```

Held-out metrics{{ " on `%s`" % cfg.eval_dataset if cfg.eval_dataset }}, a step correct when \
P(correct) >= {{ g(cfg.threshold) }}:

{{ table }}

Base model license: {{ license or ("none: random initialization" if tiny else "unknown") }}. \
Trained with torch {{ version('torch') }}, transformers {{ version('transformers') }}. Cite: \
Uesato et al. 2022, arXiv:2211.14275; Lightman et al. 2023, arXiv:2305.20050. The command:

```bash
{{ command }}
```

'''  # jinja drops the last newline


def launch_command(argv=None, env=None) -> str:
    """The command line; under torchrun, its torchrun line (no rendezvous flags)."""
    argv, env = sys.argv if argv is None else argv, os.environ if env is None else env
    if "LOCAL_WORLD_SIZE" in env:
        local, world = int(env["LOCAL_WORLD_SIZE"]), int(env["WORLD_SIZE"])
        nodes = f"--nnodes {world // local} " if world > local else ""
        return f"torchrun {nodes}--nproc_per_node {local} " + shlex.join(argv)
    return "python " + shlex.join(argv)


def config_command(cfg) -> str:
    """For a run started from Python: `python train.py` and every non-default setting."""
    default, args = type(cfg)(), []
    for name, value in vars(cfg).items():
        if value != getattr(default, name):
            flag = "--" + name.replace("_", "-")
            bool_flag = flag if value else "--no-" + flag[2:]
            args += [bool_flag] if isinstance(value, bool) else [flag, str(value)]
    return "python " + shlex.join(["train.py"] + args)


def base_license(model: str) -> str:
    """From the base model's local or cached card, or ''; offline."""
    try:
        card = (os.path.join(model, "README.md") if os.path.isdir(model)
                else try_to_load_from_cache(model, "README.md"))
        found = isinstance(card, str) and os.path.isfile(card)  # not None nor a "missing" marker
        return str(ModelCard.load(card).data.license or "") if found else ""
    except (ValueError, yaml.YAMLError):  # not a hub id; front matter that is not a mapping
        return ""


def model_card(cfg, metrics: dict, command: str) -> str:
    """Deterministic markdown: no dates, no timings."""
    tiny = cfg.model == "tiny"
    license = "" if tiny else base_license(cfg.model)
    # hub metadata names hub models and datasets only
    hub = [d for d in (cfg.dataset, cfg.eval_dataset) if d and d != "synthetic" and not is_local(d)]
    data = ModelCardData(library_name="transformers", pipeline_tag="token-classification",
                         tags=["process-reward-model", "prm"], license=license or None,
                         datasets=hub or None,
                         base_model=None if tiny or os.path.exists(cfg.model) else cfg.model)
    # not the data reports nor the training figures
    rows = [f"| {k} | {shown(v)} |" for k, v in metrics.items() if not isinstance(v, (dict, list))
            and k not in ("train_tokens_per_second", "padding_efficiency")]
    return str(ModelCard.from_template(
        data, template_str=TEMPLATE, cfg=cfg, tiny=tiny, sep=repr(cfg.step_separator),
        table="\n".join(["| metric | value |", "|---|---|"] + rows), license=license,
        command=command, version=version, g=lambda x: f"{x:g}"))


def shown(v) -> str:
    return "n/a" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v)


def tracker_module(report_to: str):
    """None for 'none'; UsageError if not installed."""
    if report_to == "none":
        return None
    name = "torch.utils.tensorboard" if report_to == "tensorboard" else "wandb"
    try:
        return importlib.import_module(name)
    except ImportError:
        check([f"--report-to {report_to} needs the {report_to} package: pip install {report_to}"])


def scalars(record: dict) -> dict:
    """A metrics.jsonl record -> {tag: number}: train/loss, eval/auroc, final/f1, ..."""
    if "final" in record:
        items = {f"final/{k}": v for k, v in record["final"].items()}
    else:
        items = {("eval/" + k[5:] if k.startswith("eval_") else "train/" + k): v
                 for k, v in record.items() if k != "step"}
    return {k: float(v) for k, v in items.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


class Tracker:
    """TensorBoard (<output-dir>/tensorboard/<run name>) or W&B ($WANDB_PROJECT)."""

    def __init__(self, cfg, resumed_at: int = 0):
        module = tracker_module(cfg.report_to)
        name = cfg.run_name or os.path.basename(os.path.abspath(cfg.output_dir))
        self.run = None
        if cfg.report_to == "wandb":
            self.run = module.init(project=os.environ.get("WANDB_PROJECT", "prm"), name=name,
                                   config=dataclasses.asdict(cfg), dir=cfg.output_dir)
            return
        log_dir = os.path.join(cfg.output_dir, "tensorboard", name)
        purge = resumed_at + 1 if resumed_at else None  # resumed: later events go
        self.writer = module.SummaryWriter(log_dir=log_dir, purge_step=purge)
        # indented: verbatim in TensorBoard's markdown
        self.writer.add_text("config", textwrap.indent(cfg.to_json(), "    "))

    def log(self, record: dict):
        if self.run:
            self.run.log(scalars(record), step=record["step"])
            return
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, record["step"])
        self.writer.flush()  # a crash keeps the curve up to here

    def close(self):
        if self.run:
            self.run.finish()
        else:
            self.writer.close()
