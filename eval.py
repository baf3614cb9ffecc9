"""Evaluate a PRM (ours or any 2-label token classifier): step metrics, ProcessBench F1, AUROC,
PRMScore, best-of-N. A table to stderr; stdout's last line: one JSON object."""
import json
import os
import sys
from dataclasses import dataclass, field, replace

from prm.cli import Parser, parsed, writable
from prm.config import FILE, Checked, Config, at_least, opt
from prm.errors import UsageError, check, exit_status, overwrites
from prm.scoring import ScorerOptions

SCORING = Config.names_with("scoring")  # the run settings eval.py takes
PROCESSBENCH_COLUMNS = ("f1", "acc_error", "acc_correct", "auroc", "chance_f1")
STEP_COLUMNS = ("step_accuracy", "positive_rate", "f1_0", "auroc", "n_steps")


@dataclass(frozen=True)
class Options(Checked):
    model: str = opt("", "a run's final/ or checkpoint, or any 2-label token classifier",
                     required=True)
    datasets: tuple = opt((), "sources to report (default: the run's held-out set)",
                          flag="--dataset", nargs="+", metavar="SOURCE")
    predictions: str = opt("", "a JSON line per example: step P(correct), labels, first errors",
                           metavar="OUT_JSONL")
    processbench: bool = opt(False, "ProcessBench metrics from the step labels")
    tune_threshold: str = opt("", "tune the F1 threshold on this dev set (reported as 'dev')",
                              metavar="DEV_FILE")
    best_of_n: bool = opt(False, "best-of-N accuracy by final_answer_correct, per 'group' (else "
                          "prompt)")
    best_of_n_draws: int = opt(8, "seeded shuffles per N", metavar="K", check=at_least(1))
    scoring: ScorerOptions = ScorerOptions()  # set by parse_args
    given: dict = field(default_factory=dict)  # {field: value} of the flags given

    def __post_init__(self):
        super().__post_init__()
        path, folder = self.predictions, os.path.dirname(os.path.abspath(self.predictions))
        why = ("a folder, not a file" if os.path.isdir(path) else f"no such folder {folder}"
               if not os.path.isdir(folder) else None if writable(path) else "not writable")
        check([f"--predictions {path}: {why}"] if path and why else [])
        refuse_tuning_on(self.tune_threshold, self.datasets)


def build_eval_parser() -> Parser:
    p = Parser(Options, ScorerOptions, description=__doc__)
    p.add_fields(Config, SCORING, group=p.add_argument_group(
        "run settings", "not given: the run's (config.train.json, else config.json's 'prm')"))
    return p


def refuse_tuning_on(tune: str, reported: list):
    files = [os.path.join(s, n) for s in reported  # "x.json/": realpath drops the "/"
             for n in (os.listdir(s) if os.path.isdir(s) else [""])]
    if tune and os.path.realpath(tune) in map(os.path.realpath, files):
        raise UsageError(f"--tune-threshold {tune} is also read for the reported set "
                         f"({', '.join(reported)}): tune on a separate dev set")


def parse_args(argv=None) -> Options:
    args = build_eval_parser().parse_args(argv)
    return replace(parsed(Options, args), scoring=parsed(ScorerOptions, args))


if __name__ == "__main__":  # --help and a bad flag answer before torch loads
    with exit_status():
        parse_args()

import torch
from transformers import AutoConfig

from prm.files import write_lines
from prm.core.data import pad_token_id
from prm.core.evaluate import best_of_n_report, predict, report, true_first_error
from prm.readers.ingest import tokenize_dataset
from prm.answers import answer_key
from prm.core.metrics import first_error, tune_threshold
from prm.core.model import input_settings
from prm.core.runtime import (Runtime, autocast_dtype, barrier, main_first, progress_off, setup,
                              teardown)
from prm.scoring.scorers import load as load_scorer
from prm.readers.sources import load_eval


def settings(opts: Options) -> Config:
    """A run setting not given: the run's."""
    if os.path.isfile(os.path.join(opts.model, FILE)):
        base = Config.load(opts.model).__dict__
    else:
        try:
            trust = opts.given.get("trust_remote_code", False)
            base = input_settings(AutoConfig.from_pretrained(opts.model, trust_remote_code=trust))
        except Exception:  # load_scorer says why
            base = {}
    # a model's code runs only if the command line says so; a LoRA base scores in fp32
    fixed = {"model": opts.model, "trust_remote_code": False, "lora_base_dtype": "fp32"}
    if opts.datasets:  # new files: format auto
        fixed["format"] = None
    cfg = Config.from_dict({**base, **fixed, **opts.given}).resolve()
    reported = opts.datasets or [cfg.eval_dataset or cfg.dataset]
    refuse_tuning_on(opts.tune_threshold, reported)
    read = [("--model", cfg.model), ("--tune-threshold", opts.tune_threshold)]
    check(overwrites([("--predictions", opts.predictions)],
                     [("--dataset", d) for d in reported] + read))
    return cfg


@dataclass
class Evaluator:
    cfg: Config
    rt: Runtime
    tokenizer: object
    model: object
    tokenize: object  # a published PRM's row builder

    def sets(self, sources: list) -> dict:
        """{subset name: tokenized rows}, every row kept; `group` defaults to the prompt."""
        names = [os.path.splitext(os.path.basename(s.rstrip("/")))[0] for s in sources]
        names = names if len(set(names)) == len(names) else sources
        sets = {}
        with main_first(self.rt):  # "": the run's held-out set
            for name, source in list(zip(names, sources)) or [("held-out", "")]:
                ds = load_eval(self.cfg, source)
                sets[name] = rows = tokenize_dataset(
                    ds, self.tokenizer, self.cfg, is_eval=True, desc=f"tokenize {name}",
                    num_proc=self.cfg.num_proc, drop_unlabeled=False, tokenize=self.tokenize,
                )[0].to_list()
                if "prompt" in ds.column_names:
                    for row, prompt in zip(rows, ds["prompt"][:]):
                        text = prompt if isinstance(prompt, str) else json.dumps(prompt)
                        row["group"] = row.get("group") or text
        return sets

    def probs(self, rows: list) -> list:
        """P(correct) at each row's step ends, from every rank."""
        return predict(self.model, rows, batch_size=self.cfg.eval_batch_size, rt=self.rt,
                       pad_id=pad_token_id(self.tokenizer),
                       amp_dtype=autocast_dtype(self.cfg.dtype, self.rt.device),
                       progress=not progress_off(self.cfg.disable_tqdm))


def tuned_threshold(ev: Evaluator, opts: Options) -> dict:
    path, fmt = opts.tune_threshold, ev.cfg.format if "format" in opts.given else None
    dev = next(iter(replace(ev, cfg=replace(ev.cfg, format=fmt)).sets([path]).values()))
    probs = ev.probs(dev)
    kept = [(ps, true_first_error(r)) for ps, r in zip(probs, dev) if ps]
    try:
        t, f1 = tune_threshold([ps for ps, _ in kept], [e for _, e in kept])
    except ValueError as e:
        raise UsageError(f"--tune-threshold {path}: {e}") from None
    return {"threshold": t, "threshold_tuned_on": path, "dev_f1": f1,
            "dev": report(probs, dev, t, True)}


def evaluate(ev: Evaluator, opts: Options, threshold: float) -> tuple:
    """({subset name: its report}, the --predictions lines)."""
    blocks, lines = {}, []
    for name, rows in ev.sets(opts.datasets).items():
        pb = (opts.processbench or ev.cfg.format == "processbench"
              or rows and "first_error" in rows[0])
        probs = ev.probs(rows)
        blocks[name] = report(probs, rows, threshold, pb)
        if opts.best_of_n:  # answers vote as prm.search's do
            keyed = [{**r, "response_answer": answer_key(r.get("response_answer"))} for r in rows]
            try:
                blocks[name].update(best_of_n_report(
                    probs, keyed, draws=opts.best_of_n_draws, seed=ev.cfg.seed))
            except ValueError as e:
                raise UsageError(f"{name}: {e}") from None
        for i, (ps, row) in enumerate(zip(probs, rows)):
            line = {"subset": name, "id": row.get("id", i), "step_probs": ps,
                    "labels": row["step_labels"]}
            if pb:
                line.update(first_error_pred=first_error(ps, threshold),
                            first_error=true_first_error(row))
            if opts.best_of_n:
                line.update(group=row["group"], correct=row.get("final_answer_correct"),
                            response_answer=row.get("response_answer"))
            line.update({k: row[k] for k in ("final_answer_correct", "category")
                         if row.get(k) is not None})
            lines.append(line)
    return blocks, lines


def mean_f1(blocks: dict):
    f1s = [b.get("f1") for b in blocks.values()]
    return sum(f1s) / len(f1s) if None not in f1s else None


def warnings_for(blocks: dict, cfg: Config, threshold: float) -> list:
    out, cap = [], cfg.max_completion_length
    for name, b in blocks.items():
        if b["examples_truncated"] or b["examples_dropped"]:
            out.append(f"{name}: {b['examples_truncated']} examples truncated, "
                       f"{b['examples_dropped']} dropped: raise --max-length ({cfg.max_length})"
                       + (f" or --max-completion-length ({cap})" if cap else ""))
        if b["n_steps"] and None in (b["precision_0"], b["precision_1"]):
            verdict = "correct" if b["precision_0"] is None else "wrong"
            out.append(f"{name}: every labeled step is predicted {verdict} at threshold "
                       f"{threshold:g}: step_accuracy is that class's share")
    return ["warning: " + w for w in out]


def why_undefined(b: dict, column: str) -> str:
    if column in ("f1", "acc_correct", "chance_f1") and not b.get("n_without_error"):
        return "no error-free solutions"
    if column in ("f1", "acc_error", "chance_f1") and not b.get("n_with_error"):
        return "no solutions with an error"
    if not b.get("n_steps"):
        return "no labeled steps"
    return {"auroc": f"every labeled step is {'correct' if b.get('positive_rate') else 'wrong'}",
            "f1_0": "no wrong step labeled or predicted"}.get(column, "undefined")


def cell(v) -> str:
    return "n/a" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def table(blocks: dict, *, threshold: float) -> str:
    cols = PROCESSBENCH_COLUMNS if all("f1" in b for b in blocks.values()) else STEP_COLUMNS
    rows = [["subset", *cols]] + [[k, *(cell(b.get(c)) for c in cols)] for k, b in blocks.items()]
    if len(blocks) > 1 and cols == PROCESSBENCH_COLUMNS:
        rows.append(["mean", cell(mean_f1(blocks))])
    width = max(len(r[0]) for r in rows)
    lines = [f"{r[0]:<{width}}" + "".join(f"  {v:>13}" for v in r[1:]) for r in rows]
    lines.append(f"threshold {threshold:g}: a step with P(correct) below it is predicted wrong")
    for name, b in blocks.items():
        undefined = {}
        for c in (c for c in cols if b.get(c) is None):
            undefined.setdefault(why_undefined(b, c), []).append(c)
        notes = [f"{', '.join(cs)} n/a ({why})" for why, cs in undefined.items()]
        if "best_of_n" in b:
            n = "/".join(map(str, b["candidates_per_problem"]))
            accs = ", ".join(f"{m} {cell(acc['all'])}" for m, acc in b["best_of_n"].items())
            notes.append(f"best-of-N accuracy with all {n} candidates: {accs}")
        if b.get("candidates_with_answer") == 0:
            notes.append("weighted_*, majority_vote n/a (no extractable answer)")
        if "prmbench" in b:
            pb = {k: cell(v) for k, v in b["prmbench"].items()}
            notes.append(f"PRMScore {pb['prmscore']} (f1 {pb['f1']}, f1_neg {pb['f1_neg']})")
        lines += [f"{name}: {note}" for note in notes]
    return "\n".join(lines)


def main(argv=None) -> dict:
    """Warnings and the table to stderr, the JSON to stdout (returned)."""
    opts = parse_args(argv)
    cfg = settings(opts)
    rt = setup()
    progress_off(cfg.disable_tqdm)  # before loading, for transformers' bars too
    try:
        bf16 = autocast_dtype(cfg.dtype, rt.device) == torch.bfloat16  # a published PRM's too
        ev = Evaluator(cfg, rt, *load_scorer(cfg, "tokenizer" in opts.given, opts.scoring,
                                             dtype=torch.bfloat16 if bf16 else torch.float32))
        ev.model.to(rt.device)
        head = tuned_threshold(ev, opts) if opts.tune_threshold else {"threshold": cfg.threshold}
        t = head["threshold"]
        blocks, lines = evaluate(ev, opts, t)
        out = {**head, **next(iter(blocks.values()))} if len(blocks) == 1 else \
            {**head, "subsets": blocks, "mean_f1": mean_f1(blocks)}
        if rt.is_main:
            print(*warnings_for(blocks, cfg, t), table(blocks, threshold=t), sep="\n",
                  file=sys.stderr)
            print(json.dumps(out), flush=True)
        barrier(rt)
        if rt.is_main and opts.predictions:  # after the JSON: a failed write loses no figures
            write_lines(opts.predictions, map(json.dumps, lines))
        return out
    finally:
        teardown(rt)


if __name__ == "__main__":
    with exit_status():
        main()
