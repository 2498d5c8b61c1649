"""Split-KV decoding (Flash-Decoding): split_kv.py (Triton), hopper.py (Gluon, sm_90) and the plans
that choose between them (configs.py)."""
