"""Adapters that plug generated kernels into other libraries' attention hooks."""
