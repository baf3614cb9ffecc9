"""Using a PRM: published PRMs (scorers), rewards for RL (reward), the reward server (serve). ScorerOptions, here
so that eval.py's --help loads no torch, says how a model is read."""
import dataclasses

from prm.config import opt

FAMILIES = ("classifier", "qwen-prm", "step-tag", "chat-turns")


@dataclasses.dataclass(frozen=True)
class ScorerOptions:
    """How a model's outputs are read as step scores: eval.py's and prm.serve's flags, PRMReward's keywords."""
    scorer: str = opt("auto", "how the model scores steps, as its authors do: a "
                      "token-classification head (ours, TRL's); Qwen2.5-Math-PRM's <extra_0> head "
                      "(needs --trust-remote-code); Math-Shepherd's good/bad LM logits at a "
                      "--step-tag; RLHFlow's at each assistant turn. auto: qwen-prm when the "
                      "model's config (local or hub) names a *ForProcessRewardModel, else "
                      "classifier", choices=("auto",) + FAMILIES)
    step_tag: str = opt("", "step-tag: the one token ending each step (Math-Shepherd: ки)")
    good_token: str = opt("+", "step-tag, chat-turns: the one token meaning 'correct'")
    bad_token: str = opt("-", "step-tag, chat-turns: the one token meaning 'wrong'")
