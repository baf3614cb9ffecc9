"""A trained PRM as the reward of an RL trainer: one float per completion, in the form TRL's GRPOTrainer calls
(`reward_funcs=[PRMReward("out/final")]`). Depends on: torch, prm.build, prm.config, prm.evaluate, prm.formats,
prm.metrics."""
import os

import torch

from prm.build import load_trained
from prm.config import FILE, Config
from prm.evaluate import score_batch
from prm.formats import split_steps
from prm.metrics import AGGREGATES

EMPTY_REWARD = 0.0  # a completion with no step to score (empty, or every step cut): the lowest P(correct)


def load_reward_model(path: str, trust_remote_code: bool = False):
    """(tokenizer, model, run config) of a train.py output or any 2-label token classifier, like eval.py loads it.

    The run's config.train.json, when present, gives the step separator and max length it was trained with; never
    whether the directory's own Python files may run: that is the caller's trust_remote_code alone."""
    cfg = Config.load(path) if os.path.isfile(os.path.join(path, FILE)) else Config()
    cfg.model = path  # the saved config names the base model it started from; we want the trained one
    cfg.trust_remote_code = trust_remote_code  # the user's choice, never the file's (a downloaded model ships it)
    tokenizer, model = load_trained(cfg, tokenizer_given=False)
    return tokenizer, model, cfg


def completion_text(completion) -> str:
    """TRL passes text, or for conversational data a list of messages: the assistant's contents, joined."""
    if isinstance(completion, str):
        return completion
    return "".join(m["content"] for m in completion if m.get("role", "assistant") == "assistant")


class PRMReward:
    """reward(prompts, completions, **kwargs) -> [float]: the completion split into steps at the model's step
    separator, each step scored with the training tokenization, the scores aggregated (min, prod, last, mean).

    model: a directory (train.py output or any 2-label token classifier), or a loaded PRM with `tokenizer=`.
    trust_remote_code: let a directory's own Python files (an auto_map in its config) run; off whatever it says."""

    def __init__(self, model, aggregate: str = "min", device=None, batch_size: int = 16, *, tokenizer=None,
                 step_separator: str = None, max_length: int = None, trust_remote_code: bool = False):
        if aggregate not in AGGREGATES:
            raise ValueError(f"aggregate {aggregate!r}: expected one of {', '.join(AGGREGATES)}")
        if not isinstance(trust_remote_code, bool):  # the string "false" would be true
            raise ValueError(f"trust_remote_code {trust_remote_code!r}: expected True or False")
        if isinstance(model, str):
            tokenizer, model, cfg = load_reward_model(model, trust_remote_code)
        elif tokenizer is None:
            raise ValueError("a loaded model needs its tokenizer: PRMReward(model, tokenizer=...)")
        else:
            cfg = Config()  # defaults: "\n" separator, 1024 tokens
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model, self.tokenizer = model.to(self.device).eval(), tokenizer
        self.step_separator = step_separator if step_separator is not None else cfg.step_separator
        self.max_length = max_length if max_length is not None else cfg.max_length
        self.aggregate, self.batch_size = aggregate, batch_size
        self.__name__ = f"prm_{aggregate}"  # TRL names each reward function's logged column after __name__

    def steps(self, completion) -> list:
        """The completion's steps as training cuts them (prm.formats.split_steps): split at the separator,
        blank pieces (a trailing separator, blank lines, zero-width characters) dropped."""
        return split_steps(completion_text(completion), self.step_separator)

    def prompt(self, prompt):
        """Messages go through the chat template, as in training; a tokenizer without one reads their text."""
        if isinstance(prompt, str) or getattr(self.tokenizer, "chat_template", None):
            return prompt
        return "\n".join(m["content"] for m in prompt)

    def step_probs(self, prompts: list, completions: list) -> list:
        """P(correct) per step of each completion; [] for one with no step."""
        solutions = [(self.prompt(p), self.steps(c)) for p, c in zip(prompts, completions)]
        todo = [i for i, (_, steps) in enumerate(solutions) if steps]  # an empty solution is not run
        probs = score_batch(self.model, self.tokenizer, [solutions[i] for i in todo], self.step_separator,
                            max_length=self.max_length, batch_size=self.batch_size)
        out = [[] for _ in solutions]
        for i, ps in zip(todo, probs):
            out[i] = ps
        return out

    def __call__(self, prompts: list, completions: list, **kwargs) -> list:
        """One float per completion; TRL's extra columns (kwargs) are accepted and not used."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
        return self.aggregated(self.step_probs(prompts, completions))

    def aggregated(self, step_probs: list) -> list:
        """One float per step_probs list: the aggregate of its steps, EMPTY_REWARD for one with none."""
        agg = AGGREGATES[self.aggregate]
        return [float(agg(ps)) if ps else EMPTY_REWARD for ps in step_probs]
