"""prm.scoring.verl_manager in verl 0.9.1's reward loop: loaded by path as verl's config selects it, a DataProto
batch of left-padded prompts and right-padded responses through run_single (each sample, concurrently, as verl's
worker runs them) and assemble_rm_scores. Runs where verl imports (a separate virtual environment:
../shared/tools/verl_venv.sh; PYTHONPATH=the project), skipped elsewhere; the manager's own reading
of a sample (padding, raw_prompt, default shaping, prm not importable) on a stand-in for verl's base
class, everywhere.
Depends on: pytest, torch, verl, prm."""
import asyncio
import importlib.util
import os
import re
import sys
import types

import pytest
import torch

from conftest import REWARD_PROMPTS as PROMPTS, REWARD_TEXTS as ROWS
from conftest import ROOT, built_tokenizer, policy_ids
from prm.scoring.reward import SHAPINGS

MANAGER = os.path.join(ROOT, "prm", "scoring", "verl_manager.py")


class RewardManagerBase:
    """verl's base class, as much of it as the manager uses."""
    _class_initialized = False

    def __init__(self, config, tokenizer, compute_score=None):
        self.config, self.tokenizer = config, tokenizer
        self.init_class(config, tokenizer)

    @classmethod
    def init_class(cls, config, tokenizer):
        cls._class_initialized = True


def load_manager(monkeypatch):
    """PRMRewardManager loaded by path, as verl loads it, on the stand-in base class."""
    name = "verl.experimental.reward_loop.reward_manager.base"
    for k in range(1, 6):
        module = types.ModuleType("stand-in")
        monkeypatch.setitem(sys.modules, ".".join(name.split(".")[:k]), module)
    sys.modules[name].RewardManagerBase = RewardManagerBase
    spec = importlib.util.spec_from_file_location("verl_manager_under_test", MANAGER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PRMRewardManager


def sample(response: list, pad: int, left: bool, raw_prompt) -> types.SimpleNamespace:
    """One sample as run_single reads it: two prompt tokens, the response padded to 24 tokens."""
    fill = [pad] * (24 - len(response))
    ids, mask = (fill + response, [0] * len(fill) + [1] * len(response)) if left else \
        (response + fill, [1] * len(response) + [0] * len(fill))
    batch = {"prompts": torch.tensor([pad, pad]), "responses": torch.tensor(ids),  # (P,), (R,)
             "attention_mask": torch.tensor([1, 1] + mask)}  # (P + R,)
    return types.SimpleNamespace(batch=batch, non_tensor_batch={"raw_prompt": raw_prompt})


@pytest.fixture
def manager(monkeypatch, model_dir):
    config = types.SimpleNamespace(reward={"reward_kwargs": {"model": model_dir, "device": "cpu"}})
    return load_manager(monkeypatch)(config, built_tokenizer())


def run(manager, item) -> dict:
    return asyncio.run(manager.run_single([item]))


def test_left_padded_responses_are_read_and_rewarded_on_their_own_tokens(manager):
    policy, chat = manager.tokenizer, [{"role": "user", "content": PROMPTS[0]}]
    ids = policy_ids(policy, ROWS[:1])[0]
    right, left = (sample(ids, policy.pad_token_id, side, chat) for side in (False, True))
    got = [run(manager, s)["reward_score"] for s in (right, left)]
    assert got[0] == got[1] == manager.reward.token_rewards([chat], ROWS[:1], [ids], policy)[0]
    data = types.SimpleNamespace(batch={k: torch.stack([s.batch[k] for s in (right, left)])
                                        for k in ("responses", "attention_mask")})
    rm_scores = type(manager).assemble_rm_scores(data, got)  # (2, 24)
    pads = [0.0] * (24 - len(ids))
    assert rm_scores.tolist() == [pytest.approx(got[0] + pads), pytest.approx(pads + got[0])]


def test_a_raw_prompt_string_is_its_text_and_other_shapes_are_one_line(manager):
    policy, ids = manager.tokenizer, policy_ids(manager.tokenizer, ROWS[:1])[0]
    out = run(manager, sample(ids, policy.pad_token_id, False, PROMPTS[0]))
    want = manager.reward.token_rewards(PROMPTS[:1], ROWS[:1], [ids], policy)
    assert [out["reward_score"]] == want
    # the default shaping (min): the rewards sum to the lowest step P, however many steps there are
    assert sum(out["reward_score"]) == pytest.approx(out["reward_extra_info"]["prm_min"], abs=1e-6)
    message = r"completion 0: the prompt \{'role'.*\}: expected a string or a list of messages"
    with pytest.raises(ValueError, match=message):
        run(manager, sample(ids, policy.pad_token_id, False, {"role": "user", "content": "q"}))


def test_prm_not_importable_in_verls_python_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "prm.scoring.reward", None)  # as where prm is not installed
    with pytest.raises(ImportError, match=r"in verl's python: install prm there \(pip install -e "
                                          + re.escape(ROOT) + r"\)"):
        load_manager(monkeypatch)


def batch(policy, with_messages: bool):
    """Prompts left-padded and responses right-padded to the longest, as verl's rollout leaves them."""
    import numpy as np
    import torch
    from verl import DataProto
    prompts = [policy(p, add_special_tokens=False)["input_ids"] for p in PROMPTS[:3]]
    responses = policy_ids(policy, ROWS[:3])
    width, length, pad = max(map(len, prompts)), max(map(len, responses)) + 2, policy.pad_token_id
    rows = [[pad] * (width - len(p)) + p + r + [pad] * (length - len(r)) for p, r in zip(prompts, responses)]
    mask = [[0] * (width - len(p)) + [1] * (len(p) + len(r)) + [0] * (length - len(r))
            for p, r in zip(prompts, responses)]
    ids = torch.tensor(rows)  # (3, P + R)
    tensors = {"input_ids": ids, "attention_mask": torch.tensor(mask), "prompts": ids[:, :width],
               "responses": ids[:, width:]}
    chats = np.empty(3, dtype=object)
    chats[:] = [[{"role": "user", "content": p}] for p in PROMPTS[:3]]
    return DataProto.from_dict(tensors, non_tensors={"raw_prompt": chats} if with_messages else {}), responses


@pytest.mark.parametrize("shaping, with_messages", [("step", True), ("delta", False), ("min", True)])
def test_verl_rm_scores_hold_each_steps_reward_on_its_token(model_dir, shaping, with_messages):
    verl = pytest.importorskip("verl", reason="verl does not import here: it runs in its own "
                                              "virtual environment (../shared/tools/verl_venv.sh)")
    from omegaconf import OmegaConf
    from verl.trainer.ppo.reward import load_reward_manager
    from prm.scoring.reward import PRMReward
    config = OmegaConf.create({"reward": {
        "reward_manager": {"source": "importlib", "name": "PRMRewardManager",
                           "module": {"path": os.path.join(ROOT, "prm", "scoring", "verl_manager.py")}},
        "reward_kwargs": {"model": model_dir, "device": "cpu", "shaping": shaping}}})
    policy = built_tokenizer()
    manager = load_reward_manager(config, policy)  # as verl's RewardLoopWorker builds it
    data, responses = batch(policy, with_messages)

    async def run_all():  # verl's compute_score_batch: a task per sample
        return await asyncio.gather(*(manager.run_single(data[i:i + 1]) for i in range(len(data))))
    outputs = asyncio.run(run_all())
    rm_scores = type(manager).assemble_rm_scores(data, [out["reward_score"] for out in outputs])
    print(f"verl {verl.__version__}, shaping {shaping}: rm_scores nonzero at "
          f"{rm_scores.nonzero().tolist()}")
    reward = PRMReward(model_dir, device="cpu")
    scores = reward.step_scores(PROMPTS[:3], ROWS[:3])
    assert rm_scores.shape == data.batch["responses"].shape
    for i, (steps, ids) in enumerate(zip(scores, responses)):
        row = rm_scores[i].tolist()
        values = SHAPINGS[shaping]([p for *_, p in steps])
        expected = reward.token_rewards(PROMPTS[i:i + 1], ROWS[i:i + 1], [ids], policy, shaping)[0]
        assert row == pytest.approx(expected + [0.0] * (len(row) - len(ids)), abs=1e-6)  # padding: 0.0
        assert sorted(v for v in row if v) == pytest.approx(sorted(v for v in values if v), abs=1e-6)
        assert outputs[i]["reward_extra_info"] == {"prm_min": pytest.approx(min(p for *_, p in steps), abs=1e-6)}
    if shaping == "step":  # hand-checked places of the first row (tests/test_step_rewards.py): '.\n', CRLF, 'é'
        assert rm_scores[0].nonzero().flatten().tolist() == [4, 9, 12]
