"""Evaluate a PRM (ours or any HF 2-label token classifier): step metrics, ProcessBench F1, outcome AUROC, as one JSON object. Depends on: prm, transformers."""
import argparse
import json
import os
import sys

import torch

from prm.checkpoint import TRAINABLE, load_trainable
from prm.config import Config, build_parser
from prm.data import IGNORE, check_tokenized, cut_tokenized, pad_token_id
from prm.evaluate import predict, report, score_batch, true_first_error
from prm.metrics import first_error, tune_threshold
from prm.model import PRM, load_tokenizer
from prm.runtime import autocast_dtype, barrier, main_first, setup, teardown
from prm.sources import exit_on_data_error, load_eval
from prm.trainer import model_for

EXTRA = ("predictions", "processbench", "tune_threshold")


def parse_args(argv=None):
    """Every training flag is accepted; those not given come from the run's saved config beside the model.

    Returns (config, the eval-only options, the names of the config fields given on the command line)."""
    p = build_parser(Config, description=__doc__)
    for a in p._actions:  # on the actions, not set_defaults: that would put the SUPPRESS string in the namespace
        a.default = argparse.SUPPRESS
        if a.dest == "dataset":
            a.nargs = "+"
            a.help = ("one or more sources, each evaluated whole (default: the run's held-out set); several give "
                      "one block per subset and their mean F1")
    p.add_argument("--predictions", default="", metavar="OUT_JSONL",
                   help="write one JSON line per example: id, per-step P(correct), truth, predicted first error")
    p.add_argument("--processbench", action="store_true",
                   help="ProcessBench metrics even when the data has no first_error column (taken from the labels)")
    p.add_argument("--tune-threshold", default="", metavar="DEV_FILE",
                   help="pick the threshold maximizing ProcessBench F1 on this set, then use it everywhere")
    args = vars(p.parse_args(argv))
    if "model" not in args:
        p.error("--model is required: a directory written by train.py or any 2-label token-classification model")
    opts = {k: args.pop(k) for k in EXTRA}
    opts["datasets"] = args.pop("dataset", [])
    saved = os.path.join(args["model"], "config.train.json")
    base = Config.from_dict(json.load(open(saved))) if os.path.isfile(saved) else Config()
    if opts["datasets"] and "format" not in args:  # the run's training format says nothing about new files
        args["format"] = "auto"
    return Config.from_dict({**base.__dict__, **args}).resolve(), opts, set(args)


def load_model(cfg: Config, given: set, device):
    """The tokenizer saved beside the model wins unless --tokenizer is given; label 1 must mean 'correct'."""
    from transformers import AutoConfig
    if os.path.isfile(os.path.join(cfg.model, TRAINABLE)):  # a LoRA run's checkpoint: base + adapters + head
        return load_lora_checkpoint(cfg, device)
    hf_cfg = AutoConfig.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    if not any(a.endswith("ForTokenClassification") for a in hf_cfg.architectures or []):
        raise SystemExit(f"{cfg.model}: not a token-classification checkpoint (architectures "
                         f"{hf_cfg.architectures}); a PRM needs its trained 2-label head")
    own = os.path.join(cfg.model, "tokenizer_config.json")
    name = cfg.tokenizer if cfg.tokenizer and ("tokenizer" in given or not os.path.isfile(own)) else cfg.model
    tokenizer = load_tokenizer(name, cfg.trust_remote_code)
    model = PRM.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code, dtype=torch.float32)
    names = {int(i): str(n).lower() for i, n in (hf_cfg.id2label or {}).items()}
    positive = {"correct", "positive", "good", "+", "true", "yes"}
    if names.get(0) in positive and names.get(1) not in positive:  # a checkpoint that put 'correct' first
        with torch.no_grad():
            model.head.weight.copy_(model.head.weight.flip(0))
            if model.head.bias is not None:
                model.head.bias.copy_(model.head.bias.flip(0))
    return tokenizer, model.to(device)


def load_lora_checkpoint(cfg: Config, device):
    """The frozen base rebuilt from the run's own --model (and seed, for 'tiny'), then its adapters and head."""
    with open(os.path.join(cfg.model, "config.train.json")) as f:
        run = Config.from_dict(json.load(f))
    tokenizer = load_tokenizer(cfg.model, cfg.trust_remote_code)
    model = model_for(run, tokenizer)  # its LoRA dropout is off in evaluation: predict() puts the model in eval mode
    load_trainable(model, os.path.join(cfg.model, TRAINABLE))
    return tokenizer, model.to(device)


def load_rows(cfg: Config, sources: list, rt, tokenizer) -> dict:
    """{subset name: rows}; rank 0 loads first so the other ranks read the datasets cache it filled.

    Pre-tokenized rows are checked against the tokenizer, then read as steps (as_steps)."""
    names = [os.path.splitext(os.path.basename(s.rstrip("/")))[0] for s in sources]
    names = names if len(set(names)) == len(names) else sources
    with exit_on_data_error(), main_first(rt):
        sets = {name: load_eval(cfg, s) for name, s in zip(names, sources)} if sources else \
            {"held-out": load_eval(cfg)}
        for ds in sets.values():
            if "input_ids" in ds.column_names:
                check_tokenized(ds, tokenizer, cfg)
        return {name: [as_steps(r) if "input_ids" in r else r for r in ds.to_list()] for name, ds in sets.items()}


def as_steps(row: dict) -> dict:
    """A pre-tokenized row as report() reads it: its labeled positions are its steps."""
    labels = [y for y in row["labels"] if y != IGNORE]
    return {**row, "token_labels": row["labels"], "labels": labels, "completions": [None] * len(labels)}


def main(argv=None):
    cfg, opts, given = parse_args(argv)
    rt = setup()
    try:
        tokenizer, model = load_model(cfg, given, rt.device)
        amp = autocast_dtype(cfg.dtype, rt.device)
        batch_size = cfg.eval_batch_size

        def scores(rows):
            if rows and "input_ids" in rows[0]:  # pre-tokenized: cut at --max-length as in training
                cut = cut_tokenized({"input_ids": [r["input_ids"] for r in rows],
                                     "labels": [r["token_labels"] for r in rows]}, cfg.max_length, is_eval=True)
                tok = [{"input_ids": i, "labels": y} for i, y in zip(cut["input_ids"], cut["labels"])]
                return [ps for ps, _ in predict(model, tok, batch_size, pad_token_id(tokenizer), rt.device, amp, rt)]
            return score_batch(model, tokenizer, [(r["prompt"], r["completions"]) for r in rows], cfg.step_separator,
                               cfg.max_length, batch_size, amp, rt, progress=True,
                               max_completion_length=cfg.max_completion_length)

        head = {"threshold": cfg.threshold}
        if opts["tune_threshold"]:
            dev = load_rows(cfg, [opts["tune_threshold"]], rt, tokenizer).popitem()[1]
            kept = [(ps, r) for ps, r in zip(scores(dev), dev) if ps]
            t, f1 = tune_threshold([ps for ps, _ in kept], [true_first_error(r) for _, r in kept])
            head = {"threshold": t, "threshold_tuned_on": opts["tune_threshold"], "dev_f1": f1}
        threshold = head["threshold"]
        blocks, lines = {}, []
        for name, rows in load_rows(cfg, opts["datasets"], rt, tokenizer).items():
            pb = opts["processbench"] or cfg.format == "processbench" or bool(rows and "first_error" in rows[0])
            probs = scores(rows)
            blocks[name] = report(probs, rows, threshold, pb)
            for i, (ps, row) in enumerate(zip(probs, rows)):
                line = {"subset": name, "id": row.get("id", i), "step_probs": ps, "labels": row["labels"]}
                if pb:
                    line.update(first_error_pred=first_error(ps, threshold), first_error=true_first_error(row))
                if row.get("final_answer_correct") is not None:
                    line["final_answer_correct"] = row["final_answer_correct"]
                lines.append(line)
        if len(blocks) == 1:
            out = {**head, **blocks.popitem()[1]}
        else:
            f1s = [b.get("f1") for b in blocks.values()]
            mean_f1 = sum(f1s) / len(f1s) if all(f is not None for f in f1s) else None
            out = {**head, "subsets": blocks, "mean_f1": mean_f1}
        if rt.is_main:
            for name, block in ([("", out)] if "subsets" not in out else out["subsets"].items()):
                if block["examples_truncated"] or block["examples_dropped"]:
                    print(f"warning: {name or 'data'}: {block['examples_truncated']} examples truncated (their cut "
                          f"steps are unscored), {block['examples_dropped']} dropped (no step fits); raise "
                          f"--max-length (now {cfg.max_length})" + (f" or --max-completion-length (now "
                          f"{cfg.max_completion_length})" if cfg.max_completion_length else ""), file=sys.stderr)
            if opts["predictions"]:
                with open(opts["predictions"], "w") as f:
                    f.writelines(json.dumps(line) + "\n" for line in lines)
            print(json.dumps(out), flush=True)
        barrier(rt)  # no rank tears the process group down while another is still talking to it
        return out
    finally:
        teardown(rt)


if __name__ == "__main__":
    main()
