"""Several processes on the CPU (gloo): the samplers behind the global batch and the exact evaluation, against plain
single-process references; real 2-process DDP runs of train.py (through tests/train/ddp_driver.py, which records
every rank's steps, learning rates and final weights) under Fabric's launcher, torchrun and simulated SLURM; and
one checkpoint tested on 1 and 3 processes (the loop's evaluation, a plain ``lightning.Trainer`` with
``ImageClassifier``, and eval.py) against a plain count of correct predictions."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from zoo.data.samplers import ContiguousShard, GlobalBatchShard, split_batch
from zoo.runtime.distributed import planned_world_size

sys.path.insert(0, str(Path(__file__).parent))
from ddp_driver import test as scored_on_every_process  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("ddp_driver.py")
LAUNCH_ENV = ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ZOO_RUN_DIR",
              "TORCHELASTIC_RUN_ID")


def clean_env(record: Path, **extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV and not k.startswith("SLURM_")}
    return {**env, "ZOO_TEST_RECORD": str(record), "OMP_NUM_THREADS": "1", **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_args(cifar_dir: Path, tmp_path: Path, *extra: str) -> list[str]:
    return ["--model", "vit_nano", "--data-dir", str(cifar_dir), "--cache-dir", str(tmp_path / "cache"),
            "--max-train-images", "200", "--max-test-images", "40", "--set", "val_size=40", "--batch-size", "32",
            "--out", str(tmp_path / "runs"), "--limit-val-batches", "1", "--limit-test-batches", "1",
            "--ckpt-every-n-steps", "1", "--precision", "32", *extra]


def run(cmd: list[str], env: dict, cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def records(record: Path, world: int) -> list[dict]:
    return [json.loads((record / f"rank{r}.json").read_text()) for r in range(world)]


# ----------------------------------------------------------------------------------------- samplers, in-process

def test_split_batch_names_the_fix():
    assert split_batch(128, 4) == 32
    with pytest.raises(ValueError, match=r"batch_size 100 is the global batch .* 3 processes .* e\.g\. 99 or 102"):
        split_batch(100, 3)


def test_devices_auto_on_several_gpus_is_several_processes_and_says_so(monkeypatch, capsys):
    import zoo.runtime.distributed as distributed
    from zoo.train import loop
    from zoo.train.loop import report_auto_devices
    from zoo.train.recipe import Recipe

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(distributed, "external_environment", lambda: None)  # as if no launcher, even on a cluster
    monkeypatch.setattr(loop, "external_environment", lambda: None)
    assert planned_world_size("auto", 1, "gpu") == 4 and planned_world_size("auto", 2, "gpu") == 8
    assert planned_world_size("auto", 1, "cpu") == 1 and planned_world_size("0,2", 1, "gpu") == 2
    report_auto_devices(Recipe(batch_size=128), "gpu", 4)
    (line,) = capsys.readouterr().out.splitlines()
    assert "all 4 GPUs" in line and "batch_size 128 is the global batch (32 per GPU)" in line


@pytest.mark.parametrize("n, batch", [(103, 16), (96, 16), (10, 16)])
def test_global_batch_shards_rebuild_the_single_process_batches(n, batch):
    """Reference: torch's own shuffled DataLoader (RandomSampler with the seeded generator, drop_last)."""
    data = list(range(n))
    reference = [b.tolist() for b in DataLoader(data, batch_size=batch, shuffle=True, drop_last=n > batch,
                                                generator=torch.Generator().manual_seed(3))]
    for world in (1, 2, 4):
        shards = []
        for rank in range(world):  # the generator also seeds the loader, as in the data module
            generator = torch.Generator().manual_seed(3)
            shards.append(list(DataLoader(data, batch_size=split_batch(batch, world), generator=generator,
                                          sampler=GlobalBatchShard(data, batch, world, rank, generator))))
        assert {len(s) for s in shards} == {len(reference)}   # the same optimizer steps per epoch on every rank
        for step, expected in enumerate(reference):
            if n >= batch:
                assert sum((s[step].tolist() for s in shards), []) == expected
            else:  # smaller than one batch: what divides among the ranks, in the same order
                assert sum((s[step].tolist() for s in shards), []) == expected[: n // world * world]


@pytest.mark.parametrize("n", [1001, 10, 7])
def test_contiguous_shards_cover_every_image_once(n):
    for world in (1, 2, 3, 4):
        seen = sum((list(ContiguousShard(list(range(n)), world, rank)) for rank in range(world)), [])
        assert seen == list(range(n))


# ----------------------------------------------------------------------------------------- real DDP runs of train.py

def ranks_agree(record: Path) -> dict:
    """Rank 0's record, once both ranks are seen to have fitted the same step count to the time budget, taken the
    same steps with the same learning rates and ended with bit-identical weights, and rank 0 alone wrote
    summary.json, once."""
    rank0, rank1 = records(record, 2)
    assert rank0["total_steps"] is not None and rank0["total_steps"] == rank1["total_steps"]
    assert rank0["global_step"] == rank1["global_step"] and rank0["steps"] == rank1["steps"]
    weights0, weights1 = (torch.load(record / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert weights0.keys() == weights1.keys()
    assert all(torch.equal(weights0[k], weights1[k]) for k in weights0)
    assert (record / "writes-rank0.txt").read_text().split().count("summary.json") == 1
    assert not (record / "writes-rank1.txt").exists()
    return rank0


@pytest.mark.slow  # about a minute on 2 CPU cores; the default suite keeps smaller forms
def test_ddp_time_budget_stops_every_rank_on_one_step_after_a_resume(cifar_dir, tmp_path):
    """Rank 1 starts its clock 3 s after rank 0: a per-rank budget would fit different step counts (and hang or
    stop apart). A first part ends after 1 epoch (11 steps, past the budget's measurement, which the driver makes
    at step 4) and the run resumes with 100 epochs under the same 30 s budget (what the first part spent counted):
    both ranks take the same steps with the same learning rates, end on one step with the same weights, and
    summary.json is written once per part, by rank 0."""
    args = train_args(cifar_dir, tmp_path, "--accelerator", "cpu", "--devices", "2", "--strategy", "ddp",
                      "--max-time", "00:00:00:30", "--max-train-images", "400", "--ckpt-every-n-steps", "1000")
    parts = []
    for part, extra in enumerate((["--epochs", "1"], ["--epochs", "100", "--resume", "auto"])):
        record = tmp_path / f"record{part}"
        record.mkdir()
        run([sys.executable, str(DRIVER), "train", *args, *extra],
            clean_env(record, ZOO_TEST_SKEW="3", ZOO_TEST_MEASURE="1,3"), tmp_path, timeout=150)
        parts.append(ranks_agree(record))
    first, resumed = parts
    assert first["global_step"] == first["batches_per_epoch"] == 11
    assert resumed["steps"][0][0] == first["global_step"] + 1      # it continued where the first part ended
    assert resumed["global_step"] < 100 * resumed["batches_per_epoch"]   # the budget, not the epochs, ended it
    (run_dir,) = (tmp_path / "runs" / "vit_nano").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["global_step"] == resumed["global_step"] and summary["devices"] == 2


@pytest.mark.slow
def test_two_minute_ddp_runs_end_together_five_times(cifar_dir, tmp_path):
    """train.py --devices 2 --strategy ddp --max-time 00:00:02:00, five times (the budget measured as in a real
    run): each ends, without a hang, with both ranks on one step and identical weights, summary.json written once."""
    for repeat in range(5):
        root, record = tmp_path / str(repeat), tmp_path / f"record{repeat}"
        record.mkdir()
        args = train_args(cifar_dir, root, "--epochs", "1000", "--accelerator", "cpu", "--devices", "2",
                          "--strategy", "ddp", "--max-time", "00:00:02:00", "--max-train-images", "2000",
                          "--ckpt-every-n-steps", "1000")
        run([sys.executable, str(DRIVER), "train", *args], clean_env(record), tmp_path, timeout=600)
        rank0 = ranks_agree(record)
        (run_dir,) = (root / "runs" / "vit_nano").iterdir()
        assert json.loads((run_dir / "summary.json").read_text())["global_step"] == rank0["global_step"]


@pytest.mark.slow  # the default suite's real DDP run of train.py is torchrun's, below
def test_one_process_and_two_slurm_tasks_run_the_same_steps_and_learning_rates(cifar_dir, tmp_path):
    """batch_size 32 is the global batch: 160 training images give 160 // 32 = 5 steps per epoch on one process
    and on two tasks started as srun would (SLURM_* variables, no launcher of Lightning's), with the same
    learning rate at each step; the two tasks share one run directory, which rank 0 alone writes."""
    record = tmp_path / "record1"
    record.mkdir()
    cmd = [sys.executable, str(DRIVER), "train",
           *train_args(cifar_dir, tmp_path / "1", "--epochs", "2", "--accelerator", "cpu", "--devices", "1")]
    run(cmd, clean_env(record), tmp_path)
    (single,) = records(record, 1)
    record = tmp_path / "record2"
    record.mkdir()
    cmd = [sys.executable, str(DRIVER), "train",
           *train_args(cifar_dir, tmp_path / "2", "--epochs", "2", "--accelerator", "cpu", "--devices", "2",
                       "--strategy", "ddp")]
    port = str(free_port())
    procs = [subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=clean_env(record, SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_NNODES="1",
                                            SLURM_PROCID=str(r), SLURM_LOCALID=str(r), SLURM_NODEID="0",
                                            SLURM_JOB_ID="4242", SLURM_JOB_NAME="zoo", MASTER_ADDR="127.0.0.1",
                                            MASTER_PORT=port))
             for r in (0, 1)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]
    (run_dir,) = (tmp_path / "2" / "runs" / "vit_nano").iterdir()
    assert outs[0][0].strip().splitlines()[-1] == outs[1][0].strip().splitlines()[-1] == str(run_dir)
    assert json.loads((run_dir / "summary.json").read_text())["devices"] == 2
    assert not (record / "writes-rank1.txt").exists()
    expected_steps = (200 - 40) // 32
    for rank in (single, *records(record, 2)):
        assert rank["batches_per_epoch"] == expected_steps and rank["global_step"] == 2 * expected_steps
        assert rank["steps"] == single["steps"]
    assert [s for s, _ in single["steps"]] == list(range(1, 2 * expected_steps + 1))


@pytest.mark.slow  # the default suite's small form: a failure on rank 0 reaching every rank, below
def test_a_nan_loss_on_one_rank_stops_every_rank(cifar_dir, tmp_path):
    """Rank 1 alone flags a non-finite loss at step 3: both ranks stop at the next check with the error (exit 1),
    rather than rank 0 waiting in an all-reduce rank 1 never joins."""
    record = tmp_path / "record"
    record.mkdir()
    cmd = [sys.executable, str(DRIVER), "train",
           *train_args(cifar_dir, tmp_path, "--epochs", "2", "--accelerator", "cpu", "--devices", "2",
                       "--strategy", "ddp", "--ckpt-every-n-steps", "1000")]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=clean_env(record, ZOO_TEST_NAN_AT="3"),
                          timeout=150)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "non-finite training loss at optimizer step 3" in done.stderr
    assert not list(record.glob("rank*.json"))  # neither rank finished training


@pytest.mark.parametrize("resume", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["one-part", "resumed"])
def test_torchrun_two_processes_share_one_resumable_run(cifar_dir, tmp_path, resume):
    """The default suite's real DDP run of train.py (torchrun, 2 CPU processes): one run directory, which rank 0
    alone writes; resumed (-m slow), both ranks continue at the next step with the same learning rates."""
    record = tmp_path / "record"
    record.mkdir()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                str(free_port()), str(DRIVER), "train"]
    args = train_args(cifar_dir, tmp_path, "--accelerator", "cpu", "--devices", "2", "--strategy", "ddp")
    first = run([*torchrun, *args, "--epochs", "1"], clean_env(record), tmp_path)
    (run_dir,) = (tmp_path / "runs" / "vit_nano").iterdir()
    assert first.stdout.strip().splitlines()[-1] == str(run_dir)
    assert json.loads((run_dir / "summary.json").read_text())["global_step"] == 5
    written = (record / "writes-rank0.txt").read_text().split()
    assert written.count("config.yaml") == written.count("summary.json") == 1 and "last.ckpt" in written
    assert not (record / "writes-rank1.txt").exists()
    rank0, rank1 = records(record, 2)
    assert [s for s, _ in rank0["steps"]] == list(range(1, 6)) and rank0["steps"] == rank1["steps"]
    if not resume:
        return
    torchrun[6] = str(free_port())
    run([*torchrun, *args, "--epochs", "2", "--resume", "auto"], clean_env(record), tmp_path)
    assert [p.name for p in (tmp_path / "runs" / "vit_nano").iterdir()] == [run_dir.name]
    assert json.loads((run_dir / "summary.json").read_text())["global_step"] == 10
    rank0, rank1 = records(record, 2)
    assert [s for s, _ in rank0["steps"]] == list(range(6, 11)) and rank0["steps"] == rank1["steps"]


# ----------------------------------------------------------------------------------------- exact evaluation

@pytest.mark.parametrize("n, world", [(301, 1), pytest.param(301, 3, marks=pytest.mark.slow),
                                      pytest.param(10_000, 3, marks=pytest.mark.slow)])
def test_test_accuracy_is_exact_on_one_and_three_processes(tiny_run, cifar_dir, tmp_path, n, world):
    """301 test images (or all 10,000) do not divide among 3 processes (a padding sampler would count 303 or
    10,002); Lightning's logged top-1 / top-5 / loss and eval.py's metrics.json equal a plain single-process loop
    over the images, on 1 process and (world 3) also on 3 (torchrun); so do the loop's own evaluation and a plain
    ``lightning.Trainer``'s test of ``ImageClassifier``."""
    from zoo.data import ImageData
    from zoo.explain.cli import main as eval_main
    from zoo.train import ImageClassifier

    ckpt = tiny_run / "checkpoints" / "last.ckpt"
    module = ImageClassifier.load_from_checkpoint(ckpt, map_location="cpu", tta=0).eval()
    dm = ImageData(cifar_dir, max_test_images=n, splits=("test",), cache_dir=tmp_path / "ref-cache")
    dm.setup("test")
    summary = json.loads((tiny_run / "summary.json").read_text())
    dm.use_normalization(summary["mean"], summary["std"])
    with torch.no_grad():
        logits = torch.cat([module(dm.normalize(x)) for x in dm.test_dataset.images.split(100)])
    labels = dm.test_dataset.labels
    top1 = int((logits.argmax(1) == labels).sum())
    top5 = int((logits.topk(5, dim=1).indices == labels[:, None]).any(1).sum())
    loss = float(F.cross_entropy(logits, labels, label_smoothing=module.hparams.label_smoothing))
    one = scored_on_every_process(str(ckpt), str(cifar_dir), n, str(tmp_path / "ref-cache"))
    assert eval_main(["--checkpoint", str(ckpt), "--data-dir", str(cifar_dir), "--max-test-images", str(n),
                      "--cache-dir", str(tmp_path / "ref-cache"), "--device", "cpu",
                      "--out", str(tmp_path / "eval1")]) == 0
    found, folders = [one["loop"], one["lightning"]], [tmp_path / "eval1"]
    if world == 3:
        record = tmp_path / "record"
        record.mkdir()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port",
               str(free_port()), str(DRIVER), "test", str(ckpt), str(cifar_dir), str(n), str(tmp_path / "ref-cache")]
        run(cmd, clean_env(record), tmp_path)
        three = json.loads((record / "test.json").read_text())
        found += [three["loop"], three["lightning"]]
        folders.append(record / "eval")
    for results in found:
        assert round(results["test/top1"] * n) == top1 and abs(results["test/top1"] - top1 / n) < 1e-6
        assert round(results["test/top5"] * n) == top5 and abs(results["test/top5"] - top5 / n) < 1e-6
        assert results["test/loss"] == pytest.approx(loss, rel=1e-5)
    plain_loss = float(F.cross_entropy(logits, labels))
    confusion = torch.zeros(10, 10, dtype=torch.long).index_put_((labels, logits.argmax(1)), torch.tensor(1),
                                                                 accumulate=True)
    for folder in folders:
        metrics = json.loads((folder / "metrics.json").read_text())
        assert metrics["num_images"] == n and metrics["test_top1"] == top1 / n and metrics["test_top5"] == top5 / n
        assert metrics["test_cross_entropy"] == pytest.approx(plain_loss, rel=1e-5)
        per_class = (confusion.diag() / confusion.sum(1)).tolist()
        assert list(metrics["per_class_accuracy"].values()) == pytest.approx(per_class, abs=1e-6)


RANK_ZERO_FAILS = """
import os, sys
from datetime import timedelta
import torch
from zoo.runtime.distributed import on_rank_zero
torch.distributed.init_process_group("gloo", timeout=timedelta(seconds=60))
def choose():
    raise OSError("the disk went away")
try:
    on_rank_zero(choose)
except Exception as err:
    print(f"{type(err).__name__}: {err}")
"""


def test_a_failure_on_rank_zero_that_is_not_a_value_error_stops_every_rank(tmp_path):
    """An OSError (a damaged checkpoint, a failed download) on rank 0 while the others wait for its result: rank 0
    raises it, the others a RuntimeError naming it, instead of waiting out the process group's timeout."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", RANK_ZERO_FAILS], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=clean_env(tmp_path, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                            MASTER_PORT=port)) for r in (0, 1)]
    outs = [p.communicate(timeout=120)[0].strip().splitlines()[-1] for p in procs]
    assert outs == ["OSError: the disk went away", "RuntimeError: rank 0 failed: OSError: the disk went away"]


NODE_FIRST = """
import os, time
from datetime import timedelta
from pathlib import Path
import torch
from zoo.runtime.distributed import rank_zero_first
torch.distributed.init_process_group("gloo", timeout=timedelta(seconds=60))
disk = Path(f"machine{os.environ['GROUP_RANK']}")  # each machine its own disk: no shared file system
def build():
    if (disk / "cache").exists():
        return "found"
    time.sleep(1.0)  # a build that takes a while: the processes of one machine would overlap in it
    disk.mkdir(exist_ok=True)
    with open(disk / "builds", "a") as log:
        log.write("build\\n")
    (disk / "cache").write_text("decoded")
    return "built"
def missing():
    if os.environ["GROUP_RANK"] == "1":
        raise ValueError("no CIFAR-10 in DATA on this machine")
    return "ok"
def unreadable():
    if os.environ["RANK"] == "2":
        raise OSError("the cache cannot be read")
    return "ok"
print(rank_zero_first(build))
for make in (missing, unreadable):
    try:
        rank_zero_first(make)
    except (ValueError, RuntimeError, OSError) as err:
        print(f"{type(err).__name__}: {err}")
"""


@pytest.mark.slow  # the default suite's small form: a failure on rank 0 reaching every rank, above
def test_each_machine_builds_its_data_once_and_a_failed_build_stops_every_rank(tmp_path):
    """Three torchrun processes on two machines without a shared disk (rank 0 alone, ranks 1 and 2 together): rank 0
    builds, then the first process of the other machine, then the rest, which find its copy; a ValueError on the
    second machine, or an OSError on the last rank, reaches every rank instead of leaving them waiting."""
    port = str(free_port())
    machines = [(0, 0, 1), (1, 0, 2), (1, 1, 2)]  # per rank: machine, local rank, processes on that machine
    procs = [subprocess.Popen([sys.executable, "-c", NODE_FIRST], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=clean_env(tmp_path, RANK=str(rank), WORLD_SIZE="3", GROUP_RANK=str(machine),
                                            LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(size),
                                            MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for rank, (machine, local, size) in enumerate(machines)]
    outs = [p.communicate(timeout=120) for p in procs]
    missing, unreadable = "ValueError: no CIFAR-10 in DATA on this machine", "OSError: the cache cannot be read"
    told = "RuntimeError: rank 2 failed: " + unreadable
    assert [out.strip().splitlines() for out, _ in outs] == [
        ["built", missing, told], ["built", missing, told], ["found", missing, unreadable]], [e[-999:] for _, e in outs]
    assert [(tmp_path / f"machine{m}" / "builds").read_text().count("build") for m in (0, 1)] == [1, 1]
