"""prm: train process reward models in plain PyTorch. Names load on first use (no torch until
one needs it): `from prm import PRM, PRMReward, load_tokenizer, score`."""
import importlib

_HOME = {
    "Config": "prm.config",
    "PRMError": "prm.errors", "UsageError": "prm.errors",
    "PRM": "prm.core.model", "step_loss": "prm.core.model",
    "tokenize_example": "prm.core.data", "collate": "prm.core.data", "pack": "prm.core.data",
    "predict": "prm.core.evaluate", "report": "prm.core.evaluate",
    "score": "prm.core.evaluate", "score_batch": "prm.core.evaluate",
    "step_metrics": "prm.core.metrics", "processbench_metrics": "prm.core.metrics",
    "apply_lora": "prm.core.lora",
    "load_tokenizer": "prm.loading", "load_trained": "prm.loading",
    "PRMReward": "prm.scoring.reward", "load_reward_model": "prm.scoring.reward",
    "label_file": "prm.label", "LabelOptions": "prm.label",
    "search_file": "prm.search", "SearchOptions": "prm.search",
}
__all__ = sorted(_HOME)


def __getattr__(name):
    if name not in _HOME:
        raise AttributeError(f"module 'prm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(_HOME))
