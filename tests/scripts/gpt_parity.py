"""Makes tests/fixtures/gpt-parity: a tiny GPT (examples/gpt/model.py) exported
for training by each of PyTorch's exporters, a token file, Rookery job files,
and the per-step losses PyTorch itself records when it trains each export on
the same windows. tests/tests/gpt_parity.rs trains every job with
`rookery train` (3 stages, 4 micro-batches) and compares.

The runs cover both exporters, both logit layouts ([N, T, V] trained with
`class_axis = -1` as `logits.view(-1, V)`, and torch's [N, V, T]), both
attention forms (hand-written with an additive causal mask, and
nn.MultiheadAttention), and a cosine schedule with warm-up plus gradient
clipping (transformers' get_cosine_with_min_lr_schedule_with_warmup through
LambdaLR, and clip_grad_norm_), tuned so that clipping does act.

Run: /root/.cache/rookery/torch-venv/bin/python tests/scripts/gpt_parity.py
(the venv: python3 -m venv ...; pip install torch==2.13.0 onnx onnxscript numpy)
"""
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "examples", "gpt"))
from model import GPT, GPTConfig  # noqa: E402
from export import export  # noqa: E402

OUT = os.path.join(ROOT, "tests", "fixtures", "gpt-parity")
VOCAB, CONTEXT, LAYERS, D_MODEL, HEADS = 64, 16, 2, 32, 2
BATCH, MICRO, STEPS = 8, 4, 40
TOKENS = STEPS * BATCH * CONTEXT + 1

# name: (exporter, layout, mha, schedule, optimizer)
RUNS = {
    "dynamo-ntv": ("dynamo", "ntv", False, None, "adam"),
    "legacy-nvt": ("legacy", "nvt", False, None, "adam"),
    # SGD for nn.MultiheadAttention: its key bias has a gradient that is zero
    # in exact arithmetic, so every implementation (PyTorch's fused and math
    # attention kernels included) is left with its own rounding noise there,
    # and Adam, dividing by that noise's own size, makes it a full-size update
    # that then moves other rounding: PyTorch against itself drifts to 3e-5 by
    # step 38, Rookery to 2.6e-4. SGD steps with the noise's size.
    "dynamo-nvt-mha": ("dynamo", "nvt", True, None, "sgd"),
    "legacy-ntv-mha": ("legacy", "ntv", True, None, "sgd"),
    "dynamo-ntv-cosine-clip": ("dynamo", "ntv", False, "cosine-clip", "adam"),
}
SGD_LR, SGD_MOMENTUM = 0.3, 0.9
LR = 1e-2
COSINE = {"warmup_steps": 5, "min_lr": 3e-4}
CLIP = 1.2


def tokens():
    """A learnable stream: a noisy Markov chain over the vocabulary."""
    rng = np.random.default_rng(7)
    table = rng.integers(0, VOCAB, size=VOCAB)
    out = [1, 2]
    for _ in range(TOKENS - 2):
        nxt = table[out[-1]] if rng.random() < 0.8 else rng.integers(0, VOCAB)
        out.append(int(nxt))
    return np.array(out, dtype=np.uint16)


def cosine_lambda(step):
    """transformers.get_cosine_with_min_lr_schedule_with_warmup's lr_lambda."""
    warmup, total = COSINE["warmup_steps"], STEPS
    if step < warmup:
        return float(step) / float(max(1, warmup))
    progress = float(step - warmup) / float(max(1, total - warmup))
    factor = 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress))
    rate = COSINE["min_lr"] / LR
    return factor * (1 - rate) + rate


def train(model, stream, layout, schedule, optimizer):
    # nn.MultiheadAttention runs scaled_dot_product_attention, whose fused CPU
    # kernel rounds differently from the math the exporters write out; Adam at
    # this lr amplifies that to 3e-4 by step 38. The math backend is what the
    # export holds, so PyTorch's losses below are those of the exported model.
    with sdpa_kernel(SDPBackend.MATH):
        return train_steps(model, stream, layout, schedule, optimizer)


def train_steps(model, stream, layout, schedule, optimizer):
    model.train()
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=SGD_LR, momentum=SGD_MOMENTUM)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_lambda) if schedule else None
    data = torch.from_numpy(stream.astype(np.int64))
    losses, clipped, norms = [], 0, []
    for step in range(STEPS):
        windows = [data[(step * BATCH + i) * CONTEXT:(step * BATCH + i) * CONTEXT + CONTEXT + 1] for i in range(BATCH)]
        batch = torch.stack(windows)
        x, y = batch[:, :-1], batch[:, 1:]
        opt.zero_grad()
        logits = model(x)
        if layout == "ntv":
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        else:
            loss = F.cross_entropy(logits, y)
        loss.backward()
        if schedule:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            clipped += int(norm.item() > CLIP)
            norms.append(round(norm.item(), 3))
        opt.step()
        if sched:
            sched.step()
        losses.append(loss.item())
    if schedule:
        print('grad norms', norms)
    return losses, clipped


def job_text(onnx, layout, schedule, optimizer):
    loss = '{ name = "cross_entropy", class_axis = -1 }' if layout == "ntv" else '"cross_entropy"'
    opt = (
        f'{{ name = "sgd", lr = {SGD_LR}, momentum = {SGD_MOMENTUM} }}'
        if optimizer == "sgd"
        else f'{{ name = "adam", lr = {LR} }}'
    )
    text = (
        "# Generated by tests/scripts/gpt_parity.py: PyTorch's own training of\n"
        "# this export on these windows is in expected.json.\n"
        f"[model]\nonnx = \"{onnx}\"\ninput_shape = [{CONTEXT}]\n"
        f"[data]\nformat = \"tokens\"\ntrain_inputs = \"train.u16\"\nseq_len = {CONTEXT}\n"
        f"[training]\nepochs = 1\nbatch_size = {BATCH}\nmicro_batches = {MICRO}\n"
        f"optimizer = {opt}\nloss = {loss}\n"
        "clusters = 1\nstages = 3\nshuffle = false\nseed = 0\n"
    )
    if schedule:
        text += (
            f"clip_grad_norm = {CLIP}\n[training.lr_schedule]\nkind = \"cosine\"\n"
            f"warmup_steps = {COSINE['warmup_steps']}\nmin_lr = {COSINE['min_lr']}\n"
        )
    return text


def main():
    os.makedirs(OUT, exist_ok=True)
    stream = tokens()
    stream.tofile(os.path.join(OUT, "train.u16"))
    expected = {"torch": torch.__version__, "steps": STEPS, "batch_size": BATCH, "runs": {}}
    for name, (exporter, layout, mha, schedule, optimizer) in RUNS.items():
        cfg = GPTConfig(vocab=VOCAB, context=CONTEXT, layers=LAYERS, d_model=D_MODEL, heads=HEADS,
                        dropout=0.0, mha=mha, layout=layout)
        torch.manual_seed(1234)
        model = GPT(cfg)
        onnx = f"{name}.onnx"
        export(model, os.path.join(OUT, onnx), exporter, batch=2, fixed_batch=False, embed_weights=True)
        losses, clipped = train(model, stream, layout, schedule, optimizer)
        if schedule:
            assert 0 < clipped < STEPS, f"clipping acted on {clipped} of {STEPS} steps: tune CLIP"
        expected["runs"][name] = {"losses": losses, "clipped_steps": clipped}
        with open(os.path.join(OUT, f"{name}.toml"), "w") as f:
            f.write(job_text(onnx, layout, schedule, optimizer))
        print(f"{name}: loss {losses[0]:.4f} -> {losses[-1]:.4f}" + (f", clipped {clipped} steps" if schedule else ""))
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)


if __name__ == "__main__":
    main()
