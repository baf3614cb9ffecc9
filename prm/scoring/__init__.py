"""Using a PRM. ScorerOptions lives here so that eval.py's --help loads no torch."""
import dataclasses

from prm.config import opt

FAMILIES = ("classifier", "qwen-prm", "step-tag", "chat-turns")


@dataclasses.dataclass(frozen=True)
class ScorerOptions:
    scorer: str = opt("auto", "the model's scoring recipe (auto: qwen-prm for a "
                      "*ForProcessRewardModel, else classifier)", choices=("auto",) + FAMILIES)
    step_tag: str = opt("", "step-tag: the token ending each step (Math-Shepherd: ки)")
    good_token: str = opt("+", "step-tag, chat-turns: the 'correct' token")
    bad_token: str = opt("-", "step-tag, chat-turns: the 'wrong' token")
