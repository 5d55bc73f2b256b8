"""Numeric kernels: microscaling (MX) formats."""
