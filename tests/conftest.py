"""Shared test helpers: offline tokenizers and a small in-process training run."""
import collections
import hashlib
import json
import os
import random
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(ROOT), "shared")
sys.path.insert(0, ROOT)


def pytest_addoption(parser):
    parser.addoption("--cpu-bf16", choices=["probe", "yes", "no"], default="probe",
                     help="what prm.core.runtime.cpu_has_bf16 answers (so --dtype auto), here and in the runs the tests "
                          "launch: run the suite as a bf16-native CPU (yes) or an AVX2-only one (no) sees it")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA (skipped without it); run by python -m prm.bench --gpu-check")
    answer = config.getoption("--cpu-bf16")
    if answer != "probe":  # an environment variable, so that train.py / eval.py subprocesses see it too
        os.environ["PRM_CPU_BF16"] = "1" if answer == "yes" else "0"


@pytest.fixture(scope="session")
def char_tok():
    from prm.readers.synthetic import char_tokenizer
    return char_tokenizer()


@pytest.fixture(scope="session")
def char_tok_no_bos():
    from prm.readers.synthetic import char_tokenizer
    tok = char_tokenizer()
    tok.bos_token = None
    return tok


@pytest.fixture(scope="session")
def qwen2_tok():
    path = os.path.join(SHARED, "tokenizers", "qwen2")
    if not os.path.isdir(path):
        pytest.skip("../shared/tokenizers/qwen2 is absent")
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def small_config(tmp_path, **overrides):
    from prm.config import Config
    # 63 synthetic rows: 58 train (not a multiple of the batch) + 5 held out (25 steps)
    base = dict(output_dir=str(tmp_path), synthetic_size=63, max_steps=4, batch_size=4, log_every=1, dtype="fp32",
                eval_batch_size=16, lr=1e-3)
    return Config(**{**base, **overrides})


def training():
    """train.py, the training program (a script beside the package; ROOT is on sys.path): the one
    place tests import it. Tests patch its seams there: train_step, evaluate, BatchPlan."""
    import train as program
    return program


def train(cfg):
    """The training loop in-process on a Config: the one place tests start training from."""
    return training().train(cfg)


def run_train(tmp_path, **overrides):
    return train(small_config(tmp_path, **overrides))


def read_metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def step_accuracy_by_hand(model: str, predictions: str) -> float:
    """eval.py's per-step probabilities of `model` (the run's held-out set and dtype), scored here:
    the share of labeled steps whose P(correct) sits on their label's side of 0.5."""
    import eval as eval_cli
    eval_cli.main(["--model", str(model), "--predictions", str(predictions)])
    with open(predictions) as f:
        rows = [json.loads(line) for line in f]
    pairs = [(p, y) for r in rows for p, y in zip(r["step_probs"], r["labels"]) if y is not None]
    return sum((p >= 0.5) == (y >= 0.5) for p, y in pairs) / len(pairs)


def final_weights(out_dir):
    from safetensors.torch import load_file
    return load_file(os.path.join(out_dir, "final", "model.safetensors"))


def max_weight_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def losses(out_dir) -> list:
    return [r["loss"] for r in read_metrics(out_dir) if "loss" in r]


# How far apart two runs of one computation may end when only the summation order differs (2 ranks against 1:
# gloo's all-reduce against one process's sum; packed against padded reductions; another CPU's kernels).
# AdamW moves a weight by about lr per step (the gradient over its running RMS), so lr x steps bounds any movement,
# and a weight whose gradient is ~0 may move that far either way on rounding noise alone: no bound on the largest
# difference holds on every CPU (fp32 at lr 1e-3: 1.0e-5 here, 2.4e-5 on an AVX512-BF16 CPU). So we bound the SHARE
# of weights whose two copies differ by more than `moved` x lr x steps, and the relative loss difference:
# - fp32: gradients agree to ~1e-6 relative, so nearly every weight agrees to ~1e-6 of its movement; 1e-4 of them may
#   differ by over 1% (measured: none of 0.75M). Losses are fp32 sums: a few ulps apart (<= 7e-7 measured), bound 1e-5.
# - bf16 autocast rounds every matmul output to 8 bits (u = 2^-8): gradients agree to ~1e-2 only; 1% of the weights
#   may differ by over 10% (measured: 0.17% packed against padded, 0.007% 2 ranks against 1), losses by 2u (<= 1.3e-3).
# Breaking what these tests guard lands far outside (fp32, 5 steps at lr 1e-3): each rank or
# micro-batch dividing by its own label count moves 43-54% of the weights by over 1% (losses
# 0.9-1.7e-2 apart) where batches are not grouped by length (grouped, each holds as many labels and
# the bug is invisible: 1e-7); packed examples that see each other, 86% (6e-2).
SAME_RUN = {"fp32": dict(moved=1e-2, share=1e-4, loss_rtol=1e-5), "bf16": dict(moved=0.1, share=1e-2, loss_rtol=2 ** -7)}


def weight_share_apart(wa: dict, wb: dict, *, lr: float, steps: int, precision: str = "fp32") -> float:
    """The share of weights (two state dicts) apart by more than SAME_RUN's `moved` x lr x steps."""
    assert wa.keys() == wb.keys()
    limit = SAME_RUN[precision]["moved"] * lr * steps
    over = sum(int(((wa[k].float() - wb[k].float()).abs() > limit).sum()) for k in wa)
    return over / sum(v.numel() for v in wa.values())


def assert_same_weights(wa: dict, wb: dict, *, lr: float, steps: int, precision: str = "fp32"):
    share = weight_share_apart(wa, wb, lr=lr, steps=steps, precision=precision)
    print(f"{precision}: weights apart by over {SAME_RUN[precision]['moved']} x lr x steps: {share:.2e} of them")
    assert share <= SAME_RUN[precision]["share"]


def assert_same_run(a, b, *, lr: float, steps: int, precision: str = "fp32"):
    """Runs a and b (output directories) logged the same losses and ended with the same weights, within SAME_RUN."""
    la, lb = losses(a), losses(b)
    assert len(la) == len(lb) == steps
    worst = max(abs(x - y) / abs(x) for x, y in zip(la, lb))
    print(f"{precision}: max relative loss difference {worst:.2e}")
    assert worst <= SAME_RUN[precision]["loss_rtol"]
    assert_same_weights(final_weights(a), final_weights(b), lr=lr, steps=steps, precision=precision)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A saved tiny PRM (random weights, seed 0) with its character tokenizer: what eval.py reads."""
    return save_tiny(str(tmp_path_factory.mktemp("model")))


# Helpers that more than one test module uses: test modules import from here, not from each
# other.
def save_tiny(path, separator=None):
    """A tiny random PRM (seed 0) and its character tokenizer, saved at path; separator: the run's
    --step-separator, saved beside the weights as train.py leaves it."""
    from prm.config import Config
    from prm.loading import build_model
    from prm.readers.synthetic import char_tokenizer
    tokenizer = char_tokenizer()
    build_model("tiny", tokenizer, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    if separator is not None:
        Config(step_separator=separator).save(path)
    return path


# prm.label's problems: 8 rows, every third with completions of its own
LABEL_ROWS = [{"prompt": f"problem {i}\n", "answer": 1, "id": f"p{i}"} if i % 3 else
              {"prompt": f"problem {i}\n", "answer": "1", "completions": ["a", "b", "\\boxed{1}"]}
              for i in range(8)]


def scripted(wins_of, wrong="so \\boxed{0}"):
    """complete() whose every prompt gets wins_of(prompt, n) continuations answering 1 and n - that
    `wrong` ones; `log` keeps the prompts."""
    log = []

    def complete(prompts, n, seed):
        log.extend(prompts)
        wins = [wins_of(p, n) for p in prompts]
        return [["so \\boxed{1}"] * w + [wrong] * (n - w) for w in wins]
    return complete, log


def random_policy(prompts, n, seed):
    """A seeded stand-in for a policy: solutions of 1-4 lines, rollouts right or wrong by the
    seed."""
    import random
    out = []
    for p in prompts:
        rng = random.Random(f"{seed}/{p}")
        out.append([f"step {rng.random():.3f}\n" * rng.randint(0, 3)
                    + f"\\boxed{{{rng.randint(1, 2)}}}" for _ in range(n)])
    return out


def write_rows(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def read_text(path):
    with open(path) as f:
        return f.read()


# packing's rows, of mixed lengths: a 1-token step, a row that is only the prompt plus one step,
# hard and soft labels
PACKING_ROWS = {"prompt": ["Q: 2+2?", "x", "A long question about numbers and their sums?", "Why?"],
                "completions": [["4", "so the answer is 4", "!"], ["y"],
                                ["a", "bb", "ccc", "dddd", "e"], ["because"]],
                "labels": [[1.0, 0.0, 1.0], [1.0], [0.9, 0.25, 0.0, 1.0, 0.5], [0.0]]}


def packing_rows(tokenizer):
    """PACKING_ROWS tokenized: the collator's input rows."""
    from prm.core.data import tokenize_batch
    batch = tokenize_batch(PACKING_ROWS, tokenizer, "\n", max_length=None,
                           max_completion_length=None, train_on_last_step_only=False, is_eval=False)
    return [{"input_ids": i, "labels": y} for i, y in zip(batch["input_ids"], batch["labels"])]


def reference_kernel(signature: str, calls: list):
    """A stand-in for torch.nn.attention.varlen.varlen_attn with the installed-version signature
    named: it checks the arguments the CUDA branch passes and runs per-example causal SDPA."""
    import torch
    import torch.nn.functional as F

    def check_and_run(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, gqa):
        assert q.dim() == 3 and q.dtype == k.dtype == v.dtype
        assert cu_q.dtype == torch.int32 and cu_q is cu_k
        bounds = cu_q.tolist()
        longest = max(e - s for s, e in zip(bounds, bounds[1:]))
        assert isinstance(max_q, int) and max_q == max_k >= longest
        assert causal and (gqa or k.shape[1] == q.shape[1])
        calls.append({"dtype": q.dtype, "heads": (q.shape[1], k.shape[1]), "gqa": gqa})
        out = torch.empty_like(q)  # (N, H, D)
        for s, e in zip(bounds, bounds[1:]):
            out[s:e] = F.scaled_dot_product_attention(
                q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1),
                is_causal=True, scale=scale, enable_gqa=gqa).transpose(0, 1)
        return out

    if signature == "2.10":  # is_causal, no grouped-query support
        def kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False,
                   return_aux=None, scale=None):
            return check_and_run(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale,
                                 is_causal, False)
    else:  # 2.13: a (left, right) window, (-1, 0) is causal; enable_gqa
        def kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                   scale=None, window_size=(-1, -1), enable_gqa=False, seqused_k=None,
                   block_table=None, num_splits=None):
            return check_and_run(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale,
                                 tuple(window_size) == (-1, 0), enable_gqa)
    return kernel


# train.py's flags in the torchrun tests: 72 rows, 65 train (+7 held out, an odd eval set); with
# the flags the tests add, 65 is not a multiple of every batch
LAUNCH_FLAGS = ["--synthetic-size", "72", "--max-steps", "5", "--log-every", "1", "--dtype", "fp32",
                "--lr", "1e-3", "--eval-batch-size", "4", "--seed", "7"]


def launch(out, nproc, *flags, script="train.py"):
    """train.py (or script) with LAUNCH_FLAGS and flags: nproc ranks through torchrun, or one
    plain process; the final metrics it prints."""
    import subprocess
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={nproc}"]
    cmd = ((launcher if nproc > 1 else [sys.executable])
           + [script, *LAUNCH_FLAGS, "--output-dir", str(out), *flags])
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# step rewards' texts: unicode (a character over two byte tokens, an emoji), CRLF, a separator at
# the start and the end, steps ending inside a token (".\n" is one token of Qwen2's and of
# built_tokenizer's), and a row max_length cuts
REWARD_PROMPTS = ["Q: count on.", "Q: sums?", "Q: say é", "Q: a long one"]
REWARD_TEXTS = ["\nx=1.\ny=é\r\nwé\n", "1+1=2.\n  2+1=3 \n\n∑ = 5 🙂", "é\r\nñ.\nend\n",
                "\n".join(f"{k}+1={k + 1}." for k in range(12))]


def built_tokenizer():
    """A byte-level BPE built here: every byte a token, plus merges that put ".\\n" and CRLF in one
    token; a character of two UTF-8 bytes stays two tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    merges = [(".", "Ċ"), ("č", "Ċ")]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet()) + [a + b for a, b in merges]
    vocab = {t: i for i, t in enumerate(alphabet)}
    tok = Tokenizer(models.BPE({**vocab, "<eos>": len(vocab)}, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")


def policy_ids(policy, texts):
    """The policy's response tokens as an RL trainer holds them: the text's tokens, then EOS."""
    return [policy(t, add_special_tokens=False)["input_ids"] + [policy.eos_token_id] for t in texts]


# prm.search: a scripted policy and PRM (test_search, test_hostile_search)
SEP = "\n"


def proposal(prefix: str, j: int, stop, seed=0) -> str:
    """The scripted policy's j-th text from `prefix`: a step, a final answer, an empty step or a cut
    one; each names its problem (p<index>)."""
    rng = random.Random(f"{prefix}|{j}|{seed}")
    r, a, p = rng.random(), rng.randrange(3), "p" + prefix.split()[1][:-1]
    if stop is None:  # a whole solution
        return f"s{a}{j}{p}{SEP}{p}: the answer is {a}"
    if r < 0.08:
        return rng.choice(["", SEP, " " + SEP])
    if r < 0.13:
        return f"cut{a}{p}"  # usage marks it cut by max_new_tokens
    if r < 0.35 or prefix.count(SEP) > 6:
        return f"{p}: so the answer is {a}"
    return f"s{a}{j}{p}{SEP}"


def scripted_policy(log=None, seeded=False, stop_after=None):
    """propose() of proposal(): the k-th copy of a prefix in a call gets texts k*n .. k*n + n - 1;
    `log` keeps each call's prefixes; the call after `stop_after` calls raises KeyboardInterrupt."""
    calls = []

    def propose(prefixes, n, seeds, stop):
        if stop_after is not None and len(calls) >= stop_after:
            raise KeyboardInterrupt
        calls.append(list(prefixes))
        if log is not None:
            log.append(list(prefixes))
        seen = collections.Counter()
        outs = []
        for p, seed in zip(prefixes, seeds):
            seen[p] += 1
            outs.append([proposal(p, (seen[p] - 1) * n + j, stop, seed * seeded) for j in range(n)])
        propose.usage = [[(len(t), t.startswith("cut")) for t in ts] for ts in outs]
        return outs
    return propose


def step_score(question: str, steps: list) -> float:
    return int(hashlib.sha256(repr((question, steps)).encode()).hexdigest()[:8], 16) / 16 ** 8


def scripted_score(questions, outputs):
    """P per step: a hash of the question and the steps up to it."""
    steps = [[[s for s in text.split(SEP) if s.strip()] for text in texts] for texts in outputs]
    return [[[step_score(q, s[:k + 1]) for k in range(len(s))] for s in ss]
            for q, ss in zip(questions, steps)]


def write_problems(path, n=5, **extra):
    rows = [{"id": f"p{i}", "prompt": f"problem {i}:", "answer": str(i % 3), **extra}
            for i in range(n)]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)
