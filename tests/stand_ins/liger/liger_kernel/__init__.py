"""A CPU stand-in for liger-kernel (benchmark rehearsals only): its kernels are torch ops."""
CPU_STAND_IN = True
