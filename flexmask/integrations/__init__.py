"""Bridges to other libraries. Each submodule imports its library, so import only the one you
use (e.g. ``import flexmask.integrations.transformers``); flexmask itself needs none of them."""
