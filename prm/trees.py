"""Beam search and DVTS with a PRM: tree_search is one problem's search; TreeRun and grow batch
many problems' searches into shared calls."""
import collections
import itertools
import time

from prm.answers import extract_answer
from prm.core.metrics import solution_score
from prm.errors import UsageError
from prm.label import mix

# text: what the policy continues; is_correct(text) -> bool
Problem = collections.namedtuple("Problem", "index row text is_correct")
# state: PRMReward.extend's prefix after the steps
Beam = collections.namedtuple("Beam", "steps scores state")


def proposed(propose, prefixes: list, n: int, seeds: list, stop) -> tuple:
    """(texts, usage: per text (tokens or None, cut by max_new_tokens), seconds per prefix)."""
    start, outs = time.time(), propose(prefixes, n, seeds, stop)
    if len(outs) != len(prefixes) or any(len(texts) != n for texts in outs):
        raise UsageError(f"propose() must give {n} texts for each of its {len(prefixes)} prefixes")
    usage = getattr(propose, "usage", None) or [[(None, False)] * n for _ in prefixes]
    return outs, usage, (time.time() - start) / len(prefixes)


def plus(*counts):
    """None (not counted) if one is."""
    return None if None in counts else sum(counts)


def candidate(steps, scores, end: str, problem: Problem, opts) -> dict:
    text = opts.step_separator.join(steps)
    return {"steps": list(steps), "scores": scores,
            "answer": extract_answer(text, opts.answer_pattern),
            "correct": bool(problem.is_correct(text)), "end": end}


def tree_search(problem: Problem, method: str, n: int, width: int, opts):
    """One problem's beam search or DVTS (Snell et al. 2024; search-and-learn); unlike theirs: no
    lookahead, no duplicate filtering, survivors ended at --max-steps. Yields ("propose", beams,
    M), sent M (text, cut) per beam, and ("score", [(parent, steps)]), sent a Beam each."""
    keep, groups = (n // width, 1) if method == "beam" else (1, n // width)
    groups = [[Beam((), [], None)] * keep for _ in range(groups)]
    done = []

    def end(beam, how: str):
        done.append(candidate(beam.steps, beam.scores, how, problem, opts))
    for _ in range(opts.max_steps):
        if not any(groups):
            break
        texts = iter((yield "propose", [b for g in groups for b in g], width))
        new = [[] for _ in groups]  # (parent, steps, how it ended: "" if it goes on)
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


class TreeRun:
    """A tree_search under way: its request (None: ended), costs and candidates."""

    def __init__(self, problem: Problem, method: str, n: int, width: int, opts, seed: int):
        self.problem, self.method, self.n, self.width, self.seed = problem, method, n, width, seed
        self.search = tree_search(problem, method, n, width, opts)
        self.cost, self.done = collections.Counter(), None
        self.drawn = itertools.count()  # the tree's own seeds, one per prefix
        self.send(None)

    def send(self, answer):
        try:
            self.request = self.search.send(answer)
        except StopIteration as stop:
            self.request, self.done = None, stop.value


def rescoring(score, count, sep: str):
    """grow's scorer: each new beam's whole text rescored."""
    def extend(asked: list) -> list:  # [(run, parent, steps)] -> [(Beam, tokens)]
        questions = [r.problem.row["prompt"] for r, _, _ in asked]
        texts = [sep.join(steps) for _, _, steps in asked]
        probs = score(questions, [[text] for text in texts])
        return [(Beam(steps, ps, None), count(q, text))
                for (_, _, steps), q, text, [ps] in zip(asked, questions, texts, probs)]
    return extend


def cached(reward):
    """grow's scorer: a new step's tokens run on its parent's PRM cache."""
    def extend(asked: list) -> list:
        roots = {r: reward.start(r.problem.row["prompt"]) for r, parent, _ in asked
                 if parent.state is None}
        out = reward.extend([parent.state or roots[r] for r, parent, _ in asked],
                            [steps[-1] for _, _, steps in asked])
        return [(Beam(steps, parent.scores + ([] if p is None else [p]), prefix), ran)
                for (_, parent, steps), (prefix, p, ran) in zip(asked, out)]
    return extend


def grow(runs: list, propose, extend, opts, stops=False):
    """One step of every tree: a propose call per width, one scoring call. stops: refuse a
    propose() that drops the stop."""
    sep, ended = opts.step_separator, []
    asking = [r for r in runs if r.request and r.request[0] == "propose"]
    for width in sorted({r.width for r in asking}):
        beams = [(r, b) for r in asking if r.width == width for b in r.request[1]]
        prefixes = [r.problem.text + "".join(s + sep for s in b.steps) for r, b in beams]
        seeds = [mix(r.seed, r.problem.index, r.method, r.n, next(r.drawn)) for r, _ in beams]
        outs, usage, took = proposed(propose, prefixes, width, seeds, sep)
        answers = collections.defaultdict(list)
        for (r, _), texts, use in zip(beams, outs, usage):
            r.cost["seconds"] += took
            r.cost["policy_tokens"] = plus(r.cost["policy_tokens"], *(k for k, _ in use))
            answers[r].append([(text, cut) for text, (_, cut) in zip(texts, use)])
            ended += [sep in text or cut or not text.strip() for text, (_, cut) in zip(texts, use)]
        for r, texts in answers.items():
            r.send(texts)
    if stops and ended and not any(ended):
        raise UsageError(f"propose() drops the stop {sep!r} from all {len(ended)} first steps "
                         "(vLLM: include_stop_str_in_output=True)")
    # the order they proposed in
    asking = sorted([r for r in runs if r.request and r.request[0] == "score"],
                    key=lambda r: r.width)
    asked = [(r, parent, steps) for r in asking for parent, steps in r.request[1]]
    start = time.time()
    scored = iter(extend(asked) if asked else [])
    took = (time.time() - start) / max(1, len(asked))
    for r in asking:
        beams = [next(scored) for _ in r.request[1]]
        r.cost["prm_tokens"] = plus(r.cost["prm_tokens"], *(tokens for _, tokens in beams))
        r.cost["seconds"] += took * len(beams)
        r.send([beam for beam, _ in beams])
