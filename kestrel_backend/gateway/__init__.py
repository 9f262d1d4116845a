"""The Moondream API and OpenAI chat completions in front of tritonserver (python -m kestrel_backend.gateway)."""
