"""Loads weights trained by Rookery into the PyTorch twin of
examples/mnist-cnn.toml with `load_state_dict(strict=True)` and evaluates them
on the held-out MNIST digits.

    rookery train examples/mnist-job.toml --local-providers 6 --out rookery-out
    python tests/scripts/check_weights_in_pytorch.py rookery-out/weights.safetensors
"""
import gzip
import sys

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn


def idx(path):
    data = gzip.open(path).read()
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(data[3])]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * data[3]).reshape(dims)


def main(weights):
    # The layer spec, layer by layer: nn.Sequential indices are the parameter names.
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Dropout(0.25),
        nn.Linear(32 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10),
    )
    model.load_state_dict(load_file(weights), strict=True)
    model.eval()
    x = torch.tensor(idx("datasets/mnist-10k/t10k-images-idx3-ubyte.gz"), dtype=torch.float32).unsqueeze(1)
    x = (x / 255.0 - 0.1307) / 0.3081
    y = torch.tensor(idx("datasets/mnist-10k/t10k-labels-idx1-ubyte.gz")).long()
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    print(f"PyTorch loaded {weights} (strict) and scores {accuracy:.4f} on {len(y)} held-out digits")


if __name__ == "__main__":
    main(sys.argv[1])
