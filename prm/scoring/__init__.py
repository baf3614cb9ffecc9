"""Using a PRM: published PRMs (scorers), RL rewards (reward), the reward server (serve).
ScorerOptions lives here so that eval.py's --help loads no torch."""
import dataclasses

from prm.config import opt

FAMILIES = ("classifier", "qwen-prm", "step-tag", "chat-turns")


@dataclasses.dataclass(frozen=True)
class ScorerOptions:
    """How a model's outputs are read as step scores: eval.py's and prm.serve's flags."""
    scorer: str = opt("auto", "how the model scores steps, as its authors do: a "
                      "token-classification head (ours, TRL's); Qwen2.5-Math-PRM's <extra_0> head "
                      "(needs --trust-remote-code); Math-Shepherd's good/bad LM logits at a "
                      "--step-tag; RLHFlow's at each assistant turn. auto: qwen-prm for a "
                      "*ForProcessRewardModel config, else classifier",
                      choices=("auto",) + FAMILIES)
    step_tag: str = opt("", "step-tag: the token ending each step (Math-Shepherd: ки)")
    good_token: str = opt("+", "step-tag, chat-turns: the token meaning 'correct'")
    bad_token: str = opt("-", "step-tag, chat-turns: the token meaning 'wrong'")
