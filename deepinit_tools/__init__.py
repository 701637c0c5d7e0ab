"""The tools around the plugin: benchmarks, the Multi30k stability matrix, the data preparations and the
language-model depth study. The scripts in ``scripts/`` and ``benchmarks/`` are their command lines.

Imported as a package (from the checkout's root, or installed next to the plugin by ``scripts/setup.sh``);
the plugin, ``fairseq_deepinit``, never imports it (``tests/test_layout.py``). Layout in
docs/architecture.md ("The tools").
"""
