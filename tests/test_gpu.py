"""The CUDA fast path: varlen flash attention in bf16 against padded SDPA, --compile --pack-to compiling
once, no host sync in a training step, eval.py / PRMReward on CUDA against the CPU's fp32, 2 GPUs (DDP, FSDP2 over
NCCL) against 1. The [cuda] cases skip without CUDA (pytest -rs shows why); the [cpu] cases run the same bodies on
the CPU with prm.core.varlen's CUDA branch pointed at test_packing's reference kernel, so what the GPU runs is tested
here first. `python -m prm.bench --gpu-check` runs the [cuda] cases on a GPU machine."""
import copy
import functools
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, SAME_RUN, assert_same_run, small_config, training

# the gpu marker (conftest) selects what --gpu-check runs: pytest -m gpu
needs_cuda = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
needs_2_gpus = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", marks=needs_cuda, id="cuda")]


def marked(marks: list):
    """A decorator applying every mark of the list."""
    return lambda f: functools.reduce(lambda g, m: m(g), marks, f)
U = 2 ** -8  # bf16 keeps 8 significant bits: each rounding is off by at most u = 2^-8 relative
LAYERS = 3
# Packed and padded differ only in the attention kernel (varlen flash or the reference kernel against masked SDPA),
# each of whose outputs rounds to bf16 on its own: within u of each other per layer. The residual stream carries
# each layer's difference on without shrinking it, and the head's bf16 matmul rounds once more: logits within
# (LAYERS + 1) u relative (L2 over the real tokens), doubled for the two sides: 8u = 3.1%. The backward pass rounds
# through every layer again: gradients within twice that, 16u. Examples that see each other in the packed row move
# the logits by far more (CPU, measured below in test_packed_bf16_equals_padded's comment).
LOGIT_RTOL, GRAD_RTOL = 2 * (LAYERS + 1) * U, 4 * (LAYERS + 1) * U


def kernel_on(device: str, monkeypatch, calls: list):
    """prm.core.varlen's kernel, counted: the real varlen_attn on CUDA; on the CPU the reference kernel, opaque to
    torch.compile (as the real kernel, a custom op, is) and with prm.core.varlen's CUDA branch pointed at the CPU."""
    from prm.core import varlen
    from conftest import reference_kernel
    if device == "cpu":
        monkeypatch.setattr(varlen, "KERNEL_DEVICE", "cpu")
        kernel = torch._dynamo.disable(reference_kernel("2.13", []))
    else:
        assert varlen.varlen_attn is not None, f"torch {torch.__version__} has no varlen_attn (needs >= 2.10)"
        kernel = varlen.varlen_attn

    @functools.wraps(kernel)  # inspect.signature follows __wrapped__: kernel_options sees the kernel's own
    def counted(*args, **kwargs):
        calls.append(args[0].dtype)
        return kernel(*args, **kwargs)
    monkeypatch.setattr(varlen, "varlen_attn", torch._dynamo.disable(counted) if device == "cpu" else counted)


def prm_pair(arch: str, vocab: int, device: str):
    """(padded, packed) PRMs with the same random weights: a Qwen2- or Llama-shaped backbone with grouped-query heads
    (4 query, 2 K/V), head_dim 64."""
    from transformers import AutoModel, LlamaConfig, Qwen2Config
    from prm.core.model import PRM, new_head
    from prm.core.varlen import use_packed_attention
    cfg = {"qwen2": Qwen2Config, "llama": LlamaConfig}[arch](
        vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, attention_dropout=0.0)
    torch.manual_seed(0)
    padded = PRM(AutoModel.from_config(cfg, attn_implementation="sdpa"), new_head(cfg)).to(device)
    packed = copy.deepcopy(padded)
    use_packed_attention(packed.backbone)
    return padded, packed


def rel(a, b) -> float:
    """||a - b|| / ||b||, in fp32."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# Measured on the CPU (reference kernel against masked SDPA, bf16 autocast; qwen2 / llama): logits 6.1e-3 / 5.9e-3
# apart, losses 1.9e-4 / 2.6e-4, gradients 9.2e-3 / 9.0e-3; one segment for the whole row (examples seeing each
# other): logits 0.59 / 0.77, losses 1.1e-2 / 2.6e-2, gradients 0.69 / 0.82.
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("device", DEVICES)
def test_packed_bf16_equals_padded(char_tok, monkeypatch, arch, device):
    from prm.core.data import collate, pack
    from prm.core.model import step_loss
    from conftest import packing_rows as rows
    calls = []
    kernel_on(device, monkeypatch, calls)
    rs = rows(char_tok)
    padded, packed = prm_pair(arch, len(char_tok), device)
    c, p = collate(rs, 0), pack(rs, 0)
    n_labels = int((c["labels"] != -100).sum())
    out = {}
    for name, model, inputs, labels in (("padded", padded, {k: c[k] for k in ("input_ids", "attention_mask")},
                                         c["labels"]), ("packed", packed, p, p["labels"])):
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = model(**{k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()
                              if k != "labels"})  # (B, T, 2); packed: (1, N, 2)
        loss, _, _ = step_loss(logits, labels.to(device), n_labels)
        loss.backward()
        grads = torch.cat([q.grad.flatten() for q in model.parameters()])  # (n_params,)
        out[name] = logits.float(), loss.item(), grads
    assert calls and set(calls) == {torch.bfloat16}  # the kernel ran, in bf16 (not the exact fallback)
    cu = p["cu_seq_lens_q"].tolist()
    ref = torch.cat([out["padded"][0][i, :cu[i + 1] - cu[i]] for i in range(len(rs))])  # (N, 2)
    logit_gap, grad_gap = rel(out["packed"][0][0, :cu[-1]], ref), rel(out["packed"][2], out["padded"][2])
    loss_gap = abs(out["packed"][1] - out["padded"][1]) / out["padded"][1]
    print(f"{arch} on {device}: logits {logit_gap:.2e}, loss {loss_gap:.2e}, gradients {grad_gap:.2e} apart")
    assert logit_gap <= LOGIT_RTOL and grad_gap <= GRAD_RTOL
    assert loss_gap <= SAME_RUN["bf16"]["loss_rtol"]


def trainer_on(tmp_path, device: str, **overrides):
    """A Run of train.py on the tiny preset (bf16, packed) on the device, in train mode, and its first epoch's batches."""
    from prm.core.runtime import Runtime
    train = training()
    cfg = small_config(tmp_path, dtype="bf16", max_length=64, synthetic_size=64, **overrides).resolve()
    rt = Runtime(device=torch.device(device))
    run, _ = train.build(cfg, rt, train.Checkpointer(cfg, rt))
    run.net.train()
    run.plan.batch(0)  # draws epoch 0's global batches
    return run, run.plan.batches


@pytest.mark.parametrize("device", DEVICES)
def test_compile_with_pack_to_compiles_once(tmp_path, monkeypatch, device):
    """--compile --pack-to 256 (4 rows of <= 64 tokens: one bucket): the first step compiles, the next ones reuse its
    graphs. The CPU runs dynamo's guards with the aot_eager backend (inductor's C++ build takes minutes here); the
    CPU's own exact fallback would fail this test: its .tolist() of the boundaries recompiles at every step."""
    from torch._dynamo.utils import counters
    kernel_on(device, monkeypatch, [])
    if device == "cpu":
        monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    torch._dynamo.reset()
    counters.clear()
    run, plan = trainer_on(tmp_path, device, compile=True, pack_to=256, batch_size=4)
    training().train_step(run, plan[0])
    graphs = counters["stats"]["unique_graphs"]
    for batch in plan[1:5]:
        training().train_step(run, batch)
    print(f"{device}: {graphs} graphs after the first step, {counters['stats']['unique_graphs']} after 5")
    assert graphs > 0 and counters["stats"]["unique_graphs"] == graphs and not counters["recompiles"]


@marked(needs_cuda)
@pytest.mark.parametrize("compiled", [False, True])
def test_no_host_sync_in_a_training_step(tmp_path, compiled):
    """After a warm-up step, one train_step (packed, bf16) makes no host sync: prm.bench's sync counting
    (torch's sync debug mode, "warn"), every sync named by where it happened."""
    from prm.bench import counting_syncs
    run, plan = trainer_on(tmp_path, "cuda", compile=compiled, pack_to=256 if compiled else 0, batch_size=4)
    training().train_step(run, plan[0])  # lazy initializations (cuBLAS handles, the kernel's options, compilation) sync once
    seen = {}
    with counting_syncs(torch.device("cuda"), seen):
        training().train_step(run, plan[1])
    syncs = [f"{w.filename}:{w.lineno}: {w.message}" for w in seen["warnings"] if "synchroniz" in str(w.message)]
    assert syncs == []


def eval_probs(tmp_path, model_dir: str, precision: str, device: str) -> list:
    """eval.py's per-step P(correct) on test_packing's ROWS, on the device ("cpu" hides CUDA from it)."""
    from conftest import PACKING_ROWS as ROWS
    data, out = tmp_path / "rows.jsonl", tmp_path / f"{precision}-{device}.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "completions": c, "labels": [y >= 0.5 for y in ls]}) + "\n"
                            for p, c, ls in zip(ROWS["prompt"], ROWS["completions"], ROWS["labels"])))
    env = {**os.environ, "PYTHONPATH": ROOT, **({"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {})}
    ev = subprocess.run([sys.executable, "eval.py", "--model", model_dir, "--dataset", str(data), "--predictions",
                         str(out), "--dtype", precision], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=300)
    assert ev.returncode == 0, ev.stderr[-3000:]
    return [p for line in out.read_text().splitlines() for p in json.loads(line)["step_probs"]]


# P = sigmoid(logit gap) moves by at most a quarter of the gap's change; bf16 autocast rounds every matmul output to
# u relative, and the tiny model's gaps stay under 1, so P moves by about u (test_packing measured 4.9e-4 for two
# bf16 layouts). Here one side is fp32 and the kernels differ (varlen flash on CUDA): bound 2u.
@pytest.mark.parametrize("device", DEVICES)
def test_eval_bf16_matches_cpu_fp32(tmp_path, model_dir, device):
    ref, got = eval_probs(tmp_path, model_dir, "fp32", "cpu"), eval_probs(tmp_path, model_dir, "bf16", device)
    assert len(ref) == len(got) == 10
    worst = max(abs(a - b) for a, b in zip(ref, got))
    print(f"eval.py bf16 on {device} against fp32 on cpu: P(correct) at most {worst:.2e} apart")
    assert worst <= 2 * U


@marked(needs_cuda)
def test_reward_on_cuda_matches_cpu(model_dir):
    """PRMReward with dtype fp32 (no autocast) on both: within test_packing's fp32 bound (1e-5)."""
    from prm.scoring.reward import PRMReward
    prompts, completions = ["count from 3:", "count from 7:"], ["3+1=4\n4+1=5\n5+1=7", "7+1=8"]
    cpu = PRMReward(model_dir, device="cpu", aggregate="mean", dtype="fp32")(prompts, completions)
    cuda = PRMReward(model_dir, device="cuda", aggregate="mean", dtype="fp32")(prompts, completions)
    assert max(abs(a - b) for a, b in zip(cpu, cuda)) <= 1e-5


@marked(needs_2_gpus)
@pytest.mark.parametrize("fsdp", [False, True])
def test_two_gpus_match_one(tmp_path, fsdp):
    """torchrun over NCCL, fp32 (conftest's LAUNCH_FLAGS): 2 ranks x batch 3 equal 1 process x
    batch 6."""
    from conftest import launch
    launch(tmp_path / "one", 1, "--batch-size", "6")
    launch(tmp_path / "two", 2, "--batch-size", "3", *(["--fsdp"] if fsdp else []))
    assert_same_run(tmp_path / "one", tmp_path / "two", lr=1e-3, steps=5, precision="fp32")
