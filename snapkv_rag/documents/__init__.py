"""Documents reused across questions: compressed document sets (stored, saved, loaded) and per-document
caches stitched into any prompt."""
