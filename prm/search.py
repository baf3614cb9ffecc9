"""`python -m prm.search`: a PRM picks a policy's answer among sampled solutions (majority,
best-of-n, weighted) or step by step (beam, dvts: prm.trees)."""
import collections
import dataclasses
import datetime
import functools
import itertools
import json
import signal
import statistics
import sys
import time

from prm.answers import answer_key, judge
from prm.cli import Parser, parsed
from prm.config import Checked, at_least, bound, opt, within
from prm.core.metrics import AGGREGATES, picked
from prm.errors import Stopped, UsageError, check, exit_status, overwrites
from prm.files import finished, parts, resumed, stamp, write_lines
from prm.label import Generator, LabelOptions, LabelRun, merge, mix, read_input
from prm.readers.formats import split_steps
from prm.scoring import ScorerOptions
from prm.trees import Problem, TreeRun, cached, candidate, grow, plus, proposed, rescoring

SAMPLED, TREES = ("majority", "best-of-n", "weighted"), ("beam", "dvts")
METHODS = SAMPLED + TREES
COSTS = ("policy_tokens", "prm_tokens", "seconds")
RESULT = ("n", "answer", "correct", *COSTS)  # what a "same_as" result repeats
SPEED = ("problems", "batch_size", "prm_batch_size")  # a rerun may change them: not settings


def label(name: str, **kw):
    return opt(like=LabelOptions.__dataclass_fields__[name], **kw)


@dataclasses.dataclass
class SearchOptions(Checked):
    """Kept in the output's settings, which a rerun must match."""
    methods: tuple = opt(METHODS, "comma list of " + ", ".join(METHODS),
                         check=bound(lambda m: m in METHODS, "expected " + ", ".join(METHODS)))
    n: tuple = opt((1, 4, 16), "comma list of budgets N (solutions or beams)",
                   check=within(1, 1 << 16))
    beam_width: int = opt(4, "M: N/M beams (dvts: subtrees), each extended M ways",
                          check=at_least(1))
    aggregate: str = opt("last", "a solution's score from its step scores",
                         choices=list(AGGREGATES))
    select: str = opt("weighted", "how beam and dvts pick a finished beam", choices=SAMPLED)
    max_steps: int = opt(40, "most steps per beam", check=at_least(1))
    seeds: tuple = opt((0,), "comma list; the summary is over them")
    problems: int = opt(8, "problems searched together (a speed knob)", check=at_least(1))
    policy: str = label("policy")
    temperature: float = label("temperature")
    top_p: float = label("top_p")
    max_new_tokens: int = label("max_new_tokens", help="tokens per solution or step")
    batch_size: int = label("batch_size")
    prm_batch_size: int = opt(16, "solutions per PRM forward", check=at_least(1))
    dtype: str = opt("auto", "the PRM's dtype (auto: its run's)",
                     choices=["auto", "fp32", "bf16", "fp16"])
    max_length: int = opt(0, "the PRM's tokens per solution (0: its run's)", check=at_least(0))
    prompt_field: str = label("prompt_field")
    system_prompt: str = opt("", "a system message for the policy (not the PRM)")
    step_separator: str = label("step_separator")
    answer_field: str = label("answer_field")
    answer_pattern: str = label("answer_pattern")
    checker: str = label("checker")

    def __post_init__(self):
        check([f"SearchOptions({k}={v!r}): expected a tuple, such as {(v,)!r}"
               for k, v in vars(self).items() if k in ("methods", "n", "seeds")
               and not isinstance(v, (tuple, list))][:1])
        super().__post_init__()
        m = self.beam_width
        check([f"--n {n}: not a multiple of --beam-width {m}"
               for n in self.n if n > m and n % m and set(self.methods) & set(TREES)])


@dataclasses.dataclass
class SearchRun(Checked):
    dataset: str = opt("", "problems with a reference answer", required=True)
    output: str = opt("", "a line per problem and seed; a rerun continues it", required=True)
    model: str = opt("", "the PRM, as eval.py's --model", required=True)
    shard: str = opt(like=LabelRun.__dataclass_fields__["shard"])
    skip_invalid: bool = opt(False, "leave out invalid rows")
    trust_remote_code: bool = opt(False, "allow the models' code")


def prm_tokens(reward, question, text: str):
    """The tokens a PRMReward reads; None (not counted) for another scorer."""
    if not hasattr(reward, "tokenizer"):
        return None
    if not isinstance(question, str):
        question = "\n".join(m["content"] for m in question)
    n = len(reward.tokenizer(question + reward.step_separator + text)["input_ids"])
    return min(n, reward.max_length or n)


def pick(cands: list, how: str, aggregate: str):
    """The index of the candidate `how` picks (the first of a tie), or None."""
    wins = picked([answer_key(c["answer"]) for c in cands], [c["scores"] for c in cands], how,
                  aggregate)
    return wins[0][0] if wins else None


def result(method: str, n: int, cands: list, how: str, opts, **more) -> dict:
    i = pick(cands, how, opts.aggregate)
    return {"method": method, "n": n, "answer": None if i is None else cands[i]["answer"],
            "correct": i is not None and cands[i]["correct"], **more}


def sample(block: list, records: dict, propose, score, count, opts, seed: int):
    """max(N) solutions per problem in one propose and one PRM call; N takes the first N."""
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


def search_block(block: list, propose, score, count, opts, seed: int, extend=None,
                 stops=False):
    """Yields each problem's record as its searches end; the problems share calls."""
    records = {p.index: {"row": p.index, "lines": len(opts.seeds), "seed": seed,
                         **({"id": p.row["id"]} if "id" in p.row else {}),
                         "answer": str(p.row[opts.answer_field]), "results": []} for p in block}
    if set(opts.methods) & set(SAMPLED):
        sample(block, records, propose, score, count, opts, seed)
    kinds = list(itertools.product([m for m in opts.methods if m in TREES], opts.n))
    # dvts at N <= M is beam search: run once, reported as beam's
    same = {("dvts", n) for m, n in kinds if m == "beam" and n <= opts.beam_width}
    runs = {p.index: [TreeRun(p, m, n, min(n, opts.beam_width), opts, seed) for m, n in kinds
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
                records[i]["results"].append(
                    got.get((m, n)) or {"method": m, **beam, "same_as": "beam"})
            del runs[i]
            yield records[i]
        grow(list(itertools.chain(*runs.values())), propose, extend, opts, stops)
        stops = False


def search_file(dataset, output: str, propose, score, opts: SearchOptions, *,
                render=lambda prompt: prompt, count=None, settings: dict = None,
                part=(0, 1), skip_invalid=False, show=True, extend=None) -> dict:
    """Searches rows with index % part[1] == part[0] into `output` (a share: OUTPUT.part<p>of<m>),
    continuing it. PRM tokens: count(question, text)'s, else a PRMReward's own."""
    from tqdm import tqdm
    rows, digest = read_input(dataset, opts, skip_invalid) if isinstance(dataset, str) else dataset
    count = count or functools.partial(prm_tokens, getattr(score, "__self__", None))
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
            if not all(isinstance(t, str) for t in texts):
                raise UsageError("a chat prompt needs render=")
            block = [Problem(i, row, text + ("" if text[-1:].isspace() else opts.step_separator),
                             judge(str(row[opts.answer_field]), opts))
                     for (i, row), text in zip(chunk, texts)]
            for seed in opts.seeds:
                for rec in search_block(block, propose, score, count, opts, seed, extend,
                                        stops=b == 0 and seed == opts.seeds[0]):
                    write_lines(own, [json.dumps(rec, ensure_ascii=False)], "a")
                    bar.update()
        bar.close()
        if m == 1 and parts(output):
            merge(output, show=False, writer="prm.search")
    with open(own, encoding="utf-8") as f:
        return summary([json.loads(line) for line in f], opts)


def summary(records: list, opts) -> dict:
    """{problems, seeds, results: {method: {N: {accuracy, min, max, *COSTS[, same_as]}}}}."""
    by = collections.defaultdict(list)
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
                **{k: mean([x[k] for x in flat]) for k in COSTS},
                **({"same_as": "beam"} if all("same_as" in x for x in flat) else {})}
    return {"problems": len({r["row"] for r in records}), "seeds": list(opts.seeds), "results": out}


def mean(values: list):
    """None (not counted) if one is."""
    return None if None in values else statistics.fmean(values)


def table(out: dict) -> str:
    lines = [f"{'method':<10}{'N':>5}{'accuracy':>10}{'seed range':>14}"
             + "".join(f"{c:>14}" for c in COSTS)]
    for m, by_n in out["results"].items():
        for n, r in by_n.items():
            if "same_as" in r:
                lines.append(f"{m:<10}{n:>5}   = {r['same_as']} (the same run)")
                continue
            spread = f"{r['min']:.3f}-{r['max']:.3f}"
            lines.append(f"{m:<10}{n:>5}{r['accuracy']:>10.3f}{spread:>14}"
                         + "".join(f"{'not counted' if r[c] is None else f'{r[c]:.4g}':>14}"
                                   for c in COSTS))
    return "\n".join(lines + [f"{out['problems']} problems, seeds {out['seeds']}"])


def main(argv=None):
    with exit_status():
        a = Parser(SearchRun, ScorerOptions, SearchOptions, prog="python -m prm.search",
                   description="Search a policy's answers with a PRM.").parse_args(argv)
        parsed(SearchRun, a)
        opts = parsed(SearchOptions, a)
        check(overwrites([("--output", a.output)], [
            ("--dataset", a.dataset), ("--model", a.model), ("--policy", a.policy)], new=True))
        problems = read_input(a.dataset, opts, a.skip_invalid)  # before any model loads
        try:
            search(a, opts, problems, tuple(map(int, a.shard.split("/"))))
        except KeyboardInterrupt:
            raise Stopped("stopped by SIGINT; rerun to continue", signal.SIGINT) from None


def search(a, opts: SearchOptions, problems, shard: tuple):
    """main's search, on every rank of a torchrun."""
    import torch.distributed as dist
    from prm.core.runtime import setup, teardown
    from prm.scoring.reward import PRMReward
    rt, scoring = setup(), dataclasses.asdict(parsed(ScorerOptions, a))
    try:
        # ranks end at different times
        wait = rt.distributed and dist.new_group(backend="gloo", timeout=datetime.timedelta(days=7))
        reward = PRMReward(a.model, opts.aggregate, rt.device, opts.prm_batch_size,
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
        cache = reward.cacheable and reward.step_separator == opts.step_separator
        run = functools.partial(search_file, problems, a.output, gen, reward.score, opts,
                                render=render, settings=model, extend=cache and cached(reward))
        out = run(part=part, show=rt.is_main)
        if rt.distributed:
            dist.barrier(group=wait)
            if rt.is_main and shard[1] == 1:
                out = run(show=False)
        if rt.is_main:
            print(table(out), file=sys.stderr)
            print(json.dumps(out), flush=True)
    finally:
        teardown(rt)


if __name__ == "__main__":
    main()
