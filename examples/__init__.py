"""Runnable examples of flexmask. Run them as modules from the repository root, e.g.
``python -m examples.train_packed_lm train --tiny``."""
