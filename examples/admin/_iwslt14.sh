# shellcheck shell=bash
# Settings shared by Admin's IWSLT14 De-En recipes (Liu et al. 2020), from the released
# Transformer-Clinic nmt-experiments/iwslt14_de-en.md and eval_iwslt_de-en.sh:
# joined dictionary, shared embeddings, RAdam (0.9, 0.98) lr 7e-4, inverse_sqrt with 6000 warmup
# updates from 1e-7, dropout 0.3 (attention and ReLU 0.1), weight decay 1e-4, 4096 tokens on 1 GPU,
# 100k updates (about 90 epochs); the last 10 epoch checkpoints up to epoch 90 averaged; beam 5;
# BLEU as fairseq-generate prints it (tokenized, lowercased data). The released runs used --fp16,
# added here on a GPU; their seeds were 1111..5555 (SEED=...).
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
DATASET=iwslt14_de_en SRC=de TGT=en
BPE_TOKENS=${BPE_TOKENS:-10000}
JOINED_DICT=1 SCORE=tok
AVG_MODE=epoch DEFAULT_AVG_N=10 AVG_UPPER=90 DEFAULT_SEED=1111
PAPER_GPUS=1 PAPER_UPDATE_FREQ=1 PAPER_FP16=1
TRAIN_ARGS=(
  --share-all-embeddings --optimizer radam --adam-betas "(0.9,0.98)" --clip-norm 0.0
  --lr 7e-4 --lr-scheduler inverse_sqrt --warmup-init-lr 1e-7 --warmup-updates 6000 --max-update 100000
  --dropout 0.3 --attention-dropout 0.1 --activation-dropout 0.1 --weight-decay 0.0001
  --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --max-tokens 4096
)
GEN_ARGS=(--beam 5)
