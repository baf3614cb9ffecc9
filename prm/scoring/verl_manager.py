"""verl 0.9.1's reward manager, loaded by path: PRMReward.token_rewards fill `rm_scores`."""
import asyncio
import os
import threading

import torch
from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase

try:
    from prm.scoring.reward import PRMReward
except ModuleNotFoundError as e:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    raise ImportError(f"{e} in verl's python: install prm there (pip install -e {root})") from e


class PRMRewardManager(RewardManagerBase):
    reward: PRMReward = None  # one per process
    shaping = "min"
    lock = threading.Lock()

    def __init__(self, config, tokenizer, compute_score=None, **kwargs):  # kwargs: verl's routing
        super().__init__(config, tokenizer, compute_score)

    @classmethod
    def init_class(cls, config, tokenizer):
        if cls._class_initialized:
            return
        kwargs = dict(config.reward.get("reward_kwargs") or {})
        if "model" not in kwargs:
            raise ValueError("PRMRewardManager needs +reward.reward_kwargs.model=DIR")
        cls.shaping = kwargs.pop("shaping", cls.shaping)
        cls.reward = PRMReward(kwargs.pop("model"), **kwargs)
        super().init_class(config, tokenizer)

    def score(self, prompt, ids: list) -> dict:
        with self.lock:
            completion = self.tokenizer.decode(ids, skip_special_tokens=True)
            scores = self.reward.step_scores([prompt], [completion])
            rewards = self.reward.token_rewards(
                [prompt], [completion], [ids], self.tokenizer, self.shaping, scores=scores)[0]
        aggregate = self.reward.aggregated([[p for *_, p in scores[0] if p is not None]])[0]
        return {"reward_score": rewards, "reward_extra_info": {self.reward.__name__: aggregate}}

    async def run_single(self, data) -> dict:
        item = data[-1:][0]
        responses, mask = item.batch["responses"], item.batch["attention_mask"]  # (R,), (P + R,)
        ids = responses[mask[-responses.shape[-1]:].bool()].tolist()  # left- or right-padded
        prompt = item.non_tensor_batch.get("raw_prompt")
        if prompt is None:  # the prompt's own tokens, left-padded
            prompt_ids = item.batch["prompts"]  # (P,)
            kept = prompt_ids[mask[:len(prompt_ids)].bool()]
            prompt = self.tokenizer.decode(kept, skip_special_tokens=True)
        elif not isinstance(prompt, (str, dict)):  # a list or verl's numpy array of messages
            prompt = list(prompt)
        return await asyncio.get_running_loop().run_in_executor(None, self.score, prompt, ids)

    @classmethod
    def assemble_rm_scores(cls, data, scores: list) -> torch.Tensor:
        rm_scores = torch.zeros_like(data.batch["responses"], dtype=torch.float32)  # (B, R)
        kept = data.batch["attention_mask"][:, -rm_scores.shape[1]:].bool()  # (B, R)
        for i, rewards in enumerate(scores):
            rm_scores[i, kept[i]] = torch.tensor(rewards, dtype=torch.float32)
        return rm_scores
