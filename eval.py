"""Evaluate a PRM (ours or any HF 2-label token classifier): step metrics, ProcessBench F1, outcome AUROC, PRMBench's
PRMScore, best-of-N, as one JSON object. Depends on: transformers, prm."""
import argparse
import json
import os
import sys

from prm.config import FILE, Config, Parser, add_field, exit_on_problems, writable

EXTRA = ("predictions", "processbench", "tune_threshold", "best_of_n", "best_of_n_draws")
# the run settings eval.py takes: how data is read, tokenized and scored; the rest (optimizer, LoRA, checkpoints,
# the held-out split) belongs to the run and comes from it
SCORING = ("tokenizer", "format", "neutral_label", "skip_invalid", "dataset_config", "eval_split", "num_proc",
           "max_length", "max_completion_length", "step_separator", "dtype", "packing", "eval_batch_size",
           "threshold", "seed", "trust_remote_code")
# the table on stderr: ProcessBench's columns when every subset has them (chance_f1: F1 of random flags), else the step's
PROCESSBENCH_COLUMNS = ("f1", "acc_error", "acc_correct", "auroc", "chance_f1")
STEP_COLUMNS = ("step_accuracy", "f1_0", "auroc", "n_steps")


def build_eval_parser() -> argparse.ArgumentParser:
    """eval.py's own options first; then the run settings it takes, whose value when not given comes from the run."""
    p = Parser(usage="%(prog)s --model DIR [options]", description=__doc__.split(" Depends on:")[0])
    p.add_argument("--model", default=argparse.SUPPRESS, help="a directory written by train.py (final/ or a "
                   "checkpoint) or any 2-label token-classification model; required")
    p.add_argument("--dataset", nargs="+", default=[], metavar="SOURCE",
                   help="one or more sources, each evaluated whole (default: the run's held-out set); several give "
                        "one block per subset and their mean F1")
    p.add_argument("--predictions", default="", metavar="OUT_JSONL",
                   help="write one JSON line per example: id, per-step P(correct), truth, predicted first error")
    p.add_argument("--processbench", action="store_true",
                   help="ProcessBench metrics even when the data has no first_error column (taken from the labels)")
    p.add_argument("--tune-threshold", default="", metavar="DEV_FILE",
                   help="pick the threshold maximizing ProcessBench F1 on this set, then use it everywhere; the "
                        "set's own metrics at it are the output's 'dev' block")
    p.add_argument("--best-of-n", action="store_true",
                   help="best-of-N accuracy per method and N; candidates of one problem share its 'group' (the "
                        "candidates format) or, in flat rows, their prompt; correctness from final_answer_correct")
    p.add_argument("--best-of-n-draws", type=int, default=8, metavar="K",
                   help="seeded shuffles (--seed) per N, each cut into disjoint subsets of N candidates")
    run = p.add_argument_group("run settings", "how to read and score the data; each flag not given comes from "
                               "the run's config.train.json beside --model (else from config.json's 'prm', else "
                               "the training default)")
    for name in SCORING:
        add_field(run, Config.__dataclass_fields__[name], suppress=True)
    return p


if __name__ == "__main__":  # --help and a bad flag answer before torch and transformers load (seconds)
    build_eval_parser().parse_args()

# the heavy imports, after the early parse above
from transformers import AutoConfig  # noqa: E402

from prm.build import load_trained  # noqa: E402
from prm.data import pad_token_id  # noqa: E402
from prm.evaluate import best_of_n_report, predict, report, true_first_error  # noqa: E402
from prm.ingest import tokenize_dataset  # noqa: E402
from prm.metrics import first_error, tune_threshold  # noqa: E402
from prm.model import input_settings  # noqa: E402
from prm.runtime import autocast_dtype, barrier, main_first, setup, teardown  # noqa: E402
from prm.errors import exit_status  # noqa: E402
from prm.sources import load_eval  # noqa: E402


def run_settings(model: str, trust_remote_code: bool) -> Config:
    """The run's saved Config beside the model; else the input settings a PRM carries in its config.json (a model
    exported without config.train.json); else the defaults."""
    if os.path.isfile(os.path.join(model, FILE)):
        return Config.load(model)
    try:
        hf = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):  # not loadable: load_trained reports it properly
        return Config()
    return Config.from_dict(input_settings(hf))


def parse_args(argv=None):
    """The run settings in SCORING are accepted; those not given come from the run's saved config beside the model.

    Returns (config, the eval-only options, the names of the config fields given on the command line)."""
    p = build_eval_parser()
    args = vars(p.parse_args(argv))
    if "model" not in args:
        p.error("--model is required: a directory written by train.py or any 2-label token-classification model")
    opts = {k: args.pop(k) for k in EXTRA}
    opts["datasets"] = args.pop("dataset")
    base = run_settings(args["model"], args.get("trust_remote_code", False))
    base.trust_remote_code = False  # only the user's own command line may allow a model's code, never a file
    if opts["datasets"] and "format" not in args:  # the run's training format says nothing about new files
        args["format"] = "auto"
    cfg = Config.from_dict({**base.__dict__, **args})
    bad_out = opts["predictions"] and not writable(opts["predictions"])
    exit_on_problems(cfg.problems() + ([f"--predictions {opts['predictions']}: not writable"] if bad_out else []))
    return cfg.resolve(), opts, set(args)


def load_sets(cfg: Config, sources: list, tokenizer, rt) -> dict:
    """{subset name: tokenized rows}, read, checked and tokenized as training does (prm.ingest), every row kept.

    Rows without a best-of-N `group` get their prompt as one. Rank 0 goes first, so the other ranks read the
    datasets cache it filled."""
    names = [os.path.splitext(os.path.basename(s.rstrip("/")))[0] for s in sources]
    names = names if len(set(names)) == len(names) else sources
    with exit_status(), main_first(rt):
        raw = {name: load_eval(cfg, s) for name, s in zip(names, sources)} if sources else \
            {"held-out": load_eval(cfg)}
        sets = {}
        for name, ds in raw.items():
            rows = tokenize_dataset(ds, tokenizer, cfg, is_eval=True, num_proc=cfg.num_proc, desc=f"tokenize {name}",
                                    drop_unlabeled=False)[0].to_list()
            if "prompt" in ds.column_names:  # flat rows: the candidates of a problem are the rows with its prompt
                for row, prompt in zip(rows, ds["prompt"][:]):
                    row["group"] = row.get("group") or (prompt if isinstance(prompt, str) else json.dumps(prompt))
            sets[name] = rows
        return sets


def tuned_threshold(cfg: Config, path: str, tokenizer, rt, score) -> dict:
    """The threshold that maximizes ProcessBench F1 on a dev set (never the set being reported), and the dev set's
    every metric at it (`dev`: its step AUROC judges a model as much as its F1 does)."""
    dev = load_sets(cfg, [path], tokenizer, rt).popitem()[1]
    probs = score(dev)
    kept = [(ps, r) for ps, r in zip(probs, dev) if ps]
    try:
        t, f1 = tune_threshold([ps for ps, _ in kept], [true_first_error(r) for _, r in kept])
    except ValueError as e:  # e.g. a dev set without a single wrong solution
        exit_on_problems([f"--tune-threshold {path}: {e}"])
    return {"threshold": t, "threshold_tuned_on": path, "dev_f1": f1, "dev": report(probs, dev, t, True)}


def prediction_lines(name: str, rows: list, probs: list, threshold: float, processbench: bool,
                     best_of_n: bool = False) -> list:
    """One line per row for --predictions: enough to recompute every reported number."""
    lines = []
    for i, (ps, row) in enumerate(zip(probs, rows)):
        line = {"subset": name, "id": row.get("id", i), "step_probs": ps, "labels": row["step_labels"]}
        if processbench:
            line.update(first_error_pred=first_error(ps, threshold), first_error=true_first_error(row))
        if row.get("final_answer_correct") is not None:
            line["final_answer_correct"] = row["final_answer_correct"]
        if best_of_n:
            line.update(group=row["group"], correct=row.get("final_answer_correct"),
                        response_answer=row.get("response_answer"))
        if row.get("category") is not None:
            line["category"] = row["category"]
        lines.append(line)
    return lines


def bon_block(name: str, probs: list, rows: list, cfg: Config, draws: int) -> dict:
    """best_of_n_report for one subset; rows without a known outcome end the run with a message, not a traceback."""
    try:
        return best_of_n_report(probs, rows, draws=draws, seed=cfg.seed)
    except ValueError as e:
        exit_on_problems([f"{name}: {e}"])


def warn_cuts(out: dict, cfg: Config):
    for name, block in ([("", out)] if "subsets" not in out else out["subsets"].items()):
        if block["examples_truncated"] or block["examples_dropped"]:
            print(f"warning: {name or 'data'}: {block['examples_truncated']} examples truncated (their cut "
                  f"steps are unscored), {block['examples_dropped']} dropped (no step fits); raise "
                  f"--max-length (now {cfg.max_length})" + (f" or --max-completion-length (now "
                  f"{cfg.max_completion_length})" if cfg.max_completion_length else ""), file=sys.stderr)


def mean_f1(blocks: dict):
    """ProcessBench's headline over subsets."""
    f1s = [b.get("f1") for b in blocks.values()]
    return sum(f1s) / len(f1s) if None not in f1s else None  # undefined in one subset: undefined on average


def table(blocks: dict) -> str:
    """The headline figures of each subset, one row each: ProcessBench's when every subset has them, else the
    step metrics; 'n/a' where a figure is undefined (e.g. AUROC with one class only)."""
    cols = PROCESSBENCH_COLUMNS if all("f1" in b for b in blocks.values()) else STEP_COLUMNS
    cell = lambda v: "n/a" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)
    width = max(len("subset"), *map(len, blocks))
    rows = [["subset", *cols]] + [[name, *(cell(b.get(c)) for c in cols)] for name, b in blocks.items()]
    if len(blocks) > 1 and cols == PROCESSBENCH_COLUMNS:  # the JSON's mean_f1, under the F1 column
        rows.append(["mean", cell(mean_f1(blocks))] + [""] * (len(cols) - 1))
    return "\n".join(f"{r[0]:<{width}}" + "".join(f"  {v:>13}" for v in r[1:]) for r in rows)


def main(argv=None):
    cfg, opts, given = parse_args(argv)
    rt = setup()
    try:
        tokenizer, model = load_trained(cfg, "tokenizer" in given)
        model, amp = model.to(rt.device), autocast_dtype(cfg.dtype, rt.device)
        score = lambda rows: predict(model, rows, batch_size=cfg.eval_batch_size, pad_id=pad_token_id(tokenizer),
                                     amp_dtype=amp, rt=rt)
        head = tuned_threshold(cfg, opts["tune_threshold"], tokenizer, rt, score) if opts["tune_threshold"] \
            else {"threshold": cfg.threshold}
        blocks, lines = {}, []
        for name, rows in load_sets(cfg, opts["datasets"], tokenizer, rt).items():
            pb = opts["processbench"] or cfg.format == "processbench" or bool(rows and "first_error" in rows[0])
            probs = score(rows)
            blocks[name] = report(probs, rows, head["threshold"], pb)
            if opts["best_of_n"]:
                blocks[name].update(bon_block(name, probs, rows, cfg, opts["best_of_n_draws"]))
            lines += prediction_lines(name, rows, probs, head["threshold"], pb, opts["best_of_n"])
        shown = table(blocks)
        out = {**head, **blocks.popitem()[1]} if len(blocks) == 1 else \
            {**head, "subsets": blocks, "mean_f1": mean_f1(blocks)}
        if rt.is_main:
            warn_cuts(out, cfg)
            print(shown, file=sys.stderr)  # for people; stdout's last line stays the one JSON object
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
