"""The tools around the plugin: benchmarks, the Multi30k stability matrix, the data preparations and the
language-model depth study. The scripts in ``scripts/`` and ``benchmarks/`` are their command lines.

Not installed with the plugin: each script puts its checkout first on ``sys.path`` (README, "Research
tools"); the plugin, ``fairseq_deepinit``, never imports it (``tests/test_layout.py``). Layout in
docs/architecture.md ("The tools").
"""
