"""Evaluates the Fashion-MNIST model that train_fashion_mnist --save_safetensors wrote, in Python:
the same network in torch.nn, its weights from the .safetensors file by name, the 10 000 test images
standardized as dtrain's FashionMNIST dataset does them. Prints the test accuracy.

  ./build/bin/dtrain-run --standalone --nproc_per_node 2 ./build/bin/train_fashion_mnist \
      --save_safetensors /tmp/fashion.safetensors
  .venv/bin/python examples/eval_safetensors.py /tmp/fashion.safetensors

Needs torch and safetensors (scripts/setup.sh puts both into .venv/).
"""
import gzip
import sys

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

DATA = "/usr/share/datasets/fashion-mnist"
MEAN, STD = 0.2860, 0.3530  # dtrain's kFashionMNISTMean and kFashionMNISTStd


class FashionCNN(torch.nn.Module):
    """conv 32, conv 64, linear 128: train_fashion_mnist.cpp's FashionCNN, with its names."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = torch.nn.Linear(64 * 7 * 7, 128)
        self.fc2 = torch.nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def idx(path, offset):
    with gzip.open(path, "rb") as f:
        return np.frombuffer(f.read(), dtype=np.uint8, offset=offset)


def main():
    weights = sys.argv[1]
    limit = int(sys.argv[2]) if len(sys.argv) > 2 else 10000
    model = FashionCNN()
    model.load_state_dict(load_file(weights))  # strict: every name and shape must match
    model.eval()
    images = torch.from_numpy(idx(f"{DATA}/t10k-images-idx3-ubyte.gz", 16).copy()).view(-1, 1, 28, 28)[:limit]
    labels = torch.from_numpy(idx(f"{DATA}/t10k-labels-idx1-ubyte.gz", 8).copy()).long()[:limit]
    x = (images.float() / 255 - MEAN) / STD
    with torch.no_grad():
        correct = sum(int((model(x[i:i + 500]).argmax(1) == labels[i:i + 500]).sum()) for i in range(0, len(x), 500))
    print(f"test accuracy {correct / len(x):.4f} ({correct} of {len(x)}) from {weights}")


if __name__ == "__main__":
    main()
