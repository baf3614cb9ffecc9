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

from prm.cli import Parser, add_fields, parsed
from prm.config import opt
from prm.core.metrics import AGGREGATES, solution_score
from prm.errors import Stopped, UsageError, check, exit_status
from prm.label import (Generator, LabelOptions, check_settings, extract_answer, finished,
                                judge, locked, normalize, read_input, write_lines)
from prm.readers.formats import split_steps
from prm.scoring import ScorerOptions

SAMPLED, TREES = ("majority", "best-of-n", "weighted"), ("beam", "dvts")
COSTS = ("policy_tokens", "prm_tokens", "seconds")
RESULT = ("n", "answer", "correct", *COSTS)  # what a run reported twice repeats
# a problem searched: its input row, the text the policy continues, is_correct(text) -> bool
Problem = collections.namedtuple("Problem", "index row text is_correct")


def _shared(name: str, **meta):
    """prm.label's option `name`: its flag and default (meta: what differs)."""
    f = LabelOptions.__dataclass_fields__[name]
    return dataclasses.field(default=f.default, metadata={**f.metadata, **meta})


def _list(kind):
    def comma_list(text: str) -> tuple:  # argparse's error names it
        return tuple(kind(x.strip()) for x in text.split(","))
    return comma_list


@dataclasses.dataclass
class SearchOptions:
    """What decides the results: kept in OUTPUT.settings; a rerun with others is refused."""
    methods: tuple = opt(SAMPLED + TREES, "comma list of majority, best-of-n, weighted (sharing "
                         "samples), beam, dvts", type=_list(str))
    n: tuple = opt((1, 4, 16), "comma list of budgets N: solutions sampled, or beams",
                   type=_list(int))
    beam_width: int = opt(4, "M: beam keeps N/M beams, each extended M ways; dvts grows N/M "
                          "subtrees of M (M = N for N < M)")
    aggregate: str = opt("last", "a solution's score from its step scores",
                         choices=list(AGGREGATES))
    select: str = opt("weighted", "how beam and dvts pick a finished beam", choices=SAMPLED)
    max_steps: int = opt(40, "steps a beam takes at most")
    seeds: tuple = opt((0,), "comma list; the summary's mean and range are over them",
                       type=_list(int))
    problems: int = opt(8, "problems searched together, sharing calls and seeds")
    policy: str = _shared("policy", help="the policy (a Hugging Face name or folder)")
    temperature: float = _shared("temperature")
    top_p: float = _shared("top_p")
    max_new_tokens: int = _shared("max_new_tokens", help="tokens per sampled solution or beam step")
    batch_size: int = _shared("batch_size", help="sequences per generate or PRM call")
    step_separator: str = _shared("step_separator")
    answer_field: str = _shared("answer_field")
    answer_pattern: str = _shared("answer_pattern")
    checker: str = _shared("checker")

    def __post_init__(self):
        """Refuses what would fail only after the models load."""
        LabelOptions.__post_init__(self)
        m, known = self.beam_width, SAMPLED + TREES
        small = ("beam_width", "max_steps", "problems", "batch_size", "max_new_tokens")
        check([f"--methods: unknown {x!r} (expected some of {', '.join(known)})"
               for x in self.methods if x not in known]
              + [f"--{k.replace('_', '-')} must be at least 1" for k in small
                 if getattr(self, k) < 1]
              + [f"--n {n}: a budget must be at least 1" for n in self.n if n < 1]
              + [f"--n {n}: not a multiple of --beam-width {m} (beam and dvts keep N/M beams)"
                 for n in self.n if n > m and n % m and set(self.methods) & set(TREES)]
              + ([] if self.temperature >= 0 and 0 < self.top_p <= 1 else
                 [f"--temperature {self.temperature:g} must be >= 0, --top-p {self.top_p:g} in "
                  "(0, 1]"]))


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
            "correct": bool(problem.is_correct(text)), "end": end}


def pick(cands: list, how: str, aggregate: str):
    """The index of the candidate `how` picks, or None: best-of-n, the best aggregate; majority and
    weighted, the first of the answer with the most candidates or the highest aggregate sum."""
    if how == "best-of-n":
        values = [solution_score(c["scores"], aggregate) for c in cands]
        return values.index(max(values)) if cands else None
    votes, first = collections.defaultdict(float), {}
    for i, c in enumerate(cands):
        if c["answer"] is not None:
            key = normalize(c["answer"])
            first.setdefault(key, i)
            votes[key] += 1 if how == "majority" else AGGREGATES[aggregate](c["scores"] or [0])
    return first[max(votes, key=votes.get)] if votes else None


def result(method: str, n: int, cands: list, how: str, opts, **more) -> dict:
    i = pick(cands, how, opts.aggregate)
    return {"method": method, "n": n, "answer": None if i is None else cands[i]["answer"],
            "correct": i is not None and cands[i]["correct"], **more}


# a beam: its steps, their scores, the scorer's state after them (PRMReward.extend's prefix)
Beam = collections.namedtuple("Beam", "steps scores state")


def tree_search(problem: Problem, method: str, n: int, width: int, opts):
    """One problem's beam search or DVTS (Snell et al. 2024, "Scaling LLM test-time compute";
    search-and-learn): beam keeps the best N/M of one group of N/M beams, each extended M ways;
    DVTS, the best of each of N/M groups of one. Unlike theirs: no lookahead, no duplicate
    filtering, survivors at --max-steps end. Yields ("propose", beams, M), sent M (text, cut) per
    beam, and ("score", [(parent, steps)]), sent a Beam each; returns the candidates."""
    keep, groups = (n // width, 1) if method == "beam" else (1, n // width)
    groups = [[Beam((), [], None)] * keep for _ in range(groups)]
    done = []

    def end(beam, how: str):
        done.append(candidate(beam.steps, beam.scores, how, problem, opts))
    for _ in range(opts.max_steps):
        if not any(groups):
            break
        texts = iter((yield "propose", [b for g in groups for b in g], width))
        new = [[] for _ in groups]  # per group: (parent, steps, how it ended: "" if it goes on)
        for g, group in enumerate(groups):
            for beam in group:
                for text, cut in next(texts):
                    head, found, _ = text.partition(opts.step_separator)
                    if not head.strip():  # an empty step ends the beam as it was
                        end(beam, "empty")
                        continue
                    how = "" if found else "cut" if cut else "eos"
                    new[g].append((beam, beam.steps + (head,), how))
        asked = [(parent, steps) for group in new for parent, steps, _ in group]
        scored = iter((yield "score", asked) if asked else [])
        for g, group in enumerate(new):
            going = []
            for (_, _, how), beam in zip(group, scored):
                if how:
                    end(beam, how)
                else:
                    going.append(beam)
            going.sort(key=lambda b: -solution_score(b.scores, opts.aggregate))  # ties keep order
            groups[g] = going[:keep]
    for beam in itertools.chain(*groups):
        end(beam, "max_steps")
    return done


@dataclasses.dataclass(eq=False)
class TreeRun:
    """A tree_search under way: its request (None: ended), costs and candidates."""
    problem: Problem
    method: str
    n: int
    width: int
    opts: SearchOptions

    def __post_init__(self):
        self.search = tree_search(self.problem, self.method, self.n, self.width, self.opts)
        self.cost, self.done = collections.Counter(), None
        self.send(None)

    def send(self, answer):
        try:
            self.request = self.search.send(answer)
        except StopIteration as stop:
            self.request, self.done = None, stop.value


def rescoring(score, count, sep: str):
    """grow's scorer of each new beam's whole text: score(questions, outputs); count(question,
    text), its PRM tokens. extend([(run, parent, steps)]) -> [(Beam, tokens)]."""
    def extend(asked: list) -> list:
        questions = [r.problem.row["prompt"] for r, _, _ in asked]
        texts = [sep.join(steps) for _, _, steps in asked]
        probs = score(questions, [[text] for text in texts])
        return [(Beam(steps, ps, None), count(q, text))
                for (_, _, steps), q, text, [ps] in zip(asked, questions, texts, probs)]
    return extend


def cached(reward):
    """grow's scorer on the PRM's caches (PRMReward.extend): a new step's tokens run after its
    parent's cache; a question's once per search."""
    def extend(asked: list) -> list:
        roots = {r: reward.start(r.problem.row["prompt"]) for r, parent, _ in asked
                 if parent.state is None}
        out = reward.extend([parent.state or roots[r] for r, parent, _ in asked],
                            [steps[-1] for _, _, steps in asked])
        return [(Beam(steps, parent.scores + ([] if p is None else [p]), prefix), ran)
                for (_, parent, steps), (prefix, p, ran) in zip(asked, out)]
    return extend


def grow(runs: list, propose, extend, opts, seeds):
    """One step of every tree: a propose call per width, one scoring call."""
    sep = opts.step_separator
    asking = [r for r in runs if r.request and r.request[0] == "propose"]
    for width in sorted({r.width for r in asking}):
        beams = [(r, b) for r in asking if r.width == width for b in r.request[1]]
        prefixes = [r.problem.text + "".join(s + sep for s in b.steps) for r, b in beams]
        outs, usage, took = proposed(propose, prefixes, width, next(seeds), sep)
        answers = collections.defaultdict(list)
        for (r, _), texts, use in zip(beams, outs, usage):
            r.cost["seconds"] += took
            r.cost["policy_tokens"] += sum(tokens for tokens, _ in use)
            answers[r].append([(text, cut) for text, (_, cut) in zip(texts, use)])
        for r, texts in answers.items():
            r.send(texts)
    # by width, then in the runs' order: the order they proposed in
    asking = sorted([r for r in runs if r.request and r.request[0] == "score"],
                    key=lambda r: r.width)
    asked = [(r, parent, steps) for r in asking for parent, steps in r.request[1]]
    start = time.time()
    scored = iter(extend(asked) if asked else [])
    took = (time.time() - start) / max(1, len(asked))
    for r in asking:
        beams = [next(scored) for _ in r.request[1]]
        r.cost["prm_tokens"] += sum(tokens for _, tokens in beams)
        r.cost["seconds"] += took * len(beams)
        r.send([beam for beam, _ in beams])


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


def search_block(block: list, propose, score, count, opts, seed: int, extend=None):
    """Yields each problem's record as its searches end; the problems of `block` share calls.
    extend: grow's scorer (default: rescoring)."""
    # a call's seed: from the seed, the block's first problem and the call's number
    seeds = itertools.count((seed * 1_000_003 + block[0].index) * 1_000)
    records = {p.index: {"row": p.index, "lines": len(opts.seeds), "seed": seed,
                         **({"id": p.row["id"]} if "id" in p.row else {}),
                         "answer": str(p.row[opts.answer_field]), "results": []} for p in block}
    if set(opts.methods) & set(SAMPLED):
        sample(block, records, propose, score, count, opts, seeds)
    kinds = list(itertools.product([m for m in opts.methods if m in TREES], opts.n))
    # DVTS at N <= M is beam search (one group of one beam): run once, reported as beam's
    same = {("dvts", n) for m, n in kinds if m == "beam" and n <= opts.beam_width}
    runs = {p.index: [TreeRun(p, m, n, min(n, opts.beam_width), opts) for m, n in kinds
                      if (m, n) not in same] for p in block}
    extend = extend or rescoring(score, count, opts.step_separator)
    while runs:
        for i, these in list(runs.items()):
            if any(r.request for r in these):
                continue
            got = {(r.method, r.n): result(
                r.method, r.n, r.done, opts.select, opts, **{k: r.cost[k] for k in COSTS},
                ends=dict(collections.Counter(c["end"] for c in r.done)), candidates=r.done)
                for r in these}
            for m, n in kinds:
                beam = {k: v for k, v in got.get(("beam", n), {}).items() if k in RESULT}
                records[i]["results"].append(got.get((m, n)) or
                                             {"method": m, **beam, "same_as": "beam"})
            del runs[i]
            yield records[i]
        grow(list(itertools.chain(*runs.values())), propose, extend, opts, seeds)


def search_file(dataset, output: str, propose, score, opts: SearchOptions, *,
                render=lambda prompt: prompt, count=lambda question, text: 0, settings: dict = None,
                skip_invalid=False, show=True, extend=None) -> dict:
    """Searches every problem (dataset: a path or read_input's answer) at every seed into `output`;
    a rerun continues it. render(prompt): the text the policy continues; count(question, text): the
    PRM's tokens; extend: the trees' scoring layer (cached(reward); default: rescoring). Returns
    summary()."""
    from tqdm import tqdm
    rows, digest = read_input(dataset, opts, skip_invalid) if isinstance(dataset, str) else dataset
    size = opts.problems
    with locked(output):
        check_settings(output, {**dataclasses.asdict(opts), **(settings or {}), "dataset": digest},
                       "searched")
        done = finished(output)
        write_lines(output, [line for lines in done.values() for line in lines])  # drops a cut line
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
                for rec in search_block(block, propose, score, count, opts, seed, extend):
                    if rec["row"] not in done:
                        write_lines(output, [json.dumps(rec, ensure_ascii=False)], "a")
                        bar.update()
        bar.close()
    with open(output, encoding="utf-8") as f:
        return summary([json.loads(line) for line in f], opts)


def summary(records: list, opts) -> dict:
    """{problems, seeds, results: {method: {N: {accuracy, min, max, *COSTS[, same_as]}}}}:
    accuracy's mean and range over seeds, mean costs."""
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
                **{k: statistics.fmean(x[k] for x in flat) for k in COSTS},
                **({"same_as": "beam"} if all("same_as" in x for x in flat) else {})}
    return {"problems": len({r["row"] for r in records}), "seeds": list(opts.seeds), "results": out}


def table(out: dict) -> str:
    """summary() as text, a row per method and N."""
    lines = [f"{'method':<10}{'N':>5}{'accuracy':>10}{'seed range':>14}"
             + "".join(f"{c:>14}" for c in COSTS)]
    for m, by_n in out["results"].items():
        for n, r in by_n.items():
            spread = f"{r['min']:.3f}-{r['max']:.3f}"
            if "same_as" in r:  # one run, reported once
                lines.append(f"{m:<10}{n:>5}   = {r['same_as']} (the same run)")
                continue
            lines.append(f"{m:<10}{n:>5}{r['accuracy']:>10.3f}{spread:>14}"
                         + "".join(f"{r[c]:>14.4g}" for c in COSTS))
    return "\n".join(lines + [f"{out['problems']} problems, seeds {out['seeds']}"])


def main(argv=None):
    with exit_status():  # a bad flag too: one line and exit status 2
        p = Parser(prog="python -m prm.search", description="Search a policy's answers with a PRM.")
        p.add_argument("--dataset", required=True, help="problems with a reference answer, as "
                       "prm.label reads them")
        p.add_argument("--output", required=True, help="the .jsonl written, a line per problem and "
                       "seed; a rerun continues it")
        p.add_argument("--model", required=True, help="the PRM, as eval.py's --model")
        add_fields(p, ScorerOptions)
        p.add_argument("--skip-invalid", action="store_true", help="leave out invalid rows")
        p.add_argument("--trust-remote-code", action="store_true", help="allow the models' code")
        a = add_fields(p, SearchOptions).parse_args(argv)
        opts = parsed(SearchOptions, a)
        problems = read_input(a.dataset, opts, a.skip_invalid)  # bad rows: refused before any model
        from prm.scoring.reward import PRMReward
        scoring = dataclasses.asdict(parsed(ScorerOptions, a))
        reward = PRMReward(a.model, opts.aggregate, batch_size=opts.batch_size,  # before the policy
                           trust_remote_code=a.trust_remote_code, **scoring)
        if reward.step_separator != opts.step_separator:
            print(f"note: the PRM splits steps at {reward.step_separator!r}, the policy at "
                  f"{opts.step_separator!r}", file=sys.stderr)
        gen = Generator(opts, device=reward.device, trust_remote_code=a.trust_remote_code)

        def count(question, text):  # the PRM's tokens: the problem's and the solution's text
            question = question if isinstance(question, str) else \
                "\n".join(m["content"] for m in question)
            return len(reward.tokenizer(question + reward.step_separator + text)["input_ids"])
        extend = None  # each new step scored alone on the PRM's cache, where the rows allow it
        if reward.cacheable and reward.step_separator == opts.step_separator:
            extend = cached(reward)
        elif set(opts.methods) & set(TREES):
            print("note: beam and dvts re-score each beam's whole text: this PRM's scorer or "
                  "separator rules out its cache", file=sys.stderr)
        try:
            out = search_file(problems, a.output, gen, reward.score, opts, render=gen.render,
                              count=count, settings={"model": a.model, **scoring}, extend=extend)
        except KeyboardInterrupt:
            raise Stopped("stopped by SIGINT; run the same command again to continue",
                          signal.SIGINT) from None
        print(table(out), file=sys.stderr)
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
