"""Evaluate, explain, benchmark and compare trained runs (argument parsing only; the work is in zoo.explain).

    python eval.py --checkpoint runs/vit_tiny/<run-id> --out eval/vit_tiny [--attention --num-images 8]
                   [--deletion] [--benchmark] [--data-dir DIR] [--max-test-images N] [--batch-size B]
    python eval.py --pretrained hybrid_tiny --data-dir DIR --out eval/hybrid_tiny [--attention ...]
    python eval.py --compare runs/vit_tiny/<id> runs/resnet18_cbam/<id> --out eval/compare
    python eval.py --faithfulness runs/hybrid_tiny/<id> [pretrained:NAME ...] --out eval/faithfulness
                   [--faithfulness-images 1000] [--methods attnlrp,captum:IntegratedGradients] [--full-grid]
                   [--sanity] [--absolute-scale]
    python eval.py --report pretrained:hybrid_tiny pretrained:vit_nano --out eval/report [--faithfulness-images N]
    python eval.py --bench-suite --out bench [--data-dir DIR] [--results results]

User errors (missing / truncated / foreign checkpoint, missing data) print one line and exit with code 2.
Under torchrun / SLURM, --checkpoint / --pretrained split the test set among the processes (each image counted
once; rank 0 writes and prints); the other modes run on one device, rank 0's, and say so in one line.
"""

from __future__ import annotations

import argparse
import json

from zoo.runtime.console import OneLineParser, error_line, line_buffered_output, parse_or_exit_code


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.splitlines()[0])
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--checkpoint", metavar="CKPT_OR_RUN_DIR", help="a run directory or a .ckpt file")
    what.add_argument("--pretrained", metavar="NAME",
                      help="a model whose weights ship with the zoo (zoo.models.shipped_models()); no run needed")
    what.add_argument("--compare", nargs="+", metavar="RUN_DIR", help="run directories to compare")
    what.add_argument("--faithfulness", nargs="+", metavar="RUN",
                      help="the faithfulness leaderboard of these runs (run directories, .ckpt files, or "
                      "pretrained:NAME): every applicable explanation method scored by deletion and insertion AUC "
                      "with bootstrap CIs and a paired test against random (faithfulness.csv, faithfulness.md, "
                      "figures; ~10 min per hybrid_tiny on 1 CPU core with the defaults)")
    what.add_argument("--report", nargs="+", metavar="RUN",
                      help="one self-contained report.html comparing these runs (as --faithfulness takes them): "
                      "accuracy (plain / TTA) on --max-test-images test images (default: as many as "
                      "--faithfulness-images), params, FLOPs, throughput, the same --num-images test images under "
                      "each model's rollout and most faithful method, the leaderboard on --faithfulness-images "
                      "test images and its curves (a few minutes for both shipped models at 50 images, 2 cores)")
    what.add_argument("--bench-suite", action="store_true",
                      help="the benchmark suite: attention op and vit_tiny vs timm, memory per backend, MFU, "
                      "input pipeline, optimisation claims (bench.json + bench.md; ~5 min on 2 CPU cores)")
    p.add_argument("--out", required=True, help="the folder the output files are written into (created if needed; "
                   "files of the same names there are replaced), e.g. eval/vit_tiny")
    p.add_argument("--data-dir", help="data folder (default: the one the run was trained on); its classes must be "
                   "the run's")
    p.add_argument("--cache-dir", help="where the decoded test images are cached (default: the run's cache_dir, "
                   "else $XDG_CACHE_HOME/zoo or ~/.cache/zoo)")
    p.add_argument("--max-test-images", type=int, help="evaluate on a seeded subset of this many test images (with "
                   "--report: its accuracy and TTA passes; default there: as many as --faithfulness-images)")
    p.add_argument("--batch-size", type=int, default=256, help="evaluation batch size")
    p.add_argument("--attention", action="store_true",
                   help="attention maps, rollouts and CBAM maps as figures")
    p.add_argument("--num-images", type=int, default=8, help="test images to explain with --attention")
    p.add_argument("--deletion", action="store_true", help="run the deletion (faithfulness) test")
    p.add_argument("--deletion-images", type=int, default=256, help="test images for the deletion test")
    p.add_argument("--faithfulness-images", type=int, default=1000,
                   help="test images for --faithfulness, the same number from every class")
    p.add_argument("--methods", type=lambda text: [m.strip() for m in text.split(",") if m.strip()],
                   help="--faithfulness scores only these methods, comma-separated (zoo methods such as attnlrp, "
                   "chefer2021, or captum:NAME for a Captum attribution class; default every zoo method that "
                   "applies); the baselines random, centre and edges are always scored")
    p.add_argument("--full-grid", action="store_true",
                   help="--faithfulness with every removal (zero, blur, mean, road) instead of zero only (~5x "
                   "slower)")
    p.add_argument("--sanity", action="store_true", help="--faithfulness also runs the model-randomisation sanity "
                   "check (Adebayo et al. 2018) on up to 100 of the images")
    p.add_argument("--absolute-scale", action="store_true", help="--faithfulness draws each method's maps on one "
                   "absolute colour scale instead of scaling every map min->max")
    p.add_argument("--benchmark", action="store_true", help="inference / training images/s, latency, memory")
    p.add_argument("--precision", default="32", choices=("32", "32-true", "bf16-mixed", "16-mixed"),
                   help="benchmark precision (zoo.bench.timing.PRECISIONS)")
    p.add_argument("--device", help="cpu, cuda, cuda:1, mps (default: cuda when a GPU is visible, else mps on Apple "
                   "silicon, else cpu)")
    args = p.parse_args(argv)
    for name in ("max_test_images", "num_images", "deletion_images", "faithfulness_images", "batch_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    return args


def main(argv=None) -> int:
    from zoo.runtime.console import zoo_warnings_in_one_line
    from zoo.runtime.memory import keep_freed_memory

    line_buffered_output()
    zoo_warnings_in_one_line("eval.py")
    keep_freed_memory()  # each batch reuses the pages the last one freed
    args = parse_or_exit_code(parse_args, argv)
    if isinstance(args, int):
        return args
    from zoo.runtime.device import eval_device

    try:
        eval_device(args.device)  # a bad --device fails here, before the heavy imports and any work
    except ValueError as err:
        return error_line("eval.py", err)
    launched = one_device_under_launcher(args)
    if launched is not None:
        return launched
    from zoo.explain.compare import compare_runs
    from zoo.explain.report import check_out_dir, check_out_is_folder, evaluate_run

    try:
        check_out_is_folder(args.out)  # before any model is loaded or image read
        if args.bench_suite:
            from zoo.bench.suite import run_suite

            check_out_dir(args.out)
            run_suite(args.out, data_dir=args.data_dir, device=args.device)
            print(open(f"{args.out}/bench.md").read())
            return 0
        if args.report:
            from zoo.explain.html_report import html_report

            path = html_report(args.report, args.out, data_dir=args.data_dir, num_images=args.faithfulness_images,
                               grid_images=args.num_images, accuracy_images=args.max_test_images,
                               batch_size=args.batch_size, device=args.device, cache_dir=args.cache_dir)
            print(f"wrote {path}")
            return 0
        if args.faithfulness:
            from zoo.explain.faithfulness_report import DEFAULT_REMOVALS, faithfulness_report
            from zoo.explain.perturbation import REMOVALS

            faithfulness_report(args.faithfulness, args.out, data_dir=args.data_dir,
                                num_images=args.faithfulness_images, methods=args.methods,
                                removals=REMOVALS if args.full_grid else DEFAULT_REMOVALS, sanity=args.sanity,
                                absolute_scale=args.absolute_scale, batch_size=args.batch_size, device=args.device,
                                cache_dir=args.cache_dir)
            print(open(f"{args.out}/faithfulness.md").read())
            print(f"wrote {args.out}")
            return 0
        if args.compare:
            compare_runs(args.compare, args.out, data_dir=args.data_dir, batch_size=args.batch_size,
                         deletion_images=min(args.deletion_images, 64), cache_dir=args.cache_dir, device=args.device)
            print(open(f"{args.out}/compare.md").read())
            return 0
        report = evaluate_run(args.checkpoint, args.out, pretrained=args.pretrained, data_dir=args.data_dir,
                              batch_size=args.batch_size,
                              max_test_images=args.max_test_images,
                              attention_images=args.num_images if args.attention else 0,
                              deletion_images=args.deletion_images if args.deletion else 0,
                              benchmark=args.benchmark, precision=args.precision, device=args.device,
                              cache_dir=args.cache_dir)
    except (ValueError, OSError) as err:  # zoo.data.DataError is a ValueError
        return error_line("eval.py", err)
    from zoo.runtime.distributed import is_global_zero

    if not is_global_zero():
        return 0
    m = report["metrics"]
    print(f"{m['model']}: test top-1 {m['test_top1']:.4f}, top-5 {m['test_top5']:.4f}, "
          f"cross-entropy {m['test_cross_entropy']:.4f} on {m['num_images']} images")
    print("most confused (true -> predicted): " + ", ".join(
        f"{p['true']} -> {p['predicted']} ({p['count']})" for p in m["most_confused"]))
    if report["deletion"]:
        print("deletion AUC (lower = more faithful): " + json.dumps(report["deletion"]["auc"]))
    if report["benchmark"]:
        print("benchmark: " + json.dumps(report["benchmark"]))
    print(f"wrote {args.out}")
    return 0


def one_device_under_launcher(args: argparse.Namespace) -> int | None:
    """Under torchrun / SLURM with several processes, the modes other than --checkpoint / --pretrained run on
    rank 0 alone: rank 0 says so in one line and goes on (None), the other ranks exit with 0."""
    if args.checkpoint or args.pretrained:
        return None
    from zoo.runtime.distributed import external_environment

    environment = external_environment()
    if environment is None or environment.world_size() <= 1:
        return None
    if environment.global_rank() != 0:
        return 0
    mode = next(flag for flag in ("compare", "faithfulness", "report", "bench_suite") if getattr(args, flag))
    print(f"eval.py --{mode.replace('_', '-')} runs on one device: rank 0 runs it, the other "
          f"{environment.world_size() - 1} processes exit")
    return None
