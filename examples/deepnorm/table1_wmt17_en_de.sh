#!/usr/bin/env bash
# DeepNorm / DeepNet (Wang et al. 2022), Table 1: WMT17 En-De at 6L-6L, 18L-18L, 50L-50L and
# 100L-100L with Post-LN, Pre-LN and DeepNorm. Claim: DeepNorm trains at every depth where Post-LN
# diverges, and beats Pre-LN. METHODS.md has DeepNorm's constants but no numbers or training recipe
# for this table: the hyperparameters are Admin's released WMT14 En-De ones (admin/table2_wmt14_en_de.sh),
# the closest published fairseq recipe for deep Post-LN variants. Data: fairseq's prepare-wmt14en2de.sh
# without --icml17 (its "wmt17_en_de": news-commentary v12, newstest2014 test), 40k BPE merges.
source "$(dirname "$0")/../common.sh"
PAPER=deepnorm TABLE=table1_wmt17_en_de DATASET=wmt17_en_de SRC=en TGT=de
BPE_TOKENS=${BPE_TOKENS:-40000}
JOINED_DICT=1 SCORE=tok
AVG_MODE=epoch DEFAULT_AVG_N=10 AVG_UPPER=100 DEFAULT_SEED=1
PAPER_GPUS=4 PAPER_UPDATE_FREQ=1 PAPER_FP16=1
TRAIN_ARGS=(
  --share-all-embeddings --optimizer radam --adam-betas "(0.9,0.98)" --clip-norm 0.0
  --lr 0.001 --lr-scheduler inverse_sqrt --warmup-init-lr 1e-07 --warmup-updates 8000
  --max-update 500000 --max-epoch 100 --dropout 0.1 --attention-dropout 0.1 --activation-dropout 0.1
  --weight-decay 0.0 --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --max-tokens 8192
)
GEN_ARGS=(--beam 5)

for n in 6 18 50 100; do
  row "postln-${n}l" - --arch postln_wmt_en_de --encoder-layers "$n" --decoder-layers "$n"
  row "preln-${n}l" - --arch preln_wmt_en_de --encoder-layers "$n" --decoder-layers "$n"
  row "deepnorm-${n}l" - --arch deepnorm_wmt_en_de --encoder-layers "$n" --decoder-layers "$n"
done

recipe_main "$@"
