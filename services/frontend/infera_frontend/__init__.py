"""Infera frontend: the OpenAI-compatible HTTP and NATS API in front of the fleet."""
