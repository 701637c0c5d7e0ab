#!/usr/bin/env bash
# DS-Init + MAtt (Zhang, Titov & Sennrich 2019): WMT14 En-De, Transformer base.
# Claims: 12-layer DS-Init + MAtt 28.55 vs 6-layer baseline 27.59; deep vanilla Post-LN fails to
# train; the MAtt ablations of Table 3 (self-attention or gated AAN in place of SAAN).
#
# The paper trains with its own TensorFlow code (bzhangGo/zero). From the paper and its README: joint
# BPE with 32k merges, Adam (0.9, 0.98) with the Noam schedule (peak 7e-4 after 4000 warmup steps,
# which is fairseq's inverse_sqrt with --lr 7e-4 --warmup-updates 4000), ~25k tokens per batch
# (4096 x update-freq 6 here), dropout 0.1, label smoothing 0.1, the last 5 checkpoints averaged,
# beam 4 with length penalty 0.6, tokenized case-sensitive BLEU (multi-bleu.perl). fairseq's length
# penalty divides by len^0.6, not GNMT's ((5+len)/6)^0.6. Training length (100k updates) and
# checkpoint interval (every 1500 updates) are this recipe's choice: METHODS.md is silent. Data:
# fairseq's prepare-wmt14en2de.sh --icml17 (the paper used Stanford's preprocessed WMT14 release).
source "$(dirname "$0")/../common.sh"
PAPER=dsinit TABLE=wmt14_en_de DATASET=wmt14_en_de SRC=en TGT=de
BPE_TOKENS=${BPE_TOKENS:-32000}
JOINED_DICT=1 SCORE=tok
AVG_MODE=update DEFAULT_AVG_N=5 SAVE_INTERVAL_UPDATES=1500 DEFAULT_SEED=1
PAPER_GPUS=1 PAPER_UPDATE_FREQ=6 PAPER_FP16=0
TRAIN_ARGS=(
  --share-all-embeddings --optimizer adam --adam-betas "(0.9,0.98)" --clip-norm 0.0
  --lr 0.0007 --lr-scheduler inverse_sqrt --warmup-init-lr 0 --warmup-updates 4000 --max-update 100000
  --dropout 0.1 --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --max-tokens 4096
)
GEN_ARGS=(--beam 4 --lenpen 0.6)

row base-6l 27.59 --arch postln_wmt_en_de
row base-12l - --arch postln_wmt_en_de_12l
row dsinit-12l - --arch dsinit_wmt_en_de_12l
row matt-6l - --arch matt_wmt_en_de
row dsinit-matt-12l 28.55 --arch dsinit_matt_wmt_en_de_12l
row dsinit-matt-selfattn-12l - --arch dsinit_matt_wmt_en_de_12l --matt-self-branch self-attn
row dsinit-matt-gatedaan-12l - --arch dsinit_matt_wmt_en_de_12l --matt-self-branch gated-aan

recipe_main "$@"
