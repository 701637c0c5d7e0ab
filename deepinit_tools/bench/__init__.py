"""The benchmarks' code; ``benchmarks/<name>.py`` is the command line of ``deepinit_tools.bench.<name>``."""
