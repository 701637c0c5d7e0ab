#!/usr/bin/env bash
# Admin (Liu et al. 2020), Table 2: WMT14 En-Fr, 60-layer encoder and 12-layer decoder (base dims).
# Claim: Admin 43.80 vs Pre-LN 43.10 BLEU.
#
# Hyperparameters: the released nmt-experiments/wmt14_en-fr.md (60-12l runs): shared embeddings,
# RAdam (0.9, 0.98) lr 7e-4, inverse_sqrt with 8000 warmup updates from 1e-7, dropout 0.1 everywhere,
# no weight decay, 5000 tokens x update-freq 16 on each of 16 GPUs (scaled to your GPUs), fp16,
# 50 epochs; the last 10 epoch checkpoints up to epoch 50 averaged; beam 5, length penalty 0.8;
# BLEU as fairseq-generate prints it (tokenized). Data: fairseq's prepare-wmt14en2fr.sh (40k BPE),
# which Admin's pre-process/wmt14en-fr.sh adapts unchanged.
source "$(dirname "$0")/../common.sh"
PAPER=admin TABLE=table2_wmt14_en_fr DATASET=wmt14_en_fr SRC=en TGT=fr
BPE_TOKENS=${BPE_TOKENS:-40000}
JOINED_DICT=1 SCORE=tok
AVG_MODE=epoch DEFAULT_AVG_N=10 AVG_UPPER=50 DEFAULT_SEED=1111
PAPER_GPUS=16 PAPER_UPDATE_FREQ=16 PAPER_FP16=1
TRAIN_ARGS=(
  --share-all-embeddings --optimizer radam --adam-betas "(0.9,0.98)" --clip-norm 0.0
  --lr 0.0007 --lr-scheduler inverse_sqrt --warmup-init-lr 1e-07 --warmup-updates 8000 --stop-min-lr 1e-09
  --max-epoch 50 --dropout 0.1 --attention-dropout 0.1 --activation-dropout 0.1 --weight-decay 0.0
  --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --max-tokens 5000
  --encoder-layers 60 --decoder-layers 12
)
GEN_ARGS=(--beam 5 --lenpen 0.8)

row postln-60-12l - --arch postln_wmt_en_de
row preln-60-12l 43.10 --arch preln_wmt_en_de
row admin-60-12l 43.80 --arch admin_wmt_en_de --task translation_admin

recipe_main "$@"
