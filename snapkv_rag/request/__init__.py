"""A request's text side: prompts and citations, chat templates and stop strings, tools, structured
output, and the results a generation returns."""
