"""The KV cache: a request's compressed prompt cache, the static slot cache rows decode from, recurrent row
states, ragged heads, prompt tails, and the document prefix cache."""
