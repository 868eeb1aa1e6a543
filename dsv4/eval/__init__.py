"""Evaluations of a trained model: held-out loss (nats/token, bits/byte) and code-completion quality."""
