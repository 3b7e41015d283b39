"""Command line of run_inference.py: flags override params.yaml; user errors exit 2 with one line."""
from __future__ import annotations

import argparse
import logging
import signal
import sys

from modelzoo.errors import UserError
from modelzoo.job.params import load_params, with_overrides


def build_parser() -> argparse.ArgumentParser:
    """The run_inference.py argument parser."""
    parser = argparse.ArgumentParser(
        prog="run_inference.py",
        description="Greedy batch inference over a tokenized .h5 prompt set; writes "
                    "<model_dir>/artifacts/predictions/predictions_{global_step}.npz, one per batch.",
    )
    parser.add_argument("--params", required=True, help="params.yaml (sections model, inference_input, runconfig)")
    parser.add_argument("--model_dir", required=True, help="output folder; predictions go to <model_dir>/artifacts/predictions")
    parser.add_argument("--checkpoint_path", help="Hugging Face checkpoint folder (overrides model.checkpoint_path)")
    parser.add_argument("--inference_steps", type=int, help="process only the first N batches (a dry run)")
    parser.add_argument("--compile_only", action="store_true", default=None,
                        help="validate params, data and checkpoint, estimate memory, run one forward pass; write no predictions")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), help="overrides runconfig.device")
    parser.add_argument("--overwrite", action="store_true",
                        help="delete this run's earlier predictions in model_dir and start over (default: resume, "
                             "refusing if the inputs changed)")
    parser.add_argument("--num_shards", type=int,
                        help="split the steps over K independent jobs (e.g. $SLURM_ARRAY_TASK_COUNT); "
                             "default: torchrun's WORLD_SIZE or srun's SLURM_NTASKS, else 1")
    parser.add_argument("--shard_index", type=int, help="this job's shard, 0..K-1 (e.g. $SLURM_ARRAY_TASK_ID)")
    parser.add_argument("--mount_dirs", nargs="*", default=[], help="accepted for compatibility with Cerebras job scripts; unused")
    parser.add_argument("--python_paths", nargs="*", default=[], help="folders added to sys.path (Cerebras compatibility)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parses the command line, runs the job, and returns the process exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    sys.path.extend(p for p in args.python_paths if p not in sys.path)
    try:
        params = with_overrides(load_params(args.params), {
            "model": {"checkpoint_path": args.checkpoint_path},
            "runconfig": {"inference_steps": args.inference_steps, "compile_only": args.compile_only,
                          "device": args.device},
        })
        # torch imports only after the cheap argument checks have had their say
        from modelzoo.job.distributed import close_process_group, detect_shard
        from modelzoo.job.runner import InferenceJob
        from modelzoo.models.tensor_parallel import check_tensor_parallel

        tensor_parallel = params.runconfig.tensor_parallel
        check_tensor_parallel(params.model.checkpoint_path, tensor_parallel)  # before any process group opens
        shard = detect_shard(args.num_shards, args.shard_index, tensor_parallel)
        if not shard.writes:  # tensor parallel: the group's rank 0 speaks for it
            logging.getLogger("zoo-infer").setLevel(logging.WARNING)
        stats = InferenceJob.open(params, args.model_dir, shard, overwrite=args.overwrite).run()
        close_process_group()
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if stats.interrupted_by:
        print(f"interrupted by {stats.interrupted_by}: {stats.batches_done} batches written, {stats.batches_remaining} "
              "left; run the same command again to resume", file=sys.stderr)
        return 128 + signal.Signals[stats.interrupted_by].value  # the shell's convention for "killed by"
    return 0
