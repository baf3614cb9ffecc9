"""`python -m prm.search`: a policy's answers picked by a PRM among sampled solutions (best-of-n,
weighted vote) or step by step (beam search, DVTS); majority vote is the baseline. Any policy
`propose(prefixes, n, seeds, stop) -> list[list[str]]` (a seed per prefix), any PRM
`score(questions, outputs)`."""
import collections
import dataclasses
import datetime
import itertools
import json
import signal
import statistics
import sys
import time

from prm.answers import answer_key, extract_answer, judge
from prm.cli import Parser, parsed
from prm.config import Checked, at_least, bound, opt, within
from prm.core.metrics import AGGREGATES, picked, solution_score
from prm.errors import Stopped, UsageError, check, exit_status, overwrites
from prm.files import finished, parts, resumed, stamp, write_lines
from prm.label import Generator, LabelOptions, LabelRun, merge, mix, read_input
from prm.readers.formats import split_steps
from prm.scoring import ScorerOptions

SAMPLED, TREES = ("majority", "best-of-n", "weighted"), ("beam", "dvts")
COSTS = ("policy_tokens", "prm_tokens", "seconds")
MAX_N = 1 << 16  # solutions or beams per problem: more would not fit in memory
SPEED = ("problems", "batch_size", "prm_batch_size")  # knobs a rerun may change: not settings
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
    problems: int = opt(8, "problems searched together, sharing generate and PRM calls: a speed "
                        "knob (a problem's samples depend on the seed and the problem only)",
                        check=at_least(1))
    policy: str = opt(like=LABEL["policy"], help="the policy (a Hugging Face name or folder)")
    temperature: float = opt(like=LABEL["temperature"])
    top_p: float = opt(like=LABEL["top_p"])
    max_new_tokens: int = opt(like=LABEL["max_new_tokens"],
                              help="tokens per sampled solution or beam step")
    batch_size: int = opt(like=LABEL["batch_size"])
    prm_batch_size: int = opt(16, "solutions per PRM forward", check=at_least(1))
    dtype: str = opt("auto", "the PRM's compute dtype, as eval.py's --dtype (auto: the run's)",
                     choices=["auto", "fp32", "bf16", "fp16"])
    max_length: int = opt(0, "the PRM's token cap per solution (steps past it unscored); 0: the "
                          "run's", check=at_least(0))
    prompt_field: str = opt(like=LABEL["prompt_field"])
    system_prompt: str = opt("", "a system message before each problem, for the policy's chat "
                             "template (the PRM reads the problem alone)")
    step_separator: str = opt(like=LABEL["step_separator"])
    answer_field: str = opt(like=LABEL["answer_field"])
    answer_pattern: str = opt(like=LABEL["answer_pattern"])
    checker: str = opt(like=LABEL["checker"])

    def __post_init__(self):
        """Refuses what would fail only after the models load."""
        check([f"SearchOptions({k}={v!r}): expected a tuple, such as {(v,)!r}"
               for k, v in vars(self).items() if k in ("methods", "n", "seeds")
               and not isinstance(v, (tuple, list))][:1])
        super().__post_init__()
        m = self.beam_width
        check([f"--n {n}: not a multiple of --beam-width {m} (beam and dvts keep N/M beams)"
               for n in self.n if n > m and n % m and set(self.methods) & set(TREES)])


@dataclasses.dataclass
class SearchRun(Checked):
    """prm.search's other flags: the files and the PRM."""
    dataset: str = opt("", "problems with a reference answer, as prm.label reads them",
                       required=True)
    output: str = opt("", "the .jsonl written, a line per problem and seed: each method's answer, "
                      "candidates (steps, 'scores': the PRM's P(correct) per step), tokens, "
                      "seconds; a rerun continues it", required=True)
    model: str = opt("", "the PRM, as eval.py's --model", required=True)
    shard: str = opt(like=LabelRun.__dataclass_fields__["shard"],
                     help="i/n: every n-th problem from the i-th; no --shard merges the shards")
    skip_invalid: bool = opt(False, "leave out invalid rows")
    trust_remote_code: bool = opt(False, "allow the models' code")


def proposed(propose, prefixes: list, n: int, seeds: list, stop) -> tuple:
    """(texts, usage: per text (tokens, None if not counted; cut by max_new_tokens), seconds per
    prefix), checked."""
    start, outs = time.time(), propose(prefixes, n, seeds, stop)
    if len(outs) != len(prefixes) or any(len(texts) != n for texts in outs):
        raise UsageError(f"propose() must give {n} texts for each of its {len(prefixes)} prefixes")
    usage = getattr(propose, "usage", None) or [[(None, False)] * n for _ in prefixes]
    return outs, usage, (time.time() - start) / len(prefixes)


def counted(propose, tokenizer):
    """propose() with a `usage` of its own, else its texts' tokens by `tokenizer`."""
    def call(*args):
        outs = propose(*args)
        size = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa
        call.usage = getattr(propose, "usage", None) or [[(size(t), False) for t in ts]
                                                         for ts in outs]
        return outs
    return call


def plus(*counts):
    """Their sum; None (not counted) if one is."""
    return None if None in counts else sum(counts)


def prm_counter(reward):
    """count(question, text): the tokens `reward` (a PRMReward) reads, at most its max_length."""
    def count(question, text):
        question = question if isinstance(question, str) else \
            "\n".join(m["content"] for m in question)
        n = len(reward.tokenizer(question + reward.step_separator + text)["input_ids"])
        return min(n, reward.max_length or n)
    return count


def candidate(steps, scores, end: str, problem: Problem, opts) -> dict:
    """A finished solution: steps, scores, answer, whether it is right, how it ended."""
    text = opts.step_separator.join(steps)
    return {"steps": list(steps), "scores": scores,
            "answer": extract_answer(text, opts.answer_pattern),
            "correct": bool(problem.right(text)), "end": end}


def pick(cands: list, how: str, aggregate: str):
    """The index of the candidate `how` picks (metrics.picked, the first of a tie), or None."""
    wins = picked([answer_key(c["answer"]) for c in cands], [c["scores"] for c in cands], how,
                  aggregate)
    return wins[0][0] if wins else None


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
    seed: int

    def __post_init__(self):  # beam: a group of N/M beams, keeping N/M; dvts: N/M groups of one
        k = self.n // self.width
        self.keep, groups = (k, 1) if self.method == "beam" else (1, k)
        self.groups = [[((), [])] * self.keep for _ in range(groups)]
        self.done, self.ends, self.cost = [], collections.Counter(), collections.Counter()
        self.drawn = itertools.count()  # the tree's own stream of seeds: one per prefix

    def next_seed(self) -> int:
        return mix(self.seed, self.problem.index, self.method, self.n, next(self.drawn))

    def end(self, steps, scores, how: str, opts):
        self.ends[how] += 1
        self.done.append(candidate(steps, scores, how, self.problem, opts))


def grow(trees: list, propose, score, count, opts, stops=False):
    """One step of every tree: its survivors propose (a call per width), the PRM scores the new
    prefixes (one call), each group keeps its best. stops: refuse a propose() whose texts never
    end at the stop."""
    sep, new, ended = opts.step_separator, collections.defaultdict(list), []
    old = [(t, g, beam) for t in trees for g, group in enumerate(t.groups) for beam in group]
    for t in trees:
        t.groups = [[] for _ in t.groups]
    for width in sorted({t.width for t, _, _ in old}):
        beams = [b for b in old if b[0].width == width]
        prefixes = [t.problem.text + "".join(s + sep for s in steps) for t, _, (steps, _) in beams]
        seeds = [t.next_seed() for t, _, _ in beams]
        outs, usage, took = proposed(propose, prefixes, width, seeds, sep)
        for (t, g, (steps, scores)), texts, use in zip(beams, outs, usage):
            t.cost["seconds"] += took
            for text, (tokens, cut) in zip(texts, use):
                t.cost["policy_tokens"] = plus(t.cost["policy_tokens"], tokens)
                head, found, _ = text.partition(sep)
                ended.append(bool(found or cut or not head.strip()))
                if head.strip():
                    new[t, g].append((steps + (head,), "" if found else "cut" if cut else "eos"))
                else:  # an empty step ends the beam as it was
                    t.end(steps, scores, "empty", opts)
    check([f"not one of propose()'s {len(ended)} first steps ends at the stop {sep!r}: it must "
           "keep the stop it ended a text at (vLLM: include_stop_str_in_output=True); a policy "
           "that answers in one step leaves beam and dvts nothing to search"]
          * (stops and not any(ended)))
    keys, start = list(new), time.time()
    texts = [[sep.join(steps) for steps, _ in new[k]] for k in keys]
    probs = score([t.problem.row["prompt"] for t, _ in keys], texts) if keys else []
    took = (time.time() - start) / max(1, sum(map(len, texts)))
    for (t, g), ps, ts in zip(keys, probs, texts):
        t.cost["prm_tokens"] = plus(t.cost["prm_tokens"],
                                    *(count(t.problem.row["prompt"], text) for text in ts))
        t.cost["seconds"] += took * len(ts)
        going = []
        for (steps, end), p in zip(new[t, g], ps):
            if end:
                t.end(steps, p, end, opts)
            else:
                going.append((steps, p))
        going.sort(key=lambda b: -solution_score(b[1], opts.aggregate))  # stable: ties keep order
        t.groups[g] = going[:t.keep]


def sample(block: list, records: dict, propose, score, count, opts, seed: int):
    """max(N) solutions per problem, in one propose and one PRM call; N takes the first N."""
    methods, top = [m for m in opts.methods if m in SAMPLED], max(opts.n)
    seeds = [mix(seed, p.index, "sample") for p in block]
    outs, usage, policy_s = proposed(propose, [p.text for p in block], top, seeds, None)
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
                m, n, first, m, opts, policy_tokens=plus(*(c["policy_tokens"] for c in first)),
                prm_tokens=plus(*(c["prm_tokens"] for c in first)) if prm else 0,
                seconds=(policy_s + prm_s * prm) * n / top))


def search_block(block: list, propose, score, count, opts, seed: int, stops=False):
    """Yields each problem's record as its searches end; the problems of `block` share calls, but
    each draws its own seeds (from the seed, the problem, the method and N): a speed knob."""
    records = {p.index: {"row": p.index, "lines": len(opts.seeds), "seed": seed,
                         **({"id": p.row["id"]} if "id" in p.row else {}),
                         "answer": str(p.row[opts.answer_field]), "results": []} for p in block}
    if set(opts.methods) & set(SAMPLED):
        sample(block, records, propose, score, count, opts, seed)
    kinds = list(itertools.product([m for m in opts.methods if m in TREES], opts.n))
    trees = {p.index: [Tree(p, m, n, min(n, opts.beam_width), seed) for m, n in kinds]
             for p in block}
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
        grow(list(itertools.chain(*trees.values())), propose, score, count, opts,
             stops and step == 0)


def search_file(dataset, output: str, propose, score, opts: SearchOptions, *,
                render=lambda prompt: prompt, count=None, tokenizer=None, settings: dict = None,
                part=(0, 1), skip_invalid=False, show=True) -> dict:
    """Searches the problems (dataset: a path or read_input's answer) whose index % part[1] ==
    part[0] at every seed into `output` (OUTPUT.part<p>of<m> for a share; a run of all merges the
    parts); a rerun continues it. render(prompt): the text the policy continues. Tokens: the
    policy's from propose.usage, else `tokenizer`; the PRM's by count(question, text), else a
    PRMReward's own tokenizer; else not counted (None). Returns summary() of what it wrote."""
    from tqdm import tqdm
    rows, digest = read_input(dataset, opts, skip_invalid) if isinstance(dataset, str) else dataset
    owner = getattr(score, "__self__", None)
    count = count or (prm_counter(owner) if hasattr(owner, "tokenizer") else lambda q, t: None)
    propose = counted(propose, tokenizer) if tokenizer else propose
    (p, m), size = part, opts.problems
    own = output if m == 1 else f"{output}.part{p}of{m}"
    kept = {k: v for k, v in dataclasses.asdict(opts).items() if k not in SPEED}
    settings = {**kept, "policy_files": stamp(opts.policy), **(settings or {}), "dataset": digest}
    with resumed(output, settings, "prm.search", (own,)):
        done = finished(output, *parts(output), writer="prm.search")
        todo = [(i, row) for i, row in rows if i % m == p and i not in done]
        bar = tqdm(total=len(todo) * len(opts.seeds), desc="searching", disable=not show or None)
        for b in range(0, len(todo), size):
            chunk = todo[b:b + size]
            texts = [render(row["prompt"]) for _, row in chunk]
            check([] if all(isinstance(t, str) for t in texts) else
                  ["a chat prompt needs render= (e.g. Generator(...).render)"])
            block = [Problem(i, row, text + ("" if text[-1:].isspace() else opts.step_separator),
                             judge(str(row[opts.answer_field]), opts))
                     for (i, row), text in zip(chunk, texts)]
            for seed in opts.seeds:  # the run's first step checks propose() keeps the stop
                for rec in search_block(block, propose, score, count, opts, seed,
                                        stops=b == 0 and seed == opts.seeds[0]):
                    write_lines(own, [json.dumps(rec, ensure_ascii=False)], "a")
                    bar.update()
        bar.close()
        if m == 1 and parts(output):
            merge(output, show=False, writer="prm.search")
    with open(own, encoding="utf-8") as f:
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
                **{k: mean([x[k] for x in flat]) for k in COSTS}}
    return {"problems": len({r["row"] for r in records}), "seeds": list(opts.seeds), "results": out}


def mean(values: list):
    """Their mean; None (not counted) if one is."""
    return None if None in values else statistics.fmean(values)


def table(out: dict) -> str:
    """summary() as text, a row per method and N."""
    lines = [f"{'method':<10}{'N':>5}{'accuracy':>10}{'seed range':>14}"
             + "".join(f"{c:>14}" for c in COSTS)]
    for m, by_n in out["results"].items():
        for n, r in by_n.items():
            spread = f"{r['min']:.3f}-{r['max']:.3f}"
            lines.append(f"{m:<10}{n:>5}{r['accuracy']:>10.3f}{spread:>14}"
                         + "".join(f"{'not counted' if r[c] is None else f'{r[c]:.4g}':>14}"
                                   for c in COSTS))
    return "\n".join(lines + [f"{out['problems']} problems, seeds {out['seeds']}"])


def main(argv=None):
    with exit_status():  # a bad flag too: one line and exit status 2
        p = Parser(SearchRun, ScorerOptions, SearchOptions, prog="python -m prm.search",
                   description="Search a policy's answers with a PRM.")
        a = p.parse_args(argv)
        parsed(SearchRun, a)
        opts = parsed(SearchOptions, a)
        check(overwrites([("--output", a.output)], [("--dataset", a.dataset), ("--model", a.model),
                                                     ("--policy", a.policy)], new=True))
        problems = read_input(a.dataset, opts, a.skip_invalid)  # bad rows: refused before any model
        try:  # Ctrl-C while the models load too: one line
            search(a, opts, problems, tuple(map(int, a.shard.split("/"))))
        except KeyboardInterrupt:
            raise Stopped("stopped by SIGINT; run the same command again to continue",
                          signal.SIGINT) from None


def search(a, opts: SearchOptions, problems, shard: tuple):
    """main's search, on every rank of a torchrun (each a share of the problems)."""
    import torch.distributed as dist
    from prm.core.runtime import setup, teardown
    from prm.scoring.reward import PRMReward
    rt, scoring = setup(), dataclasses.asdict(parsed(ScorerOptions, a))
    try:
        # ranks end at different times: a group that does not time out
        wait = rt.distributed and dist.new_group(backend="gloo", timeout=datetime.timedelta(days=7))
        reward = PRMReward(a.model, opts.aggregate, rt.device, opts.prm_batch_size,  # first
                           trust_remote_code=a.trust_remote_code, dtype=opts.dtype,
                           max_length=opts.max_length or None, **scoring)
        if reward.step_separator != opts.step_separator and rt.is_main:
            print(f"note: the PRM splits steps at {reward.step_separator!r}, the policy at "
                  f"{opts.step_separator!r}", file=sys.stderr)
        gen = Generator(opts, device=rt.device, trust_remote_code=a.trust_remote_code)
        system = [{"role": "system", "content": opts.system_prompt}] * bool(opts.system_prompt)
        chat = lambda q: q if isinstance(q, list) else [{"role": "user", "content": q}]  # noqa
        render = (lambda q: gen.render(system + chat(q))) if system else gen.render
        part = (shard[0] * rt.world_size + rt.rank, shard[1] * rt.world_size)
        model = {"model": a.model, "model_files": stamp(a.model), **scoring}
        count = prm_counter(reward)
        out = search_file(problems, a.output, gen, reward.score, opts, render=render, count=count,
                          settings=model, part=part, show=rt.is_main)
        if rt.distributed:
            dist.barrier(group=wait)
            if rt.is_main and shard[1] == 1:
                out = search_file(problems, a.output, gen, reward.score, opts, render=render,
                                  count=count, settings=model, show=False)
        if rt.is_main:
            print(table(out), file=sys.stderr)
            print(json.dumps(out), flush=True)
    finally:
        teardown(rt)


if __name__ == "__main__":
    main()
