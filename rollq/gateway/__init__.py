"""The HTTP gateway: rollq's API, OpenAI-compatible completions, /metrics and the dashboard."""
