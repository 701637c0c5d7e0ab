# shellcheck shell=bash
# Settings shared by the T-Fixup IWSLT14 De-En recipes (Huang et al. 2020), from the released
# Train_IWSLT_TFixup_example.sh and InferenceIWSLT.py: fairseq's prepare-iwslt14.sh data with
# separate dictionaries, tied decoder input/output embeddings, Adam (0.9, 0.98) lr 5e-4, dropout 0.5,
# weight decay 1e-4, 4000 tokens on 1 GPU, fp16, 300 epochs; 10 epoch checkpoints averaged; beam 4,
# length penalty 0.3; BLEU as fairseq-generate prints it (tokenized, lowercased data).
# The released InferenceIWSLT.py picks the 10-epoch window with the best test BLEU; these recipes
# average the last 10 epochs instead (choosing on the test set is not a fair protocol).
# The learning-rate schedule is per row: T-Fixup has no warmup (--lr-scheduler tfixup, lr * sqrt(4000 / (4000 + t))).
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
DATASET=iwslt14_de_en SRC=de TGT=en
BPE_TOKENS=${BPE_TOKENS:-10000}
JOINED_DICT=0 SCORE=tok
AVG_MODE=epoch DEFAULT_AVG_N=10 DEFAULT_SEED=1
PAPER_GPUS=1 PAPER_UPDATE_FREQ=1 PAPER_FP16=1
TRAIN_ARGS=(
  --share-decoder-input-output-embed --optimizer adam --adam-betas "(0.9,0.98)" --lr 0.0005
  --dropout 0.5 --weight-decay 0.0001 --criterion label_smoothed_cross_entropy --label-smoothing 0.1
  --max-tokens 4000 --max-epoch 300
)
GEN_ARGS=(--beam 4 --lenpen 0.3)
NO_WARMUP=(--lr-scheduler tfixup --decay-period 4000)
# fairseq's standard IWSLT warmup (examples/translation): 4000 linear warmup updates, then 1/sqrt(t)
WARMUP=(--lr-scheduler inverse_sqrt --warmup-updates 4000 --warmup-init-lr 1e-07)
