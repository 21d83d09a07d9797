#!/usr/bin/env python3
"""Exports the ONNX fixtures that rookery-model's ONNX import tests read.

Defines four small PyTorch models (MLP, CNN with BatchNorm and Dropout,
ResNet-style network, transformer encoder block), exports each in training mode
with both of PyTorch's exporters into shared/model/fixtures/:

  NAME.dynamo.onnx (+ NAME.dynamo.onnx.data)   torch.onnx.export(dynamo=True, optimize=False)
  NAME.legacy.onnx                             torch.onnx.export(dynamo=False, TrainingMode.TRAINING,
                                                                 do_constant_folding=False)

plus cnn.folded.onnx, the CNN exported the default (eval-mode, BatchNorm folded)
way, and cnn.folded.dynamo.onnx (dynamo's default optimize=True, which folds
BatchNorm too), which the importer must warn about, and transformer.dynamic.{dynamo,legacy}.onnx,
exported with symbolic batch and sequence axes, which keep the exporters' shape
arithmetic (Shape, Gather, Unsqueeze, Concat, Range, ...) in the graph. NAME.expected.json records what
PyTorch says about the example input: the output shape, each module's output
shape (forward hooks), and the state_dict (name, shape, dtype, checksum) so the
Rust tests compare the importer's shape inference and weights against PyTorch.

Run with the venv made as the report in shared/model describes:
  python3 -m venv /root/.cache/rookery/torch-venv
  /root/.cache/rookery/torch-venv/bin/pip install torch==2.13.0 onnx onnxscript
  /root/.cache/rookery/torch-venv/bin/python shared/model/scripts/export_fixtures.py
"""

import ast
import copy
import json
import math
import os
import sys
import warnings

import onnx
import onnx.numpy_helper
import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(os.path.dirname(HERE), "fixtures")
SEED = 0


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act1 = nn.ReLU()
        self.fc2 = nn.Linear(32, 32)
        self.act2 = nn.ReLU()
        self.fc3 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc3(self.act2(self.fc2(self.act1(self.fc1(x)))))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu1 = nn.ReLU()
        self.pool1 = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.relu2 = nn.ReLU()
        self.pool2 = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.drop = nn.Dropout(0.25)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = self.pool1(self.relu1(self.bn1(self.conv1(x))))
        x = self.pool2(self.relu2(self.bn2(self.conv2(x))))
        return self.fc(self.drop(self.flatten(x)))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.layer1 = BasicBlock(8, 8, 1)
        self.layer2 = BasicBlock(8, 16, 2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


class SelfAttention(nn.Module):
    def __init__(self, d, heads, p):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        b, t, d = x.shape
        h = self.heads
        qkv = self.qkv(x).reshape(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // h)
        att = self.drop(att.softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(y)


class Transformer(nn.Module):
    """One pre-norm encoder block with token and position embeddings and an LM head."""

    def __init__(self, vocab=64, d=32, heads=4, ff=64, p=0.1):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(16, d)
        self.ln1 = nn.LayerNorm(d)
        self.attn = SelfAttention(d, heads, p)
        self.ln2 = nn.LayerNorm(d)
        self.ff1 = nn.Linear(d, ff)
        self.gelu = nn.GELU()
        self.ff2 = nn.Linear(ff, d)
        self.drop = nn.Dropout(p)
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        t = idx.shape[1]
        positions = torch.arange(t, device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        x = x + self.attn(self.ln1(x))
        x = x + self.drop(self.ff2(self.gelu(self.ff1(self.ln2(x)))))
        return self.head(self.ln_f(x))


def example_input(name):
    if name == "mlp":
        return torch.randn(2, 16)
    if name == "transformer":
        return torch.randint(0, 64, (2, 8), dtype=torch.int64)
    return torch.randn(2, 3, 16, 16)


MODELS = {"mlp": MLP, "cnn": CNN, "resnet": ResNet, "transformer": Transformer}


def checksum(t):
    """Order-sensitive checksum the Rust test recomputes in f64 over the f32 values:
    sum of values and sum of value * (1 + index mod 7)."""
    v = t.detach().to(torch.float64).reshape(-1)
    w = (torch.arange(v.numel(), dtype=torch.float64) % 7) + 1
    return [float(v.sum()), float((v * w).sum())]


def state_dict_entries(model):
    trainable = {n for n, _ in model.named_parameters()}
    out = []
    for name, t in model.state_dict().items():
        out.append(
            {
                "name": name,
                "shape": list(t.shape),
                "dtype": str(t.dtype).replace("torch.", ""),
                "trainable": name in trainable,
                "checksum": checksum(t),
            }
        )
    return out


def module_shapes(model, x):
    """Output shape of every submodule, by qualified name, from forward hooks."""
    shapes = {}
    hooks = []
    for name, m in model.named_modules():
        if not name:
            continue

        def hook(_m, _inp, out, name=name):
            if isinstance(out, torch.Tensor):
                shapes[name] = list(out.shape)

        hooks.append(m.register_forward_hook(hook))
    with torch.no_grad():
        y = model(x)
    for h in hooks:
        h.remove()
    return list(y.shape), shapes


def onnx_initializers(path):
    m = onnx.load(path, load_external_data=True)
    return {i.name: onnx.numpy_helper.to_array(i) for i in m.graph.initializer}


def check_weights(path, model):
    """The file must carry the exported model's weights under state_dict names."""
    inits = onnx_initializers(path)
    sd = model.state_dict()
    for name, t in sd.items():
        if name not in inits:
            continue
        a = torch.from_numpy(inits[name].copy())
        if a.shape != t.shape or not torch.equal(a.to(t.dtype), t):
            sys.exit(f"{path}: initializer {name} differs from the state_dict")
    return sorted(n for n in sd if n in inits)


def node_module(node, exporter, modules):
    """The qualified name of the module whose forward created `node`, or None."""
    if exporter == "dynamo":
        meta = {p.key: p.value for p in node.metadata_props}
        scopes = meta.get("pkg.torch.onnx.name_scopes")
        if scopes is None:
            return None
        scopes = ast.literal_eval(scopes)
        # [root, module, submodule, ..., op]: the entry before the op is the module.
        return scopes[-2] if len(scopes) >= 2 else ""
    # Legacy: "/layer2/downsample/downsample.0/Conv"; a Sequential child's scope
    # repeats its parent's name, and a module called twice gets "_1" appended.
    if not node.name.startswith("/"):
        return None
    path = []
    for seg in node.name.split("/")[1:-1]:
        if path and seg.startswith(path[-1] + "."):
            seg = seg[len(path[-1]) + 1 :]
        path.append(seg)
    qual = ".".join(path)
    if qual not in modules:
        base = qual.rsplit("_", 1)[0]
        if base in modules:
            qual = base
    return qual


def module_outputs(path, exporter, modules):
    """For each module, the first outputs of the nodes in its scope, in file order;
    the Rust test takes the last one the imported graph has as the module's output."""
    m = onnx.load(path, load_external_data=False)
    out = {}
    for node in m.graph.node:
        mod = node_module(node, exporter, modules)
        if mod is None or not node.output:
            continue
        for name in modules:
            if mod == name or mod.startswith(name + "."):
                out.setdefault(name, []).append(node.output[0])
    return out


def dynamic_axes(name, x):
    """Symbolic batch (and sequence) axes, for the exports that keep shape arithmetic
    in the graph instead of baking the example's sizes in; None for static exports."""
    if name != "transformer":
        return None
    from torch.export import Dim

    return {
        "dynamo": ({0: Dim("batch", max=64), 1: Dim("seq", max=16)},),
        "legacy": {"idx": {0: "batch", 1: "seq"}},
    }


def export(name, model, x):
    """Exports a copy of `model` per exporter; returns, per export, the state_dict
    entries of that copy after export, which of them the file holds, and the ONNX
    tensors each module's scope produced."""
    base = os.path.join(OUT, name)
    variants = [("dynamo", "dynamo", None), ("legacy", "legacy", None)]
    dyn_axes = dynamic_axes(name, x)
    if dyn_axes:
        variants += [
            ("dynamic.dynamo", "dynamo", dyn_axes["dynamo"]),
            ("dynamic.legacy", "legacy", dyn_axes["legacy"]),
        ]
    exports = {}
    for variant, exporter, axes in variants:
        path = f"{base}.{variant}.onnx"
        for p in (path, path + ".data"):
            if os.path.exists(p):
                os.remove(p)
        # The legacy exporter runs the model to trace it, and a training-mode
        # forward updates BatchNorm's running statistics before the weights are
        # written; so each export gets its own copy, and the expected weights are
        # that copy's afterwards.
        m = copy.deepcopy(model).train()
        if exporter == "dynamo":
            kwargs = {"dynamic_shapes": axes} if axes else {}
            torch.onnx.export(m, (x,), path, dynamo=True, optimize=False, **kwargs)
        else:
            kwargs = {"input_names": ["idx"], "dynamic_axes": axes} if axes else {}
            torch.onnx.export(
                m,
                (x,),
                path,
                dynamo=False,
                training=torch.onnx.TrainingMode.TRAINING,
                do_constant_folding=False,
                **kwargs,
            )
        exports[variant] = {
            "state_dict": state_dict_entries(m),
            "initializers_in_file": check_weights(path, m),
            "module_outputs": module_outputs(
                path, exporter, [n for n, _ in model.named_modules() if n]
            ),
        }
    if name == "cnn":
        # The default settings: eval mode, BatchNorm folded into the convolutions.
        torch.onnx.export(copy.deepcopy(model).eval(), (x,), base + ".folded.onnx", dynamo=False)
        # The dynamo exporter's default optimize=True folds BatchNorm even in
        # training mode.
        folded = base + ".folded.dynamo.onnx"
        for p in (folded, folded + ".data"):
            if os.path.exists(p):
                os.remove(p)
        torch.onnx.export(copy.deepcopy(model).train(), (x,), folded, dynamo=True)
    return exports


def main():
    os.makedirs(OUT, exist_ok=True)
    warnings.filterwarnings("ignore")
    for name, cls in MODELS.items():
        torch.manual_seed(SEED)
        model = cls()
        x = example_input(name)
        # Running statistics start at their defaults; hooks run on a copy in eval mode
        # so nothing here changes the weights the exports see, and dropout is off.
        out_shape, shapes = module_shapes(copy.deepcopy(model).eval(), x)
        exports = export(name, model, x)
        expected = {
            "model": name,
            "input_shape": list(x.shape),
            "input_dtype": str(x.dtype).replace("torch.", ""),
            "output_shape": out_shape,
            "module_shapes": shapes,
            "exports": exports,
        }
        with open(os.path.join(OUT, name + ".expected.json"), "w") as f:
            json.dump(expected, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"{name}: output {out_shape}, {len(model.state_dict())} state_dict entries")


if __name__ == "__main__":
    main()
