#!/usr/bin/env bash
# The demo pair, end to end (hours on 2 CPU cores). Each step resumes where it stopped.
#   1. tokenizer + corpus tokens   2. target (tools/train_demo.py)   3. draft (speccompile distill, two
#   stages: corpus windows, then half the batches continued by the target)   4. fp16 export into
#   speccompile/demo/   5. measurements for the model card
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-work/demo}
[ -f "$WORK/train_tokens.npy" ] || python tools/train_demo.py tokenizer "$WORK"
python tools/train_demo.py target "$WORK" --steps 900
python tools/train_demo.py export "$WORK" speccompile/demo/target
speccompile distill --target speccompile/demo/target --corpus stdlib --out "$WORK/draft" \
    --layers 3 --hidden 192 --intermediate 512 --steps 2000 --batch 16 --seq-len 128 --lr 3e-3 --seed 0 \
    --generated-fraction 0.2 --checkpoint-every 50
python tools/train_demo.py export "$WORK" speccompile/demo/draft --model "$WORK/draft"
speccompile distill --target speccompile/demo/target --corpus stdlib --out "$WORK/draft2" \
    --init speccompile/demo/draft --steps 2400 --batch 16 --seq-len 128 --lr 1e-3 --seed 1 \
    --generated-fraction 0.5 --checkpoint-every 50
python tools/train_demo.py export "$WORK" speccompile/demo/draft --model "$WORK/draft2"
python -m tools.measure demo --out "$WORK/measurements.json"
