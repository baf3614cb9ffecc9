"""`python -m prm.label`: step labels by Monte-Carlo rollouts of a policy (Math-Shepherd's soft or
hard estimate, OmegaPRM's binary search). The API takes any `complete(prompts, n, seed)`."""
import dataclasses
import datetime
import glob
import hashlib
import json
import os
import re
import signal
import sys
import time
from fractions import Fraction
from types import SimpleNamespace

import regex

from prm.cli import Parser, add_fields, parsed
from prm.config import opt, unescape
from prm.errors import Stopped, UsageError, check, exit_status, overwrites
from prm.files import locked, write_lines
from prm.readers.formats import row_problems, split_steps
from prm.readers.sources import DataError, _sources


@dataclasses.dataclass
class LabelOptions:
    """What decides the labels: kept in OUTPUT.settings; a rerun with others is refused."""
    rollouts: int = opt(8, "continuations rolled out from each step's prefix")
    label: str = opt("hard", "hard: 1 if any rollout is right; soft: the share (V); progress: "
                     "min(1, V after / V before) (V before 0: 1 if V after > 0; V before "
                     "step 1: the prompt's rollouts)", choices=["soft", "hard", "progress"])
    search: str = opt("all", "all: roll out every step's prefix; binary: search the first step no "
                      "rollout rescues (1 before, 0 at, null after)", choices=["all", "binary"])
    samples: int = opt(4, "solutions sampled for a row without 'completions'")
    step_separator: str = opt("\n", "what ends each step (escapes such as \\n understood)",
                              type=unescape)
    answer_field: str = opt("answer", "the column of the reference final answer")
    answer_pattern: str = opt("", "regex whose last match (its first group that took part) is the "
                              "answer; default: the last \\boxed{}, 'the answer is ...' or number")
    checker: str = opt("exact", "exact: normalized match; or math-verify",
                       choices=["exact", "math-verify"])
    seed: int = opt(0, "each row is seeded from it and the row's index")
    policy: str = opt("", "the model rolled out (a hub name or folder)", required=True)
    prover: str = opt("", "the model rolled out from each prefix, if not --policy (it continues "
                      "the text --policy renders)")
    temperature: float = opt(0.7, "sampling temperature; 0: greedy")
    top_p: float = opt(1.0, "nucleus sampling share")
    max_new_tokens: int = opt(512, "tokens per rollout or sampled solution")
    batch_size: int = opt(16, "sequences per generate call")

    def __post_init__(self):
        """Refuses what would fail only after the policy loads."""
        try:
            regex.compile(self.answer_pattern)
        except regex.error as e:
            raise UsageError(f"--answer-pattern {self.answer_pattern!r}: not a regular "
                             f"expression ({e})") from None
        binary_progress = getattr(self, "label", "") == "progress" and self.search == "binary"
        check(["--step-separator must not be empty: it ends each step"] * (not self.step_separator)
              + ["--label progress needs --search all"] * binary_progress)
        if self.checker == "math-verify":
            try:
                import math_verify  # noqa: F401 (judge uses it)
            except ImportError:
                raise UsageError("--checker math-verify needs the math-verify package: "
                                 "pip install 'math-verify[antlr4_13_2]'") from None


def extract_answer(text: str, pattern: str = ""):
    """The last match of `pattern` (its first group that took part, else all of it; within 2 s),
    else of \\boxed{...}, "answer is ...", a number."""
    if pattern:
        try:
            found = list(regex.finditer(pattern, text, timeout=2.0))
        except TimeoutError:
            raise UsageError(f"--answer-pattern {pattern!r}: no result within 2 s on a text of "
                             f"{len(text)} characters; avoid nested repeats") from None
        m = found[-1] if found else None
        return m and next((g for g in m.groups() if g is not None), m.group(0))
    start, depth = text.rfind("\\boxed{"), 0
    for j in range(start + 6, len(text) if start >= 0 else 0):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[start + 7:j]
    ends = [m.end() for m in re.finditer(r"answer is:?\s*", text, re.I)]
    # the rest of its line or sentence, less a closing period
    said = re.split(r"\n|\.\s", text[ends[-1]:], maxsplit=1)[0] if ends else ""
    numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    return said.rstrip().removesuffix(".") or (numbers[-1].rstrip(",") if numbers else None)


def normalize(answer: str) -> str:
    """Without spaces, $, \\left/\\right, \\text{}, \\dfrac, final period, "x =", 1,000's comma."""
    s = re.sub(r"\\(?:text|mathrm|textbf)\{([^{}]*)\}", r"\1", answer)
    for old, new in (("\\left", ""), ("\\right", ""), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"),
                     ("$", ""), ("\\!", ""), ("\\,", ""), (" ", "")):
        s = s.replace(old, new)
    s = re.sub(r"^[a-zA-Z]=", "", s.strip().rstrip("."))
    return s.replace(",", "") if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s) else s


def _number(s: str):
    """The exact value of an integer, decimal, a/b or \\frac{a}{b}; None for anything else."""
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?0*[1-9]\d*)\}"
                     r"|(-?\d+(?:\.\d+)?)(?:/(0*[1-9]\d*))?", s)
    if not m or len(s) > sys.get_int_max_str_digits() > 0:  # too long for int(): compared as text
        return None
    if m.group(2) is not None:
        return Fraction(int(m.group(2)), int(m.group(3))) * (-1 if m.group(1) else 1)
    return Fraction(m.group(4)) / int(m.group(5) or 1)


def same_answer(found, reference) -> bool:
    """Normalized exact match, or the same number (0.5 = 1/2 = \\frac{1}{2}); no answer is wrong."""
    a, b = normalize(str(found)), normalize(str(reference))
    return found is not None and (a == b or (_number(a) is not None and _number(a) == _number(b)))


def judge(reference: str, opts: LabelOptions):
    """right(text, before=""): text's answer, else before + text's last one, is the reference."""
    def answer(text, before=""):
        own = extract_answer(text, opts.answer_pattern)
        return extract_answer(before + text, opts.answer_pattern) if own is None and before else own
    if opts.checker == "math-verify":
        from math_verify import parse, verify
        gold = parse("\\boxed{" + reference + "}")
        return lambda text, before="": (a := answer(text, before)) is not None and \
            verify(gold, parse("\\boxed{" + a + "}"))
    return lambda text, before="": same_answer(answer(text, before), reference)


def label_solutions(text: str, solutions: list, right, complete, opts: LabelOptions,
                    seed: int) -> list:
    """{labels, rollouts, successes} per solution (a list of steps; the last by its answer), and
    for progress `start`: [rollouts, successes] from the prompt alone."""
    sep, n, calls = opts.step_separator, opts.rollouts, []
    tries, wins = [[0] * len(s) for s in solutions], [[0] * len(s) for s in solutions]
    final = [right(sep.join(s)) for s in solutions]

    def roll(todo):  # [(solution, k)]: n continuations of each prefix (steps 1..k), in one call
        before = ["".join(step + sep for step in solutions[i][:k]) for i, k in todo]
        calls.append(prompts := [text + b for b in before])
        outs = complete(prompts, n, seed + len(calls))
        if len(outs) != len(prompts) or any(len(o) != n for o in outs):
            raise UsageError(f"complete() must give {n} texts for each of its {len(prompts)} "
                             "prompts")
        return [sum(right(t, b) for t in texts) for b, texts in zip(before, outs)]
    start = None
    if opts.search == "binary":  # the first error is a step in lo..hi; one call per round
        lo, hi = [1] * len(solutions), [len(s) for s in solutions]
        while todo := [(i, (lo[i] + hi[i]) // 2) for i in range(len(solutions))
                       if lo[i] < hi[i] and not final[i]]:
            for (i, k), w in zip(todo, roll(todo)):
                tries[i][k - 1], wins[i][k - 1] = n, w
                lo[i], hi[i] = (k + 1, hi[i]) if w else (lo[i], k)
        labels = [[True] * len(s) if final[i] else
                  [True] * (hi[i] - 1) + [False] + [None] * (len(s) - hi[i])
                  for i, s in enumerate(solutions)]
    else:  # progress: first the prompt's own rollouts, as a prefix of 0 steps
        todo = [(i, k) for i, s in enumerate(solutions) for k in range(1, len(s))]
        asked = ([(0, 0)] if opts.label == "progress" and solutions else []) + todo
        found = roll(asked) if asked else []
        start = found.pop(0) if len(found) > len(todo) else None
        for (i, k), w in zip(todo, found):
            tries[i][k - 1], wins[i][k - 1] = n, w
        labels = [step_labels(ws, f, n, opts.label, start) for ws, f in zip(wins, final)]
    more = {} if start is None else {"start": [n, start]}
    return [{"labels": y, "rollouts": t, "successes": w, **more}
            for y, t, w in zip(labels, tries, wins)]


def step_labels(wins: list, final: bool, n: int, how: str, start: int = None) -> list:
    """A solution's labels from its steps' successes (of n; the last step's unused) and outcome."""
    if how == "hard":
        return [w > 0 for w in wins[:-1]] + [final]
    values = [w / n for w in wins[:-1]] + [float(final)]  # V after each step
    if how == "soft":
        return values
    before = [start / n] + values[:-1]
    return [min(1.0, v / b) if b else float(v > 0) for v, b in zip(values, before)]


def label_row(row: dict, index: int, complete, render, opts: LabelOptions, prover=None) -> list:
    """The output lines of one row: its completions, or opts.samples sampled solutions."""
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


def read_input(spec: str, opts: LabelOptions, skip_invalid: bool):
    """([(index, row)] of the valid rows, a digest of all); bad rows: DataError, or skipped."""
    rows, problems, bad, digest = [], [], 0, hashlib.sha256()
    sources = _sources(spec, "train", SimpleNamespace(dataset_config=None))
    records = ((name, rec) for name, recs in sources for rec in recs)
    for index, (name, (where, r, problem)) in enumerate(records):
        digest.update(json.dumps(r, sort_keys=True, default=str).encode())
        issues = [problem] if problem else input_problems(r, opts.answer_field)
        chat = not issues and isinstance(r["prompt"], list)
        if not issues and rows and chat != isinstance(rows[0][1]["prompt"], list):
            issues = ["field 'prompt': plain-text and conversational prompts are mixed in one "
                      "dataset (training refuses such an output)"]
        problems.extend(f"{name} {where}: {p}" for p in issues)
        bad += bool(issues)
        rows += [] if issues else [(index, r)]
    if bad and not skip_invalid:
        raise DataError(problems, total_rows=bad)
    if bad:
        print(f"{spec}: skipped {bad} invalid rows (--skip-invalid): {problems[0]}",
              file=sys.stderr)
    return rows, digest.hexdigest()[:16]


def input_problems(r, field: str) -> list:
    if not isinstance(r, dict):
        return ["expected a JSON object"]
    steps, answer = r.get("completions"), r.get(field)
    out = row_problems({"prompt": r.get("prompt"), "completions": ["-"] if steps is None else steps,
                        "labels": [True] * (len(steps) if isinstance(steps, list) else 1)})
    if type(answer) not in (str, int, float) or not str(answer).strip():
        got = f"expected the reference answer (text, number), got {answer!r}"
        out.append(f"field '{field}': {got[:110] if field in r else 'missing'}")
    return out


def finished(*paths: str) -> dict:
    """{input row: its output lines} of the rows complete in one of the files, the first such."""
    rows = {}
    for path in filter(os.path.isfile, paths):
        with open(path, encoding="utf-8") as f:
            lines, got = f.read().split("\n")[:-1], {}  # past the last newline: a line cut short
        for n, line in enumerate(lines, 1):
            try:
                r = json.loads(line)
                got.setdefault(r["row"], []).append((line, r["lines"]))
            except (ValueError, KeyError, TypeError):
                raise UsageError(f"{path} line {n}: not a line prm.label writes; pass another "
                                 "--output") from None
        rows = {k: [line for line, _ in v] for k, v in got.items() if len(v) == v[0][1]} | rows
    return rows


def parts(output: str) -> list:
    found = glob.glob(glob.escape(output) + ".part*")
    return sorted(p for p in found if re.search(r"\.part\d+of\d+$", p))


def blanks(output: str) -> list:
    """OUTPUT.blank and OUTPUT.part<p>of<m>.blank: the rows whose samples were all blank."""
    return [output + ".blank", *glob.glob(glob.escape(output) + ".part*of*.blank")]


def check_settings(output: str, settings: dict, verb: str):
    """Writes OUTPUT.settings at the first run; refuses a rerun with other settings."""
    side, now = output + ".settings", json.loads(json.dumps(settings))  # tuples as JSON lists
    if not os.path.isfile(side):
        write_lines(side, [json.dumps(now, indent=1)])
    try:
        with open(side, encoding="utf-8") as f:
            old = json.load(f)
        if not isinstance(old, dict):
            raise ValueError(f"a JSON {type(old).__name__}, not an object")
    except ValueError as e:  # cut short, not JSON, not UTF-8
        raise UsageError(f"{side}: not the settings prm.label writes ({e}); restore it, or pass "
                         "another --output") from None
    diff = [f"{k} {old.get(k)!r} (now {v!r})" for k, v in now.items() if old.get(k) != v]
    check([f"{output} was {verb} with other settings: {', '.join(diff)}; rerun with those to "
           "continue it, or pass another --output"] if diff else [])


def label_file(dataset: str, output: str, complete, opts: LabelOptions, *,
               render=lambda prompt: prompt, part=(0, 1), skip_invalid=False, show=True,
               prover=None) -> int:
    """Labels the rows whose index % part[1] == part[0] into `output` (OUTPUT.part<p>of<m> for a
    share; a run of all rows merges the parts); render(prompt): the text the policy continues.
    Returns rollouts spent."""
    from tqdm import tqdm
    start, (p, m) = time.time(), part
    rows, digest = read_input(dataset, opts, skip_invalid)
    own, spent = output if m == 1 else f"{output}.part{p}of{m}", 0
    blank = own + ".blank"  # its own per part: a cut last line is dropped as the output's is
    with locked(own):
        check_settings(output, {**dataclasses.asdict(opts), "dataset": digest}, "labeled")
        done = finished(output, *parts(output), *blanks(output))
        for path in (own, blank) if os.path.isfile(blank) else (own,):  # drops what a kill cut
            write_lines(path, [line for lines in finished(path).values() for line in lines])
        todo = [(i, r) for i, r in rows if i % m == p and i not in done]
        for i, row in (bar := tqdm(todo, desc="labeling rows", disable=not show or None)):
            write_lines(own, lines := label_row(row, i, complete, render, opts, prover), "a")
            if not lines:
                mark = {"row": i, "lines": 1, "blank_samples": opts.samples}
                write_lines(blank, [json.dumps(mark)], "a")
                bar.write(f"row {i}: its {opts.samples} sampled solutions are all blank; no line "
                          f"written, listed in {blank}, not sampled again", file=sys.stderr)
            spent += sum(sum(json.loads(line)["rollouts"]) for line in lines)
            spent += json.loads(lines[0]).get("start", [0])[0] if lines else 0  # one per row
            bar.set_postfix_str(f"{spent / (time.time() - start):.1f} rollouts/s")
        if m == 1:
            merge(output, spent, time.time() - start, show)
        elif show:
            print(f"{own}: {len(todo)} rows, {spent} rollouts, {time.time() - start:.0f} s",
                  file=sys.stderr)
    return spent


def merge(output: str, spent: int = 0, seconds: float = 0.0, show: bool = True):
    """Writes the finished rows of `output` and its parts into `output` in order, less the parts."""
    rows = finished(output, *(old := parts(output)))
    write_lines(output, lines := [line for k in sorted(rows) for line in rows[k]])
    for path in old:
        os.remove(path)
    solutions = [json.loads(line) for line in lines]
    labels = [float(y) for r in solutions for y in r["labels"] if y is not None]
    if show:
        print(f"{output}: {len(rows)} rows, {len(solutions)} solutions, {len(labels)} steps "
              f"labeled ({sum(y >= 0.5 for y in labels) / max(1, len(labels)):.0%} at least 0.5), "
              f"{sum(sum(r['rollouts']) for r in solutions)} rollouts in all; this run: {spent} "
              f"rollouts, {seconds:.0f} s", file=sys.stderr, flush=True)


class Generator:
    """complete() by a transformers causal LM: batched, left-padded, seeded; bf16 where native."""

    def __init__(self, opts: LabelOptions, *, device, trust_remote_code: bool = False):
        self.opts, self.device, self.trust = opts, device, trust_remote_code
        self.tok = self.model = None
        self.stops = {}  # stop string -> its stopping criteria

    def tokenizer(self):
        """The policy's tokenizer, with its model, loaded at the first row."""
        if self.tok is None:
            import torch
            from transformers import AutoModelForCausalLM
            from prm.loading import load_tokenizer, loading
            from prm.core.model import saved_weights
            from prm.core.runtime import autocast_dtype
            self.tok = tok = load_tokenizer(self.opts.policy, self.trust, "--policy")
            tok.padding_side, tok.pad_token = "left", tok.pad_token or tok.eos_token
            bos = tok.bos_token_id
            adds = bos is not None and tok("x")["input_ids"][:1] == [bos]
            self.bos = tok.bos_token if adds else ""
            dtype = autocast_dtype(None, self.device) or torch.float32
            self.model = loading("--policy", self.opts.policy, saved_weights,
                                 auto=AutoModelForCausalLM, trust_remote_code=self.trust,
                                 dtype=dtype).to(self.device).eval()
        return self.tok

    def render(self, prompt) -> str:
        """Text as the tokenizer starts it (its BOS if it adds one); chat by its template."""
        from jinja2 import TemplateError
        tok = self.tokenizer()
        try:
            return self.bos + prompt if isinstance(prompt, str) else \
                tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        except (ValueError, TemplateError) as e:  # no chat template, or one that refuses these
            raise UsageError(f"--policy {self.opts.policy}: cannot render a chat prompt: "
                             f"{' '.join(str(e).split())}") from None

    def __call__(self, prompts: list, n: int, seed: int, stop: str = None) -> list:
        """n texts per prompt, each ended after its first `stop` if given; `usage`: per text,
        (tokens generated, whether max_new_tokens cut it: no EOS, no stop)."""
        import torch
        o, d, tok = self.opts, self.device, self.tokenizer()
        sampling = dict(max_new_tokens=o.max_new_tokens, pad_token_id=tok.pad_token_id,
                        do_sample=o.temperature > 0)
        if o.temperature > 0:
            sampling.update(temperature=o.temperature, top_p=o.top_p, top_k=0)
        if stop:
            if stop not in self.stops:  # built once: it reads the whole vocabulary
                from transformers import StoppingCriteriaList, StopStringCriteria
                self.stops[stop] = StoppingCriteriaList([StopStringCriteria(tok, [stop])])
            sampling.update(stopping_criteria=self.stops[stop])
        copies, size = n if o.temperature > 0 else 1, o.batch_size  # greedy: one text
        flat, out, usage = [p for p in prompts for _ in range(copies)], [], []
        for c, batch in enumerate(flat[s:s + size] for s in range(0, len(flat), size)):
            enc = tok(batch, return_tensors="pt", padding=True, add_special_tokens=False).to(d)
            torch.manual_seed((seed * 1_009 + c) % 2 ** 63)
            with torch.no_grad():
                ids = self.model.generate(**enc, **sampling)  # (B, T + new)
            new = ids[:, enc["input_ids"].shape[1]:]  # (B, new)
            # a finished sequence is padded: its tokens end at its last non-pad one
            at = torch.arange(1, new.shape[1] + 1, device=d)  # (new,)
            made = ((new != tok.pad_token_id) * at).amax(1)  # (B,)
            for text, k, last in zip(tok.batch_decode(new, skip_special_tokens=True), made.tolist(),
                                     new[:, -1].tolist()):
                head, found, _ = text.partition(stop) if stop else (text, "", "")
                out.append(head + found)
                usage.append((k, k == o.max_new_tokens and last != tok.eos_token_id and not found))
        # greedy: the copies of a prompt's one text cost no tokens
        self.usage = [usage[i * copies:(i + 1) * copies] + [(0, usage[i][1])] * (n // copies - 1)
                      for i in range(len(prompts))]
        return [out[i * copies:(i + 1) * copies] * (n // copies) for i in range(len(prompts))]


def main(argv=None):
    with exit_status():  # a bad flag too: one line and exit status 2
        p = Parser(prog="python -m prm.label",
                   description="Label solution steps by Monte-Carlo policy rollouts.")
        p.add_argument("--dataset", required=True, help="a .jsonl/.json/.parquet file or folder")
        p.add_argument("--output", required=True, help="the .jsonl written; a rerun resumes it")
        p.add_argument("--shard", default="0/1",
                       help="i/n: every n-th row from the i-th; no --shard merges")
        p.add_argument("--skip-invalid", action="store_true", help="leave out invalid rows")
        p.add_argument("--trust-remote-code", action="store_true", help="run the policy's code")
        a = add_fields(p, LabelOptions).parse_args(argv)
        if not (m := re.fullmatch(r"(\d+)/(\d+)", a.shard)) or int(m.group(1)) >= int(m.group(2)):
            p.error(f"--shard {a.shard}: expected i/n with 0 <= i < n")
        if min(a.rollouts, a.samples, a.batch_size, a.max_new_tokens) < 1:
            p.error("--rollouts, --samples, --batch-size and --max-new-tokens must be at least 1")
        # else transformers refuses after the policy loads
        if not (a.temperature >= 0 and 0 < a.top_p <= 1):
            p.error(f"--temperature {a.temperature:g} must be >= 0 and --top-p {a.top_p:g} "
                    "in (0, 1]")
        read = [("--dataset", a.dataset), ("--policy", a.policy), ("--prover", a.prover)]
        check(overwrites([("--output", a.output)], read))
        opts = parsed(LabelOptions, a)
        shard, shards = map(int, m.groups())
        import torch
        import torch.distributed as dist
        from prm.core.runtime import setup, teardown
        rt = setup()
        try:
            # ranks end at different times: a group that does not time out
            wait = rt.distributed and dist.new_group(backend="gloo",
                                                     timeout=datetime.timedelta(days=7))
            gen = Generator(opts, device=rt.device, trust_remote_code=a.trust_remote_code)
            prover = opts.prover and Generator(dataclasses.replace(opts, policy=opts.prover),
                                               device=rt.device, trust_remote_code=gen.trust)
            start = time.time()
            spent = label_file(a.dataset, a.output, gen, opts, render=gen.render, show=rt.is_main,
                               skip_invalid=a.skip_invalid, prover=prover or None,
                               part=(shard * rt.world_size + rt.rank, shards * rt.world_size))
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
