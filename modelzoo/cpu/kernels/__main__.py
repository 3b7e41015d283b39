"""`python -m modelzoo.cpu.kernels`: builds the C++ CPU kernels for this machine (run by `make setup`)."""
import logging

from modelzoo.cpu.kernels import cpu_kernels, kernel_build_dir

logging.basicConfig(level=logging.INFO, format="%(message)s")
if cpu_kernels() is None:
    raise SystemExit("C++ CPU kernels NOT built; zoo-infer will use its PyTorch code path")
print(f"C++ CPU kernels ready in {kernel_build_dir()}")
