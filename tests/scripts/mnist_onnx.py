"""Makes tests/fixtures/mnist-onnx: a small MNIST CNN exported from PyTorch
for training (dynamo exporter, weights in model.onnx.data). The dashboard's
end-to-end test (tests/tests/dashboard.rs) uploads it through the New job
form with the MNIST files and checks the trained weights carry these
parameter names (parameter_names.json).

Run: /root/.cache/rookery/torch-venv/bin/python tests/scripts/mnist_onnx.py
(the venv: python3 -m venv ...; pip install torch==2.13.0 onnx onnxscript numpy)
"""
import json
import os

import torch
from torch import nn

OUT = os.path.join(os.path.dirname(__file__), "..", "fixtures", "mnist-onnx")


def model():
    torch.manual_seed(7)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(8 * 14 * 14, 32),
        nn.ReLU(),
        nn.Linear(32, 10),
    )


def main():
    os.makedirs(OUT, exist_ok=True)
    m = model().train()
    example = torch.zeros(4, 1, 28, 28)
    torch.onnx.export(
        m, (example,), os.path.join(OUT, "model.onnx"), dynamo=True, optimize=False, external_data=True
    )
    names = {k: list(v.shape) for k, v in m.state_dict().items()}
    with open(os.path.join(OUT, "parameter_names.json"), "w") as f:
        json.dump(names, f, indent=1)


if __name__ == "__main__":
    main()
