#!/usr/bin/env bash
# Xu et al. 2020, Table 3: deep encoders (6/12/18/24 layers, 6-layer decoder) on WMT14 En-De with
# the original Post-LN order ("v1"), Pre-LN ("v2") and Post-LN with Lipschitz init ("v1-L").
# Claim: v1-L converges at every depth (27.96/28.67/29.05/29.46). The 6-layer decoder is this
# recipe's reading of the paper (deep encoders here, deep decoders in Table 4); change the depths
# with EXTRA_ARGS="--decoder-layers N" if your copy of the paper says otherwise.
source "$(dirname "$0")/_wmt14.sh"
PAPER=lipschitz TABLE=table3_wmt14_en_de

declare -A V1L=([6]=27.96 [12]=28.67 [18]=29.05 [24]=29.46)
for n in 6 12 18 24; do
  row "v1-enc${n}" - --arch postln_wmt_en_de --encoder-layers "$n" --decoder-layers 6
  row "v2-enc${n}" - --arch preln_wmt_en_de --encoder-layers "$n" --decoder-layers 6
  row "v1L-enc${n}" "${V1L[$n]}" --arch lipschitz_wmt_en_de --encoder-layers "$n" --decoder-layers 6
done

recipe_main "$@"
