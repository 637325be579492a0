"""API features beside generation: structured output (xgrammar), tools, chat template."""
