#!/usr/bin/env python
"""C++ kernel builds taking turns inside one real job: each forward pass runs on the next build (prefill groups take
turns among themselves, decode steps among themselves), and every kernel call is timed; printed per build, each
kernel's seconds per phase, per phase each build's kernel time a token fed against the first's, and each build's
forward passes: their seconds and the part of them outside the kernels (Python, PyTorch's views, ops and dispatch,
while the other threads wait; measure it at the thread count that matters: on Zen 4 it shrank from one thread to two).

Two whole jobs one after the other drift with the machine (on a shared VM, +-10% between runs of the same code), and
kernel_builds.py's loop over one kernel at a time misses what a job does between calls (the KV cache streamed
through the caches, the next layer's weights cold). Taking turns forward by forward, the builds meet the same data
in the same state of the machine, and its drift falls on both alike.

    python -m modelzoo.cpu.kernels        # prints this checkout's build folder; edit a kernel, run it again
    python benchmarks/job_kernel_builds.py before=<build folder> after=<build folder> -- \\
        --params params.yaml --model_dir out --overwrite
    python benchmarks/job_kernel_builds.py -- --params params.yaml ...     # this checkout's build: where passes go
    python benchmarks/job_kernel_builds.py --per_kernel -- ...   # a Llama layer's kernels timed one by one, not as
                                                                 # the one call (bf16_decoder_layer) a job makes

The arguments after `--` are run_inference.py's. The job's outputs mix the builds' rows: kernel_builds.py and the
tests check that builds compute the same bits, this script only times them. Calls outside a forward pass (the
set-up's GEMM timing) run on the first build, untimed. The timing adds about a microsecond a call to the time outside
the kernels.
"""
from __future__ import annotations

import sys
import time
from collections import defaultdict
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

REPO_ROOT = Path(__file__).resolve().parents[1]
for path in (REPO_ROOT, REPO_ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import modelzoo.cpu.kernels as kernels_module  # noqa: E402
from kernel_builds import load_builds  # noqa: E402


class TakingTurns:
    """Stands in for the kernel module: each attribute is the current build's; inside a forward pass, each call is
    timed into `seconds[(build, phase, kernel)]` and counted in `calls`."""

    def __init__(self, builds: dict[str, ModuleType]) -> None:
        self.builds, self.labels = builds, list(builds)
        self.phase: str | None = None  # "decode" or "prefill" inside a forward pass, else None
        self.turns: dict[str | None, int] = defaultdict(int)  # forward passes of each phase so far
        self.tokens: dict[tuple[str, str], int] = defaultdict(int)  # (build, phase) -> the tokens its passes fed
        self.seconds: dict[tuple[str, str, str], float] = defaultdict(float)
        self.calls: dict[tuple[str, str, str], int] = defaultdict(int)
        self.forward_seconds: dict[tuple[str, str], float] = defaultdict(float)  # (build, phase) -> its passes' time
        self.passes: dict[tuple[str, str], int] = defaultdict(int)

    @property
    def label(self) -> str:
        return self.labels[self.turns[self.phase] % len(self.labels)]

    def __getattr__(self, name: str) -> Any:
        kernel = getattr(self.builds[self.label], name)
        if not callable(kernel) or self.phase is None:
            return kernel
        key = (self.label, self.phase, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            result = kernel(*args, **kwargs)
            self.seconds[key] += time.perf_counter() - start
            self.calls[key] += 1
            return result

        return timed

    def wrap_forward(self, forward: Callable) -> Callable:
        """CausalLM.forward on its phase's next build, the phase named by its tokens (B, T): decode where T is 1."""
        def forward_in_turn(model: Any, tokens: Any, *args: Any, **kwargs: Any) -> Any:
            self.phase = "decode" if tokens.shape[1] == 1 else "prefill"
            start = time.perf_counter()
            try:
                return forward(model, tokens, *args, **kwargs)
            finally:
                key = (self.label, self.phase)
                self.forward_seconds[key] += time.perf_counter() - start
                self.passes[key] += 1
                self.tokens[key] += tokens.numel()
                self.turns[self.phase] += 1
                self.phase = None

        return forward_in_turn

    def report(self) -> str:
        """Seconds per kernel and phase for each build; then per phase, each build's kernel time a token fed against
        the first build's (passes of one phase alternate between the builds, but differ in size), and its passes'
        time in and outside the kernels."""
        rows = sorted({(phase, name) for _, phase, name in self.seconds})
        lines = []
        for phase, name in rows:
            cells = [f"{label}: {self.seconds[(label, phase, name)]:8.3f} s ({self.calls[(label, phase, name)]} calls)"
                     for label in self.labels]
            lines.append(f"{phase:8s} {name:22s} " + " | ".join(cells))
        inside: dict[tuple[str, str], float] = defaultdict(float)  # (build, phase) -> its kernels' seconds
        for (label, phase, _), seconds in self.seconds.items():
            inside[(label, phase)] += seconds
        for phase in sorted({phase for _, phase in self.tokens}):
            per_token = {label: inside[(label, phase)] / self.tokens[(label, phase)] * 1e6
                         for label in self.labels if self.tokens[(label, phase)]}
            first = per_token.get(self.labels[0])
            lines.append(f"{phase} kernel us a token: " + " | ".join(
                f"{label} {micros:.2f} ({self.tokens[(label, phase)]} tokens"
                + (f", {micros / first:.3f}x {self.labels[0]})" if first else ")") for label, micros in per_token.items()))
        for (label, phase), seconds in sorted(self.forward_seconds.items(), key=lambda item: item[0][::-1]):
            passes, kernels = self.passes[(label, phase)], inside[(label, phase)]
            lines.append(f"{phase} passes, {label}: {passes} in {seconds:.4f} s, the kernels {kernels:.4f} s, outside "
                         f"them {seconds - kernels:.4f} s ({(seconds - kernels) / passes * 1e3:.3f} ms a pass)")
        return "\n".join(lines)


def install(turns: TakingTurns) -> None:
    """Every kernel lookup of zoo-infer's modules goes to `turns`, every forward pass takes the next turn."""
    from modelzoo.job import cli  # noqa: F401  (imports the modules that bind cpu_kernels at import)
    from modelzoo.models.base import CausalLM

    def kernels() -> TakingTurns:
        return turns

    kernels_module.cpu_kernels = kernels
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("modelzoo") and hasattr(module, "cpu_kernels"):
            module.cpu_kernels = kernels
    CausalLM.forward = turns.wrap_forward(CausalLM.forward)


def main(argv: list[str]) -> int:
    if "--" not in argv:
        sys.exit("usage: job_kernel_builds.py [--per_kernel] [label=<build folder> ...] -- "
                 "<run_inference.py arguments>")
    split = argv.index("--")
    specs, job_args = argv[:split], argv[split + 1:]  # no build: this checkout's
    if "--per_kernel" in specs:  # every layer through its modules: each kernel timed on its own, not one layer call
        from modelzoo.models import REGISTRY, registered_class
        from modelzoo.models.base import CausalLM

        specs.remove("--per_kernel")
        for architecture in REGISTRY:
            registered_class(architecture).layer_chains = CausalLM.layer_chains
    turns = TakingTurns(load_builds(specs))
    install(turns)
    from modelzoo.job.cli import main as run_job

    try:
        return run_job(job_args)
    finally:
        print(turns.report())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
