"""prm.scoring.verl_manager in verl 0.9.1's reward loop: loaded by path as verl's config selects it, a DataProto
batch of left-padded prompts and right-padded responses through run_single (each sample, concurrently, as verl's
worker runs them) and assemble_rm_scores. Runs where verl imports (a separate virtual environment:
../shared/tools/verl_venv.sh; PYTHONPATH=the project), skipped elsewhere. Depends on: pytest, torch, verl, prm."""
import asyncio
import os

import pytest

verl = pytest.importorskip("verl", reason="verl does not import here: it runs in its own virtual environment "
                                          "(../shared/tools/verl_venv.sh)")

from conftest import ROOT  # noqa: E402
from test_step_rewards import PROMPTS, ROWS, SHAPINGS, built_tokenizer, policy_ids  # noqa: E402


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
