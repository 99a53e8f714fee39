"""The engine's front end: sampling parameters in, text and structured output out, offline LLM."""
