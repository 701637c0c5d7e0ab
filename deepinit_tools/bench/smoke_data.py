"""The data of gpu_smoke.py: fairseq dictionaries of ``N_SYMBOLS`` words (no corpus) and one fixed batch per
model kind, collated as fairseq collates them."""

from __future__ import annotations

from pathlib import Path

N_SYMBOLS = 60


def write_dictionaries(folder: Path) -> Path:
    """Dictionaries fairseq's tasks load (``dict.src.txt``, ``dict.tgt.txt``, ``dict.txt``); no corpus."""
    from fairseq.data import Dictionary

    d = Dictionary()
    for i in range(N_SYMBOLS):
        d.add_symbol(f"w{i}", n=N_SYMBOLS - i)
    for name in ("dict.src.txt", "dict.tgt.txt", "dict.txt"):
        d.save(str(folder / name))
    return folder


def translation_batch(task, bsz: int, seed: int) -> dict:
    """A fairseq-collated batch of ``bsz`` pairs of varied lengths (fairseq's LanguagePairDataset)."""
    import torch
    from fairseq.data import LanguagePairDataset

    g = torch.Generator().manual_seed(seed)
    src_d, tgt_d = task.source_dictionary, task.target_dictionary
    lo = src_d.nspecial

    def sentence(n: int, d) -> torch.Tensor:
        return torch.cat([torch.randint(lo, len(d), (n,), generator=g), torch.tensor([d.eos()])])

    src = [sentence(4 + (3 * i) % 9, src_d) for i in range(bsz)]
    tgt = [sentence(3 + (5 * i) % 10, tgt_d) for i in range(bsz)]
    ds = LanguagePairDataset(src, [len(s) for s in src], src_d, tgt, [len(t) for t in tgt], tgt_d)
    return ds.collater([ds[i] for i in range(bsz)])


def lm_batch(task, bsz: int, seed: int) -> dict:
    """A right-padded language-modeling batch (``src_tokens`` = eos + tokens, target = tokens + eos)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    d = task.source_dictionary
    rows = [torch.randint(d.nspecial, len(d), (4 + (5 * i) % 12,), generator=g) for i in range(bsz)]
    width = max(len(r) for r in rows) + 1
    src = torch.full((bsz, width), d.pad())
    tgt = torch.full((bsz, width), d.pad())
    for i, r in enumerate(rows):
        src[i, : len(r) + 1] = torch.cat([torch.tensor([d.eos()]), r])
        tgt[i, : len(r) + 1] = torch.cat([r, torch.tensor([d.eos()])])
    lengths = torch.tensor([len(r) + 1 for r in rows])
    return {"id": torch.arange(bsz), "nsentences": bsz, "ntokens": int(lengths.sum()), "target": tgt,
            "net_input": {"src_tokens": src, "src_lengths": lengths}}  # fmt: skip


def on_device(sample: dict, device: str) -> dict:
    if device != "cuda":
        return sample
    from fairseq import utils

    return utils.move_to_cuda(sample)
