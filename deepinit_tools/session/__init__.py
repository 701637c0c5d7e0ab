"""One GPU session in one device command: ``benchmarks/gpu_session.py``.

A lent GPU comes for one command of at most 10 minutes. This package runs the project's GPU
evidence in that command, in order, under one wall-clock budget, each stage with its own deadline
and its results copied out as they are written (a command cut by its limit returns what finished):

- :mod:`.stages`: the stages (CUDA smoke test, speed rows, packed paper cells, ...), their
  commands on the device and in the CPU rehearsal, and how the budget is shared out;
- :mod:`.driver`: runs the selected stages, mirrors their files into the output folder, writes
  ``session.json`` and ``session.log``, and packs the bulky extras into one tarball;
- :mod:`.cells`: the paper cells trained side by side, one fairseq-train process each, until the
  stage's deadline; per-epoch dev loss and greedy dev BLEU; beam-5 test BLEU of the best checkpoint;
- :mod:`.data`: the data the device command carries, prepared here, and the carried tree's size;
- :mod:`.plan`: what each stage is expected to take (``--plan``);
- :mod:`.paste`: the returned files into ``docs/benchmarks/gpu.json``, ``docs/results/converged.json``
  and the docs' tables;
- :mod:`.cli`: the command line.
"""
