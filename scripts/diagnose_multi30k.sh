#!/usr/bin/env bash
# Reproduces the figures of docs/diagnostics.md: deepinit-diagnose on Multi30k de-en for Post-LN,
# Pre-LN, Admin, T-Fixup and DS-Init at 6 and 18 layers per stack (d=128, FFN 512, 4 heads: small
# enough for 2 CPU cores), the output change against depth for each scheme, and the learned
# ScaleNorm g of a Transformers-without-Tears model trained for a short while.
#
# Knobs (environment variables):
#   MULTI30K_DIR [unset: ../shared/data/multi30k if present, else the pinned public release,
#                 downloaded once into work-data/multi30k and sha256-checked; scripts/multi30k_data.py]
#   WORK_DIR [work-data/diagnostics]  OUT_DIR [docs/diagnostics]  TWT_UPDATES [1500]
#   SCHEMES [postln preln admin tfixup dsinit]  PY [.venv/bin/python]
# About an hour on 2 busy cores. Every finished run is skipped on a re-run.
set -euo pipefail
case ${1:-} in
  -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
  "") ;;
  *) echo "error: $0 takes no arguments (got $1); set the environment variables of --help instead" >&2; exit 1 ;;
esac
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WORK=${WORK_DIR:-work-data/diagnostics}
OUT=${OUT_DIR:-docs/diagnostics}
SCHEMES=${SCHEMES:-postln preln admin tfixup dsinit}
TWT_UPDATES=${TWT_UPDATES:-1500}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
DIMS=(--encoder-embed-dim 128 --decoder-embed-dim 128 --encoder-ffn-embed-dim 512 --decoder-ffn-embed-dim 512
      --encoder-attention-heads 4 --decoder-attention-heads 4)
LOSS=(--criterion label_smoothed_cross_entropy --label-smoothing 0.1)
mkdir -p "$WORK" "$OUT"

# 1. word-level, lower-cased Multi30k de-en (read in place; nothing is copied into the repository)
if [ ! -f "$WORK/bin/dict.en.txt" ]; then
  # the folder given by MULTI30K_DIR, the local copy, or the public release (one-line error, exit 1)
  M30K=$("$PY" scripts/multi30k_data.py) || exit 1
  mkdir -p "$WORK/raw"
  for split in train val; do
    for l in de en; do
      "$PY" - "$M30K/$split.$l.gz" "$WORK/raw/$split.$l" <<'EOF'
import gzip, re, sys
with gzip.open(sys.argv[1], "rt", encoding="utf-8") as f, open(sys.argv[2], "w", encoding="utf-8") as g:
    for line in f:
        g.write(" ".join(re.findall(r"\w+|[^\w\s]", line.lower())) + "\n")
EOF
    done
  done
  "$PY" -m fairseq_cli.preprocess --source-lang de --target-lang en --trainpref "$WORK/raw/train" \
    --validpref "$WORK/raw/val" --destdir "$WORK/bin" --thresholdsrc 2 --thresholdtgt 2 --workers 2
fi

label() {
  case $1 in
    postln) echo "Post-LN" ;; preln) echo "Pre-LN" ;; admin) echo "Admin" ;;
    tfixup) echo "T-Fixup" ;; dsinit) echo "DS-Init" ;; *) echo "$1" ;;
  esac
}

# 2. every scheme at 6 and 18 layers; the output-change depth sweep once per scheme (with the 6-layer run)
for scheme in $SCHEMES; do
  if [ "$scheme" = admin ] && ! "$PY" -c "import fairseq_deepinit.admin" 2>/dev/null; then
    echo "skipping admin: fairseq_deepinit.admin is not available in this checkout"
    continue
  fi
  for layers in 6 18; do
    run=$WORK/runs/${scheme}${layers}
    [ -f "$run/diagnostics.json" ] && { echo "done: $run"; continue; }
    measure=grad,flow,norm
    [ "$layers" = 6 ] && measure=$measure,change
    "$PY" -m fairseq_deepinit.diagnostics.diagnose "$WORK/bin" --arch "${scheme}_iwslt_de_en" "${DIMS[@]}" \
      --encoder-layers "$layers" --decoder-layers "$layers" "${LOSS[@]}" --max-tokens 3000 \
      --measure "$measure" --depths 2,4,8,16 --repeats 3 --output-dir "$run" --label "$(label "$scheme") ${layers}L"
  done
done

# 3. Transformers without Tears (PreNorm + ScaleNorm + FixNorm + SmallInit), trained for TWT_UPDATES
#    updates (d=64: what a shared 2-core machine allows) with the diagnostics criterion logging the
#    ScaleNorm g and the per-layer gradient norms every 250 updates; then its learned g against depth
ckpt=$WORK/twt6_long/checkpoint_last.pt
if [ ! -f "$ckpt" ]; then
  "$PY" -m fairseq_cli.train "$WORK/bin" --user-dir fairseq_deepinit --arch twt_iwslt_de_en \
    --encoder-embed-dim 64 --decoder-embed-dim 64 --encoder-ffn-embed-dim 256 --decoder-ffn-embed-dim 256 \
    --encoder-attention-heads 4 --decoder-attention-heads 4 --encoder-layers 6 --decoder-layers 6 --dropout 0.1 \
    --criterion label_smoothed_cross_entropy_diagnostics --label-smoothing 0.1 --diagnostics-interval 250 \
    --diagnostics-stats scalenorm,grad --optimizer adam --adam-betas '(0.9, 0.98)' --lr 2e-3 \
    --lr-scheduler inverse_sqrt --warmup-updates 200 --max-tokens 2000 --max-update "$TWT_UPDATES" \
    --log-interval 250 --log-format simple --no-progress-bar --disable-validation --no-epoch-checkpoints \
    --save-interval-updates 250 --keep-interval-updates 1 --save-dir "$WORK/twt6_long" --seed 1 \
    | tee "$WORK/twt6_long.log"
fi
[ -f "$WORK/runs/twt6_trained/diagnostics.json" ] ||
  "$PY" -m fairseq_deepinit.diagnostics.diagnose "$WORK/bin" --checkpoint "$ckpt" --max-tokens 2000 \
    --measure scalenorm,grad --output-dir "$WORK/runs/twt6_trained" --label "TwT 6L d=64, $TWT_UPDATES updates"

# 4. the figures of docs/diagnostics.md
runs=()
for scheme in $SCHEMES; do [ -f "$WORK/runs/${scheme}6/diagnostics.json" ] && runs+=("$WORK/runs/${scheme}6"); done
"$PY" -m fairseq_deepinit.diagnostics.diagnose --compare "${runs[@]}" --output-dir "$WORK/cmp_change"
cp "$WORK/cmp_change/output_change.png" "$OUT/output_change.png"
"$PY" -m fairseq_deepinit.diagnostics.diagnose --compare "$WORK"/runs/{postln,dsinit}{6,18} --output-dir "$WORK/cmp_dsinit"
cp "$WORK/cmp_dsinit/grad_norm.png" "$OUT/grad_norm_postln_dsinit.png"
runs18=()
for scheme in $SCHEMES; do [ -f "$WORK/runs/${scheme}18/diagnostics.json" ] && runs18+=("$WORK/runs/${scheme}18"); done
"$PY" -m fairseq_deepinit.diagnostics.diagnose --compare "${runs18[@]}" --output-dir "$WORK/cmp_18"
cp "$WORK/cmp_18/grad_norm.png" "$OUT/grad_norm_18l.png"
cp "$WORK/runs/postln18/gradient_flow.png" "$OUT/gradient_flow_postln18.png"
cp "$WORK/runs/dsinit18/gradient_flow.png" "$OUT/gradient_flow_dsinit18.png"
cp "$WORK/runs/twt6_trained/scalenorm_g.png" "$OUT/scalenorm_g_twt6.png"
ls -la "$OUT"
