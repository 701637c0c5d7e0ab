"""A fairseq data pipeline as a ``transformers`` tokenizer, for ``AutoTokenizer.from_pretrained(DIR,
trust_remote_code=True)``; this file is copied as it is into an exported model's folder
(:func:`fairseq_deepinit.export.hf_tokenizer.write_tokenizer`), so it imports only the standard library and
``transformers``.

Encoding, as the data was made: the pre-tokeniser (``punct``: ``deepinit_tools.prepare_bible.tokenize``;
``words`` and ``lower``: ``deepinit_tools.multi30k.words`` and ``.lower``), subword-nmt's BPE (Sennrich et al.
2016) with its vocabulary filter, ported from subword-nmt 0.3.8 ``subword_nmt/apply_bpe.py`` (``encode``,
``recursive_split``, ``check_vocab_and_split``; MIT licence), then the fairseq dictionary's ids with ``</s>``
appended (``Dictionary.encode_line``). Decoding, as the quickstart scores: the tokens joined, ``--remove-bpe``
(``(s + " ").replace("@@ ", "").rstrip()``), then ``prepare_bible.detokenize`` for ``punct``.
``skip_special_tokens`` drops ``<s>``, ``<pad>`` and ``</s>`` but keeps ``<unk>``, which fairseq-generate prints.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Dict, List, Tuple

from transformers import PreTrainedTokenizer

VOCAB_FILES_NAMES = {"vocab_file": "dict.txt", "codes_file": "bpe.codes", "bpe_vocab_file": "bpe.vocab"}
SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")  # fairseq's Dictionary: ids 0, 1, 2, 3
_SPLIT_AFTER = re.compile(r"(?<=\S)([.,;:!?)\]])")
_SPLIT_BEFORE = re.compile(r"([(\[])(?=\S)")
_SPLIT_QUOTES = re.compile(r"([»«„“”\"`])")
_JOIN_AFTER = re.compile(r" ([.,;:!?)\]])")
_JOIN_BEFORE = re.compile(r"([(\[]) ")
_WORDS = re.compile(r"\w+|[^\w\s]")


def pretokenize(text: str, name: str) -> List[str]:
    """The words of ``text`` as the pipeline ``name`` wrote them (``punct``, ``words``, ``lower``)."""
    if name == "punct":
        text = _SPLIT_AFTER.sub(r" \1", text)
        text = _SPLIT_BEFORE.sub(r"\1 ", text)
        text = _SPLIT_QUOTES.sub(r" \1 ", text)
        return text.split()
    if name == "words":
        return _WORDS.findall(text.lower())
    if name == "lower":
        return text.strip().lower().split()
    raise ValueError(f"unknown pre-tokeniser {name!r}")


def detokenize(text: str, name: str) -> str:
    """``prepare_bible.detokenize`` for ``punct``; the text as it is for the others."""
    return _JOIN_BEFORE.sub(r"\1", _JOIN_AFTER.sub(r"\1", text)) if name == "punct" else text


class SubwordNmt:
    """subword-nmt's ``apply-bpe`` on one word, with ``--vocabulary V --vocabulary-threshold N`` when given."""

    def __init__(self, codes_file: str, vocab_file: str | None = None, threshold: int | None = None):
        with open(codes_file, encoding="utf-8") as f:
            lines = f.read().rstrip("\n").split("\n")
        self.version = (0, 1)
        if lines and lines[0].startswith("#version:"):
            self.version = tuple(int(x) for x in re.sub(r"(\.0+)*$", "", lines[0].split()[-1]).split("."))
            lines = lines[1:]
        codes = [tuple(line.strip("\r\n ").split(" ")) for line in lines]
        if any(len(pair) != 2 for pair in codes):
            raise ValueError(f"{codes_file}: every merge is two symbols separated by a space")
        # apply_bpe.BPE.__init__'s two dictionaries, built the same way: a repeated pair keeps its first rank,
        # and of the merges that make one string, the reverse map keeps the one its construction order leaves last
        self.codes = dict([(code, i) for (i, code) in reversed(list(enumerate(codes)))])
        self.reverse = dict([(pair[0] + pair[1], pair) for pair, i in self.codes.items()])
        self.vocab = None
        if vocab_file is not None:
            self.vocab = set()
            with open(vocab_file, encoding="utf-8") as f:
                for line in f:
                    word, freq = line.strip("\r\n ").split(" ")
                    if threshold is None or int(freq) >= threshold:
                        self.vocab.add(word)
        self.cache: Dict[str, Tuple[str, ...]] = {}

    def segment(self, orig: str) -> Tuple[str, ...]:
        """The pieces of one word, without separators (apply_bpe.encode)."""
        if orig in self.cache:
            return self.cache[orig]
        if len(orig) == 1:
            return (orig,)
        word = list(orig) + ["</w>"] if self.version == (0, 1) else list(orig[:-1]) + [orig[-1] + "</w>"]
        while len(word) > 1:
            pairs = [
                (self.codes[pair], i, pair)
                for i, pair in enumerate(zip(word, word[1:], strict=False))
                if pair in self.codes
            ]
            if not pairs:
                break
            bigram = min(pairs)[2]
            positions = [i for _, i, pair in pairs if pair == bigram]
            i, new_word = 0, []
            for j in positions:
                if j < i:  # overlapping pairs (x x x -> xx x)
                    continue
                new_word += word[i:j] + ["".join(bigram)]
                i = j + 2
            word = new_word + word[i:]
        if word[-1] == "</w>":
            word = word[:-1]
        elif word[-1].endswith("</w>"):
            word[-1] = word[-1][:-4]
        out = tuple(word)
        if self.vocab is not None:
            out = tuple(self._check_vocab(out))
        self.cache[orig] = out
        return out

    def _split(self, segment: str, final: bool):
        """apply_bpe.recursive_split: undo merges until each unit is in the vocabulary or a character."""
        try:
            left, right = self.reverse[segment + "</w>"] if final else self.reverse[segment]
        except KeyError:
            yield segment
            return
        if final:
            right = right[:-4]
        if left + "@@" in self.vocab:
            yield left
        else:
            yield from self._split(left, False)
        if (final and right in self.vocab) or (not final and right + "@@" in self.vocab):
            yield right
        else:
            yield from self._split(right, final)

    def _check_vocab(self, pieces: Tuple[str, ...]) -> List[str]:
        out: List[str] = []
        for segment in pieces[:-1]:
            out += [segment] if segment + "@@" in self.vocab else list(self._split(segment, False))
        last = pieces[-1]
        return out + ([last] if last in self.vocab else list(self._split(last, True)))


class DeepinitTokenizer(PreTrainedTokenizer):
    """A fairseq dictionary (``dict.txt``) behind the pipeline's pre-tokeniser and subword-nmt BPE."""

    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(
        self,
        vocab_file: str,
        codes_file: str | None = None,
        bpe_vocab_file: str | None = None,
        pretokenizer: str = "punct",
        vocabulary_threshold: int | None = None,
        bos_token: str = "<s>",
        pad_token: str = "<pad>",
        eos_token: str = "</s>",
        unk_token: str = "<unk>",
        **kwargs,
    ):
        self.vocab_file, self.codes_file, self.bpe_vocab_file = vocab_file, codes_file, bpe_vocab_file
        self.pretokenizer, self.vocabulary_threshold = pretokenizer, vocabulary_threshold
        pretokenize("", pretokenizer)  # an unknown name fails here
        self.symbols = list(SPECIALS)
        with open(vocab_file, encoding="utf-8") as f:  # as fairseq's Dictionary.add_from_file reads dict.txt
            for line in f:
                word, field = line.rstrip().rsplit(" ", 1)
                if field == "#fairseq:overwrite":
                    word, field = word.rsplit(" ", 1)
                self.symbols.append(word)
        self.indices = {sym: i for i, sym in enumerate(self.symbols)}  # a repeat (#fairseq:overwrite): its last id
        self.bpe = None
        if codes_file is not None:
            self.bpe = SubwordNmt(codes_file, bpe_vocab_file if vocabulary_threshold is not None else None,
                                  vocabulary_threshold)  # fmt: skip
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        kwargs.setdefault("split_special_tokens", True)  # "</s>" in the text is text, as it is to fairseq
        # passed on so that save_pretrained writes them into tokenizer_config.json again
        kwargs.update(pretokenizer=pretokenizer, vocabulary_threshold=vocabulary_threshold)
        super().__init__(bos_token=bos_token, pad_token=pad_token, eos_token=eos_token, unk_token=unk_token, **kwargs)

    @property
    def vocab_size(self) -> int:
        return len(self.symbols)

    def get_vocab(self) -> Dict[str, int]:
        return dict(self.indices, **self.added_tokens_encoder)

    def _tokenize(self, text: str, **kwargs) -> List[str]:
        out: List[str] = []
        for word in pretokenize(text, self.pretokenizer):
            if self.bpe is None:
                out.append(word)
                continue
            pieces = self.bpe.segment(word)
            out += [p + "@@" for p in pieces[:-1]] + [pieces[-1]]
        return out

    def _convert_token_to_id(self, token: str) -> int:
        return self.indices.get(token, self.indices[self.unk_token])

    def _convert_id_to_token(self, index: int) -> str:
        return self.symbols[index]

    def convert_tokens_to_string(self, tokens: List[str]) -> str:
        text = " ".join(tokens)
        if self.bpe is not None:
            text = (text + " ").replace("@@ ", "").rstrip()
        return detokenize(text, self.pretokenizer)

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False):
        if isinstance(ids, int):
            return self._convert_id_to_token(ids)
        skip = {self.bos_token_id, self.pad_token_id, self.eos_token_id} if skip_special_tokens else set()
        return [self._convert_id_to_token(int(i)) for i in ids if int(i) not in skip]

    def build_inputs_with_special_tokens(self, token_ids_0: List[int], token_ids_1: List[int] | None = None):
        out = token_ids_0 + [self.eos_token_id]
        return out if token_ids_1 is None else out + token_ids_1 + [self.eos_token_id]

    def get_special_tokens_mask(self, token_ids_0, token_ids_1=None, already_has_special_tokens: bool = False):
        if already_has_special_tokens:
            return super().get_special_tokens_mask(token_ids_0, token_ids_1, already_has_special_tokens=True)
        mask = [0] * len(token_ids_0) + [1]
        return mask if token_ids_1 is None else mask + [0] * len(token_ids_1) + [1]

    def create_token_type_ids_from_sequences(self, token_ids_0, token_ids_1=None):
        return [0] * len(self.build_inputs_with_special_tokens(token_ids_0, token_ids_1))

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> Tuple[str, ...]:
        out = []
        for key, name in VOCAB_FILES_NAMES.items():
            src = getattr(self, key)
            if src is None:
                continue
            dst = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "") + name)
            if os.path.abspath(src) != os.path.abspath(dst):
                shutil.copyfile(src, dst)
            out.append(dst)
        return tuple(out)
