#!/usr/bin/env bash
# Transformers without Tears (Nguyen & Salazar 2019): IWSLT15 En-Vi. Claims: PreNorm + FixNorm +
# ScaleNorm 32.79 vs Post-LN 31.94 BLEU; Post-LN without warmup fails (Table 5).
#
# From the released code (tnq177/transformers_without_tears, configurations.py base/en2vi) and
# METHODS.md: Stanford's preprocessed, tokenized IWSLT15 En-Vi (tst2012 dev, tst2013 test), 8000
# joint BPE merges, Transformer base dims (512-2048-8, 6+6 layers), tied target embeddings (separate
# dictionaries here, equivalent to TwT's target-vocabulary logit mask), dropout 0.3 everywhere,
# label smoothing 0.1, gradient clipping 1.0, batches of 4096 source+target tokens (--max-tokens 2048
# counts one side), learning rate x0.8 when dev BLEU has not improved for 3 evaluations (fairseq's
# reduce_lr_on_plateau on validation BLEU, one evaluation per epoch ~ TwT's 1500-step epochs), stop at
# lr 5e-5 or 200 epochs; the checkpoint with the best dev BLEU; beam 4 with length penalty 0.6 (GNMT's
# penalty in TwT, len^0.6 in fairseq); tokenized BLEU. Warmup rows: 8000 linear warmup updates to
# 5e-4 (about the Noam peak for d=512), starting at 6e-5: fairseq-train stops before any epoch whose
# lr is <= --stop-min-lr (fairseq_cli/train.py:196), so a warmup from 1e-7 would train 0 updates;
# TwT's released default is no warmup at lr 3e-4.
# Not available in fairseq: TwT's word dropout 0.1.
source "$(dirname "$0")/../common.sh"
PAPER=twt TABLE=iwslt15_en_vi DATASET=iwslt15_en_vi SRC=en TGT=vi
BPE_TOKENS=${BPE_TOKENS:-8000}
JOINED_DICT=0 SCORE=tok
DEFAULT_AVG_N=0 DEFAULT_SEED=1
PAPER_GPUS=1 PAPER_UPDATE_FREQ=1 PAPER_FP16=0
TRAIN_ARGS=(
  --share-decoder-input-output-embed --optimizer adam --adam-betas "(0.9,0.98)" --clip-norm 1.0
  --lr-scheduler reduce_lr_on_plateau --lr-shrink 0.8 --lr-patience 3 --stop-min-lr 5e-05 --max-epoch 200
  --dropout 0.3 --attention-dropout 0.3 --activation-dropout 0.3
  --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --max-tokens 2048
  --eval-bleu --eval-bleu-args '{"beam": 4}' --eval-bleu-remove-bpe
  --best-checkpoint-metric bleu --maximize-best-checkpoint-metric
)
GEN_ARGS=(--beam 4 --lenpen 0.6)
WARMUP=(--lr 5e-4 --warmup-updates 8000 --warmup-init-lr 6e-05)
NO_WARMUP=(--lr 3e-4)

row postnorm 31.94 --arch postln_wmt_en_de "${WARMUP[@]}"
row prenorm - --arch preln_wmt_en_de "${WARMUP[@]}"
row prenorm-fixnorm-scalenorm 32.79 --arch twt_wmt_en_de "${WARMUP[@]}"
row twt-nowarmup - --arch twt_wmt_en_de "${NO_WARMUP[@]}"
row postnorm-nowarmup - --arch postln_wmt_en_de "${NO_WARMUP[@]}"

recipe_main "$@"
