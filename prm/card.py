"""The model card (README.md) written into final/: what the model is, how it scores, its metrics and the command. Depends on: prm.sources."""
import os
import shlex
import sys

from prm.sources import is_local

CITATIONS = """\
@article{uesato2022solving,
  title   = {Solving math word problems with process- and outcome-based feedback},
  author  = {Uesato, Jonathan and Kushman, Nate and Kumar, Ramana and Song, Francis and Siegel, Noah and
             Wang, Lisa and Creswell, Antonia and Irving, Geoffrey and Higgins, Irina},
  journal = {arXiv preprint arXiv:2211.14275},
  year    = {2022}
}

@article{lightman2023lets,
  title   = {Let's Verify Step by Step},
  author  = {Lightman, Hunter and Kosaraju, Vineet and Burda, Yura and Edwards, Harri and Baker, Bowen and
             Lee, Teddy and Leike, Jan and Schulman, John and Sutskever, Ilya and Cobbe, Karl},
  journal = {arXiv preprint arXiv:2305.20050},
  year    = {2023}
}"""

NOT_HELD_OUT = ("train_tokens_per_second", "padding_efficiency")  # training figures; the first also varies per run


def launch_command(argv=None, env=None) -> str:
    """This process's command line; under torchrun, the torchrun line that started it (rendezvous flags omitted)."""
    argv, env = list(sys.argv if argv is None else argv), os.environ if env is None else env
    if "LOCAL_WORLD_SIZE" in env:
        local, world = int(env["LOCAL_WORLD_SIZE"]), int(env["WORLD_SIZE"])
        nodes = f"--nnodes {world // local} " if world > local else ""
        return f"torchrun {nodes}--nproc_per_node {local} " + shlex.join(argv)
    return "python " + shlex.join(argv)


def config_command(cfg) -> str:
    """An equivalent `python train.py` line for a run started from Python: every setting that is not the default."""
    default, args = type(cfg)(), []
    for name, value in vars(cfg).items():
        if value != getattr(default, name):
            flag = "--" + name.replace("_", "-")
            args += [flag if value else "--no-" + flag[2:]] if isinstance(value, bool) else [flag, str(value)]
    return "python " + shlex.join(["train.py"] + args)


def model_card(cfg, metrics: dict, command: str) -> str:
    """Deterministic markdown: the same run gives the same text byte for byte (no dates, no timings)."""
    base = "a 3-layer, 128-wide Qwen2 decoder initialized at random (`--model tiny`)" if cfg.model == "tiny" \
        else f"`{cfg.model}`"
    datasets = [d for d in (cfg.dataset, cfg.eval_dataset) if d]
    header = ["---", "library_name: transformers", "pipeline_tag: token-classification",
              "tags: [process-reward-model, prm]"]
    header += [f"base_model: {cfg.model}"] if cfg.model != "tiny" else []
    hub = [d for d in datasets if d != "synthetic" and not is_local(d)]  # hub metadata names hub datasets only
    header += (["datasets:"] + [f"- {d}" for d in hub] if hub else []) + ["---"]
    method = (f"LoRA (rank {cfg.lora_r}, alpha {cfg.lora_alpha:g}, dropout {cfg.lora_dropout:g}, targets "
              f"`{cfg.lora_targets}`), merged into the weights; the 2-way head fully trained") if cfg.lora_r \
        else "full fine-tuning of every weight"
    rows = [(k, v) for k, v in metrics.items() if k not in NOT_HELD_OUT and not isinstance(v, (dict, list))]
    table = ["| metric | value |", "|---|---|"] + [
        f"| {k} | {'n/a' if v is None else f'{v:.4f}' if isinstance(v, float) else v} |" for k, v in rows]
    return "\n".join(header + [
        "", "# Process reward model", "",
        f"A process reward model (PRM) trained from {base} on `{cfg.dataset}` with `prm`, "
        f"by {method}. For every step of a solution it gives the probability that the step is correct.",
        "", "## How it scores", "",
        "- Architecture: the backbone plus a linear head with 2 outputs per token; it loads with "
        "`AutoModelForTokenClassification`.",
        "- Labels: class 1 = `correct`, class 0 = `incorrect` (`id2label` in `config.json`); "
        "P(correct) = softmax(logits)[..., 1].",
        f"- Step separator: `{cfg.step_separator!r}`.",
        "- Tokens: the prompt's ids (BOS first only if the tokenizer has one), then for each step ids(step) + "
        "ids(separator), each piece tokenized on its own without special tokens. A step's score is read at the "
        "LAST token of its separator; scores elsewhere mean nothing. Build inputs exactly this way "
        "(`prm.data.tokenize_example`, `prm.evaluate.score`): joining the text and tokenizing it once gives other "
        "ids with BPE tokenizers.",
        f"- Training: {cfg.batch_size} examples per device x {cfg.grad_accum} accumulation steps, peak learning "
        f"rate {cfg.lr:g}, seed {cfg.seed}; at most {cfg.max_length} tokens per example"
        + (f" and {cfg.max_completion_length} tokens of steps" if cfg.max_completion_length else "")
        + (", on the last step's label only" if cfg.train_on_last_step_only else "") + ".",
        "", "## Held-out metrics", "",
        f"On {f'`{cfg.eval_dataset}`' if cfg.eval_dataset else 'the held-out part of the training source'}; a step "
        f"counts as predicted correct when P(correct) >= {cfg.threshold:g}; class 0 = incorrect step.", ""] + table + [
        "", "## Command", "", "```bash", command, "```", "",
        "## Citations", "", "Process supervision was introduced and studied in:", "", "```bibtex", CITATIONS, "```", ""])
