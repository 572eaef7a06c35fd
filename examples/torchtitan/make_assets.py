"""Make the torchtitan example's data and tokenizer locally: nothing is downloaded.

Writes, under OUT (default ``runs-titan/assets``):

* ``c4_test/data.json``: synthetic ``{"text": ...}`` JSON lines in the layout of torchtitan's
  ``c4_test`` dataset (``--dataloader.dataset_path``). The text comes from a small seeded
  grammar, so it has structure a model can learn in a few dozen steps (the loss falls visibly).
* ``tokenizer/tokenizer.json`` and ``tokenizer/tokenizer_config.json``: a byte-level BPE
  tokenizer trained on that text with the ``tokenizers`` package (``--hf_assets_path``). Its
  vocabulary (at most 2048 ids) fits the llama3 debug model.

Deterministic: the same seed gives the same files. Run with the example's venv::

    .venv-titan/bin/python examples/torchtitan/make_assets.py [OUT]
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

VOCAB_SIZE = 2000  # < 2048, the llama3 debug model's vocabulary
N_DOCS = 4000
SEED = 1234

_SUBJECTS = [
    "the replica",
    "a gradient",
    "the lighthouse",
    "every worker",
    "the optimizer",
    "a quorum",
    "the checkpoint",
    "one group",
    "the manager",
    "a healthy peer",
]
_VERBS = [
    "sends",
    "averages",
    "heals",
    "restores",
    "commits",
    "skips",
    "joins",
    "waits for",
    "reads",
    "rebuilds",
]
_OBJECTS = [
    "the weights",
    "its state",
    "the next step",
    "a new quorum",
    "the batch",
    "the process group",
    "every shard",
    "the loss",
    "a fresh store",
    "the data",
]
_TAILS = [
    "before the forward pass",
    "after a failure",
    "at every step",
    "without a restart",
    "on the training thread",
    "in the background",
    "when asked",
    "over gloo",
]


def _sentence(rng: random.Random) -> str:
    parts = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)]
    if rng.random() < 0.6:
        parts.append(rng.choice(_TAILS))
    number = rng.randrange(100)
    return f"{' '.join(parts)} {number} times."


def make_texts(n_docs: int = N_DOCS, seed: int = SEED) -> list[str]:
    """Synthetic documents of 3 to 12 sentences each.

    Args:
        n_docs: number of documents.
        seed: RNG seed.
    """
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        sentences = [_sentence(rng) for _ in range(rng.randint(3, 12))]
        docs.append(" ".join(s[0].upper() + s[1:] for s in sentences))
    return docs


def write_dataset(texts: list[str], out: Path) -> Path:
    """Writes ``out/c4_test/data.json`` (one JSON object per line); returns the folder.

    Args:
        texts: the documents.
        out: the assets folder.
    """
    folder = out / "c4_test"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "data.json", "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    return folder


def write_tokenizer(texts: list[str], out: Path) -> Path:
    """Trains a byte-level BPE tokenizer on ``texts``; writes ``out/tokenizer``.

    Args:
        texts: the training text.
        out: the assets folder.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[bos, eos],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    folder = out / "tokenizer"
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": bos, "eos_token": eos, "add_bos_token": True, "add_eos_token": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def main(argv: list[str]) -> int:
    """Writes the dataset and tokenizer under ``argv[0]`` (default ``runs-titan/assets``).

    Args:
        argv: command-line arguments without the program name.
    """
    out = Path(argv[0] if argv else "runs-titan/assets")
    texts = make_texts()
    data = write_dataset(texts, out)
    tok = write_tokenizer(texts, out)
    print(f"dataset: {data}  tokenizer: {tok}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
