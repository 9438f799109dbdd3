"""Make the two assets torchtitan's debug configs read, with nothing downloaded.

torchtitan 0.3.0's ``llama3_torchft_debugmodel`` (like every debug config) reads a tokenizer
from ``./tests/assets/tokenizer`` and the ``c4_test`` data set from ``./tests/assets/c4_test``,
relative to the working directory; neither is in the wheel (they live in torchtitan's source
repository). This script writes both under a directory of your choice, which you then run the
trainer from::

    python examples/torchtitan/make_assets.py /tmp/titan     # ~2 s
    cd /tmp/titan && python -m torchtitan.train --module torchft.llama3 ...

* ``tests/assets/c4_test/c4_train.json``: a JSON-lines corpus in C4's layout (``text``,
  ``timestamp``, ``url``), sentences made from a fixed word list by a seeded generator, so every
  run (and every replica group) reads the same data.
* ``tests/assets/tokenizer/``: a byte-level BPE tokenizer trained on that corpus with Hugging
  Face's ``tokenizers`` (a torchtitan dependency), ``tokenizer.json`` plus a
  ``tokenizer_config.json`` naming its BOS/EOS tokens. Its vocabulary fits the debug model's
  2048 embeddings.

The output is deterministic: the same arguments give byte-identical files.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

VOCAB_SIZE = 2000          # the debug model has 2048 embeddings
BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"

_WORDS = (
    "the a an one every some replica group lighthouse quorum leader follower node cluster step "
    "train model weight gradient shard rank heal commit vote term log entry raft fault tolerant "
    "survives fails restarts joins leaves sends receives checkpoint optimizer loss token batch "
    "sequence layer attention forward backward reduce gather scatter average sum store key value "
    "fast slow quiet busy old new first last next same other small large and or but so when while "
    "because after before under over into from with without to of in on at by is was are were has "
    "have keeps loses finds asks tells waits runs stops starts reads writes learns"
).split()


def make_corpus(path: Path, documents: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for d in range(documents):
        sentences = []
        for _ in range(rng.randint(4, 12)):
            words = [rng.choice(_WORDS) for _ in range(rng.randint(5, 18))]
            sentences.append(" ".join(words).capitalize() + rng.choice(".!?"))
        texts.append(" ".join(sentences))
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for d, text in enumerate(texts):
            f.write(json.dumps({"text": text, "timestamp": "2019-04-25T12:57:54Z",
                                "url": f"https://example.invalid/doc/{d}"}) + "\n")
    return texts


def make_tokenizer(directory: Path, texts: list[str]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[BOS, EOS, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "add_bos_token": True, "add_eos_token": False,
        "model_max_length": 131072, "tokenizer_class": "PreTrainedTokenizerFast",
    }, indent=2) + "\n")


def make_assets(root: Path, documents: int = 2000, seed: int = 0) -> Path:
    """Write ``root/tests/assets/{c4_test,tokenizer}``; returns ``root``."""
    assets = root / "tests" / "assets"
    texts = make_corpus(assets / "c4_test" / "c4_train.json", documents, seed)
    make_tokenizer(assets / "tokenizer", texts)
    return root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help="where to write tests/assets/ (the trainer's working directory)")
    parser.add_argument("--documents", type=int, default=2000, help="corpus size (default 2000, ~1.5 MB)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    root = make_assets(args.directory, args.documents, args.seed)
    print(f"wrote {root / 'tests' / 'assets'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
