"""Operator tools that run beside the services (``python -m infera.tools.<tool>``)."""
