"""Emit: a plan rendered through its family's Jinja2 template, black-formatted."""
