"""Using a PRM: published PRMs (scorers), rewards for RL (reward), the reward server (serve). ScorerOptions, here
so that eval.py's --help loads no torch, says how a model is read."""
import argparse
import dataclasses

FAMILIES = ("classifier", "qwen-prm", "step-tag", "chat-turns")
HELP = {"scorer": "how the model scores steps, as its authors do: a token-classification head (ours, TRL's); "
        "Qwen2.5-Math-PRM's <extra_0> head (needs --trust-remote-code); Math-Shepherd's good/bad LM logits at a "
        "--step-tag; RLHFlow's at each assistant turn. auto: qwen-prm when the model's config (local or hub) "
        "names a *ForProcessRewardModel, else classifier",
        "step_tag": "step-tag: the one token ending each step (Math-Shepherd: ки)",
        "good_token": "step-tag, chat-turns: the one token meaning 'correct'",
        "bad_token": "step-tag, chat-turns: the one token meaning 'wrong'"}


@dataclasses.dataclass(frozen=True)
class ScorerOptions:
    """How a model's outputs are read as step scores: eval.py's and prm.serve's flags, PRMReward's keywords."""
    scorer: str = "auto"
    step_tag: str = ""
    good_token: str = "+"
    bad_token: str = "-"

    @classmethod
    def add_flags(cls, parser, scorer_help: str = ""):
        """The four flags with eval.py's help texts; given scorer_help, --scorer's text and the others hidden."""
        for f in dataclasses.fields(cls):
            text = HELP[f.name] if not scorer_help else scorer_help if f.name == "scorer" else argparse.SUPPRESS
            choices = {"choices": ("auto",) + FAMILIES} if f.name == "scorer" else {}
            parser.add_argument("--" + f.name.replace("_", "-"), default=f.default, help=text, **choices)

    @classmethod
    def of(cls, args):
        """The options of a parsed command line."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
