#!/usr/bin/env bash
# Admin (Liu et al. 2020), Table 3: ReZero baselines on IWSLT14 De-En (small, 6 layers), trained
# with Admin's IWSLT recipe. Claim: ReZero (33.67) and ReZero+Post-LN (34.67) trail Admin (35.67).
source "$(dirname "$0")/_iwslt14.sh"
PAPER=admin TABLE=table3_iwslt14_de_en

row rezero 33.67 --arch rezero_iwslt_de_en
row rezero-postln 34.67 --arch rezero_postln_iwslt_de_en
row admin 35.67 --arch admin_iwslt_de_en --task translation_admin

recipe_main "$@"
