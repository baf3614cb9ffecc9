"""A trained PRM as the reward of an RL trainer: one float per completion, as TRL's GRPOTrainer calls it
(`reward_funcs=[PRMReward("out/final")]`), or each step's score on the policy's own tokens (token_rewards)."""
import bisect
import functools
import itertools
import os
import warnings

import torch

from prm.config import FILE, Config
from prm.errors import UsageError
from prm.core.evaluate import score_batch
from prm.readers.formats import split_steps, step_spans
from prm.core.metrics import AGGREGATES
from prm.core.model import input_settings
from prm.core.runtime import autocast_dtype
from prm.scoring import ScorerOptions
from prm.scoring.scorers import load

EMPTY_REWARD = 0.0  # a completion with no step scored


def suffix_minima(ps: list) -> list:
    """PURE's min-form credit (arXiv 2504.15275): the sum from any step to the end is the minimum P there."""
    m = list(itertools.accumulate(reversed(ps), min))[::-1] + [0.0]
    return [a - b for a, b in zip(m, m[1:])]


# the steps' rewards from their P(correct): their own; P_k - P_(k-1) (potential-based, sums to the last P); min form
SHAPINGS = {"step": list, "delta": lambda ps: [p - q for p, q in zip(ps, [0.0] + ps[:-1])], "min": suffix_minima}


def token_holders(tokenizer, ids: list, text: str, row: int):
    """char index -> index of the token of ids whose decoding completes that character of text; ValueError
    naming the row if ids do not decode to text."""
    decode = functools.lru_cache(lambda k: tokenizer.decode(ids[:k], skip_special_tokens=True))
    if (whole := decode(len(ids))) != text:
        at = len(os.path.commonprefix([whole, text]))
        raise ValueError(f"completion {row}: completion_ids do not decode to its text (from character {at}: "
                         f"{whole[at:at + 30]!r}, not {text[at:at + 30]!r}): pass the policy's own ids and "
                         "tokenizer")

    def covered(k):  # the characters of text that ids[:k] surely decode to
        return len(os.path.commonprefix([decode(k), text]))
    return lambda c: bisect.bisect_right(range(len(ids) + 1), c, key=covered) - 1


def load_reward_model(path: str, trust_remote_code: bool = False, **scoring):
    """(tokenizer, model, run config) of a model directory, read as eval.py reads it; scoring: ScorerOptions."""
    saved = os.path.isfile(os.path.join(path, FILE))
    cfg = Config.load(path) if saved else Config()
    cfg.model = path
    cfg.trust_remote_code = trust_remote_code
    tokenizer, model = load(cfg, False, ScorerOptions(**scoring))
    if not saved:
        cfg = Config.from_dict({**cfg.__dict__, **input_settings(model.config)})
    return tokenizer, model, cfg


class PRMReward:
    """reward(prompts, completions, **kwargs) -> [float]: each completion's steps scored as in training, then
    aggregated. model: a directory, or a loaded PRM with `tokenizer=`; scoring: ScorerOptions'
    fields; dtype: eval.py's --dtype (default: the run's, else auto)."""

    def __init__(self, model, aggregate: str = "min", device=None, batch_size: int = 16, *,
                 tokenizer=None, step_separator: str = None, max_length: int = None,
                 trust_remote_code: bool = False, dtype: str = None, **scoring):
        if aggregate not in AGGREGATES:
            raise ValueError(f"aggregate {aggregate!r}: expected one of {', '.join(AGGREGATES)}")
        if not isinstance(trust_remote_code, bool):  # the string "false" would be true
            raise ValueError(f"trust_remote_code {trust_remote_code!r}: expected True or False")
        scorer = ScorerOptions(**scoring).scorer
        if isinstance(model, str):
            tokenizer, model, cfg = load_reward_model(model, trust_remote_code, **scoring)
        elif scorer not in ("auto", "classifier"):
            raise ValueError(f"scorer {scorer!r} reads a model directory; "
                             "prm.scoring.scorers.load gives a loaded one")
        elif tokenizer is None:
            raise ValueError("a loaded model needs its tokenizer: PRMReward(model, tokenizer=...)")
        else:
            cfg = Config.from_dict(input_settings(model.config))
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model, self.tokenizer = model.to(self.device).eval(), tokenizer
        self.step_separator = step_separator if step_separator is not None else cfg.step_separator
        self.max_length = max_length if max_length is not None else cfg.max_length
        self.aggregate, self.batch_size = aggregate, batch_size
        self.__name__ = f"prm_{aggregate}"  # TRL's logged column
        if dtype not in (None, "auto", "fp32", "bf16", "fp16"):
            raise ValueError(f"dtype {dtype!r}: expected auto, fp32, bf16 or fp16")
        self.amp_dtype = autocast_dtype(None if dtype == "auto" else dtype or cfg.dtype,
                                        self.device)
        if self.amp_dtype == torch.bfloat16 and hasattr(tokenizer, "prm_rows"):  # as eval.py's
            self.model.to(torch.bfloat16)

    @staticmethod
    def text(completion) -> str:
        """A completion's text: a string, or the assistant's contents of a list of messages, joined."""
        if isinstance(completion, str):
            return completion
        return "".join(m["content"] for m in completion if m.get("role", "assistant") == "assistant")

    def steps(self, completion) -> list:
        """The completion's steps as training keeps them."""
        return split_steps(self.text(completion), self.step_separator)

    def prompt(self, prompt):
        """Messages for the chat template, as in training; without one, their text."""
        if isinstance(prompt, str) or getattr(self.tokenizer, "chat_template", None):
            return prompt
        return "\n".join(m["content"] for m in prompt)

    def template_failure(self, prompts: dict):
        """UsageError naming the first completion ({index: prompt}) whose chat prompt the template refuses."""
        for i, prompt in prompts.items():
            if isinstance(prompt, str):
                continue
            try:
                self.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            except Exception as e:
                raise UsageError(f"completion {i}: the tokenizer's chat template fails on its prompt: "
                                 f"{type(e).__name__}: {str(e).strip()[:200]}") from e

    def step_probs(self, prompts: list, completions: list) -> list:
        """P(correct) per step of each completion; steps past max_length unscored, with a warning."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
        solutions = [(self.prompt(p), self.steps(c)) for p, c in zip(prompts, completions)]
        todo = [i for i, (_, steps) in enumerate(solutions) if steps]
        try:
            probs = score_batch(self.model, self.tokenizer, [solutions[i] for i in todo], self.step_separator,
                                max_length=self.max_length, batch_size=self.batch_size,
                                amp_dtype=self.amp_dtype)
        except Exception:  # a template failure said as such, else as it is
            self.template_failure({i: solutions[i][0] for i in todo})
            raise
        scored = dict(zip(todo, probs))
        cut = [ps for i, ps in scored.items() if len(ps) < len(solutions[i][1])]
        if cut:
            warnings.warn(f"PRMReward: {sum(map(bool, cut))} of {len(todo)} completions truncated (their cut "
                          f"steps are unscored), {cut.count([])} with no step that fits (reward "
                          f"{EMPTY_REWARD}); raise max_length (now {self.max_length})", stacklevel=2)
        return [scored.get(i, []) for i in range(len(solutions))]

    def step_scores(self, prompts: list, completions: list) -> list:
        """Per completion, (start, end, p) per step: its span of `text(completion)` and P(correct), None if cut."""
        spans = [step_spans(self.text(c), self.step_separator) for c in completions]
        probs = self.step_probs(prompts, completions)
        return [[(a, b, p) for (a, b), p in itertools.zip_longest(s, ps)] for s, ps in zip(spans, probs)]

    def token_rewards(self, prompts: list, completions: list, completion_ids: list, tokenizer,
                      shaping: str = "step", *, scores: list = None) -> list:
        """Per completion, a float per token of completion_ids: each scored step's SHAPINGS value on the token
        holding its last character, 0.0 elsewhere. scores: step_scores' answer, if already computed."""
        if shaping not in SHAPINGS:
            raise ValueError(f"shaping {shaping!r}: expected one of {', '.join(SHAPINGS)}")
        if len(completion_ids) != len(completions):
            raise ValueError(f"{len(completion_ids)} completion_ids for {len(completions)} completions")
        holders = [token_holders(tokenizer, ids, self.text(c), i)
                   for i, (c, ids) in enumerate(zip(completions, completion_ids))]
        scores = scores if scores is not None else self.step_scores(prompts, completions)
        out = []
        for steps, holder, ids in zip(scores, holders, completion_ids):
            scored = [(end, p) for _, end, p in steps if p is not None]
            row = [0.0] * len(ids)
            for (end, _), value in zip(scored, SHAPINGS[shaping]([p for _, p in scored])):
                row[holder(end - 1)] += value
            out.append(row)
        return out

    def __call__(self, prompts: list, completions: list, **kwargs) -> list:
        """One float per completion; TRL's extra columns (kwargs) unused."""
        return self.aggregated(self.step_probs(prompts, completions))

    def aggregated(self, step_probs: list) -> list:
        """The aggregate of each list of step probabilities, EMPTY_REWARD for an empty one."""
        return [float(AGGREGATES[self.aggregate](ps)) if ps else EMPTY_REWARD for ps in step_probs]
