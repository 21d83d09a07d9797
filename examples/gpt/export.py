"""Exports examples/gpt's GPT for training, the way README tells users to.

    python examples/gpt/export.py --out gpt.onnx                 # dynamo, dynamic batch, ~14M parameters
    python examples/gpt/export.py --exporter legacy --mha --layout nvt --out gpt.onnx

Writes the ONNX file (the dynamo exporter puts the weights beside it in
`gpt.onnx.data` unless `--embed-weights`) and the initial weights as
`gpt.safetensors` (state_dict names), which `rookery generate --weights` reads.
`--fixed-batch` leaves the batch dimension out of `dynamic_shapes` /
`dynamic_axes`, as an export without the README's recipe would.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import GPT, GPTConfig, parameter_count  # noqa: E402

DEFAULT_TOKENIZER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tokenizer.json")


def vocab_of(tokenizer: str) -> int:
    """The vocabulary size of a `tokenizers` JSON file or of a character vocabulary (one JSON list)."""
    with open(tokenizer, encoding="utf-8") as f:
        data = json.load(f)
    if isinstance(data, list):
        return len(data)
    from tokenizers import Tokenizer

    return Tokenizer.from_file(tokenizer).get_vocab_size()


def export(model: GPT, path: str, exporter: str, batch: int, fixed_batch: bool, embed_weights: bool):
    """torch.onnx.export exactly as README's recipe (minus the dynamic batch with `fixed_batch`)."""
    tokens = torch.zeros(batch, model.cfg.context, dtype=torch.long)
    model.train()
    if exporter == "dynamo":
        dynamic = None if fixed_batch else {"tokens": {0: torch.export.Dim("batch")}}
        torch.onnx.export(model, (tokens,), path, dynamo=True, optimize=False,
                          dynamic_shapes=dynamic, external_data=not embed_weights)
    else:
        dynamic = None if fixed_batch else {"tokens": {0: "batch"}}
        torch.onnx.export(model, (tokens,), path, dynamo=False,
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                          input_names=["tokens"], output_names=["logits"], dynamic_axes=dynamic)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the .onnx file to write")
    p.add_argument("--exporter", choices=["dynamo", "legacy"], default="dynamo")
    p.add_argument("--mha", action="store_true", help="attention through nn.MultiheadAttention")
    p.add_argument("--layout", choices=["ntv", "nvt"], default="ntv", help="logits [N, T, V] or [N, V, T]")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the tokenizer's)")
    p.add_argument("--tokenizer", default=DEFAULT_TOKENIZER,
                   help="tokenizer.json (tokenizers) or a JSON list of characters (default: data/tokenizer.json)")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--batch", type=int, default=2, help="the example batch traced")
    p.add_argument("--fixed-batch", action="store_true", help="no dynamic batch dimension")
    p.add_argument("--embed-weights", action="store_true", help="dynamo: weights inside the .onnx file")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    if a.vocab is None and not os.path.isfile(a.tokenizer):
        p.error(f"no tokenizer at {a.tokenizer}: give --tokenizer or --vocab")
    vocab = a.vocab or vocab_of(a.tokenizer)
    cfg = GPTConfig(vocab=vocab, context=a.context, layers=a.layers, d_model=a.d_model,
                    heads=a.heads, dropout=a.dropout, mha=a.mha, layout=a.layout)
    torch.manual_seed(a.seed)
    model = GPT(cfg)
    export(model, a.out, a.exporter, a.batch, a.fixed_batch, a.embed_weights)

    from safetensors.torch import save_file

    weights = os.path.splitext(a.out)[0] + ".safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, weights)
    print(f"{a.out}: {parameter_count(model):,} parameters, vocab {vocab}, context {a.context}, "
          f"{a.exporter} exporter, {'MultiheadAttention' if a.mha else 'hand-written attention'}, "
          f"logits {'[N, V, T]' if a.layout == 'nvt' else '[N, T, V]'}; weights in {weights}")


if __name__ == "__main__":
    main()
