"""The PRM as an RL reward: PRMReward equals score() plus the aggregation, reads the run's step separator, takes
conversational completions and empty ones; the OpenRLHF-protocol server in a subprocess. Depends on: pytest, torch,
prm."""
import json
import os
import subprocess
import sys
import urllib.request

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from prm.loading import load_tokenizer  # noqa: E402
from prm.config import Config  # noqa: E402
from prm.errors import UsageError  # noqa: E402
from prm.core.evaluate import score  # noqa: E402
from prm.core.metrics import AGGREGATES  # noqa: E402
from prm.core.model import PRM  # noqa: E402
from prm.scoring.reward import EMPTY_REWARD, PRMReward  # noqa: E402
from conftest import save_tiny  # noqa: E402

PROMPTS = ["count from 1:", "count from 7:", "count from 3:"]
COMPLETIONS = ["1+1=2\n2+1=3\n3+1=4\n", "7+1=8\n8+1=0", "3+1=5"]
STEPS = [["1+1=2", "2+1=3", "3+1=4"], ["7+1=8", "8+1=0"], ["3+1=5"]]


@pytest.fixture(autouse=True)
def fp32(monkeypatch):
    """The references here are fp32: --dtype auto too, whatever the CPU (--cpu-bf16)."""
    monkeypatch.setenv("PRM_CPU_BF16", "0")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(str(tmp_path_factory.mktemp("model")))


@pytest.fixture(scope="module")
def loaded(model_dir):
    return PRM.from_pretrained(model_dir).eval(), load_tokenizer(model_dir)


@pytest.mark.parametrize("aggregate", sorted(AGGREGATES))
def test_reward_is_score_plus_aggregation(model_dir, loaded, aggregate):
    reward = PRMReward(model_dir, aggregate=aggregate, device="cpu", batch_size=2)
    got = reward(PROMPTS, COMPLETIONS, answer=["4", "0", "4"])  # extra dataset columns come as kwargs
    model, tok = loaded
    expected = [AGGREGATES[aggregate](score(model, tok, p, s)) for p, s in zip(PROMPTS, STEPS)]
    assert all(isinstance(x, float) for x in got) and got == pytest.approx(expected, abs=1e-6)
    assert reward.__name__ == f"prm_{aggregate}"  # TRL logs each reward function under its __name__


def test_the_runs_own_step_separator_is_used(tmp_path, loaded):
    reward = PRMReward(save_tiny(str(tmp_path / "m"), separator=" ; "), device="cpu")
    assert reward.step_separator == " ; "
    model, tok = loaded  # the same seed-0 weights
    got = reward(["count from 1:"], ["1+1=2 ; 2+1=3 ; "])
    assert got == pytest.approx([min(score(model, tok, "count from 1:", ["1+1=2", "2+1=3"], " ; "))], abs=1e-6)


def test_step_scores_equal_eval_py_predictions_in_its_default_precision(model_dir, tmp_path,
                                                                         monkeypatch):
    """On a bf16-native CPU (simulated), eval.py's default is bf16 autocast: PRMReward's too."""
    import eval as eval_cli
    monkeypatch.setenv("PRM_CPU_BF16", "1")
    data, pred = tmp_path / "d.jsonl", tmp_path / "p.jsonl"
    rows = [{"prompt": p, "completions": s, "labels": [True] * len(s)}
            for p, s in zip(PROMPTS, STEPS)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    eval_cli.main(["--model", model_dir, "--dataset", str(data), "--predictions", str(pred)])
    want = [json.loads(line)["step_probs"] for line in pred.read_text().splitlines()]

    def probs(**kw):
        scores = PRMReward(model_dir, device="cpu", **kw).step_scores(PROMPTS, COMPLETIONS)
        return [[p for *_, p in steps] for steps in scores]
    assert probs() == want and probs(dtype="bf16") == want
    fp32 = probs(dtype="fp32")
    # the precision shows in these scores: the test above can fail
    assert max(abs(a - b) for x, y in zip(fp32, want) for a, b in zip(x, y)) > 1e-6


def test_conversational_prompts_and_completions(model_dir, loaded):
    reward = PRMReward(model_dir, device="cpu")
    chat_prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    chat_completions = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    # a tokenizer without a chat template reads the messages' text: the same as the plain prompts
    assert reward(chat_prompts, chat_completions) == pytest.approx(reward(PROMPTS, COMPLETIONS), abs=1e-6)
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    reward.tokenizer.chat_template = template
    model, tok = loaded
    tok.chat_template = template
    expected = [min(score(model, tok, p, s)) for p, s in zip(chat_prompts, STEPS)]  # rendered as in training
    assert reward(chat_prompts, chat_completions) == pytest.approx(expected, abs=1e-6)
    reward.tokenizer.chat_template = tok.chat_template = None


def test_empty_completions_get_a_defined_reward(model_dir):
    reward = PRMReward(model_dir, device="cpu")
    got = reward(["p:", "q:", PROMPTS[0], "r:"], ["", "\n\n", COMPLETIONS[0], [{"role": "assistant", "content": ""}]])
    assert got[0] == got[1] == got[3] == EMPTY_REWARD
    assert got[2] == pytest.approx(reward(PROMPTS[:1], COMPLETIONS[:1])[0], abs=1e-6)
    assert reward([], []) == []


def test_bad_arguments_are_refused(model_dir, loaded):
    with pytest.raises(ValueError, match="aggregate 'max'"):
        PRMReward(model_dir, aggregate="max")
    with pytest.raises(ValueError, match="needs its tokenizer"):
        PRMReward(loaded[0])
    with pytest.raises(ValueError, match="2 prompts for 1 completions"):
        PRMReward(model_dir)(PROMPTS[:2], COMPLETIONS[:1])


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")


@pytest.mark.parametrize("kwargs, message", [
    ({"batch_size": -1}, "batch_size -1: expected an int > 0"),
    ({"batch_size": 0}, "batch_size 0: expected an int > 0"),
    ({"step_separator": ""}, "step_separator '': expected a non-empty string"),
    pytest.param({"device": "cuda"}, r"device 'cuda': expected a device this torch has \(it has no "
                 r"CUDA\)", marks=NO_CUDA)])
def test_bad_settings_are_refused_by_name(model_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        PRMReward(model_dir, **kwargs)


@pytest.mark.parametrize("prompt, completion, message", [
    (None, "1+1=2", "completion 1: the prompt None: expected a string or a list of messages"),
    (5, "1+1=2", "completion 1: the prompt 5: expected"),
    ([{"role": "user"}], "1+1=2", r"completion 1: the prompt \[\{'role': 'user'\}\]: expected"),
    ("p:", None, "completion 1: the completion None: expected"),
    ("p:", {"content": "1"}, r"completion 1: the completion \{'content': '1'\}: expected")])
def test_unreadable_prompts_and_completions_are_named(model_dir, prompt, completion, message):
    with pytest.raises(ValueError, match=message):
        PRMReward(model_dir, device="cpu")([PROMPTS[0], prompt], [COMPLETIONS[0], completion])


def test_each_assistant_message_ends_a_step(model_dir):
    reward = PRMReward(model_dir, device="cpu")
    messages = [{"role": "assistant", "content": c} for c in ("3+1=4", "4+1=5")]
    (steps,) = reward.step_scores(["count from 3:"], [messages])
    text = reward.text(messages)
    assert [text[a:b] for a, b, _ in steps] == ["3+1=4", "4+1=5"]  # not one step "3+1=44+1=5"
    assert reward(["count from 3:"], [messages]) == reward(["count from 3:"], ["3+1=4\n4+1=5"])


def test_a_chat_template_failing_on_one_prompt_names_its_completion(model_dir):
    reward = PRMReward(model_dir, device="cpu")
    reward.tokenizer.chat_template = ("{% for m in messages %}{% if m['content'] == 'bad' %}"
                                      "{{ raise_exception('no bad prompts') }}{% endif %}{{ m['content'] }}{% endfor %}")
    prompts = [[{"role": "user", "content": c}] for c in ("count from 1:", "bad")]
    with pytest.raises(UsageError, match="completion 1: the chat template fails on its prompt: "
                                         "TemplateError: no bad prompts"):
        reward(prompts, COMPLETIONS[:2])


def test_a_reward_call_renders_each_chat_prompt_once(model_dir):
    reward = PRMReward(model_dir, device="cpu")
    reward.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    render, calls = reward.tokenizer.apply_chat_template, []
    reward.tokenizer.apply_chat_template = lambda *a, **k: calls.append(1) or render(*a, **k)
    prompts = [[{"role": "user", "content": c}] for c in ("count from 1:", "count from 2:")]
    assert len(reward(prompts, COMPLETIONS[:2])) == 2 and len(calls) == 2  # tokenizing only: no probe first


@pytest.mark.parametrize("where", ["config.train.json", "config.json"])
def test_a_model_saved_with_max_length_1_warns_that_no_step_is_scored(tmp_path, where):
    path = save_tiny(str(tmp_path / "m"))
    if where == "config.train.json":  # as train.py --max-length 1 leaves it: BOS alone fills it
        Config(max_length=1).save(path)
    else:  # an export without the run's config: config.json's "prm" says how training read the input
        config = json.loads((tmp_path / "m" / "config.json").read_text())
        config["prm"] = {"step_separator": "\n", "max_length": 1, "max_completion_length": 0}
        (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    reward = PRMReward(path, device="cpu")
    with pytest.warns(UserWarning, match=r"0 of 3 completions truncated, 3 with no step that fits "
                                         r"\(reward 0.0\): raise max_length \(1\)"):
        assert reward(PROMPTS, COMPLETIONS) == [EMPTY_REWARD] * 3


def post(port, body: bytes):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/get_reward", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:  # an error status raises, with the server's message
        return r.status, json.loads(r.read())


def test_server_answers_the_openrlhf_protocol(model_dir, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    with open(tmp_path / "server.log", "w") as log:  # request log lines go to a file, never a full pipe
        proc = subprocess.Popen([sys.executable, "-m", "prm.serve", "--model", model_dir, "--port", "0",
                                 "--device", "cpu"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            line = proc.stdout.readline()  # the first line says where it listens (--port 0: a free port)
            assert "serving" in line, (line, (tmp_path / "server.log").read_text()[-2000:])
            port = int(line.rsplit(":", 1)[1].split("/")[0])
            body = {"query": [p + c for p, c in zip(PROMPTS, COMPLETIONS)], "prompts": PROMPTS, "labels": ["4"] * 3}
            status, out = post(port, json.dumps(body).encode())
            assert status == 200 and out["rewards"] == out["scores"]
            assert out["rewards"] == pytest.approx(PRMReward(model_dir, device="cpu")(PROMPTS, COMPLETIONS), abs=1e-6)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=60) as r:
                assert json.loads(r.read())["model"] == model_dir  # bad clients and requests: tests/test_serve.py
        finally:
            proc.terminate()
            proc.wait(timeout=30)
