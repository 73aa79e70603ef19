"""What the LangChain and LlamaIndex adapters share: the engine fields and loading spec, per-call options,
result metadata, blocking iterators turned async."""
