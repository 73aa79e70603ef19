"""RAG accuracy evals for snapkv-rag: datasets -> prompts -> shared-prefill runs -> metrics -> reports.

Run ``python -m evals --help`` from the repository root. The pieces, one job each:
:mod:`evals.datasets` builds multi-document examples from the real data in ``evals/data``,
:mod:`evals.methods` turns method specs into compression configs with per-cell budgets,
:mod:`evals.metrics` scores answers, citations and fidelity, :mod:`evals.runner` runs and
checkpoints, :mod:`evals.report` writes tables and plots.
"""
