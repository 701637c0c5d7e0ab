#!/usr/bin/env bash
# Admin (Liu et al. 2020), Table 2: IWSLT14 De-En, 6-layer small Transformer (transformer_iwslt_de_en).
# Claim: Admin matches Post-LN and Pre-LN on a shallow model (35.67 vs 35.64 / 35.50 BLEU).
# Admin profiles omega on the first training batch inside fairseq-train (--task translation_admin).
source "$(dirname "$0")/_iwslt14.sh"
PAPER=admin TABLE=table2_iwslt14_de_en

row postln 35.64 --arch postln_iwslt_de_en
row preln 35.50 --arch preln_iwslt_de_en
row admin 35.67 --arch admin_iwslt_de_en --task translation_admin

recipe_main "$@"
