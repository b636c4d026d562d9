"""The conversation as text and tokens: chat templates, thinking markers, tool calls, constraints."""
