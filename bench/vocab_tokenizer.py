"""Gives a random-weight model folder a tokenizer with text for every id of the model's vocabulary.

    python bench/vocab_tokenizer.py MODEL_DIR

A random-weight folder (../shared/peers/make_model.py's) carries a small tokenizer that knows
1,000 of the model's 128k-152k ids; the ids such a model samples decode to no text, so a
streaming server that sends only new text (pdserve's router) sends a message every hundred tokens
or so, and `bench/serving.py` then measures neither its inter-token latency nor the cost of a
message per token that real text brings. After this script, id i decodes to " t{i}" (a word of
its own), so every token is text, for every server that loads the folder. The special tokens
the old tokenizer declares keep their ids; tokenizer_config.json is left alone.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers


def full_vocab_tokenizer(old: Tokenizer, vocab_size: int) -> Tokenizer:
    """A word-level tokenizer: ``t{i}`` for each id without a special token of ``old``."""
    special = {tok.content: idx for idx, tok in old.get_added_tokens_decoder().items()
               if tok.special}
    taken = set(special.values())
    vocab = dict(special)
    vocab.update({f"t{i}": i for i in range(vocab_size) if i not in taken})
    unk = min(special, key=special.__getitem__) if special else "t0"   # text no id names
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()   # decode joins the words with spaces
    tok.add_special_tokens(sorted(special, key=special.__getitem__))
    return tok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="model folder (config.json, tokenizer.json)")
    args = parser.parse_args(argv)
    folder = Path(args.model)
    try:
        vocab_size = int(json.loads((folder / "config.json").read_text())["vocab_size"])
        old = Tokenizer.from_file(str(folder / "tokenizer.json"))
    except (OSError, ValueError, KeyError) as err:
        print(f"vocab_tokenizer: {folder}: {err}", file=sys.stderr)
        return 2
    full_vocab_tokenizer(old, vocab_size).save(str(folder / "tokenizer.json"))
    print(f"{folder}/tokenizer.json: {vocab_size} ids, each its own word")
    return 0


if __name__ == "__main__":
    sys.exit(main())
