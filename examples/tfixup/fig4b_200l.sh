#!/usr/bin/env bash
# T-Fixup (Huang et al. 2020), Fig. 4b: 200 encoder + 200 decoder layers of d=64, FFN 128, 2 heads
# (64-128-2) train on IWSLT14 De-En without LayerNorm and warmup. The paper plots the curve and
# gives no table value; hyperparameters are the released IWSLT recipe's (METHODS.md is silent on
# anything specific to the 200-layer run).
source "$(dirname "$0")/_iwslt14.sh"
PAPER=tfixup TABLE=fig4b_200l

row tfixup-200l - --arch tfixup_iwslt_de_en_200l "${NO_WARMUP[@]}"
row tfixup-6l-64d - --arch tfixup_iwslt_de_en_200l --encoder-layers 6 --decoder-layers 6 "${NO_WARMUP[@]}"

recipe_main "$@"
