"""`python -m prm.label`: step labels by Monte-Carlo rollouts of a policy (Math-Shepherd, OmegaPRM's
binary search); the API takes any `complete(prompts, n, seed)`."""
import dataclasses
import datetime
import glob
import hashlib
import importlib
import json
import os
import re
import signal
import sys
import time

import regex
import torch
import torch.distributed as dist
from jinja2 import TemplateError
from tqdm import tqdm

from prm.answers import judge
from prm.cli import Parser, parsed
from prm.config import Checked, at_least, bound, not_empty, opt, unescape, within
from prm.core.runtime import autocast_dtype, setup, teardown
from prm.errors import Stopped, UsageError, check, exit_status, overwrites
from prm.files import finished, locked, parts, resumed, stamp, write_lines
from prm.readers.formats import row_problems, split_steps
from prm.readers.sources import DataError, sources


def is_regex(text: str) -> bool:
    try:
        regex.compile(text)
    except regex.error:
        return False
    return True


def importable(checker: str) -> bool:
    try:  # an import, not find_spec: one found but broken fails only at import
        return checker != "math-verify" or bool(importlib.import_module("math_verify"))
    except ImportError:
        return False


@dataclasses.dataclass
class LabelOptions(Checked):
    """Kept in OUTPUT.settings: a rerun with others is refused."""
    rollouts: int = opt(8, "rollouts per step prefix", check=at_least(1))
    label: str = opt("hard", "hard: any rollout right; soft: the share V right; progress: min(1, "
                     "V / V before)", choices=["soft", "hard", "progress"])
    search: str = opt("all", "all: every prefix; binary: the first step no rollout rescues",
                      choices=["all", "binary"])
    samples: int = opt(4, "solutions sampled for a row without 'completions'", check=at_least(1))
    step_separator: str = opt("\n", "what ends each step (escapes understood)", type=unescape,
                              check=not_empty("it ends each step"))
    answer_field: str = opt("answer", "the reference answer's column")
    prompt_field: str = opt("prompt", "the problem's column (MATH-500's: problem)")
    answer_pattern: str = opt("", "regex whose last match is the answer (default: \\boxed{}, "
                              "'answer is', a number)",
                              check=bound(is_regex, "not a regular expression"))
    checker: str = opt("exact", "exact: normalized match; or math-verify",
                       choices=["exact", "math-verify"],
                       check=bound(importable, "needs pip install 'math-verify[antlr4_13_2]'"))
    seed: int = opt(0, "rows are seeded from it and their index")
    policy: str = opt("", "the model rolled out (hub name or folder)", required=True)
    prover: str = opt("", "the model rolled out from prefixes, if not --policy")
    temperature: float = opt(0.7, "0: greedy", check=at_least(0))
    top_p: float = opt(1.0, "nucleus sampling share", check=within(0, 1, "(]"))
    max_new_tokens: int = opt(512, "tokens per rollout or sample", check=at_least(1))
    batch_size: int = opt(16, "sequences per generate call", check=at_least(1))

    def __post_init__(self):
        super().__post_init__()
        check(["--label progress needs --search all"]
              * (self.label == "progress" and self.search == "binary"))


@dataclasses.dataclass
class LabelRun(Checked):
    dataset: str = opt("", "a .jsonl/.json/.parquet file or folder", required=True)
    output: str = opt("", "the .jsonl written; a rerun resumes it", required=True)
    shard: str = opt("0/1", "i/n: every n-th row from the i-th; no --shard merges", check=bound(
        lambda v: bool(re.fullmatch(r"\d+/\d+", v)) and int(v.split("/")[0]) < int(v.split("/")[1]),
        "expected i/n with 0 <= i < n"))
    skip_invalid: bool = opt(False, "leave out invalid rows")
    trust_remote_code: bool = opt(False, "run the policy's code")


def label_solutions(text: str, solutions: list, right, complete, opts, seed: int) -> list:
    """{labels, rollouts, successes} per solution (progress: `start`, the prompt's own too)."""
    sep, n, calls = opts.step_separator, opts.rollouts, []
    tries, wins = [[0] * len(s) for s in solutions], [[0] * len(s) for s in solutions]
    final = [right(sep.join(s)) for s in solutions]

    def roll(todo):  # [(solution, k)]: n rollouts of each k-step prefix, in one call
        before = ["".join(step + sep for step in solutions[i][:k]) for i, k in todo]
        calls.append(prompts := [text + b for b in before])
        outs = complete(prompts, n, seed + len(calls))
        if len(outs) != len(prompts) or any(len(o) != n for o in outs):
            raise UsageError(
                f"complete() must give {n} texts for each of its {len(prompts)} prompts")
        found = [sum(right(t, b) for t in texts) for b, texts in zip(before, outs)]
        for (i, k), w in zip(todo, found):
            if k:
                tries[i][k - 1], wins[i][k - 1] = n, w
        return found
    start = None
    if opts.search == "binary":  # the first error is a step in lo..hi; one call per round
        lo, hi = [1] * len(solutions), [len(s) for s in solutions]
        while todo := [(i, (lo[i] + hi[i]) // 2) for i in range(len(solutions))
                       if lo[i] < hi[i] and not final[i]]:
            for (i, k), w in zip(todo, roll(todo)):
                lo[i], hi[i] = (k + 1, hi[i]) if w else (lo[i], k)
        labels = [[True] * len(s) if final[i] else
                  [True] * (hi[i] - 1) + [False] + [None] * (len(s) - hi[i])
                  for i, s in enumerate(solutions)]
    else:  # progress: the prompt's own rollouts first, as a 0-step prefix
        todo = [(i, k) for i, s in enumerate(solutions) for k in range(1, len(s))]
        asked = ([(0, 0)] if opts.label == "progress" and solutions else []) + todo
        found = roll(asked) if asked else []
        start = found[0] if len(found) > len(todo) else None
        labels = [step_labels(ws, f, n, opts.label, start) for ws, f in zip(wins, final)]
    more = {} if start is None else {"start": [n, start]}
    return [{"labels": y, "rollouts": t, "successes": w, **more}
            for y, t, w in zip(labels, tries, wins)]


def step_labels(wins: list, final: bool, n: int, how: str, start: int = None) -> list:
    """From each step's successes of n (the last one's unused) and the outcome."""
    if how == "hard":
        return [w > 0 for w in wins[:-1]] + [final]
    values = [w / n for w in wins[:-1]] + [float(final)]  # V after each step
    if how == "soft":
        return values
    before = [start / n] + values[:-1]
    return [min(1.0, v / b) if b else float(v > 0) for v, b in zip(values, before)]


def label_row(row: dict, index: int, complete, render, opts, prover=None) -> list:
    text, sep = render(row["prompt"]), opts.step_separator
    if not isinstance(text, str):
        raise UsageError(f"row {index}: a chat prompt needs render= (e.g. Generator(...).render)")
    text += "" if text[-1:].isspace() else sep  # the first step starts on its own
    seed = (opts.seed * 1_000_003 + index) * 1_000
    answer, rid = str(row[opts.answer_field]), row.get("id")
    given = row.get("completions") is not None
    drawn = [] if given else complete([text], opts.samples, seed)[0]
    solutions = [row["completions"]] if given else [s for d in drawn if (s := split_steps(d, sep))]
    found = label_solutions(text, solutions, judge(answer, opts), prover or complete, opts, seed)
    ids = [{} if rid is None else {"id": str(rid) if given else f"{rid}/{j}"}
           for j in range(len(solutions))]
    return [json.dumps({"prompt": row["prompt"], "completions": steps, **res, "answer": answer,
                        "row": index, "lines": len(solutions), **i}, ensure_ascii=False)
            for steps, res, i in zip(solutions, found, ids)]


def read_input(spec: str, opts, skip_invalid: bool):
    """([(index, row)] of the valid rows, a digest of all)."""
    rows, problems, bad, digest = [], [], 0, hashlib.sha256()
    records = ((name, rec) for name, recs in sources(spec) for rec in recs)
    for index, (name, (where, r, problem)) in enumerate(records):
        digest.update(json.dumps(r, sort_keys=True, default=str).encode())
        if opts.prompt_field != "prompt" and isinstance(r, dict):
            r = {**r, "prompt": r.get(opts.prompt_field)}
        issues = [problem] if problem else input_problems(r, opts.answer_field)
        if not issues and rows and \
                isinstance(r["prompt"], list) != isinstance(rows[0][1]["prompt"], list):
            issues = ["field 'prompt': plain-text and conversational prompts are mixed"]
        problems.extend(f"{name} {where}: {p}" for p in issues)
        bad += bool(issues)
        rows += [] if issues else [(index, r)]
    if bad and not skip_invalid:
        raise DataError(problems, total_rows=bad)
    if bad:
        print(f"{spec}: skipped {bad} invalid rows (--skip-invalid): {problems[0]}",
              file=sys.stderr)
    check([] if rows else [f"{spec}: no rows{' left' if bad else ''}"])
    return rows, digest.hexdigest()[:16]


def input_problems(r, field: str) -> list:
    if not isinstance(r, dict):
        return ["expected a JSON object"]
    steps, answer = r.get("completions"), r.get(field)
    out = row_problems({"prompt": r.get("prompt"), "completions": ["-"] if steps is None else steps,
                        "labels": [True] * (len(steps) if isinstance(steps, list) else 1)})
    if type(answer) not in (str, int, float) or not str(answer).strip():
        got = f"expected text or a number, got {answer!r}"
        out.append(f"field '{field}': {got[:110] if field in r else 'missing'}")
    return out


def label_file(dataset: str, output: str, complete, opts: LabelOptions, *,
               render=lambda prompt: prompt, part=(0, 1), skip_invalid=False, show=True,
               prover=None) -> int:
    """Labels rows i % m == p, part=(p, m), into `output` (.part<p>of<m> if m > 1); returns the
    rollouts spent."""
    start, (p, m) = time.time(), part
    rows, digest = read_input(dataset, opts, skip_invalid)
    own, spent = output if m == 1 else f"{output}.part{p}of{m}", 0
    blank = own + ".blank"
    settings = {**dataclasses.asdict(opts), "policy_files": stamp(opts.policy), "dataset": digest}
    with resumed(output, settings, "prm.label", (own, blank)):
        done = finished(output, *parts(output), *glob.glob(glob.escape(output) + "*.blank"))
        todo = [(i, r) for i, r in rows if i % m == p and i not in done]
        for i, row in (bar := tqdm(todo, desc="labeling rows", disable=not show or None)):
            write_lines(own, lines := label_row(row, i, complete, render, opts, prover), "a")
            if not lines:
                mark = {"row": i, "lines": 1, "blank_samples": opts.samples}
                write_lines(blank, [json.dumps(mark)], "a")
                bar.write(f"row {i}: its {opts.samples} sampled solutions are all blank (kept in "
                          f"{blank})", file=sys.stderr)
            spent += sum(sum(json.loads(line)["rollouts"]) for line in lines)
            spent += json.loads(lines[0]).get("start", [0])[0] if lines else 0  # one per row
            bar.set_postfix_str(f"{spent / (time.time() - start):.1f} rollouts/s")
        if m == 1:
            merge(output, spent, time.time() - start, show)
        elif show:
            print(f"{own}: {len(todo)} rows, {spent} rollouts, {time.time() - start:.0f} s",
                  file=sys.stderr)
    return spent


def merge(output: str, spent: int = 0, seconds: float = 0.0, show: bool = True,
          writer: str = "prm.label"):
    """The finished rows of `output` and its parts into `output`; the parts go."""
    rows = finished(output, *(old := parts(output)), writer=writer)
    write_lines(output, lines := [line for k in sorted(rows) for line in rows[k]])
    for path in old:
        os.remove(path)
    if show:
        solutions = [json.loads(line) for line in lines]
        labels = [float(y) for r in solutions for y in r["labels"] if y is not None]
        high = sum(y >= 0.5 for y in labels) / max(1, len(labels))
        print(f"{output}: {len(rows)} rows, {len(solutions)} solutions, {len(labels)} steps "
              f"({high:.0%} >= 0.5), {sum(sum(r['rollouts']) for r in solutions)} rollouts; this "
              f"run: {spent}, {seconds:.0f} s", file=sys.stderr, flush=True)


class Generator:
    """complete() by a transformers causal LM: batched, seeded; bf16 where native."""

    def __init__(self, opts: LabelOptions, *, device, trust_remote_code: bool = False):
        self.opts, self.device, self.trust = opts, device, trust_remote_code
        self.tok = self.model = None
        self.stops = {}

    def tokenizer(self):  # the first call loads the model too
        if self.tok is None:
            from transformers import AutoModelForCausalLM
            from prm.loading import load_tokenizer, loading
            from prm.core.model import saved_weights
            self.tok = tok = load_tokenizer(self.opts.policy, self.trust, "--policy")
            tok.padding_side, tok.pad_token = "left", tok.pad_token or tok.eos_token
            adds = tok("x")["input_ids"][:1] == [tok.bos_token_id]
            self.bos = tok.bos_token if adds else ""
            dtype = autocast_dtype(None, self.device) or torch.float32
            self.model = loading("--policy", self.opts.policy, saved_weights, dtype=dtype,
                                 auto=AutoModelForCausalLM, trust_remote_code=self.trust)
            self.model.to(self.device).eval()
            archs = self.model.config.architectures or []
            check([f"--policy {self.opts.policy}: a masked language model ({archs[0]}) writes no "
                   "text; pass a causal LM"] if any("MaskedLM" in a for a in archs) else [])
        return self.tok

    def render(self, prompt) -> str:
        """With the BOS the tokenizer adds; chat by its template."""
        tok = self.tokenizer()
        try:
            return self.bos + prompt if isinstance(prompt, str) else \
                tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        except (ValueError, TemplateError) as e:  # no chat template, or one that refuses these
            raise UsageError(f"--policy {self.opts.policy}: cannot render a chat prompt: "
                             f"{' '.join(str(e).split())}") from None

    def __call__(self, prompts: list, n: int, seed, stop: str = None) -> list:
        """n texts per prompt (seed: an int or one per prompt), cut after `stop`; self.usage: per
        text, (tokens made, whether max_new_tokens cut it)."""
        o, d, tok = self.opts, self.device, self.tokenizer()
        sampling = dict(max_new_tokens=o.max_new_tokens, pad_token_id=tok.pad_token_id,
                        do_sample=False)  # gumbel_max samples
        if stop:
            if stop not in self.stops:  # it reads the whole vocabulary
                from transformers import StoppingCriteriaList, StopStringCriteria
                self.stops[stop] = StoppingCriteriaList([StopStringCriteria(tok, [stop])])
            sampling.update(stopping_criteria=self.stops[stop])
        seeds = seed if isinstance(seed, list) else [mix(seed, i) for i in range(len(prompts))]
        copies, size = n if o.temperature > 0 else 1, o.batch_size  # greedy: one text
        flat = [(p, mix(s, j)) for p, s in zip(prompts, seeds) for j in range(copies)]
        out, usage = [], []
        for batch in (flat[s:s + size] for s in range(0, len(flat), size)):
            enc = tok([p for p, _ in batch], return_tensors="pt", padding=True,
                      add_special_tokens=False).to(d)
            if o.temperature > 0:
                sampling["logits_processor"] = gumbel_max(o, [s for _, s in batch], d)
            ids = self.model.generate(**enc, **sampling)  # (B, T + new); generate: no_grad
            new = ids[:, enc["input_ids"].shape[1]:]  # (B, new)
            # a finished sequence is padded after its last token
            at = torch.arange(1, new.shape[1] + 1, device=d)  # (new,)
            made = ((new != tok.pad_token_id) * at).amax(1)  # (B,)
            texts = tok.batch_decode(new, skip_special_tokens=True)
            for text, k, last in zip(texts, made.tolist(), new[:, -1].tolist()):
                head, found, _ = text.partition(stop) if stop else (text, "", "")
                out.append(head + found)
                usage.append((k, k == o.max_new_tokens and last != tok.eos_token_id and not found))
        # greedy: the copies of a prompt's one text cost no tokens
        self.usage = [usage[i * copies:(i + 1) * copies] + [(0, usage[i][1])] * (n // copies - 1)
                      for i in range(len(prompts))]
        return [out[i * copies:(i + 1) * copies] * (n // copies) for i in range(len(prompts))]


def mix(*parts) -> int:
    """A 63-bit seed: different parts, unrelated seeds."""
    return int(hashlib.sha256(repr(parts).encode()).hexdigest()[:16], 16) >> 1


def gumbel_max(opts: LabelOptions, seeds: list, device):
    """Sampling under greedy decoding: Gumbel noise, each row's from its own seed."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper
    gens, drawn = [torch.Generator(device).manual_seed(s) for s in seeds], {"steps": 0}

    def noise(input_ids, scores):  # argmax(scores + Gumbel noise) samples softmax(scores)
        # k steps' noise a draw: the same for any batch
        t, k = drawn["steps"], max(1, min(opts.max_new_tokens, 2 ** 18 // scores.shape[1]))
        if t % k == 0:
            drawn["u"] = torch.stack([  # (B, k, V)
                torch.rand(k, scores.shape[1], generator=g, device=device) for g in gens])
        drawn["steps"] += 1
        return scores - torch.log(-torch.log(drawn["u"][:, t % k]))  # (B, V)
    top_p = [TopPLogitsWarper(opts.top_p)] if opts.top_p < 1 else []
    return LogitsProcessorList([TemperatureLogitsWarper(opts.temperature), *top_p, noise])


def main(argv=None):
    with exit_status():
        a = Parser(LabelRun, LabelOptions, prog="python -m prm.label",
                   description="Step labels by policy rollouts.").parse_args(argv)
        parsed(LabelRun, a)
        opts = parsed(LabelOptions, a)
        read = [("--dataset", a.dataset), ("--policy", a.policy), ("--prover", a.prover)]
        check(overwrites([("--output", a.output)], read, new=True))
        shard, shards = map(int, a.shard.split("/"))
        rt = setup()
        try:
            # ranks end at different times: a group that does not time out
            wait = rt.distributed and dist.new_group(
                backend="gloo", timeout=datetime.timedelta(days=7))
            gen = Generator(opts, device=rt.device, trust_remote_code=a.trust_remote_code)
            prover = Generator(dataclasses.replace(opts, policy=opts.prover), device=rt.device,
                               trust_remote_code=gen.trust) if opts.prover else None
            start = time.time()
            part = (shard * rt.world_size + rt.rank, shards * rt.world_size)
            spent = label_file(a.dataset, a.output, gen, opts, render=gen.render, part=part,
                               show=rt.is_main, skip_invalid=a.skip_invalid, prover=prover)
            if rt.distributed:
                dist.all_reduce(total := torch.tensor([spent]), group=wait)
                if rt.is_main and shards == 1:
                    with locked(a.output):
                        merge(a.output, int(total), time.time() - start)
        except KeyboardInterrupt:
            raise Stopped("stopped by SIGINT; run the same command again to continue",
                          signal.SIGINT) from None
        finally:
            teardown(rt)


if __name__ == "__main__":
    main()
