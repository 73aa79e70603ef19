"""Compression methods: the selection algorithms as pure tensor functions, and what builds on them."""
