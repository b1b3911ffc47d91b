"""`speccompile serve`: an OpenAI-compatible HTTP server over a Runtime's engine (app.py)."""
