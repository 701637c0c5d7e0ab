"""``deepinit-compare``: several methods trained briefly on the user's data-bin, at the user's depth and
fairseq-train arguments, judged and ranked (docs/compare.md).

:mod:`.candidates` (the methods and the data-bin's task), :mod:`.command` (the fairseq-train commands),
:mod:`.process` (a child process with its log, deadline and peak memory), :mod:`.verdict` (log parsing and
the ok / stalled / diverged / failed rules, shared with the Multi30k matrix of ``deepinit_tools/matrix``),
:mod:`.unigram` (the stall threshold), :mod:`.runner` (one candidate, resumably), :mod:`.report` (ranking,
summary and report), :mod:`.plots`, :mod:`.cli` (the console script).
"""
