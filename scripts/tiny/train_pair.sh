#!/usr/bin/env bash
# Build the noesis-tiny corpus and tokenizer, then train the target and the draft (and, with
# TERNARY_MINUTES, the ternary sibling) side by side on one device, all inside a deadline counted
# from the start of this script.
#
#   PYTHONPATH=src scripts/tiny/train_pair.sh OUT_DIR [DEADLINE_SECONDS]
#
# Writes OUT_DIR/data (corpus tokens, tokenizer), OUT_DIR/noesis-tiny, OUT_DIR/noesis-tiny-draft,
# OUT_DIR/noesis-tiny-ternary and OUT_DIR/{data,target,draft,ternary}.log. Knobs (environment):
# PYTHON, TRAIN_ITEMS, TARGET_MINUTES, DRAFT_MINUTES, TERNARY_MINUTES (0: no ternary model), SEED,
# COMPILE (1 to use torch.compile), TRAIN_ARGS (more train options for all), DATA_ARGS (more
# options for the data build, e.g. "--mixture control"), TOKENIZER (reuse the
# tokenizer.json in this directory instead of fitting one), INIT (a directory holding float
# noesis-tiny and noesis-tiny-draft checkpoints to fine-tune from; the ternary model starts from
# the float noesis-tiny), TARGET_LR, DRAFT_LR, TERNARY_LR.
set -euo pipefail
out=${1:?usage: train_pair.sh OUT_DIR [DEADLINE_SECONDS]}
deadline=${2:-460}
python=${PYTHON:-python3}
seed=${SEED:-0}
compile=$([ "${COMPILE:-1}" = 1 ] && echo --compile || true)
began=$SECONDS
mkdir -p "$out"

"$python" -m noesis.tiny.data --out "$out/data" --seed "$seed" \
    --train-items "${TRAIN_ITEMS:-600000}" ${TOKENIZER:+--tokenizer "$TOKENIZER"} ${DATA_ARGS:-} 2>&1 |
    tee "$out/data.log"

# Whatever the data build took, leave 45 s for the final evaluation and export.
left=$((deadline - (SECONDS - began) - 45))
minutes() { "$python" -c "print(round(max(0.1, min($1, $left / 60)), 2))"; }
target_minutes=$(minutes "${TARGET_MINUTES:-5}")
draft_minutes=$(minutes "${DRAFT_MINUTES:-3}")
echo "training: target ${target_minutes} min, draft ${draft_minutes} min (side by side)"

train() {  # NAME SIZE MINUTES LR INIT_DIR [more options]
    local name=$1 size=$2 mins=$3 lr=$4 init=$5
    shift 5
    "$python" -m noesis.tiny.train --data "$out/data" --out "$out/$name" --size "$size" \
        --seed "$seed" --minutes "$mins" --lr "$lr" ${init:+--init "$init"} $compile \
        ${TRAIN_ARGS:-} "$@"
}
init_target=${INIT:+$INIT/noesis-tiny}
init_draft=${INIT:+$INIT/noesis-tiny-draft}

train noesis-tiny-draft draft "$draft_minutes" "${DRAFT_LR:-3e-3}" "$init_draft" \
    >"$out/draft.log" 2>&1 &
draft_pid=$!
ternary_pid=
if [ "${TERNARY_MINUTES:-0}" != 0 ]; then
    ternary_minutes=$(minutes "$TERNARY_MINUTES")
    echo "training: ternary ${ternary_minutes} min (side by side)"
    train noesis-tiny-ternary target "$ternary_minutes" "${TERNARY_LR:-3e-3}" "$init_target" \
        --ternary >"$out/ternary.log" 2>&1 &
    ternary_pid=$!
fi
train noesis-tiny target "$target_minutes" "${TARGET_LR:-2e-3}" "$init_target" 2>&1 |
    tee "$out/target.log"
wait "$draft_pid" || { echo "draft training failed:"; tail -20 "$out/draft.log"; exit 1; }
tail -3 "$out/draft.log"
if [ -n "$ternary_pid" ]; then
    wait "$ternary_pid" || { echo "ternary training failed:"; tail -20 "$out/ternary.log"; exit 1; }
    tail -3 "$out/ternary.log"
fi
