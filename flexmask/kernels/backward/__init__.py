"""The backward kernels: two_pass.py (deterministic; also the preprocess every path shares), fused.py
(dQ by atomics), hopper.py and hopper_dq.py (Gluon, sm_90), and their launch configurations
(configs.py). kernels/dispatch.py picks one."""
