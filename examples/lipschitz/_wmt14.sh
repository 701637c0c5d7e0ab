# shellcheck shell=bash
# Settings shared by the Xu et al. 2020 (Lipschitz init) WMT14 En-De recipes. The paper trains with
# its own Neutron toolkit; METHODS.md records the init, not the training recipe. Stated in the paper:
# joint BPE with 32k merges, Transformer base, ~25k target tokens per batch, newstest2014 test.
# Everything else is fairseq's standard WMT En-De base recipe (examples/scaling_nmt, with its 7e-4
# peak lr): shared embeddings, Adam (0.9, 0.98), inverse_sqrt with 4000 warmup updates, dropout 0.1,
# label smoothing 0.1, 4096 tokens on each of 8 GPUs, 100k updates; the last 5 update checkpoints
# (every 1500 updates) averaged, beam 4; tokenized case-sensitive BLEU (multi-bleu.perl's number).
# Data: fairseq's prepare-wmt14en2de.sh --icml17.
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
DATASET=wmt14_en_de SRC=en TGT=de
BPE_TOKENS=${BPE_TOKENS:-32000}
JOINED_DICT=1 SCORE=tok
AVG_MODE=update DEFAULT_AVG_N=5 SAVE_INTERVAL_UPDATES=1500 DEFAULT_SEED=1
PAPER_GPUS=8 PAPER_UPDATE_FREQ=1 PAPER_FP16=1
TRAIN_ARGS=(
  --share-all-embeddings --optimizer adam --adam-betas "(0.9,0.98)" --clip-norm 0.0
  --lr 0.0007 --lr-scheduler inverse_sqrt --warmup-init-lr 1e-07 --warmup-updates 4000 --max-update 100000
  --dropout 0.1 --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --max-tokens 4096
)
GEN_ARGS=(--beam 4)
