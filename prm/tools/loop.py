"""The whole loop offline on the counting task: a policy that slips, its Monte-Carlo labels, a PRM
on them, PRM-guided search; over seeds. `policy DIR`: DIR/policy, DIR/{label,valid,test}.jsonl;
`bench DIR`: the pipeline per seed in DIR/seed<k>, every figure."""
import dataclasses
import itertools
import json
import os
import random
import re
import statistics
import sys
import time

import torch

from prm.cli import Parser, parsed
from prm.config import Checked, Config, at_least, opt
from prm.core.metrics import auroc, first_error
from prm.errors import WriteFailed, check, exit_status
from prm.files import write_lines
from prm.label import Generator, LabelOptions, label_file, step_labels
from prm.readers.synthetic import char_tokenizer, counting_problems, step_truth
from prm.search import SearchOptions, pick, search_file
from prm.trees import cached

SLIP, SLIP_RATE, NOISE = 7, 0.6, 0.05  # from 7 the policy adds D + 1 w.p. 0.6; else w.p. 0.05
GEN = {"max_new_tokens": 40, "batch_size": 256}  # a solution: at most 37 tokens
LABELS = ("hard", "progress")  # the bench's PRMs': prm.label's default, then the other
FILES = ("policy", "label.jsonl", "valid.jsonl", "test.jsonl")  # the policy stage's


@dataclasses.dataclass
class LoopOptions(Checked):
    stage: str = opt("", "", positional=True, choices=["policy", "bench"])
    folder: str = opt("", "a new folder, or one without what the stage writes", positional=True)
    test: int = opt(120, "test prompts (of 360)", check=at_least(1))
    valid: int = opt(60, "validation prompts (PRM held out, search settings)", check=at_least(1))
    rows: int = opt(180, "labeling prompts", check=at_least(1))
    steps: int = opt(500, "the policy's optimizer steps", check=at_least(1))
    seeds: int = opt(5, "bench: pipelines, seeds 0 .. seeds - 1", check=at_least(1))
    grid_rows: int = opt(25, "bench: problems of the label grid (seed 0)", check=at_least(1))

    def __post_init__(self):
        super().__post_init__()
        check([] if self.test + self.valid + self.rows <= 360 else
              [f"--test {self.test} + --valid {self.valid} + --rows {self.rows}: the task has 360 "
               "prompts"])


def solution(prompt: str, rng) -> list:
    """Steps as the policy learns to write them."""
    count, d, x = map(int, re.findall(r"\d+", prompt))
    steps = []
    for _ in range(count):
        y = (x + d + (rng.random() < (SLIP_RATE if x == SLIP else NOISE))) % 10
        steps.append(f"{x}+{d}={y}")
        x = y
    return steps


def train_policy(output: str, *, steps: int = 500, batch: int = 32, seed=0):
    """A tiny Qwen2 trained on solution()'s texts."""
    from transformers import AutoModelForCausalLM, Qwen2Config
    from prm.loading import tiny_config
    tok, start, rng = char_tokenizer(), time.time(), random.Random(seed)
    torch.manual_seed(seed)
    shape = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, layer_types=None)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**{**tiny_config(tok).to_dict(), **shape}))
    opt_ = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    prompts = [p["prompt"] for p in counting_problems()]
    for i in range(steps):
        texts = [p + "\n" + "".join(s + "\n" for s in solution(p, rng)) + tok.eos_token
                 for p in rng.choices(prompts, k=batch)]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        ids = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)  # (B, T): no pad loss
        loss = model(**enc, labels=ids).loss
        loss.backward()
        for g in opt_.param_groups:  # linear decay to 0
            g["lr"] = 3e-3 * (1 - i / steps)
        opt_.step()
        opt_.zero_grad()
        if i % 100 == 0 or i == steps - 1:
            print(f"policy step {i}: loss {loss.item():.4f}, {time.time() - start:.0f} s",
                  file=sys.stderr)
    model.save_pretrained(output)
    tok.save_pretrained(output)


def write_problems(folder: str, o: LoopOptions, seed: int = 0):
    """FOLDER/{test,valid,label}.jsonl, disjoint; a valid row holds a solution, its true labels."""
    problems, rng = counting_problems(), random.Random(seed)
    rng.shuffle(problems)
    parts = {"test": problems[:o.test], "valid": problems[o.test:o.test + o.valid],
             "label": problems[o.test + o.valid:][:o.rows]}
    for name, part in parts.items():
        rows = [{"id": f"{name}-{i}", **p} for i, p in enumerate(part)]
        for r in rows if name == "valid" else ():
            r["completions"] = solution(r["prompt"], rng)
            r["labels"] = step_truth(r["prompt"], r["completions"])
        write_lines(os.path.join(folder, name + ".jsonl"), map(json.dumps, rows), "x")


def relabeled(lines: list, how: str, n: int) -> list:
    """prm.label's progress lines (n rollouts) labeled `how`."""
    return [{**x, "labels": step_labels(x["successes"], x["labels"][-1] == 1, n, how,
                                        x["start"][1])} for x in lines]


def precision_recall(found: list, truth: list) -> dict:
    """Of each solution's first wrong step (first under 0.5) in `found` vs `truth`."""
    firsts = [(first_error(f), first_error(t)) for f, t in zip(found, truth)]
    return {"prec": share([a == b for a, b in firsts if a >= 0]),
            "recall": share([a == b for a, b in firsts if b >= 0])}


def share(flags: list) -> float:
    return sum(flags) / len(flags) if flags else float("nan")


def read(path: str) -> list:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def label_grid(folder: str, gen, rows: int) -> list:
    """Labels of label.jsonl's first `rows` problems vs the truth, per rollouts, label, search."""
    found, grid = [], os.path.join(folder, "grid")
    os.makedirs(grid)
    data = os.path.join(grid, "in.jsonl")
    problems = read(os.path.join(folder, "label.jsonl"))[:rows]
    write_lines(data, map(json.dumps, problems), "x")
    for r, search in itertools.product((4, 8, 16), ("all", "binary")):
        gen.opts = LabelOptions(policy=gen.opts.policy, rollouts=r, search=search,
                                label="progress" if search == "all" else "hard", **GEN)
        spent = label_file(data, out := os.path.join(grid, f"{r}{search}.jsonl"), gen, gen.opts,
                           show=False)
        solved = read(out)
        truth = [step_truth(x["prompt"], x["completions"]) for x in solved]
        for how in ("soft", "hard", "progress") if search == "all" else ("binary",):
            labels = [x["labels"] for x in (solved if how == "binary" else
                                            relabeled(solved, how, r))]
            right = [(y >= 0.5) == t for ys, ts in zip(labels, truth) for y, t in zip(ys, ts)
                     if y is not None]
            oks = [[y is None or y >= 0.5 for y in ys] for ys in labels]
            used = spent - r * len(problems) * (how != "progress")  # others: not from the prompt
            found.append({"rollouts": r, "label": how, "right": share(right),
                          **precision_recall(oks, truth), "spent": used / len(solved)})
    return found


def searched(folder: str, name: str, gen, seed: int, label=LABELS[0], **settings) -> list:
    """FOLDER/search-NAME.jsonl: prm.search of the part NAME starts with, by the PRM on `label`."""
    from prm.scoring.reward import PRMReward
    opts = SearchOptions(policy=gen.opts.policy, problems=30, seeds=(seed,), **GEN, **settings)
    reward = PRMReward(os.path.join(folder, f"prm-{label}", "final"), batch_size=GEN["batch_size"])
    gen.opts, out = opts, os.path.join(folder, f"search-{name}.jsonl")
    part = os.path.join(folder, name.split("-")[0] + ".jsonl")
    search_file(part, out, gen, reward.score, opts, render=gen.render, show=False,
                extend=cached(reward))
    return read(out)


def result(record: dict, method: str, n: int) -> dict:
    return next(x for x in record["results"] if (x["method"], x["n"]) == (method, n))


def choose(folder: str, gen, seed: int) -> dict:
    """--aggregate, then --beam-width and --select: the best on validation; ties: the default."""
    sampled = searched(folder, "valid", gen, seed, methods=("best-of-n", "weighted"), n=(4, 16))

    def right(r, m, n, how, aggregate):  # sampled: of the first N
        cands = result(r, m, n).get("candidates", r.get("samples", [])[:n])
        i = pick(cands, how, aggregate)
        return cands[i]["correct"] if i is not None else 0

    def score(records, how, aggregate):  # "": each method's own
        methods = ("beam", "dvts") if how else ("best-of-n", "weighted")
        return statistics.fmean(share([right(r, m, n, how or m, aggregate) for r in records])
                                for m, n in itertools.product(methods, (4, 16)))
    aggregate = max(("last", "min", "prod", "mean"), key=lambda a: score(sampled, "", a))
    best = (-1.0,)
    for width in (4, 2):
        trees = searched(folder, f"valid-m{width}", gen, seed, n=(4, 16),
                         methods=("beam", "dvts"), beam_width=width, aggregate=aggregate)
        for how in ("weighted", "best-of-n", "majority"):
            best = max(best, (score(trees, how, aggregate), width, how), key=lambda b: b[0])
    return {"aggregate": aggregate, "beam_width": best[1], "select": best[2]}


def pipeline(folder: str, o: LoopOptions, seed: int, times: dict) -> dict:
    """Policy, labels, a PRM per LABELS, settings, test search."""
    from prm.bench import training
    train = training().train
    clock = [time.time()]

    def lap(stage):
        clock.append(time.time())
        times.setdefault(stage, []).append(clock[-1] - clock[-2])
    write_problems(folder, o, seed)
    train_policy(at := os.path.join(folder, "policy"), steps=o.steps, seed=seed)
    lap("policy")
    opts = LabelOptions(policy=at, label="progress", seed=seed, **GEN)
    gen = Generator(opts, device=torch.device("cpu"))
    label_file(os.path.join(folder, "label.jsonl"), lab := os.path.join(folder, "labels.jsonl"),
               gen, opts, render=gen.render, show=False)
    lap("label")
    out = {"policy": share([all(step_truth(x["prompt"], x["completions"])) for x in read(lab)])}
    for how in LABELS:
        path = os.path.join(folder, f"labels-{how}.jsonl")
        write_lines(path, map(json.dumps, relabeled(read(lab), how, opts.rollouts)), "x")
        out[f"train-{how}"] = train(Config(
            model=at, dataset=path, eval_dataset=os.path.join(folder, "valid.jsonl"), lr=1e-3,
            batch_size=32, epochs=4, output_dir=os.path.join(folder, f"prm-{how}"), seed=seed))
        lap("train")
    out["chosen"] = choose(folder, gen, seed)
    lap("choose")
    out["test"] = searched(folder, "test", gen, seed, **out["chosen"])
    lap("search")
    out["other"] = searched(folder, "test-" + LABELS[1], gen, seed, LABELS[1],
                            methods=("best-of-n", "weighted"), **{**out["chosen"], "beam_width": 4})
    lap("search")
    if seed == 0:
        out["grid"] = label_grid(folder, gen, o.grid_rows)
        lap("grid")
    return out


def mean_se(values: list) -> str:
    values = [v for v in values if v is not None and v == v]  # no AUROC: a class empty
    if not values:  # no pipeline has the figure: the report goes on
        return "none"
    se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")
    return f"{statistics.fmean(values):.3f} ± {se:.3f}"


def interval(diffs: list) -> tuple:
    """95% bootstrap interval of the mean, each pipeline's values resampled."""
    rng = random.Random(0)
    means = sorted(statistics.fmean(v for d in diffs for v in rng.choices(d, k=len(d)))
                   for _ in range(2000))
    return means[50], means[1949]


def search_rows(runs: list, key: str, tag: str = "") -> list:
    """Per method and N: accuracy, its paired difference from majority, pass@N."""
    lines = []
    for m, n in sorted({(x["method"], x["n"]) for x in runs[0][key][0]["results"]},
                       key=lambda k: (k[1], "majority best-of-n weighted beam dvts".find(k[0]))):
        got = [{r["row"]: result(r, m, n)["correct"] for r in run[key]} for run in runs]
        base = [{r["row"]: result(r, "majority", n)["correct"] for r in run["test"]}
                for run in runs]
        oracle = [share([any(c["correct"] for c in r["samples"][:n]) for r in run["test"]])
                  for run in runs]
        diff = [[g[k] - b[k] for k in g] for g, b in zip(got, base)]
        lo, hi = interval(diff)
        same = m == "dvts" and n <= min(run["chosen"]["beam_width"] for run in runs)
        lines.append(f"{m + tag + (' (= beam)' if same else ''):<22}{n:>4}"
                     f"{mean_se([share(list(g.values())) for g in got]):>16}"
                     f"{statistics.fmean(map(statistics.fmean, diff)):>+9.3f}"
                     f" [{lo:+.3f}, {hi:+.3f}]{mean_se(oracle):>16}")
    return lines


def report(runs: list, times: dict, o: LoopOptions):
    print(f"{len(runs)} pipelines (seeds 0-{len(runs) - 1}); each: {o.rows} labeling, {o.valid} "
          f"validation, {o.test} test prompts, disjoint; mean ± SE over pipelines")
    print(f"policy: {mean_se([r['policy'] for r in runs])} of its sampled solutions right")
    for r in runs:
        print("chosen on validation: " + ", ".join(f"{k} {v}" for k, v in r["chosen"].items()))
    print(f"{'method':<22}{'N':>4}{'accuracy':>16}{'- majority [95% by prompt]':>27}"
          f"{'pass@N':>16}")
    print("\n".join(search_rows(runs, "test") + search_rows(runs, "other", f" ({LABELS[1]})")))
    rows = [read(os.path.join(r["folder"], "test.jsonl")) for r in runs]
    for key, label in (("test", LABELS[0]), ("other", LABELS[1])):
        steps = [prm_steps(r[key], x) for r, x in zip(runs, rows)]
        held = [r[f"train-{label}"] for r in runs]
        got = [mean_se([s[k] for s in steps]) for k in ("auroc", "prec", "recall")] + \
            [mean_se([h[k] for h in held]) for k in ("step_accuracy", "auroc")]
        print("PRM on {} labels, test samples vs the truth: step AUROC {}, first wrong step "
              "precision {} recall {}; train.py on validation: step accuracy {}, AUROC {}"
              .format(label, *got))
    print(f"label grid (seed 0, {o.grid_rows} problems) vs the truth:\n rollouts    label    right"
          "     prec   recall    spent")
    for q in runs[0]["grid"]:
        print(f"{q['rollouts']:>9}{q['label']:>9}{q['right']:>9.3f}{q['prec']:>9.3f}"
              f"{q['recall']:>9.3f}{q['spent']:>9.1f}")
    print("wall s per pipeline:", ", ".join(f"{k} {sum(v) / len(runs):.0f}"
                                             for k, v in times.items()))


def prm_steps(records: list, rows: list) -> dict:
    """The PRM's step scores of the test samples vs the truth."""
    found, truths = [], []
    for r in records:
        for c in r["samples"]:
            truths.append(step_truth(rows[r["row"]]["prompt"], c["steps"])[:len(c["scores"])])
            found.append(c["scores"][:len(truths[-1])])
    return {"auroc": auroc(sum(found, []), sum(truths, [])), **precision_recall(found, truths)}


def refusals(stage: str, at: str) -> list:
    if not at or os.path.isfile(at):
        return [f"{at!r}: not a folder"]
    if stage == "bench":
        busy = os.path.isdir(at) and os.listdir(at)
        return [f"{at}: not empty; pass another folder"] * bool(busy)
    return [f"{os.path.join(at, x)} exists; pass another folder" for x in FILES
            if os.path.lexists(os.path.join(at, x))][:1]


def main(argv=None):
    with exit_status():
        p = Parser(LoopOptions, prog="python -m prm.tools.loop",
                   description=__doc__)
        o = parsed(LoopOptions, p.parse_args(argv))
        at = o.folder
        check(refusals(o.stage, at))
        try:
            os.makedirs(at, exist_ok=True)
            if o.stage == "policy":
                write_problems(at, o)
                return train_policy(os.path.join(at, "policy"), steps=o.steps)
            runs, times, start = [], {}, time.time()
            for seed in range(o.seeds):
                os.makedirs(folder := os.path.join(at, f"seed{seed}"))
                runs.append({"folder": folder, **pipeline(folder, o, seed, times)})
                with open(os.path.join(folder, "run.json"), "x", encoding="utf-8") as f:
                    json.dump({"run": runs[-1], "times": times}, f)
            report(runs, times, o)
            print(f"bench: {time.time() - start:.0f} s wall")
        except OSError as e:
            raise WriteFailed(f"{at}: {e.strerror or e}: {e.filename or ''}") from None


if __name__ == "__main__":
    main()
