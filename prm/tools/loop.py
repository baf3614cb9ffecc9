"""The whole loop offline on the counting task (prm.readers.synthetic): a policy that slips, its
Monte-Carlo labels, a PRM trained on them, PRM-guided search; the labels' quality against the truth.

    python -m prm.tools.loop policy DIR  # DIR/policy (HF model folder), DIR/label.jsonl, test.jsonl
    python -m prm.tools.loop bench DIR   # all four stages, timed, then every figure
"""
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from dataclasses import dataclass

from prm.cli import Parser
from prm.config import opt
from prm.errors import exit_status
from prm.readers.synthetic import char_tokenizer, make_rows, step_truth
from prm.loading import tiny_config

SLIP, SLIP_RATE, NOISE = 7, 0.6, 0.05  # from 7 the policy writes 9 w.p. 0.6; else x + 2 w.p. 0.05
LABEL_OPTS = {"max_new_tokens": 40, "batch_size": 256}  # a solution: at most 37 tokens


def policy_text(n: int, seed: int) -> list:
    """Solutions as the policy learns to write them: make_rows' prompts, systematic slips."""
    rng, texts = random.Random(seed), []
    for _ in range(n):
        start, count = rng.randrange(10), rng.randint(3, 6)
        x, text = start, f"count {count} steps from {start}:\n"
        for _ in range(count):
            y = (x + 1 + (rng.random() < (SLIP_RATE if x == SLIP else NOISE))) % 10
            text, x = text + f"{x}+1={y}\n", y
        texts.append(text)
    return texts


def train_policy(output: str, *, steps: int = 300, batch: int = 32, lr: float = 3e-3, seed=0):
    """A tiny Qwen2 causal LM trained on policy_text, saved with its tokenizer (HF model folder)."""
    tok, start = char_tokenizer(), time.time()
    torch.manual_seed(seed)
    shape = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, layer_types=None)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**{**tiny_config(tok).to_dict(), **shape}))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    texts = policy_text(steps * batch, seed)
    for i in range(steps):
        enc = tok([t + tok.eos_token for t in texts[i * batch:(i + 1) * batch]],
                  return_tensors="pt", padding=True, add_special_tokens=False)
        ids = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)  # (B, T): no pad loss
        loss = model(**enc, labels=ids).loss
        loss.backward()
        for g in opt.param_groups:  # linear decay to 0
            g["lr"] = lr * (1 - i / steps)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i % 50 == 0 or i == steps - 1:
            print(f"policy step {i}: loss {loss.item():.4f}, {time.time() - start:.0f} s",
                  file=sys.stderr)
    model.save_pretrained(output)
    tok.save_pretrained(output)


def write_problems(folder: str, *, rows: int, test: int, seed: int = 0):
    """FOLDER/label.jsonl (rows) and FOLDER/test.jsonl (test): make_rows' prompts and answers;
    the test ones from a held-out quarter of the 40 distinct prompts."""
    prompts = sorted({r["prompt"] for r in make_rows(400, seed)})
    random.Random(seed).shuffle(prompts)
    held, drawn = set(prompts[:len(prompts) // 4]), make_rows(20 * (rows + test), seed)
    for name, part in (("label", [r for r in drawn if r["prompt"] not in held][:rows]),
                       ("test", [r for r in drawn if r["prompt"] in held][:test])):
        with open(os.path.join(folder, name + ".jsonl"), "w", encoding="utf-8") as f:
            f.writelines(json.dumps({k: r[k] for k in ("id", "prompt", "answer")}) + "\n"
                         for r in part)


def label_quality(folder: str, policy: str, rows: int) -> list:
    """Monte-Carlo labels of FOLDER/label.jsonl's first `rows` problems against step_truth, per
    (rollouts, label, search): the share of labeled steps on the right side of 0.5, the first
    wrong step's precision and recall, rollouts per solution."""
    from prm.label import Generator, LabelOptions, label_file
    with open(os.path.join(folder, "label.jsonl"), encoding="utf-8") as f:
        problems = f.readlines()[:rows]
    gen, found = None, []
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "in.jsonl"), "w", encoding="utf-8") as f:
            f.writelines(problems)
        for r, search in itertools.product((4, 8, 16), ("all", "binary")):
            opts = LabelOptions(policy=policy, rollouts=r, search=search, **LABEL_OPTS)
            gen = gen or Generator(opts, device=torch.device("cpu"))
            gen.opts, out = opts, os.path.join(tmp, f"{r}{search}.jsonl")  # one model loaded
            spent = label_file(os.path.join(tmp, "in.jsonl"), out, gen, opts, render=gen.render,
                               show=False)
            with open(out, encoding="utf-8") as f:
                solved = [json.loads(line) for line in f]
            truth = [step_truth(x["prompt"], x["completions"]) for x in solved]
            # the same rollouts give --label hard: any success (binary search labels either alike)
            for label in ("soft", "hard") if search == "all" else ("either",):
                labels = [x["labels"] if label != "hard" else
                          [w > 0 for w in x["successes"][:-1]] + x["labels"][-1:] for x in solved]
                pairs = [(y >= 0.5, t) for ys, ts in zip(labels, truth) for y, t in zip(ys, ts)
                         if y is not None]
                firsts = [(first_wrong([y is None or y >= 0.5 for y in ys]), first_wrong(ts))
                          for ys, ts in zip(labels, truth)]
                found.append({"rollouts": r, "label": label, "search": search,
                              "right_side": share([a == b for a, b in pairs]),
                              "precision": share([a == b for a, b in firsts if a >= 0]),
                              "recall": share([a == b for a, b in firsts if b >= 0]),
                              "rollouts_per_solution": spent / len(solved)})
    return found


def first_wrong(flags: list) -> int:
    return next((k for k, ok in enumerate(flags) if not ok), -1)


def share(flags: list) -> float:
    return sum(flags) / len(flags) if flags else float("nan")


def commands(folder: str, *, rows: int, test: int) -> list:
    """The loop's four stages as (name, argv after python): policy, labels, PRM, search."""
    at = lambda name: os.path.join(folder, name)  # noqa: E731
    gen = ["--max-new-tokens", "40", "--batch-size", "256"]
    return [("policy", ["-m", "prm.tools.loop", "policy", folder, "--rows", str(rows),
                        "--test", str(test)]),
            ("label", ["-m", "prm.label", "--policy", at("policy"), "--dataset", at("label.jsonl"),
                       "--output", at("labels.jsonl"), *gen]),
            ("train", ["train.py", "--model", at("policy"), "--dataset", at("labels.jsonl"),
                       "--output-dir", at("prm"), "--lr", "1e-3", "--batch-size", "32",
                       "--epochs", "4", "--overwrite"]),
            ("search", ["-m", "prm.search", "--policy", at("policy"), "--model", at("prm/final"),
                        "--dataset", at("test.jsonl"), "--output", at("search.jsonl"),
                        "--seeds", "0,1,2", "--problems", str(test), *gen])]


def bench(folder: str, rows: int, test: int, quality_rows: int):
    """Runs the four stages in fresh processes (wall and CPU seconds each); prints every figure."""
    from prm.search import table
    times, out = [], None
    for name, argv in commands(folder, rows=rows, test=test):
        print("$ python " + " ".join(argv), file=sys.stderr, flush=True)
        cpu, start = os.times(), time.time()
        done = subprocess.run([sys.executable, *argv], stdout=subprocess.PIPE, text=True,
                              check=True)
        used = sum(os.times()[2:4]) - sum(cpu[2:4])  # the children's user + system seconds
        times.append(f"{name} {time.time() - start:.0f} s wall, {used:.0f} s CPU")
        out = done.stdout.strip().splitlines()[-1] if name == "search" else out
    with open(os.path.join(folder, "labels.jsonl"), encoding="utf-8") as f:
        solved = [json.loads(line) for line in f]
    slips = [s != f"{SLIP}+1={SLIP + 1}" for x in solved for s in x["completions"]
             if s.startswith(f"{SLIP}+1=")]
    print("times: " + "; ".join(times))
    right = share([all(step_truth(x["prompt"], x["completions"])) for x in solved])
    print(f"policy: {right:.3f} of {len(solved)} sampled solutions right; from {SLIP} it slips in "
          f"{share(slips):.3f}")
    print("".join(f"{h:>9}" for h in ("rollouts", "label", "search", "right", "prec", "recall",
                                        "spent")))
    start, cpu = time.time(), time.process_time()
    for q in label_quality(folder, os.path.join(folder, "policy"), quality_rows):
        print(f"{q['rollouts']:>9}{q['label']:>9}{q['search']:>9}{q['right_side']:>9.3f}"
              f"{q['precision']:>9.3f}{q['recall']:>9.3f}{q['rollouts_per_solution']:>9.1f}")
    print(f"label grid {time.time() - start:.0f} s wall, {time.process_time() - cpu:.0f} s CPU")
    print(table(json.loads(out)))


@dataclass
class LoopOptions:
    stage: str = opt("", "", positional=True, choices=["policy", "bench"])
    folder: str = opt("", "for policy, problems, labels, PRM and search results", positional=True)
    rows: int = opt(200, "problems to label")
    test: int = opt(40, "held-out problems to search")
    quality_rows: int = opt(25, "problems of the label grid")
    steps: int = opt(300, "the policy's optimizer steps")


def main(argv=None):
    with exit_status():
        p = Parser(LoopOptions, prog="python -m prm.tools.loop",
                   description=__doc__.split("\n\n")[0])
        a = p.parse_args(argv)
        os.makedirs(a.folder, exist_ok=True)
        if a.stage == "bench":
            return bench(a.folder, a.rows, a.test, a.quality_rows)
        write_problems(a.folder, rows=a.rows, test=a.test)
        train_policy(os.path.join(a.folder, "policy"), steps=a.steps)


if __name__ == "__main__":
    main()
