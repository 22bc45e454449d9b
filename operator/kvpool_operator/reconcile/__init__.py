"""Reconciliation: children.py decides and applies; handlers.py wires it into kopf."""
