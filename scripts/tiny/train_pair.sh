#!/usr/bin/env bash
# Build the noesis-tiny corpus and tokenizer, then train the target and the draft side by side on
# one device, both inside a deadline counted from the start of this script.
#
#   PYTHONPATH=src scripts/tiny/train_pair.sh OUT_DIR [DEADLINE_SECONDS]
#
# Writes OUT_DIR/data (corpus tokens, tokenizer), OUT_DIR/noesis-tiny, OUT_DIR/noesis-tiny-draft and
# OUT_DIR/{data,target,draft}.log. Knobs (environment): PYTHON, TRAIN_ITEMS, TARGET_MINUTES,
# DRAFT_MINUTES, SEED, COMPILE (1 to use torch.compile), TRAIN_ARGS (more train options for both).
set -euo pipefail
out=${1:?usage: train_pair.sh OUT_DIR [DEADLINE_SECONDS]}
deadline=${2:-460}
python=${PYTHON:-python3}
seed=${SEED:-0}
compile=$([ "${COMPILE:-1}" = 1 ] && echo --compile || true)
began=$SECONDS
mkdir -p "$out"

"$python" -m noesis.tiny.data --out "$out/data" --seed "$seed" \
    --train-items "${TRAIN_ITEMS:-600000}" 2>&1 | tee "$out/data.log"

# Whatever the data build took, leave 45 s for the final evaluation and export.
left=$((deadline - (SECONDS - began) - 45))
minutes() { "$python" -c "print(round(max(0.1, min($1, $left / 60)), 2))"; }
target_minutes=$(minutes "${TARGET_MINUTES:-5}")
draft_minutes=$(minutes "${DRAFT_MINUTES:-3}")
echo "training: target ${target_minutes} min, draft ${draft_minutes} min (side by side)"

"$python" -m noesis.tiny.train --data "$out/data" --out "$out/noesis-tiny-draft" --size draft \
    --seed "$seed" --minutes "$draft_minutes" --lr 3e-3 $compile ${TRAIN_ARGS:-} >"$out/draft.log" 2>&1 &
draft_pid=$!
"$python" -m noesis.tiny.train --data "$out/data" --out "$out/noesis-tiny" --size target \
    --seed "$seed" --minutes "$target_minutes" --lr 2e-3 $compile ${TRAIN_ARGS:-} 2>&1 | tee "$out/target.log"
wait "$draft_pid" || { echo "draft training failed:"; tail -20 "$out/draft.log"; exit 1; }
tail -3 "$out/draft.log"
