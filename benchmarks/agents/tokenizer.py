"""A character-level tokenizer, saved as a ``PreTrainedTokenizerFast`` so merges copy it.

Ids are fixed by ``VOCAB``: four special tokens, then one token per character. The
training code encodes with the dictionary directly (fast); the saved ``tokenizer.json``
(a ``tokenizers`` BPE model with no merges, i.e. one token per character) gives the same ids,
which the smoke test checks.
"""

from __future__ import annotations

import string
from typing import Sequence

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
CHARACTERS = " " + string.ascii_lowercase + string.ascii_uppercase + string.digits + "+=(),\"_:?.'"
VOCAB: dict[str, int] = {token: index for index, token in enumerate(SPECIAL_TOKENS + tuple(CHARACTERS))}
PAD_ID, BOS_ID, EOS_ID, UNK_ID = (VOCAB[token] for token in SPECIAL_TOKENS)
#: Embedding rows, rounded up to a multiple of 8.
VOCAB_SIZE = (len(VOCAB) + 7) // 8 * 8
_ID_TO_CHAR = {index: token for token, index in VOCAB.items() if token not in SPECIAL_TOKENS}


def encode(text: str) -> list[int]:
    """Character ids, no special tokens."""
    return [VOCAB.get(character, UNK_ID) for character in text]


def decode(ids: Sequence[int]) -> str:
    """Characters up to the first end-of-sequence; other special tokens are dropped."""
    characters = []
    for index in ids:
        if index == EOS_ID:
            break
        characters.append(_ID_TO_CHAR.get(int(index), ""))
    return "".join(characters)


def hf_tokenizer():
    """The same vocabulary as a transformers ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(BPE(vocab=dict(VOCAB), merges=[], unk_token=UNK))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK)


def save_tokenizer(path: str) -> None:
    hf_tokenizer().save_pretrained(path)
