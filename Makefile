# make docs: the tables and figures from the committed result files, then the site (warnings are errors).
# PYTHON is the project's interpreter with the docs extra (scripts/install.sh --test installs it).
PYTHON ?= $(if $(wildcard .venv/bin/python),.venv/bin/python,python3)

.PHONY: docs docs-check

docs:
	$(PYTHON) -m docs.generate
	$(PYTHON) -m sphinx -W -b html docs docs/_build/html

docs-check:
	$(PYTHON) -m docs.generate --check
