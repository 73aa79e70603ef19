#!/usr/bin/env bash
# The committed cited-answer (JSON) run; the same command resumes it (rows already written are kept).
cd "$(dirname "$0")/../../.."
OMP_NUM_THREADS=2 exec .venv/bin/python -m evals --datasets nq --num-docs 10,20 --gold-positions first,middle,last \
  --num-questions 50 --methods full,snapkv,streaming --budgets 25%,50% --max-new-tokens 40 --citations json \
  --no-progress --out evals/results/citations-json
