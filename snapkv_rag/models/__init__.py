"""Models: loading them (the embedded default, folders, GGUF, hub ids) and what each family's layers keep."""
