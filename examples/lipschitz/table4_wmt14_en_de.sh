#!/usr/bin/env bash
# Xu et al. 2020, Table 4: deep decoders on WMT14 En-De with Lipschitz init ("v1-L") against Pre-LN
# ("v2"). Claim: unlike previous work, deeper decoders help too. METHODS.md gives no numbers for this
# table, and the depths below (6-layer encoder, 6/12/18/24-layer decoder) are this recipe's reading of
# the paper; set EXTRA_ARGS="--encoder-layers N" to pair them with a deep encoder.
source "$(dirname "$0")/_wmt14.sh"
PAPER=lipschitz TABLE=table4_wmt14_en_de

for n in 6 12 18 24; do
  row "v2-dec${n}" - --arch preln_wmt_en_de --encoder-layers 6 --decoder-layers "$n"
  row "v1L-dec${n}" - --arch lipschitz_wmt_en_de --encoder-layers 6 --decoder-layers "$n"
done

recipe_main "$@"
