#!/usr/bin/env bash
# T-Fixup (Huang et al. 2020): IWSLT14 De-En, small 6-layer Transformer (512-1024-4) without any
# LayerNorm and without learning-rate warmup. Claim: 35.5 BLEU (the released README: 35.73).
# Baselines: Post-LN with warmup (the usual recipe) and Post-LN without warmup (what T-Fixup fixes).
source "$(dirname "$0")/_iwslt14.sh"
PAPER=tfixup TABLE=iwslt14_de_en

row tfixup 35.5 --arch tfixup_iwslt_de_en "${NO_WARMUP[@]}"
row postln-warmup - --arch postln_iwslt_de_en "${WARMUP[@]}"
row postln-nowarmup - --arch postln_iwslt_de_en "${NO_WARMUP[@]}"

recipe_main "$@"
