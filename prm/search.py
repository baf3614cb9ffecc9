"""`python -m prm.search`: a policy's answers picked by a PRM among sampled solutions (best-of-n,
weighted vote) or step by step (beam search, DVTS); majority vote is the baseline. Any policy
`propose(prefixes, n, seed, stop) -> list[list[str]]`, any PRM `score(questions, outputs)`."""
import collections
import dataclasses
import itertools
import json
import signal
import statistics
import sys
import time

from prm.cli import Parser, parsed
from prm.config import Checked, at_least, bound, opt, within
from prm.core.metrics import AGGREGATES, solution_score
from prm.errors import Stopped, UsageError, check, exit_status, overwrites
from prm.files import finished, resumed, stamp, write_lines
from prm.label import Generator, LabelOptions, extract_answer, judge, normalize, read_input
from prm.readers.formats import split_steps
from prm.scoring import ScorerOptions

SAMPLED, TREES = ("majority", "best-of-n", "weighted"), ("beam", "dvts")
COSTS = ("policy_tokens", "prm_tokens", "seconds")
MAX_N = 1 << 16  # solutions or beams per problem: more would not fit in memory
# a problem searched: its input row, the text the policy continues, right(text) -> bool
Problem = collections.namedtuple("Problem", "index row text right")


LABEL = LabelOptions.__dataclass_fields__  # the flags prm.label shares


@dataclasses.dataclass
class SearchOptions(Checked):
    """What decides the results: kept in OUTPUT.settings; a rerun with others is refused."""
    methods: tuple = opt(SAMPLED + TREES, "comma list of majority, best-of-n, weighted (sharing "
                         "samples), beam, dvts", check=bound(lambda m: m in SAMPLED + TREES,
                                                             "expected majority, best-of-n, "
                                                             "weighted, beam or dvts"))
    n: tuple = opt((1, 4, 16), "comma list of budgets N: solutions sampled, or beams",
                   check=within(1, MAX_N))
    beam_width: int = opt(4, "M: beam keeps N/M beams, each extended M ways; dvts grows N/M "
                          "subtrees of M (M = N for N < M)", check=at_least(1))
    aggregate: str = opt("last", "a solution's score from its step scores",
                         choices=list(AGGREGATES))
    select: str = opt("weighted", "how beam and dvts pick a finished beam", choices=SAMPLED)
    max_steps: int = opt(40, "steps a beam takes at most", check=at_least(1))
    seeds: tuple = opt((0,), "comma list; the summary's mean and range are over them")
    problems: int = opt(8, "problems searched together, sharing calls and seeds",
                        check=at_least(1))
    policy: str = opt(like=LABEL["policy"], help="the policy (a Hugging Face name or folder)")
    temperature: float = opt(like=LABEL["temperature"])
    top_p: float = opt(like=LABEL["top_p"])
    max_new_tokens: int = opt(like=LABEL["max_new_tokens"],
                              help="tokens per sampled solution or beam step")
    batch_size: int = opt(like=LABEL["batch_size"], help="sequences per generate or PRM call")
    step_separator: str = opt(like=LABEL["step_separator"])
    answer_field: str = opt(like=LABEL["answer_field"])
    answer_pattern: str = opt(like=LABEL["answer_pattern"])
    checker: str = opt(like=LABEL["checker"])

    def __post_init__(self):
        """Refuses what would fail only after the models load."""
        super().__post_init__()
        m = self.beam_width
        check([f"--n {n}: not a multiple of --beam-width {m} (beam and dvts keep N/M beams)"
               for n in self.n if n > m and n % m and set(self.methods) & set(TREES)])


@dataclasses.dataclass
class SearchRun:
    """prm.search's other flags: the files and the PRM."""
    dataset: str = opt("", "problems with a reference answer, as prm.label reads them",
                       required=True)
    output: str = opt("", "the .jsonl written, a line per problem and seed; a rerun continues it",
                      required=True)
    model: str = opt("", "the PRM, as eval.py's --model", required=True)
    skip_invalid: bool = opt(False, "leave out invalid rows")
    trust_remote_code: bool = opt(False, "allow the models' code")


def proposed(propose, prefixes: list, n: int, seed: int, stop) -> tuple:
    """(texts, usage: per text (tokens, cut by max_new_tokens), seconds per prefix), checked."""
    start, outs = time.time(), propose(prefixes, n, seed, stop)
    if len(outs) != len(prefixes) or any(len(texts) != n for texts in outs):
        raise UsageError(f"propose() must give {n} texts for each of its {len(prefixes)} prefixes")
    usage = getattr(propose, "usage", None) or [[(0, False)] * n for _ in prefixes]
    return outs, usage, (time.time() - start) / len(prefixes)


def candidate(steps, scores, end: str, problem: Problem, opts) -> dict:
    """A finished solution: steps, scores, answer, whether it is right, how it ended."""
    text = opts.step_separator.join(steps)
    return {"steps": list(steps), "scores": scores,
            "answer": extract_answer(text, opts.answer_pattern),
            "correct": bool(problem.right(text)), "end": end}


def pick(cands: list, how: str, aggregate: str):
    """The index of the candidate `how` picks, or None: best-of-n, the best aggregate; majority and
    weighted, the first of the answer with the most candidates or the highest aggregate sum."""
    if how == "best-of-n":
        values = [solution_score(c["scores"], aggregate) for c in cands]
        return values.index(max(values)) if cands else None
    votes, first, count = collections.defaultdict(float), {}, collections.Counter()
    for i, c in enumerate(cands):
        if c["answer"] is not None:
            key = normalize(c["answer"])
            first.setdefault(key, i)
            count[key] += 1
            votes[key] += 1 if how == "majority" else AGGREGATES[aggregate](c["scores"] or [0])
    # weights tied (unscored: a prompt past the PRM's max_length): the most candidates, the first
    return first[max(votes, key=lambda k: (votes[k], count[k]))] if votes else None


def result(method: str, n: int, cands: list, how: str, opts, **more) -> dict:
    i = pick(cands, how, opts.aggregate)
    return {"method": method, "n": n, "answer": None if i is None else cands[i]["answer"],
            "correct": i is not None and cands[i]["correct"], **more}


@dataclasses.dataclass(eq=False)
class Tree:
    """One beam search or DVTS of one problem: groups of survivors ((steps, their scores)), each
    extended `width` ways; of a group's new unfinished beams, the best `keep` survive."""
    problem: Problem
    method: str
    n: int
    width: int

    def __post_init__(self):  # beam: a group of N/M beams, keeping N/M; dvts: N/M groups of one
        k = self.n // self.width
        self.keep, groups = (k, 1) if self.method == "beam" else (1, k)
        self.groups = [[((), [])] * self.keep for _ in range(groups)]
        self.done, self.ends, self.cost = [], collections.Counter(), collections.Counter()

    def end(self, steps, scores, how: str, opts):
        self.ends[how] += 1
        self.done.append(candidate(steps, scores, how, self.problem, opts))


def grow(trees: list, propose, score, count, opts, seeds):
    """One step of every tree: its survivors propose (a call per width), the PRM scores the new
    prefixes (one call), each group keeps its best."""
    sep, new = opts.step_separator, collections.defaultdict(list)
    old = [(t, g, beam) for t in trees for g, group in enumerate(t.groups) for beam in group]
    for t in trees:
        t.groups = [[] for _ in t.groups]
    for width in sorted({t.width for t, _, _ in old}):
        beams = [b for b in old if b[0].width == width]
        prefixes = [t.problem.text + "".join(s + sep for s in steps) for t, _, (steps, _) in beams]
        outs, usage, took = proposed(propose, prefixes, width, next(seeds), sep)
        for (t, g, (steps, scores)), texts, use in zip(beams, outs, usage):
            t.cost["seconds"] += took
            for text, (tokens, cut) in zip(texts, use):
                t.cost["policy_tokens"] += tokens
                head, found, _ = text.partition(sep)
                if head.strip():
                    new[t, g].append((steps + (head,), "" if found else "cut" if cut else "eos"))
                else:  # an empty step ends the beam as it was
                    t.end(steps, scores, "empty", opts)
    keys, start = list(new), time.time()
    texts = [[sep.join(steps) for steps, _ in new[k]] for k in keys]
    probs = score([t.problem.row["prompt"] for t, _ in keys], texts) if keys else []
    took = (time.time() - start) / max(1, sum(map(len, texts)))
    for (t, g), ps, ts in zip(keys, probs, texts):
        t.cost["prm_tokens"] += sum(count(t.problem.row["prompt"], text) for text in ts)
        t.cost["seconds"] += took * len(ts)
        going = []
        for (steps, end), p in zip(new[t, g], ps):
            if end:
                t.end(steps, p, end, opts)
            else:
                going.append((steps, p))
        going.sort(key=lambda b: -solution_score(b[1], opts.aggregate))  # stable: ties keep order
        t.groups[g] = going[:t.keep]


def sample(block: list, records: dict, propose, score, count, opts, seeds):
    """max(N) solutions per problem, in one propose and one PRM call; N takes the first N."""
    methods, top = [m for m in opts.methods if m in SAMPLED], max(opts.n)
    outs, usage, policy_s = proposed(propose, [p.text for p in block], top, next(seeds), None)
    start = time.time()
    probs = score([p.row["prompt"] for p in block], outs) if set(methods) - {"majority"} else \
        [[[]] * top for _ in block]
    prm_s = (time.time() - start) / len(block)
    for p, rec, texts, use, ps in zip(block, records.values(), outs, usage, probs):
        rec["samples"] = [{**candidate(split_steps(text, opts.step_separator), s,
                                       "cut" if cut else "eos", p, opts),
                           "policy_tokens": k, "prm_tokens": count(p.row["prompt"], text)}
                          for text, (k, cut), s in zip(texts, use, ps)]
        for m, n in itertools.product(methods, opts.n):
            first, prm = rec["samples"][:n], m != "majority"
            rec["results"].append(result(
                m, n, first, m, opts, policy_tokens=sum(c["policy_tokens"] for c in first),
                prm_tokens=sum(c["prm_tokens"] for c in first) if prm else 0,
                seconds=(policy_s + prm_s * prm) * n / top))


def search_block(block: list, propose, score, count, opts, seed: int):
    """Yields each problem's record as its searches end; the problems of `block` share calls."""
    # a call's seed: from the seed, the block's first problem and the call's number
    seeds = itertools.count((seed * 1_000_003 + block[0].index) * 1_000)
    records = {p.index: {"row": p.index, "lines": len(opts.seeds), "seed": seed,
                         **({"id": p.row["id"]} if "id" in p.row else {}),
                         "answer": str(p.row[opts.answer_field]), "results": []} for p in block}
    if set(opts.methods) & set(SAMPLED):
        sample(block, records, propose, score, count, opts, seeds)
    kinds = list(itertools.product([m for m in opts.methods if m in TREES], opts.n))
    trees = {p.index: [Tree(p, m, n, min(n, opts.beam_width)) for m, n in kinds] for p in block}
    for step in range(opts.max_steps + 1):
        for i, ts in list(trees.items()):
            if step < opts.max_steps and any(g for t in ts for g in t.groups):
                continue
            for t in ts:  # at max_steps, the survivors end
                for steps, scores in itertools.chain(*t.groups):
                    t.end(steps, scores, "max_steps", opts)
            records[i]["results"] += [result(
                t.method, t.n, t.done, opts.select, opts, **{k: t.cost[k] for k in COSTS},
                ends=dict(t.ends), candidates=t.done) for t in ts]
            del trees[i]
            yield records[i]
        if not trees:
            return
        grow(list(itertools.chain(*trees.values())), propose, score, count, opts, seeds)


def search_file(dataset, output: str, propose, score, opts: SearchOptions, *,
                render=lambda prompt: prompt, count=lambda question, text: 0, settings: dict = None,
                skip_invalid=False, show=True) -> dict:
    """Searches every problem (dataset: a path or read_input's answer) at every seed into `output`;
    a rerun continues it. render(prompt): the text the policy continues; count(question, text): the
    PRM's tokens. Returns summary()."""
    from tqdm import tqdm
    rows, digest = read_input(dataset, opts, skip_invalid) if isinstance(dataset, str) else dataset
    size = opts.problems
    settings = {**dataclasses.asdict(opts), "policy_files": stamp(opts.policy), **(settings or {}),
                "dataset": digest}
    with resumed(output, settings, "prm.search"):
        done = finished(output, writer="prm.search")
        bar = tqdm(total=len(rows) * len(opts.seeds), initial=len(done) * len(opts.seeds),
                   desc="searching", disable=not show or None)
        for chunk in (rows[b:b + size] for b in range(0, len(rows), size)):
            if all(i in done for i, _ in chunk):
                continue
            texts = [render(row["prompt"]) for _, row in chunk]
            check([] if all(isinstance(t, str) for t in texts) else
                  ["a chat prompt needs render= (e.g. Generator(...).render)"])
            block = [Problem(i, row, text + ("" if text[-1:].isspace() else opts.step_separator),
                             judge(str(row[opts.answer_field]), opts))
                     for (i, row), text in zip(chunk, texts)]
            for seed in opts.seeds:
                for rec in search_block(block, propose, score, count, opts, seed):
                    if rec["row"] not in done:
                        write_lines(output, [json.dumps(rec, ensure_ascii=False)], "a")
                        bar.update()
        bar.close()
    with open(output, encoding="utf-8") as f:
        return summary([json.loads(line) for line in f], opts)


def summary(records: list, opts) -> dict:
    """{problems, seeds, results: {method: {N: {accuracy, min, max, *COSTS}}}}: accuracy's mean
    and range over seeds, mean costs."""
    by = collections.defaultdict(list)  # (method, N, seed) -> results
    for r in records:
        for x in r["results"]:
            by[x["method"], x["n"], r["seed"]].append(x)
    out = {}
    for m, n in itertools.product(opts.methods, opts.n):
        accs = [statistics.fmean(x["correct"] for x in by[m, n, s])
                for s in opts.seeds if by[m, n, s]]
        if accs:
            flat = [x for s in opts.seeds for x in by[m, n, s]]
            out.setdefault(m, {})[str(n)] = {
                "accuracy": statistics.fmean(accs), "min": min(accs), "max": max(accs),
                **{k: statistics.fmean(x[k] for x in flat) for k in COSTS}}
    return {"problems": len({r["row"] for r in records}), "seeds": list(opts.seeds), "results": out}


def table(out: dict) -> str:
    """summary() as text, a row per method and N."""
    lines = [f"{'method':<10}{'N':>5}{'accuracy':>10}{'seed range':>14}"
             + "".join(f"{c:>14}" for c in COSTS)]
    for m, by_n in out["results"].items():
        for n, r in by_n.items():
            spread = f"{r['min']:.3f}-{r['max']:.3f}"
            lines.append(f"{m:<10}{n:>5}{r['accuracy']:>10.3f}{spread:>14}"
                         + "".join(f"{r[c]:>14.4g}" for c in COSTS))
    return "\n".join(lines + [f"{out['problems']} problems, seeds {out['seeds']}"])


def main(argv=None):
    with exit_status():  # a bad flag too: one line and exit status 2
        p = Parser(SearchRun, ScorerOptions, SearchOptions, prog="python -m prm.search",
                   description="Search a policy's answers with a PRM.")
        a = p.parse_args(argv)
        opts = parsed(SearchOptions, a)
        check(overwrites([("--output", a.output)], [("--dataset", a.dataset), ("--model", a.model),
                                                     ("--policy", a.policy)], new=True))
        problems = read_input(a.dataset, opts, a.skip_invalid)  # bad rows: refused before any model
        try:  # Ctrl-C while the models load too: one line
            from prm.scoring.reward import PRMReward
            scoring = dataclasses.asdict(parsed(ScorerOptions, a))
            # the PRM before the policy: its refusals come first
            reward = PRMReward(a.model, opts.aggregate, batch_size=opts.batch_size,
                               trust_remote_code=a.trust_remote_code, **scoring)
            if reward.step_separator != opts.step_separator:
                print(f"note: the PRM splits steps at {reward.step_separator!r}, the policy at "
                      f"{opts.step_separator!r}", file=sys.stderr)
            gen = Generator(opts, device=reward.device, trust_remote_code=a.trust_remote_code)

            def count(question, text):  # the PRM's tokens: the problem's and the solution's text
                question = question if isinstance(question, str) else \
                    "\n".join(m["content"] for m in question)
                tokens = len(reward.tokenizer(question + reward.step_separator + text)["input_ids"])
                return min(tokens, reward.max_length or tokens)  # what it reads, no more
            model = {"model": a.model, "model_files": stamp(a.model), **scoring}
            out = search_file(problems, a.output, gen, reward.score, opts, render=gen.render,
                              count=count, settings=model)
        except KeyboardInterrupt:
            raise Stopped("stopped by SIGINT; run the same command again to continue",
                          signal.SIGINT) from None
        print(table(out), file=sys.stderr)
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
