"""Published PRM families (prm.scoring.scorers) against plain, separate implementations of their authors' recipes, on real
ProcessBench rows (tests/fixtures), through eval.py, PRMReward and prm.serve; the one-token and template checks.
Tiny random models in each family's structure; the Qwen2 tokenizer from ../shared. Depends on: pytest, torch, prm."""
import json
import os
import shutil
import subprocess
import sys
import urllib.request

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import eval as eval_cli  # noqa: E402
from prm.errors import UsageError  # noqa: E402
from prm.readers.formats import split_steps  # noqa: E402
from prm.scoring.reward import PRMReward  # noqa: E402

TAG = "ки"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
QWEN_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
MODELING = '''import torch.nn as nn
from transformers import Qwen2Model, Qwen2PreTrainedModel


class TinyProcessRewardModel(Qwen2PreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.model = Qwen2Model(config)
        h = config.hidden_size
        self.score = nn.Sequential(nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 2))
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return (self.score(hidden),)
'''
with open(os.path.join(ROOT, "tests", "fixtures", "processbench.json")) as f:
    ROWS = json.load(f)


def tiny(cls, tok, seed):
    from transformers import Qwen2Config
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=False, pad_token_id=tok.pad_token_id, attention_dropout=0.0)
    return cls(cfg).eval()


@pytest.fixture(scope="module")
def dirs(qwen2_tok, tmp_path_factory):
    """{family: model directory}: step-tag (a Qwen2 causal LM, ки added as one token), chat-turns (the same kind,
    ChatML template), qwen-prm (its own model code, <extra_0> added, ChatML template)."""
    import copy
    import importlib.util
    from transformers import Qwen2ForCausalLM
    out = {}
    for name, seed in (("step-tag", 1), ("chat-turns", 2)):
        tok = copy.deepcopy(qwen2_tok)
        tok.add_tokens([TAG])
        tok.chat_template = CHATML
        out[name] = str(tmp_path_factory.mktemp(name))
        tiny(Qwen2ForCausalLM, tok, seed).save_pretrained(out[name])
        tok.save_pretrained(out[name])
    path = tmp_path_factory.mktemp("qwen-prm")
    (path / "modeling_tiny_prm.py").write_text(MODELING)
    spec = importlib.util.spec_from_file_location("modeling_tiny_prm", path / "modeling_tiny_prm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tok = copy.deepcopy(qwen2_tok)
    tok.add_special_tokens({"additional_special_tokens": ["<extra_0>"]})
    tok.chat_template = CHATML
    tiny(module.TinyProcessRewardModel, tok, 3).save_pretrained(str(path))
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(architectures=["Qwen2ForProcessRewardModel"],
               auto_map={"AutoModel": "modeling_tiny_prm.TinyProcessRewardModel"})
    (path / "config.json").write_text(json.dumps(cfg))
    tok.save_pretrained(str(path))
    out["qwen-prm"] = str(path)
    return out


def load(path, remote=False):
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer
    cls = AutoModel if remote else AutoModelForCausalLM
    return AutoTokenizer.from_pretrained(path), cls.from_pretrained(path, trust_remote_code=remote).eval()


@torch.no_grad()
def math_shepherd(path, problem, steps, good="+", bad="-"):
    """Math-Shepherd's model card: one text, one forward, the good token's share at every tag token."""
    tok, model = load(path)
    ids = torch.tensor([tok.encode(f"{problem} " + "\n".join(f"{s} {TAG}" for s in steps))])
    cols = [tok.encode(good)[-1], tok.encode(bad)[-1]]
    scores = model(ids).logits[:, :, cols].softmax(dim=-1)[:, :, 0]
    return scores[ids == tok.encode(TAG)[-1]].tolist()


@torch.no_grad()
def rlhflow(path, problem, steps):
    """RLHFlow's model card: the conversation grown turn by turn, one forward per step, read where the last '+'
    is predicted."""
    tok, model = load(path)
    plus, minus = tok.encode("+")[-1], tok.encode("-")[-1]
    conversation, out = [], []
    for k, step in enumerate(steps):
        conversation.append({"role": "user", "content": problem + " " + step if k == 0 else step})
        conversation.append({"role": "assistant", "content": "+"})
        ids = tok(tok.apply_chat_template(conversation, tokenize=False), add_special_tokens=False)["input_ids"]
        at = max(i for i, t in enumerate(ids) if t == plus) - 1
        out.append(model(torch.tensor([ids])).logits[0, at, [plus, minus]].softmax(-1)[0].item())
    return out


@torch.no_grad()
def qwen_card(path, problem, steps):
    """Qwen2.5-Math-PRM's model card: chat template, <extra_0> after every step, softmax[1] at each <extra_0>."""
    tok, model = load(path, remote=True)
    messages = [{"role": "system", "content": QWEN_SYSTEM}, {"role": "user", "content": problem},
                {"role": "assistant", "content": "<extra_0>".join(steps) + "<extra_0>"}]
    ids = torch.tensor([tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False))])
    probs = model(input_ids=ids)[0].softmax(dim=-1)
    return probs[ids == tok.encode("<extra_0>")[0]][:, 1].tolist()


@pytest.fixture(scope="module")
def pb_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("pb") / "processbench.json"
    path.write_text(json.dumps(ROWS))
    return str(path)


def evaluate(path, pb_file, tmp_path, *args):
    pred = str(tmp_path / "pred.jsonl")
    out = eval_cli.main(["--model", path, "--dataset", pb_file, "--dtype", "fp32", "--eval-batch-size", "2",
                         "--predictions", pred, *args])
    with open(pred) as f:
        return out, [json.loads(line)["step_probs"] for line in f]


def same_as_recipe(path, pb_file, tmp_path, flags, recipe):
    """eval.py scores every step of every row as the recipe does (lengths first: none dropped), and
    cut by --max-length 300 a prefix of each row (some rows cut); returns the cut run's figures."""
    want = [recipe(r["problem"], r["steps"]) for r in ROWS]
    _, whole = evaluate(path, pb_file, tmp_path, *flags, "--max-length", "4096")
    assert [len(p) for p in whole] == [len(w) for w in want] == [len(r["steps"]) for r in ROWS]
    out, cut = evaluate(path, pb_file, tmp_path, *flags, "--max-length", "300")
    for got, kept, full in zip(whole, cut, want):
        assert got == pytest.approx(full, abs=1e-6)
        assert kept == pytest.approx(full[:len(kept)], abs=1e-6)
    assert any(0 < len(p) < len(r["steps"]) for p, r in zip(cut, ROWS)), "no row cut: lower 300"
    return out


@pytest.mark.parametrize("packing", [[], ["--packing"]])
def test_step_tag_equals_math_shepherds_recipe(dirs, pb_file, tmp_path, packing):
    flags = ["--scorer", "step-tag", "--step-tag", TAG, *packing]
    out = same_as_recipe(dirs["step-tag"], pb_file, tmp_path, flags,
                         lambda p, s: math_shepherd(dirs["step-tag"], p, s))
    assert out["examples_truncated"] > 0 and "f1" in out


def test_chat_turns_equals_rlhflows_recipe(dirs, pb_file, tmp_path):
    same_as_recipe(dirs["chat-turns"], pb_file, tmp_path, ["--scorer", "chat-turns"],
                   lambda p, s: rlhflow(dirs["chat-turns"], p, s))


def test_qwen_prm_equals_its_model_card_and_runs_its_code_only_when_allowed(dirs, pb_file, tmp_path):
    with pytest.raises(UsageError, match="--trust-remote-code"):  # detected from its architectures
        evaluate(dirs["qwen-prm"], pb_file, tmp_path)
    same_as_recipe(dirs["qwen-prm"], pb_file, tmp_path, ["--trust-remote-code"],
                   lambda p, s: qwen_card(dirs["qwen-prm"], p, s))


# bf16 keeps 8 bits (u = 2^-8) of every weight and activation: the logit gap moves by a few u of
# the logits' size (|l| < 2.7 here; measured 0.031 = 3u|l|), and P = sigmoid(gap) by at most a
# quarter of that: bound 4u (measured 7.3e-3). The head is scaled up so that P spreads over
# 0.57-0.79 (unscaled: 0.503-0.511, where a constant 0.5 or a reordered score would pass).
def test_a_published_prm_holds_bf16_weights_where_eval_py_runs_bf16(dirs, pb_file, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = str(tmp_path / "spread")
    model = AutoModelForCausalLM.from_pretrained(dirs["step-tag"])
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(dirs["step-tag"]).save_pretrained(path)
    loaded, load = [], eval_cli.load_scorer
    monkeypatch.setattr(eval_cli, "load_scorer", lambda *a, **k: loaded.append(load(*a, **k)) or loaded[-1])
    flags = ["--scorer", "step-tag", "--step-tag", TAG, "--max-length", "300"]
    fp32, bf16 = ([p for ps in evaluate(path, pb_file, tmp_path, *flags, *dtype)[1] for p in ps]
                  for dtype in ([], ["--dtype", "bf16"]))  # the last --dtype wins
    assert [{p.dtype for p in model.parameters()} for _, model, _ in loaded] == [{torch.float32}, {torch.bfloat16}]
    tol = 4 * 2 ** -8
    assert max(fp32) - min(fp32) > 8 * tol  # spread: a constant or reordered score misses by more
    worst = max(abs(a - b) for a, b in zip(bf16, fp32))
    print(f"bf16 against fp32: {worst:.2e} apart at most; fp32 P: {min(fp32):.3f}-{max(fp32):.3f}")
    assert len(bf16) == len(fp32) and worst <= tol


def test_swapping_the_good_and_bad_tokens_changes_the_f1(dirs, pb_file, tmp_path):
    dev = str(tmp_path / "dev.json")  # the reported rows in a file of their own: tuning on a --dataset is refused
    shutil.copy(pb_file, dev)
    flags = ["--scorer", "step-tag", "--step-tag", TAG, "--tune-threshold", dev]
    out, probs = evaluate(dirs["step-tag"], pb_file, tmp_path, *flags)
    swapped, swapped_probs = evaluate(dirs["step-tag"], pb_file, tmp_path, *flags, "--good-token", "-",
                                      "--bad-token", "+")
    assert [1 - p for ps in probs for p in ps] == pytest.approx([p for ps in swapped_probs for p in ps], abs=1e-6)
    assert out["f1"] != swapped["f1"] and out["auroc"] == pytest.approx(1 - swapped["auroc"])


def test_tokens_that_are_not_one_token_and_missing_or_unread_flags(dirs, qwen2_tok, pb_file, tmp_path):
    step_tag = ["--scorer", "step-tag", "--step-tag", TAG]
    with pytest.raises(UsageError, match=r"--good-token '\+ -' must be one token: it splits into 2, \['\+', ' -'\]"):
        evaluate(dirs["step-tag"], pb_file, tmp_path, *step_tag, "--good-token", "+ -")
    with pytest.raises(UsageError, match=r"--step-tag '<extra_0>' must be one token: .*'<', 'extra', '_', '0', '>'"):
        evaluate(dirs["step-tag"], pb_file, tmp_path, "--scorer", "step-tag", "--step-tag", "<extra_0>")
    with pytest.raises(UsageError, match="--scorer step-tag needs --step-tag"):
        evaluate(dirs["step-tag"], pb_file, tmp_path, "--scorer", "step-tag")
    with pytest.raises(UsageError, match="--step-tag: not read by --scorer chat-turns"):
        evaluate(dirs["chat-turns"], pb_file, tmp_path, "--scorer", "chat-turns", "--step-tag", TAG)
    from prm.scoring.scorers import family
    fam = family(qwen2_tok, "step-tag", step_tag="и")  # one token alone, but after a space it merges
    with pytest.raises(UsageError, match=r"--step-tag 'и' merges with the text around it.*' и' tokenizes as"):
        fam.tokenize_batch({"prompt": ["q"], "completions": [["a step"]], "labels": [[True]]}, qwen2_tok)


def test_token_pieces_in_messages_are_shown_as_text_not_byte_level_symbols(qwen2_tok):
    from prm.scoring.scorers import family
    with pytest.raises(UsageError, match=r"--step-tag 'шаг' must be one token: it splits into 2, \['ш', 'аг'\]$"):
        family(qwen2_tok, "step-tag", step_tag="шаг")  # Qwen2 spells its pieces 'ÑĪ', 'Ð°Ð³'
    fam = family(qwen2_tok, "step-tag", step_tag="и")
    with pytest.raises(UsageError, match=r"there ' и' tokenizes as \[' и'\]$"):
        fam.tokenize_batch({"prompt": ["q"], "completions": [["a step"]], "labels": [[True]]}, qwen2_tok)


def test_good_and_bad_tokens_must_be_two_different_tokens_of_the_vocabulary():
    from prm.readers.synthetic import char_tokenizer
    from prm.scoring.scorers import family
    tok = char_tokenizer()  # '#' and '@' are none of its characters: it reads each as its <unk>
    for flag, chosen in (("--good-token", {"good_token": "#"}), ("--bad-token", {"bad_token": "@"}),
                         ("--step-tag", {"step_tag": "#"})):
        with pytest.raises(UsageError, match=f"{flag} '.' is not in the model's vocabulary \\(read as "
                                             "'<unk>'\\)"):
            family(tok, "step-tag", **{"step_tag": "=", **chosen})
    with pytest.raises(UsageError, match=r"--good-token '\+' and --bad-token '\+' are one token: every step would "
                                         r"score 0.5"):
        family(tok, "step-tag", step_tag="=", bad_token="+")
    assert family(tok, "step-tag", step_tag="=").bad_id == tok.convert_tokens_to_ids("-")


def test_qwen_prm_on_another_model_says_it_is_no_qwen_prm_before_asking_to_run_its_code(model_dir):
    from prm.config import Config
    from prm.scoring import ScorerOptions
    from prm.scoring.scorers import load
    with pytest.raises(UsageError, match=r"--scorer qwen-prm: is --model a Qwen PRM\? Its step separator "
                                         r"'<extra_0>' must be one token: it splits into 9"):
        load(Config(model=model_dir), False, ScorerOptions(scorer="qwen-prm"))


def test_truncation_keeps_whole_steps_within_both_caps(qwen2_tok):
    import copy
    from prm.scoring.scorers import family
    tok = copy.deepcopy(qwen2_tok)
    tok.add_tokens([TAG])
    batch = {"prompt": ["What is 1+1?"], "completions": [["1+1=2", "so 2", "done"]], "labels": [[True, False, None]]}
    fam = family(tok, "step-tag", step_tag=TAG)
    full = fam.tokenize_batch(batch, tok)
    ends = full["step_ends"][0]
    assert [full["input_ids"][0][p] for p in ends] == [tok.convert_tokens_to_ids(TAG)] * 3
    assert [full["labels"][0][p] for p in ends] == [1, 0, -100] and full["n_labeled"] == [2]
    first = tok("What is 1+1? ", add_special_tokens=False)["input_ids"].__len__()  # the steps' first token
    for cap, kept in ((ends[1] - first, 1), (ends[1] - first + 1, 2)):  # tokens of steps, the tag included
        assert fam.tokenize_batch(batch, tok, max_completion_length=cap)["step_ends"] == [ends[:kept]]
    cut = fam.tokenize_batch(batch, tok, max_length=ends[1] + 1)
    assert cut["step_ends"] == [ends[:2]] and cut["input_ids"] == [full["input_ids"][0][:ends[1] + 1]]
    assert cut["steps_kept"] == [2] and cut["step_labels"] == [[1.0, 0.0, None]]


def test_a_template_that_drops_turns_cannot_hold_step_boundaries(dirs, qwen2_tok):
    import copy
    from prm.scoring.scorers import family
    tok = copy.deepcopy(qwen2_tok)
    tok.chat_template = "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}\n{% endif %}{% endfor %}"
    fam = family(tok, "chat-turns")
    with pytest.raises(UsageError, match="does not render turn 2 .* cannot hold a step boundary"):
        fam.tokenize_batch({"prompt": ["q"], "completions": [["a", "b"]], "labels": [[True, True]]}, tok)


def test_a_missing_flag_ends_eval_py_with_status_2(dirs, pb_file):
    proc = subprocess.run([sys.executable, "eval.py", "--model", dirs["step-tag"], "--dataset", pb_file,
                           "--scorer", "step-tag"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --scorer step-tag needs --step-tag")


def test_two_ddp_ranks_and_best_of_n_with_a_step_tag_model(dirs, pb_file, tmp_path):
    flags = ["--model", dirs["step-tag"], "--dataset", pb_file, "--dtype", "fp32", "--eval-batch-size", "2",
             "--scorer", "step-tag", "--step-tag", TAG, "--best-of-n"]
    expected = eval_cli.main(flags)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "eval.py"), *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == expected  # exact: the same batches
    assert expected["best_of_n"] and expected["outcome_auroc_min"] is not None


PROMPTS = [ROWS[0]["problem"], ROWS[1]["problem"]]
COMPLETIONS = ["\n".join(ROWS[0]["steps"][:2]), "\n".join(ROWS[1]["steps"][:3])]


def test_prm_reward_and_the_server_with_a_step_tag_model(dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("PRM_CPU_BF16", "0")  # an fp32 reference: auto is fp32 on any CPU
    reward = PRMReward(dirs["step-tag"], "min", "cpu", scorer="step-tag", step_tag=TAG)
    want = [min(math_shepherd(dirs["step-tag"], p, split_steps(c, "\n")))
            for p, c in zip(PROMPTS, COMPLETIONS)]
    assert reward(PROMPTS, COMPLETIONS) == pytest.approx(want, abs=1e-6)
    with pytest.raises(ValueError, match="reads a model directory"):
        PRMReward(reward.model, tokenizer=reward.tokenizer, scorer="step-tag")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    with open(tmp_path / "server.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "prm.serve", "--model", dirs["step-tag"], "--port", "0",
                                 "--device", "cpu", "--scorer", "step-tag", "--step-tag", TAG], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            line = proc.stdout.readline()
            assert "serving" in line, (tmp_path / "server.log").read_text()[-2000:]
            port = int(line.rsplit(":", 1)[1].split("/")[0])
            body = {"query": [p + c for p, c in zip(PROMPTS, COMPLETIONS)], "prompts": PROMPTS}
            req = urllib.request.Request(f"http://127.0.0.1:{port}/get_reward", data=json.dumps(body).encode())
            with urllib.request.urlopen(req, timeout=120) as r:
                assert json.loads(r.read())["rewards"] == pytest.approx(want, abs=1e-6)
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def test_the_server_reads_a_prompt_in_the_prms_own_template_as_its_question(dirs):
    from prm.serve import Scorer
    reward = PRMReward(dirs["step-tag"], "min", "cpu", scorer="step-tag", step_tag=TAG)
    scorer, tok = Scorer(reward), reward.tokenizer
    chat = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in PROMPTS]  # as OpenRLHF sends them: rendered by the policy's template, here the same one
    body = {"query": [p + c for p, c in zip(chat, COMPLETIONS)], "prompts": chat}
    assert scorer.split(body) == (PROMPTS, COMPLETIONS)
    assert scorer(body)["rewards"] == pytest.approx(reward(PROMPTS, COMPLETIONS), abs=1e-6)
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
             {"role": "user", "content": PROMPTS[0]}]
    several = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    for other in (several, "Q: " + chat[0], chat[0].rstrip("\n")):  # not one user turn in this template: as is
        assert scorer.question(other) == other
