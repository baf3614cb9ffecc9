"""Process rewards for RL: PRMReward.step_scores (each step's span and P(correct), as __call__ and eval.py score it)
and token_rewards (each step's value on the policy token holding its last character), with the policy and the PRM
on different tokenizers; the shapings' identities; bad input refused. Depends on: pytest, tokenizers, transformers,
prm, eval.py (the shared GPT-2 and Qwen2 tokenizers where ../shared is present)."""
import json
import os
import random
import warnings

import pytest

from conftest import REWARD_PROMPTS as PROMPTS, REWARD_TEXTS as ROWS
from conftest import SHARED, built_tokenizer, policy_ids

import eval as eval_cli
from prm.readers.formats import split_steps, step_spans
from prm.scoring.reward import SHAPINGS, PRMReward

MAX_LENGTH = 48  # the last row's later steps do not fit, the other rows do


def tokenizer(name):
    if name == "built":
        return built_tokenizer()
    if name == "char":
        from prm.readers.synthetic import char_tokenizer
        return char_tokenizer()
    path = os.path.join(SHARED, "tokenizers", name)
    if not os.path.isdir(path):
        pytest.skip(f"../shared/tokenizers/{name} is absent")
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(autouse=True)
def fp32(monkeypatch):
    """The references here are fp32: --dtype auto too, whatever the CPU (--cpu-bf16)."""
    monkeypatch.setenv("PRM_CPU_BF16", "0")


@pytest.fixture(scope="module")
def prm_dirs(tmp_path_factory):
    """{tokenizer name: a saved tiny PRM (seed 0) on it}, made on first use."""
    from prm.loading import build_model
    made = {}

    def get(name):
        if name not in made:
            tok, path = tokenizer(name), str(tmp_path_factory.mktemp(name))
            build_model("tiny", tok, seed=0).save_pretrained(path)
            tok.save_pretrained(path)
            made[name] = path
        return made[name]
    return get


def holder(policy, ids, text, c):
    """The first token after which the decoded ids hold text[:c + 1] (a plain scan of the decoded prefixes)."""
    return next(k for k in range(len(ids))
                if policy.decode(ids[:k + 1], skip_special_tokens=True)[:c + 1] == text[:c + 1])


@pytest.mark.parametrize("text, separator, steps", [
    (ROWS[0], "\n", ["x=1.", "y=é\r", "wé"]), (" a ;  b\t ; \u200b ; ", " ; ", [" a", " b\t"]),
    ("xabby", "ab", ["x", "by"])])
def test_steps_are_the_pieces_between_separators_verbatim_blank_ones_dropped(text, separator, steps):
    assert split_steps(text, separator) == steps == [text[a:b] for a, b in step_spans(text, separator)]


@pytest.mark.parametrize("prm_name, policy_name", [("char", "built"), ("gpt2", "qwen2"), ("qwen2", "gpt2")])
def test_each_steps_reward_sits_on_the_policy_token_holding_its_last_character(prm_dirs, prm_name, policy_name,
                                                                               tmp_path):
    reward, policy = PRMReward(prm_dirs(prm_name), device="cpu", max_length=MAX_LENGTH), tokenizer(policy_name)
    ids = policy_ids(policy, ROWS)
    with pytest.warns(UserWarning, match="1 of 4 completions truncated"):
        scores = reward.step_scores(PROMPTS, ROWS)
    with pytest.warns(UserWarning, match="1 of 4 completions truncated"):
        got = {s: reward.token_rewards(PROMPTS, ROWS, ids, policy, s) for s in SHAPINGS}
        probs = reward.step_probs(PROMPTS, ROWS)
    for text, steps, row_probs in zip(ROWS, scores, probs):
        assert [text[a:b] for a, b, _ in steps] == split_steps(text, "\n")
        assert [p for *_, p in steps] == row_probs + [None] * (len(steps) - len(row_probs))
    assert None in [p for *_, p in scores[3]] and all(p is not None for s in scores[:3] for *_, p in s)
    for row, (text, steps, row_ids) in enumerate(zip(ROWS, scores, ids)):
        scored = [(end, p) for _, end, p in steps if p is not None]
        for shaping, rewards in got.items():
            expected = [0.0] * len(row_ids)
            for (end, _), value in zip(scored, SHAPINGS[shaping]([p for _, p in scored])):
                expected[holder(policy, row_ids, text, end - 1)] += value
            assert rewards[row] == expected, (row, shaping)
    # the same numbers as eval.py's, reading the steps as a data file
    data, pred = tmp_path / "steps.jsonl", str(tmp_path / "pred.jsonl")
    data.write_text("".join(json.dumps({"prompt": p, "completions": split_steps(c, "\n"), "labels": [True] *
                                        len(split_steps(c, "\n"))}) + "\n" for p, c in zip(PROMPTS, ROWS)))
    eval_cli.main(["--model", prm_dirs(prm_name), "--dataset", str(data), "--dtype", "fp32", "--max-length",
                   str(MAX_LENGTH), "--predictions", pred])
    with open(pred) as f:
        got_eval = [json.loads(line)["step_probs"] for line in f]
    assert list(map(len, got_eval)) == list(map(len, probs))
    assert sum(got_eval, []) == pytest.approx(sum(probs, []), abs=1e-6)


def test_a_tokenizer_built_here_places_rewards_inside_merged_and_split_tokens(model_dir):
    """Hand-checked places: '.\\n' and CRLF are one token each; 'é' is two, the step ends at its second."""
    reward, policy = PRMReward(model_dir, device="cpu"), built_tokenizer()
    text = ROWS[0]  # "\nx=1.\ny=é\r\nwé\n": steps "x=1.", "y=é\r", "wé"
    ids = policy_ids(policy, [text])
    assert [policy.decode(i) for i in ids[0]] == ["\n", "x", "=", "1", ".\n", "y", "=", "\ufffd", "\ufffd", "\r\n",
                                                   "w", "\ufffd", "\ufffd", "\n", "<eos>"]
    (steps,) = reward.step_scores(PROMPTS[:1], [text])
    assert [(a, b) for a, b, _ in steps] == [(1, 5), (6, 10), (11, 13)]
    (rewards,) = reward.token_rewards(PROMPTS[:1], [text], ids, policy, "step")
    assert {k: v for k, v in enumerate(rewards) if v} == {4: steps[0][2], 9: steps[1][2], 12: steps[2][2]}


def test_shapings_hold_their_identities_exactly():
    """Dyadic P (k / 1024) keep every difference and sum exact, so the identities are checked with ==."""
    rng = random.Random(0)
    for _ in range(200):
        ps = [rng.randrange(1025) / 1024 for _ in range(rng.randint(1, 12))]
        assert SHAPINGS["step"](ps) == ps
        delta, low = SHAPINGS["delta"](ps), SHAPINGS["min"](ps)
        assert [sum(delta[:k + 1]) for k in range(len(ps))] == ps  # potential-based: partial sums are P_k
        assert [sum(low[k:]) for k in range(len(ps))] == [min(ps[k:]) for k in range(len(ps))]
    assert SHAPINGS["min"]([0.9, 0.2, 0.7]) == [0.0, 0.2 - 0.7, 0.7] and SHAPINGS["delta"]([]) == []


def test_bad_input_is_refused_with_the_row_named(model_dir):
    reward, policy = PRMReward(model_dir, device="cpu"), built_tokenizer()
    ids = policy_ids(policy, ROWS[:2])
    with pytest.raises(ValueError, match=r"completion 1: completion_ids do not decode to its text \(from character "
                                         r"8: ' 2\+1=3 .*', not '2\+1=3 "):
        reward.token_rewards(PROMPTS[:2], [ROWS[0], ROWS[1].replace("\n  ", "\n ")], ids, policy)
    with pytest.raises(ValueError, match="shaping 'sum': expected one of step, delta, min"):
        reward.token_rewards(PROMPTS[:2], ROWS[:2], ids, policy, "sum")
    with pytest.raises(ValueError, match="1 completion_ids for 2 completions"):
        reward.token_rewards(PROMPTS[:2], ROWS[:2], ids[:1], policy)
    with pytest.raises(ValueError, match="1 prompts for 2 completions"):
        reward.token_rewards(PROMPTS[:1], ROWS[:2], ids, policy)
    with pytest.raises(ValueError, match="1 prompts for 2 completions"):
        reward.step_scores(PROMPTS[:1], ROWS[:2])
    one = reward.step_scores(PROMPTS[:1], ROWS[:1])
    with pytest.raises(ValueError, match="1 scores for 2 completions"):  # not fewer rows, silently
        reward.token_rewards(PROMPTS[:2], ROWS[:2], ids, policy, scores=one)
    for bad in ("7", 7.0, -1, 10 ** 9, len(policy)):  # 259 ids: 0 to 258
        message = rf"completion 1: completion_ids hold {bad!r}: expected ids 0 to "
        with pytest.raises(ValueError, match=message + "258"):
            reward.token_rewards(PROMPTS[:2], ROWS[:2], [ids[0], ids[1][:3] + [bad]], policy)


def test_the_default_shaping_sums_to_the_lowest_step_p_whatever_the_number_of_steps(model_dir):
    """min (PURE's): a policy gains nothing by adding steps, as with `step` (the sum of the P)."""
    reward, policy = PRMReward(model_dir, device="cpu"), built_tokenizer()
    texts = ["1+1=2\n2+1=3\n3+1=4\n", "1+1=2\n2+1=3\n3+1=4\n4+1=6\n"]
    rows = reward.token_rewards(PROMPTS[:2], texts, policy_ids(policy, texts), policy)
    lowest = [min(p for *_, p in steps) for steps in reward.step_scores(PROMPTS[:2], texts)]
    assert [sum(row) for row in rows] == pytest.approx(lowest, abs=1e-6)


def test_a_completion_with_no_scored_step_gets_zeros(model_dir):
    policy = built_tokenizer()
    texts = ["", "\n \n", ROWS[1]]
    ids = policy_ids(policy, texts)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing cut: no warning
        rewards = PRMReward(model_dir, device="cpu").token_rewards(PROMPTS[:3], texts, ids, policy,
                                                                   "step")
    assert rewards[0] == [0.0] and rewards[1] == [0.0] * 4 and sum(v != 0 for v in rewards[2]) == 3
    with pytest.warns(UserWarning, match="1 with no step that fits") as caught:
        cut = PRMReward(model_dir, device="cpu", max_length=1).token_rewards(PROMPTS[:1], texts[2:], ids[2:], policy)
    assert cut == [[0.0] * len(ids[2])] and len(caught) == 1
