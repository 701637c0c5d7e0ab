# shellcheck shell=bash
# Shared library of the paper recipes. A recipe (examples/<paper>/<table>.sh) sources this file, sets
# the settings below, declares one `row` per line of the paper's table and ends with `recipe_main "$@"`.
#
# Usage of every recipe:
#   bash examples/<paper>/<table>.sh --list            rows, the paper's BLEU and each row's flags
#   bash examples/<paper>/<table>.sh ROW               prepare data, train, average, generate, score
#   bash examples/<paper>/<table>.sh ROW --dry-run     print the commands instead of running them
#   bash examples/<paper>/<table>.sh --dry-run         print the commands of every row
#   bash examples/<paper>/<table>.sh --prepare-only    only download/prepare/binarize the data set
#
# Environment overrides (all optional):
#   DATA_DIR    local parallel text instead of downloading: {train,valid,test}.{SRC,TGT} (or .src/.tgt);
#               valid is optional (split off the training data as the paper's prepare script does)
#   TOKENIZE    moses (default; Moses tokenizer as fairseq's prepare scripts) | none (files already tokenized)
#   MOSES_DIR   a mosesdecoder checkout (default: cloned into $WORK_DIR/tools when first needed)
#   WORK_DIR    where data, runs and tools go (default: work-data/recipes in the checkout)
#   MAX_UPDATE  stop training after this many updates (appended as --max-update)
#   EXTRA_ARGS  appended to fairseq-train (last, so they win), e.g. "--max-tokens 2048 --fp16"
#   GEN_EXTRA_ARGS  appended to fairseq-generate
#   GPUS        cpu | comma-separated GPU ids (default: every GPU nvidia-smi lists, else cpu); the
#               update frequency is scaled so that the batch matches the paper's GPU count
#   BPE_TOKENS  BPE merge operations (default: the paper's)   AVG_N  checkpoints to average (0: best)
#   SEED        training seed (default: the recipe's)        PYTHON  interpreter (default: .venv/bin/python)
#   THREADS     threads for tokenization/binarization (default: nproc)

set -euo pipefail

RECIPES_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$RECIPES_DIR/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
FS_BIN=$(dirname "$PY")
USER_DIR=$ROOT/fairseq_deepinit
TOOLS=$RECIPES_DIR/recipe_tools.py
WORK_DIR=${WORK_DIR:-$ROOT/work-data/recipes}
THREADS=${THREADS:-$(nproc 2>/dev/null || echo 1)}

# ---- settings a recipe sets (defaults here) --------------------------------------------------
PAPER=${PAPER:-}               # folder name of the paper (examples/<paper>)
TABLE=${TABLE:-}               # the table or figure the rows reproduce
DATASET=${DATASET:-}           # iwslt14_de_en | wmt14_en_de | wmt17_en_de | wmt14_en_fr | iwslt15_en_vi
SRC=${SRC:-}
TGT=${TGT:-}
JOINED_DICT=${JOINED_DICT:-0}  # fairseq-preprocess --joined-dictionary
SCORE=${SCORE:-tok}            # tok | compound | sacrebleu: how the paper computed BLEU
AVG_MODE=${AVG_MODE:-epoch}    # epoch | update: which checkpoints the paper averaged
AVG_UPPER=${AVG_UPPER:-}       # average only checkpoints numbered <= this (the paper's last epoch)
SAVE_INTERVAL_UPDATES=${SAVE_INTERVAL_UPDATES:-}  # AVG_MODE=update: save every this many updates
PAPER_GPUS=${PAPER_GPUS:-1}    # GPUs the paper's batch was spread over
PAPER_UPDATE_FREQ=${PAPER_UPDATE_FREQ:-1}
PAPER_FP16=${PAPER_FP16:-0}    # the paper trained with --fp16 (added on GPUs only; never --bf16)
TRAIN_ARGS=()                  # fairseq-train flags shared by every row
GEN_ARGS=()                    # fairseq-generate flags (beam, length penalty)

declare -a ROW_NAMES=()
declare -A ROW_BLEU=() ROW_ARGS=()

# row NAME PAPER_BLEU [fairseq-train flags of this row...]
# PAPER_BLEU is the number the paper reports for the row ("-" when this project's METHODS.md has none).
row() {
  local name=$1 bleu=$2
  shift 2
  ROW_NAMES+=("$name")
  ROW_BLEU[$name]=$bleu
  ROW_ARGS[$name]=$(printf '%q ' "$@")
}

die() {
  echo "error: $*" >&2
  exit 1
}
say() { echo "==> $*" >&2; }

DRY_RUN=0
# run CMD...: execute, or print it (shell-quoted, one line) under --dry-run
run() {
  if [ "$DRY_RUN" = 1 ]; then
    printf '%q ' "$@" | sed 's/ $//'
    echo
  else
    "$@"
  fi
}
# run_to FILE CMD...: the same with stdout to FILE (written atomically)
run_to() {
  local out=$1
  shift
  if [ "$DRY_RUN" = 1 ]; then
    printf '%q ' "$@"
    printf '> %q\n' "$out"
  else
    "$@" >"$out.tmp" && mv "$out.tmp" "$out"
  fi
}

# ---- data sets ---------------------------------------------------------------------------------
# How each data set is tokenized, cleaned and split, as the prepare script named in the comment does.
dataset_settings() {
  PRETOKENIZED=0 LOWERCASE=0 AGGRESSIVE=0 NORM_PUNC=0 CLEAN_STAGE=none CLEAN_MAX=0 CLEAN_RATIO=9 VALID_EVERY=0
  case $DATASET in
    iwslt14_de_en)
      # fairseq examples/translation/prepare-iwslt14.sh: Moses tokenizer, clean-corpus-n 1-175 ratio 1.5
      # on the tokenized training data, lowercase, every 23rd training line is the validation set
      LOWERCASE=1 CLEAN_STAGE=tok CLEAN_MAX=175 CLEAN_RATIO=1.5 VALID_EVERY=23 ;;
    wmt14_en_de | wmt17_en_de)
      # fairseq prepare-wmt14en2de.sh (--icml17 for wmt14_en_de): normalize-punctuation, remove
      # non-printing chars, tokenizer -a; every 100th training line is validation; BPE, then
      # clean-corpus-n 1-250 ratio 1.5 on train and valid
      AGGRESSIVE=1 NORM_PUNC=1 CLEAN_STAGE=bpe CLEAN_MAX=250 CLEAN_RATIO=1.5 VALID_EVERY=100 ;;
    wmt14_en_fr)
      # fairseq prepare-wmt14en2fr.sh: as En-De, every 1333rd training line is validation
      AGGRESSIVE=1 NORM_PUNC=1 CLEAN_STAGE=bpe CLEAN_MAX=250 CLEAN_RATIO=1.5 VALID_EVERY=1333 ;;
    iwslt15_en_vi)
      # Stanford's preprocessed IWSLT15 En-Vi (Luong & Manning 2015; TwT's data): already tokenized;
      # TwT's README filters training pairs longer than ~250 words before BPE and nothing else
      PRETOKENIZED=1 CLEAN_STAGE=tok CLEAN_MAX=250 CLEAN_RATIO=inf ;;
    *) die "unknown DATASET '$DATASET' in the recipe" ;;
  esac
}

download() {  # download URL DEST
  local url=$1 dest=$2
  if [ -s "$dest" ]; then
    say "already downloaded: $dest"
    return
  fi
  say "downloading $url"
  if command -v wget >/dev/null; then
    wget -q -O "$dest.part" "$url" || { rm -f "$dest.part"; die "download of $url failed; fetch it by hand into $dest, or run on local files with DATA_DIR=..."; }
  else
    curl -fsSL -o "$dest.part" "$url" || { rm -f "$dest.part"; die "download of $url failed; fetch it by hand into $dest, or run on local files with DATA_DIR=..."; }
  fi
  mv "$dest.part" "$dest"
}

# sgm/xml segments to plain text, as fairseq's prepare scripts extract test sets
extract_segs() {
  grep '<seg id' "$1" | sed -e 's/<seg id="[0-9]*">\s*//g' -e 's/\s*<\/seg>\s*//g' -e "s/\’/\'/g"
}

fetch_iwslt14_de_en() {  # -> $1/{train,test}.{de,en}; validation is split off later
  local raw=$1 orig=$WORK_DIR/downloads/iwslt14
  mkdir -p "$orig"
  download http://dl.fbaipublicfiles.com/fairseq/data/iwslt14/de-en.tgz "$orig/de-en.tgz"
  tar -xzf "$orig/de-en.tgz" -C "$orig"
  local l f
  for l in de en; do
    grep -v '<url>' "$orig/de-en/train.tags.de-en.$l" | grep -v '<talkid>' | grep -v '<keywords>' |
      sed -e 's/<title>//g' -e 's/<\/title>//g' -e 's/<description>//g' -e 's/<\/description>//g' >"$raw/train.$l"
    : >"$raw/test.$l"
    for f in IWSLT14.TED.dev2010 IWSLT14.TEDX.dev2012 IWSLT14.TED.tst2010 IWSLT14.TED.tst2011 IWSLT14.TED.tst2012; do
      extract_segs "$orig/de-en/$f.de-en.$l.xml" >>"$raw/test.$l"
    done
  done
}

fetch_wmt14() {  # fetch_wmt14 RAW PAIR NC_URL NC_CORPUS: europarl v7 + commoncrawl + news-commentary, newstest2014
  local raw=$1 pair=$2 nc_url=$3 nc=$4 orig=$WORK_DIR/downloads/wmt14 l t u
  mkdir -p "$orig"
  local urls=(http://statmt.org/wmt13/training-parallel-europarl-v7.tgz
    http://statmt.org/wmt13/training-parallel-commoncrawl.tgz "$nc_url" http://statmt.org/wmt14/test-full.tgz)
  local corpora=("training/europarl-v7.$pair" "commoncrawl.$pair" "$nc")
  if [ "$pair" = fr-en ]; then
    urls+=(http://statmt.org/wmt13/training-parallel-un.tgz http://statmt.org/wmt10/training-giga-fren.tar)
    corpora+=(un/undoc.2000.fr-en giga-fren.release2.fixed)
  fi
  for u in "${urls[@]}"; do
    download "$u" "$orig/$(basename "$u")"
    tar -xf "$orig/$(basename "$u")" -C "$orig"
  done
  if [ "$pair" = fr-en ]; then gunzip -f "$orig"/giga-fren.release2.fixed.*.gz 2>/dev/null || true; fi
  for l in $SRC $TGT; do
    for u in "${corpora[@]}"; do cat "$orig/$u.$l"; done >"$raw/train.$l"
    if [ "$l" = "$SRC" ]; then t=src; else t=ref; fi
    local test_pair=deen
    [ "$pair" = fr-en ] && test_pair=fren
    extract_segs "$orig/test-full/newstest2014-$test_pair-$t.$l.sgm" >"$raw/test.$l"
  done
}

fetch_iwslt15_en_vi() {
  local raw=$1 base=https://nlp.stanford.edu/projects/nmt/data/iwslt15.en-vi l
  for l in en vi; do
    download "$base/train.$l" "$raw/train.$l"
    download "$base/tst2012.$l" "$raw/valid.$l"
    download "$base/tst2013.$l" "$raw/test.$l"
  done
}

# sets CORPUS and RAW; links DATA_DIR's files, or downloads the paper's data set (never in --dry-run)
locate_raw() {
  if [ -n "${DATA_DIR:-}" ]; then
    local abs
    abs=$(cd "$DATA_DIR" 2>/dev/null && pwd) || die "DATA_DIR=$DATA_DIR is not a folder"
    CORPUS=$WORK_DIR/data/$DATASET-local-$(printf '%s' "$abs" | sha1sum | cut -c1-8)
  else
    CORPUS=$WORK_DIR/data/$DATASET
  fi
  RAW=$CORPUS/raw
  [ "$DRY_RUN" = 1 ] && return
  [ -f "$RAW/.done" ] && return
  rm -rf "$RAW" && mkdir -p "$RAW"
  if [ -n "${DATA_DIR:-}" ]; then
    local split side lang found
    for split in train valid test; do
      for side in src tgt; do
        if [ "$side" = src ]; then lang=$SRC; else lang=$TGT; fi
        found=
        [ -f "$abs/$split.$lang" ] && found=$abs/$split.$lang
        [ -z "$found" ] && [ -f "$abs/$split.$side" ] && found=$abs/$split.$side
        if [ -n "$found" ]; then
          ln -s "$found" "$RAW/$split.$lang"
        elif [ "$split" != valid ]; then
          die "DATA_DIR=$DATA_DIR has no $split.$lang (or $split.$side); it needs {train,test}.{$SRC,$TGT}, valid optional"
        fi
      done
    done
    if [ -e "$RAW/valid.$SRC" ] && [ ! -e "$RAW/valid.$TGT" ] || [ ! -e "$RAW/valid.$SRC" ] && [ -e "$RAW/valid.$TGT" ]; then
      die "DATA_DIR has a validation file for one language only; give both or neither"
    fi
  else
    say "no DATA_DIR: downloading $DATASET (set DATA_DIR=... to use local files instead)"
    case $DATASET in
      iwslt14_de_en) fetch_iwslt14_de_en "$RAW" ;;
      wmt14_en_de) fetch_wmt14 "$RAW" de-en http://statmt.org/wmt14/training-parallel-nc-v9.tgz training/news-commentary-v9.de-en ;;
      wmt17_en_de) fetch_wmt14 "$RAW" de-en http://data.statmt.org/wmt17/translation-task/training-parallel-nc-v12.tgz training/news-commentary-v12.de-en ;;
      wmt14_en_fr) fetch_wmt14 "$RAW" fr-en http://statmt.org/wmt14/training-parallel-nc-v9.tgz training/news-commentary-v9.fr-en ;;
      iwslt15_en_vi) fetch_iwslt15_en_vi "$RAW" ;;
    esac
  fi
  touch "$RAW/.done"
}

moses() {  # path of a Moses script; clones mosesdecoder (as fairseq's prepare scripts do) when needed
  local dir=${MOSES_DIR:-$WORK_DIR/tools/mosesdecoder}
  if [ ! -d "$dir/scripts" ]; then
    [ -n "${MOSES_DIR:-}" ] && die "MOSES_DIR=$MOSES_DIR has no scripts/ folder"
    say "cloning Moses (tokenizer scripts) into $dir"
    mkdir -p "$(dirname "$dir")"
    git clone -q --depth 1 https://github.com/moses-smt/mosesdecoder.git "$dir" ||
      die "could not clone Moses; set MOSES_DIR to a mosesdecoder checkout, or TOKENIZE=none for tokenized files"
  fi
  echo "$dir/scripts/$1"
}

tokenize_file() {  # tokenize_file IN OUT LANG SPLIT
  local in=$1 out=$2 lang=$3 split=$4 aggressive=()
  [ "$AGGRESSIVE" = 1 ] && aggressive=(-a)
  if [ "$TOKENIZE" = none ]; then
    cat "$in"
  elif [ "$NORM_PUNC" = 1 ] && [ "$split" != test ]; then
    # fairseq's WMT scripts normalize punctuation of training (and validation) data, not of the test set
    perl "$(moses tokenizer/normalize-punctuation.perl)" "$lang" <"$in" | perl "$(moses tokenizer/remove-non-printing-char.perl)" |
      perl "$(moses tokenizer/tokenizer.perl)" -q -threads "$THREADS" "${aggressive[@]}" -l "$lang"
  else
    perl "$(moses tokenizer/tokenizer.perl)" -q -threads "$THREADS" "${aggressive[@]}" -l "$lang" <"$in"
  fi | if [ "$LOWERCASE" = 1 ]; then "$PY" -c 'import sys
for line in sys.stdin: sys.stdout.write(line.lower())'; else cat; fi >"$out"
}

# tokenize (+ lowercase), clean, split validation, BPE, clean, binarize; sets BPE_DIR, BIN
prepare_data() {
  dataset_settings
  TOKENIZE=${TOKENIZE:-$([ "$PRETOKENIZED" = 1 ] && echo none || echo moses)}
  [ "$TOKENIZE" = moses ] || [ "$TOKENIZE" = none ] || die "TOKENIZE must be moses or none, got '$TOKENIZE'"
  locate_raw
  local tok=$CORPUS/tok-$TOKENIZE
  BPE_DIR=$tok/bpe$BPE_TOKENS
  BIN=$BPE_DIR/bin$([ "$JOINED_DICT" = 1 ] && echo -joined || true)
  if [ "$DRY_RUN" = 1 ]; then
    echo "# data: $([ -n "${DATA_DIR:-}" ] && echo "DATA_DIR=$DATA_DIR" || echo "download $DATASET") -> tokenize=$TOKENIZE" \
      "lowercase=$LOWERCASE clean=$CLEAN_STAGE(1-$CLEAN_MAX, ratio $CLEAN_RATIO) valid=$([ "$VALID_EVERY" -gt 0 ] && echo "every ${VALID_EVERY}th train line if none given" || echo given)" \
      "-> joint BPE $BPE_TOKENS (subword-nmt) -> $BIN"
  fi
  local l split
  if [ "$DRY_RUN" = 0 ] && [ ! -f "$tok/.done" ]; then
    say "tokenize ($TOKENIZE, lowercase=$LOWERCASE) -> $tok"
    rm -rf "$tok" && mkdir -p "$tok"
    for split in train valid test; do
      [ -e "$RAW/$split.$SRC" ] || continue
      for l in $SRC $TGT; do tokenize_file "$RAW/$split.$l" "$tok/$split.$l" "$l" "$split"; done
    done
    if [ "$CLEAN_STAGE" = tok ]; then
      mv "$tok/train.$SRC" "$tok/train.unclean.$SRC" && mv "$tok/train.$TGT" "$tok/train.unclean.$TGT"
      "$PY" "$TOOLS" clean "$tok/train.unclean.$SRC" "$tok/train.unclean.$TGT" "$tok/train.$SRC" "$tok/train.$TGT" \
        --max "$CLEAN_MAX" --ratio "$CLEAN_RATIO"
      rm "$tok/train.unclean.$SRC" "$tok/train.unclean.$TGT"
    fi
    if [ ! -e "$tok/valid.$SRC" ]; then
      [ "$VALID_EVERY" -gt 0 ] || die "no validation set in $RAW"
      say "validation set: every ${VALID_EVERY}th training line (as the data set's prepare script)"
      for l in $SRC $TGT; do
        awk -v n="$VALID_EVERY" 'NR % n == 0' "$tok/train.$l" >"$tok/valid.$l"
        awk -v n="$VALID_EVERY" 'NR % n != 0' "$tok/train.$l" >"$tok/train.rest.$l" && mv "$tok/train.rest.$l" "$tok/train.$l"
      done
    fi
    touch "$tok/.done"
  fi
  if [ "$DRY_RUN" = 0 ] && [ ! -f "$BPE_DIR/.done" ]; then
    say "joint BPE, $BPE_TOKENS merges (subword-nmt) -> $BPE_DIR"
    rm -rf "$BPE_DIR" && mkdir -p "$BPE_DIR"
    cat "$tok/train.$SRC" "$tok/train.$TGT" | "$FS_BIN/subword-nmt" learn-bpe -s "$BPE_TOKENS" >"$BPE_DIR/codes"
    for split in train valid test; do
      for l in $SRC $TGT; do
        "$FS_BIN/subword-nmt" apply-bpe -c "$BPE_DIR/codes" <"$tok/$split.$l" >"$BPE_DIR/$split.$l"
      done
    done
    if [ "$CLEAN_STAGE" = bpe ]; then
      for split in train valid; do
        for l in $SRC $TGT; do mv "$BPE_DIR/$split.$l" "$BPE_DIR/$split.unclean.$l"; done
        "$PY" "$TOOLS" clean "$BPE_DIR/$split.unclean.$SRC" "$BPE_DIR/$split.unclean.$TGT" \
          "$BPE_DIR/$split.$SRC" "$BPE_DIR/$split.$TGT" --max "$CLEAN_MAX" --ratio "$CLEAN_RATIO"
        for l in $SRC $TGT; do rm "$BPE_DIR/$split.unclean.$l"; done
      done
    fi
    touch "$BPE_DIR/.done"
  fi
  if [ -f "$BIN/.done" ]; then
    say "already binarized: $BIN"
    return
  fi
  local joined=()
  [ "$JOINED_DICT" = 1 ] && joined=(--joined-dictionary)
  [ "$DRY_RUN" = 0 ] && rm -rf "$BIN"
  run "$FS_BIN/fairseq-preprocess" --source-lang "$SRC" --target-lang "$TGT" --trainpref "$BPE_DIR/train" \
    --validpref "$BPE_DIR/valid" --testpref "$BPE_DIR/test" --destdir "$BIN" --workers "$THREADS" "${joined[@]}"
  [ "$DRY_RUN" = 1 ] || touch "$BIN/.done"
}

# ---- devices -----------------------------------------------------------------------------------
# sets DEVICE_ARGS (--cpu or nothing), TRAIN_DEVICE_ARGS (--fp16 on GPUs where the paper used it)
# and UPDATE_FREQ (the paper's batch on this many devices)
devices() {
  local gpus=${GPUS:-auto} n
  if [ "$gpus" = auto ]; then
    gpus=cpu
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
      n=$(nvidia-smi -L | grep -c '^GPU')
      [ "$n" -gt 0 ] && gpus=$(seq -s, 0 $((n - 1)))
    fi
  fi
  TRAIN_DEVICE_ARGS=()
  if [ "$gpus" = cpu ]; then
    DEVICE_ARGS=(--cpu)
    n=1
  else
    export CUDA_VISIBLE_DEVICES=$gpus
    DEVICE_ARGS=()
    if [ "$PAPER_FP16" = 1 ]; then TRAIN_DEVICE_ARGS=(--fp16); fi
    n=$(echo "$gpus" | tr ',' '\n' | grep -c .)
  fi
  local total=$((PAPER_GPUS * PAPER_UPDATE_FREQ))
  UPDATE_FREQ=$(((total + n - 1) / n))
  if [ $((UPDATE_FREQ * n)) -ne "$total" ]; then
    say "warning: the paper's batch is $PAPER_GPUS GPUs x update-freq $PAPER_UPDATE_FREQ; on $n device(s)" \
      "--update-freq $UPDATE_FREQ makes it $((UPDATE_FREQ * n))/$total of that"
  fi
  NDEV=$n
}

# ---- one row -----------------------------------------------------------------------------------
run_row() {
  local name=$1
  [ -n "${ROW_BLEU[$name]+x}" ] || die "unknown row '$name' of $PAPER/$TABLE; rows: ${ROW_NAMES[*]}"
  local row_args=()
  eval "row_args=(${ROW_ARGS[$name]})"
  BPE_TOKENS=${BPE_TOKENS:?the recipe sets BPE_TOKENS}
  prepare_data
  devices
  local avg_n=${AVG_N:-$DEFAULT_AVG_N}
  local keep=()
  if [ "$avg_n" -gt 0 ] && [ "$AVG_MODE" = update ]; then
    keep=(--save-interval-updates "$SAVE_INTERVAL_UPDATES" --keep-interval-updates "$avg_n")
  elif [ "$avg_n" -gt 0 ]; then
    keep=(--keep-last-epochs "$avg_n")
  else
    keep=(--no-epoch-checkpoints)
  fi
  local extra=() gen_extra=() stop=()
  # shellcheck disable=SC2206  # word splitting of the override strings is intended
  extra=(${EXTRA_ARGS:-})
  # shellcheck disable=SC2206
  gen_extra=(${GEN_EXTRA_ARGS:-})
  [ -n "${MAX_UPDATE:-}" ] && stop=(--max-update "$MAX_UPDATE")
  local train=("$FS_BIN/fairseq-train" "$BIN" --user-dir "$USER_DIR" --task translation -s "$SRC" -t "$TGT"
    --seed "${SEED:-$DEFAULT_SEED}" "${TRAIN_ARGS[@]}" "${row_args[@]}" --update-freq "$UPDATE_FREQ" "${keep[@]}"
    --log-format simple --log-interval 100 "${DEVICE_ARGS[@]}" "${TRAIN_DEVICE_ARGS[@]}" "${stop[@]}" "${extra[@]}")
  # the run folder is named after everything that changes the model or its training, so that another
  # configuration never resumes this one's checkpoints
  local run_id
  run_id=$(printf '%s\n' "${train[@]:2}" | sha1sum | cut -c1-8)
  local run_dir=$WORK_DIR/runs/$PAPER/$TABLE/$name-$run_id
  train+=(--save-dir "$run_dir")
  echo "# $PAPER $TABLE row $name (paper: ${ROW_BLEU[$name]} BLEU, $SCORE) on $NDEV device(s); run folder $run_dir"
  if [ "$DRY_RUN" = 0 ]; then
    mkdir -p "$run_dir"
    printf '%q ' "${train[@]}" >"$run_dir/train.cmd"
  fi
  if [ -f "$run_dir/train.done" ]; then
    say "training already finished ($run_dir/train.done); delete it to train again"
  else
    if [ "$DRY_RUN" = 1 ]; then run "${train[@]}"; else
      say "train $name"
      run "${train[@]}" 2>&1 | tee -a "$run_dir/train.log" || die "fairseq-train failed (log: $run_dir/train.log)"
      [ -f "$run_dir/checkpoint_last.pt" ] || die "training wrote no checkpoint (log: $run_dir/train.log)"
      touch "$run_dir/train.done"
    fi
  fi
  local ckpt
  if [ "$avg_n" -gt 0 ]; then
    ckpt=$run_dir/checkpoint_avg$avg_n.pt
    local upper=()
    [ -n "$AVG_UPPER" ] && upper=(--upper-bound "$AVG_UPPER")
    run "$PY" "$TOOLS" average --inputs "$run_dir" --mode "$AVG_MODE" --num "$avg_n" "${upper[@]}" --output "$ckpt"
  else
    ckpt=$run_dir/checkpoint_best.pt
  fi
  local gen=$run_dir/generate-test.txt
  [ "$DRY_RUN" = 1 ] || [ -f "$ckpt" ] || die "no checkpoint to translate with: $ckpt"
  run_to "$gen" "$FS_BIN/fairseq-generate" "$BIN" --user-dir "$USER_DIR" --task translation -s "$SRC" -t "$TGT" \
    --path "$ckpt" --gen-subset test --remove-bpe --batch-size 128 --required-batch-size-multiple 1 \
    "${GEN_ARGS[@]}" "${DEVICE_ARGS[@]}" "${gen_extra[@]}"
  local score_args=(--mode "$SCORE")
  if [ "$SCORE" = sacrebleu ]; then
    [ "$TOKENIZE" = moses ] || die "sacreBLEU scores detokenized output against raw references; it needs TOKENIZE=moses"
    score_args+=(--ref "$RAW/test.$TGT" --detok-cmd "perl $(moses tokenizer/detokenizer.perl) -q -l $TGT")
  fi
  run_to "$run_dir/bleu.txt" "$PY" "$TOOLS" score "$gen" "${score_args[@]}"
  if [ "$DRY_RUN" = 0 ]; then
    grep '^Generate test' "$gen" | sed 's/^/fairseq-generate: /' || true
    echo "$PAPER $TABLE $name: $(cat "$run_dir/bleu.txt")"
    echo "paper: ${ROW_BLEU[$name]}"
  fi
}

list_rows() {
  local name
  printf '%-22s %-8s %s\n' row paper flags
  for name in "${ROW_NAMES[@]}"; do
    printf '%-22s %-8s %s\n' "$name" "${ROW_BLEU[$name]}" "${ROW_ARGS[$name]}"
  done
}

recipe_main() {
  DEFAULT_AVG_N=${DEFAULT_AVG_N:-10}
  DEFAULT_SEED=${DEFAULT_SEED:-1}
  local rows=() arg PREPARE_ONLY=0
  for arg in "$@"; do
    case $arg in
      --list) list_rows; return ;;
      --dry-run) DRY_RUN=1 ;;
      --prepare-only) PREPARE_ONLY=1 ;;
      -h | --help)
        awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
        echo "usage: bash $0 ROW [--dry-run] | --list | --dry-run (every row) | --prepare-only (data only)"
        echo "environment overrides: see examples/README.md (DATA_DIR, WORK_DIR, MAX_UPDATE, EXTRA_ARGS, GPUS, ...)"
        list_rows
        return ;;
      -*) die "unknown option $arg; use --list, --dry-run or --help" ;;
      *) rows+=("$arg") ;;
    esac
  done
  if [ "$PREPARE_ONLY" = 1 ]; then
    BPE_TOKENS=${BPE_TOKENS:?the recipe sets BPE_TOKENS}
    prepare_data
    echo "prepared: $BIN"
    return
  fi
  if [ ${#rows[@]} -eq 0 ]; then
    [ "$DRY_RUN" = 1 ] || die "name a row (bash $0 --list shows them), or --dry-run for every row's commands"
    rows=("${ROW_NAMES[@]}")
  fi
  for arg in "${rows[@]}"; do run_row "$arg"; done
}
