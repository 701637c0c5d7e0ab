"""What a ``--to huggingface`` folder holds besides the model: the model card (``README.md``) and, where the
training data folder records how its text was made, the tokenizer."""

from __future__ import annotations

import os


def text_pipeline(folder: str):
    """How ``folder``'s text was tokenised and BPE'd, or None when it does not say."""
    return None


def write_tokenizer(out: str, dicts, pipeline) -> None:
    raise NotImplementedError


def write_card(out: str, src: str, state: dict, args, route, hf, pipeline, max_diff) -> None:
    with open(os.path.join(out, "README.md"), "w", encoding="utf-8") as f:
        f.write("model card\n")
