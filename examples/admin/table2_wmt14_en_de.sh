#!/usr/bin/env bash
# Admin (Liu et al. 2020), Table 2: WMT14 En-De, Transformer base with 6/12/18 encoder and decoder layers.
# Claim: Post-LN diverges from 12 layers, Admin trains and beats Pre-LN at every depth.
#
# Hyperparameters: the released nmt-experiments/wmt14_en-de.md: shared embeddings, RAdam (0.9, 0.98)
# lr 1e-3, inverse_sqrt with 8000 warmup updates from 1e-7, dropout 0.1 (attention, ReLU 0.1), no
# weight decay, 8192 tokens on each of 4 GPUs (--update-freq scales this to your GPUs), fp16,
# 100 epochs (max 500k updates); the last 10 epoch checkpoints up to epoch 100 averaged; beam 5;
# BLEU as fairseq-generate prints it (tokenized, Moses -a).
# Data: fairseq's prepare-wmt14en2de.sh --icml17 (this project's common preparation) with Admin's
# 32764 BPE merges; Admin's own pre-process/wmt14en-de.sh differs in details (news-commentary v12,
# newstest2013 as validation, clean-corpus-n 1-80 before BPE).
source "$(dirname "$0")/../common.sh"
PAPER=admin TABLE=table2_wmt14_en_de DATASET=wmt14_en_de SRC=en TGT=de
BPE_TOKENS=${BPE_TOKENS:-32764}
JOINED_DICT=1 SCORE=tok
AVG_MODE=epoch DEFAULT_AVG_N=10 AVG_UPPER=100 DEFAULT_SEED=1111
PAPER_GPUS=4 PAPER_UPDATE_FREQ=1 PAPER_FP16=1
TRAIN_ARGS=(
  --share-all-embeddings --optimizer radam --adam-betas "(0.9,0.98)" --clip-norm 0.0
  --lr 0.001 --lr-scheduler inverse_sqrt --warmup-init-lr 1e-07 --warmup-updates 8000 --stop-min-lr 1e-09
  --max-update 500000 --max-epoch 100 --dropout 0.1 --attention-dropout 0.1 --activation-dropout 0.1
  --weight-decay 0.0 --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --max-tokens 8192
)
GEN_ARGS=(--beam 5)

row postln-6l 27.80 --arch postln_wmt_en_de
row postln-12l diverged --arch postln_wmt_en_de_12l
row postln-18l diverged --arch postln_wmt_en_de_18l
row preln-6l 27.27 --arch preln_wmt_en_de
row preln-12l 28.26 --arch preln_wmt_en_de_12l
row preln-18l 28.38 --arch preln_wmt_en_de_18l
row admin-6l 27.90 --arch admin_wmt_en_de --task translation_admin
row admin-12l 28.58 --arch admin_wmt_en_de_12l --task translation_admin
row admin-18l 29.03 --arch admin_wmt_en_de_18l --task translation_admin

recipe_main "$@"
