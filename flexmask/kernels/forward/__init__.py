"""The forward kernels: portable.py (Triton, every device and the CPU interpreter), hopper.py (Gluon,
sm_90), and their launch configurations (configs.py). kernels/dispatch.py picks one."""
